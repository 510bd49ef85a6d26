"""One rule per mistake, the same answer on every surface.

- A reply limit past the slot's context (`max_tokens`, `max_completion_tokens`,
  `max_output_tokens`, Ollama's `num_predict`, llama-server's `n_predict`) is capped to the
  context on every route, said in a `Warning: 299 minfer "..."` header and a server log line
  (minfer.server.notices), never a silent cap on some routes and a 400 on others.
- A context past the model's (`-c`, `--n-ctx`, `n_ctx=`) is capped with a warning.
- Thinking asked of a model that cannot think is refused by name everywhere (a 400 in each
  API's own shape, a CLI error, the server refusing to start), as Ollama already refused it;
  asking it not to think is fine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minfer.server.state import ServerState
from tests.test_server_app import call as app_call
from tests.test_server_app import running

N_CTX = 128
HUGE = 10**6
MSG = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def state(tiny_qwen2: Path) -> Iterator[ServerState]:
    yield from running(tiny_qwen2, n_ctx=N_CTX, slots=1)


# (path, body, where the reply's generated-token count is)
TOO_LONG: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": HUGE},
     ("usage", "completion_tokens")),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": HUGE},
     ("usage", "completion_tokens")),
    ("/v1/completions", {"prompt": "Say", "max_tokens": HUGE}, ("usage", "completion_tokens")),
    ("/v1/responses", {"input": "Say hello", "max_output_tokens": HUGE},
     ("usage", "output_tokens")),
    ("/v1/messages", {"model": "m", "messages": MSG, "max_tokens": HUGE},
     ("usage", "output_tokens")),
    ("/api/chat", {"model": "qwen2", "messages": MSG, "stream": False,
                   "options": {"num_predict": HUGE}}, ("eval_count",)),
    ("/api/generate", {"model": "qwen2", "prompt": "Say", "stream": False,
                       "options": {"num_predict": HUGE}}, ("eval_count",)),
    ("/completion", {"prompt": "Say", "n_predict": HUGE}, ("tokens_predicted",)),
]


@pytest.mark.parametrize(("path", "body", "count"), TOO_LONG, ids=[
    f"{p}:{next(k for k in b if 'max' in k or k == 'options' or k == 'n_predict')}"
    for p, b, _ in TOO_LONG])
def test_a_reply_limit_past_the_context_is_capped_with_a_warning(
        state: ServerState, path: str, body: dict[str, Any], count: tuple[str, ...],
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="minfer.server"):
        r = app_call(state, "POST", path, json=body)
    assert r.status_code == 200, r.text
    warning = r.headers.get("warning", "")
    assert warning.startswith('299 minfer "') and f"= {HUGE} exceeds the context" in warning
    assert f"capped to {N_CTX}" in warning
    assert any(f"capped to {N_CTX}" in rec.getMessage() for rec in caplog.records)
    value: Any = r.json()
    for key in count:
        value = value[key]
    assert 0 < value <= N_CTX


def test_a_limit_within_the_context_has_no_warning(state: ServerState) -> None:
    r = app_call(state, "POST", "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200 and "warning" not in r.headers


def test_a_streamed_reply_carries_the_warning_too(state: ServerState) -> None:
    r = app_call(state, "POST", "/v1/chat/completions",
                 json={"messages": MSG, "max_tokens": HUGE, "stream": True})
    assert r.status_code == 200 and "capped" in r.headers["warning"]


def test_the_official_clients_take_the_capped_reply(state: ServerState) -> None:
    """Anthropic's client (whose real service refuses a limit past a model's) still gets a
    reply to a usual 16000 (past this server's context), the warning in the raw response."""
    from tests.test_server_anthropic import with_client

    async def go(c: Any) -> Any:
        raw = await c.messages.with_raw_response.create(
            model="m", max_tokens=16000, messages=MSG)
        return raw.headers["warning"], await raw.parse()

    warning, message = with_client(state, go)
    assert "capped" in warning and 0 < message.usage.output_tokens <= N_CTX


# thinking asked of a model that cannot think (tiny_qwen2's plain ChatML template)
THINK: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"enable_thinking": True}},
     "enable_thinking"),
    ("/v1/chat/completions", {"messages": MSG, "reasoning_budget": 100}, "reasoning budget"),
    ("/v1/messages", {"model": "m", "messages": MSG, "max_tokens": 8,
                      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "enable_thinking"),
    ("/api/chat", {"model": "qwen2", "messages": MSG, "think": True}, "does not support"),
]


@pytest.mark.parametrize(("path", "body", "words"), THINK)
def test_thinking_asked_of_a_model_that_cannot_think_is_a_400(
        state: ServerState, path: str, body: dict[str, Any], words: str) -> None:
    r = app_call(state, "POST", path, json=body)
    assert r.status_code == 400, r.text
    assert words in r.text and ("does not think" in r.text or path == "/api/chat")


def test_asking_that_model_not_to_think_is_fine(state: ServerState) -> None:
    r = app_call(state, "POST", "/v1/chat/completions", json={
        "messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_the_cli_and_api_refuse_thinking_a_model_cannot_do(
        tiny_qwen2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import minfer
    from minfer.chat.reasoning import ReasoningOptions, ThinkingUnsupported
    from minfer.cli.main import main

    model = minfer.load(tiny_qwen2)
    with pytest.raises(ThinkingUnsupported, match="does not think"):
        model.chat_prompt(MSG, reasoning=ReasoningOptions.build(switch="on"))
    model.chat_prompt(MSG, reasoning=ReasoningOptions.build(switch="off"))  # not thinking: fine
    for flags in (["--reasoning", "on"], ["--reasoning-budget", "50"]):
        assert main(["run", str(tiny_qwen2), "hi", "-n", "1", *flags]) != 0
        assert "does not think" in capsys.readouterr().err


def test_a_server_told_to_think_with_a_model_that_cannot_does_not_start(
        tiny_qwen2: Path) -> None:
    from minfer.chat.reasoning import ReasoningOptions
    from tests.test_server_app import make_state

    st = make_state(tiny_qwen2, reasoning=ReasoningOptions.build(switch="on"))
    st.start()
    try:
        assert not st.wait_ready(10)
        assert st.error is not None and "does not think" in st.error
    finally:
        st.stop()


def test_a_server_context_past_the_models_is_capped_with_a_warning(
        tiny_qwen2: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tests.test_server_app import make_state

    with caplog.at_level(logging.WARNING, logger="minfer"):
        st = make_state(tiny_qwen2, n_ctx=99_999_999, slots=1)
        st.start()
        try:
            assert st.wait_ready(30) and st.model().limits.n_ctx_slot == 2048
        finally:
            st.stop()
    assert any("--n-ctx = 99999999 exceeds" in r.getMessage() for r in caplog.records)
