"""Reasoning replies through the HTTP app in-process (a tiny qwen3 with `<think>` tokens and the
published Qwen3 / R1-distill templates, fake engine).

The reply's text is forced with a grammar, so each case of llama.cpp's split is scripted: thinking
then answer, no `</think>`, whitespace around the tags, a prompt that opened the thinking, tool
calls after it, a stop string inside it; every reasoning_format; the stream's deltas concatenate
to the whole response's fields. A thinking budget of 8 gives exactly 8 thinking tokens, then the
end-of-thinking tokens, then the answer. Bad fields are 400s naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from minfer.chat.reasoning import FORCED_CLOSE
from minfer.gguf.reader import GGUFFile
from minfer.server.state import ServerState
from minfer.tokenizer.tokenizer import Tokenizer
from tests.test_server_app import CHAT, call, running, sse

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
THINK = ("<think>", "</think>")
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
FAILING = ("{% if fail_on is defined %}{{ raise_exception('cannot render ' ~ fail_on) }}"
           "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")


def _state(path: Path) -> Iterator[ServerState]:
    yield from running(path, n_ctx=512, slots=2)


@pytest.fixture(scope="module")
def qwen3(think_model: Callable[..., Path]) -> Iterator[ServerState]:
    yield from _state(think_model("qwen3"))


@pytest.fixture(scope="module")
def r1(think_model: Callable[..., Path]) -> Iterator[ServerState]:
    """The R1-distill template opens `<think>` in its generation prompt."""
    yield from _state(think_model("r1-distill-qwen"))


def gbnf(text: str) -> str:
    return "root ::= " + json.dumps(text)


def ask(state: ServerState, forced: str, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the whole response's choice, the stream's deltas joined per field) for a forced reply."""
    body = {"messages": ASK, "max_tokens": 200, "temperature": 0, "grammar": gbnf(forced),
            **extra}
    r = call(state, "POST", CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    chunks = sse(call(state, "POST", CHAT, json={**body, "stream": True}))
    joined: dict[str, Any] = {"finish_reason": chunks[-1]["choices"][0]["finish_reason"]}
    for c in chunks:
        for key, value in c["choices"][0]["delta"].items():
            if key in ("content", "reasoning_content") and value:
                joined[key] = joined.get(key, "") + value
    return choice, joined


def check(choice: dict[str, Any], joined: dict[str, Any], content: str | None,
          reasoning: str | None, finish: str = "stop") -> None:
    msg = choice["message"]
    assert (msg["content"], msg.get("reasoning_content")) == (content, reasoning)
    assert (joined.get("content") or None, joined.get("reasoning_content")) == \
        (content or None, reasoning)
    assert choice["finish_reason"] == joined["finish_reason"] == finish


@pytest.mark.parametrize(("forced", "content", "reasoning"), [
    ("<think>\nTwo and two.\n</think>\n\nIt is 4.", "It is 4.", "Two and two."),
    ("<think>\nstill going", "", "still going"),  # no </think>: all of it is reasoning
    ("  <think>a</think>   b  ", "  b  ", "a"),  # leading blanks stay, those after </think> go
    ("<think></think>4", "4", None),  # empty thinking: none
    ("The answer is 4.", "The answer is 4.", None),  # no <think>: all content
    ("4 <think>x</think>", "4 <think>x</think>", None),  # a tag later on is content
])
def test_split_as_llama_cpp(qwen3: ServerState, forced: str, content: str,
                            reasoning: str | None) -> None:
    check(*ask(qwen3, forced), content, reasoning)


def test_reasoning_formats(qwen3: ServerState) -> None:
    forced = "<think>\nhm\n</think>\n\n4"
    check(*ask(qwen3, forced, reasoning_format="none"), forced, None)
    check(*ask(qwen3, forced, reasoning_format="deepseek"), "4", "hm")
    check(*ask(qwen3, forced, reasoning_format="deepseek-legacy"), forced, "hm")


def test_prompt_that_opened_the_thinking(r1: ServerState) -> None:
    check(*ask(r1, "Two and two.\n</think>\n\nIt is 4."), "It is 4.", "Two and two.")
    check(*ask(r1, "never closed"), "", "never closed")


def test_stop_string_inside_the_thinking(qwen3: ServerState) -> None:
    check(*ask(qwen3, "<think>count: 1 STOP 2</think>4", stop=["STOP"]), "", "count: 1")


def test_tool_calls_after_the_thinking(qwen3: ServerState) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    choice, joined = ask(qwen3, "<think>use the tool</think>\n\n" + call_text, tools=[tool])
    msg = choice["message"]
    assert msg["reasoning_content"] == joined["reasoning_content"] == "use the tool"
    assert msg["content"] is None and choice["finish_reason"] == "tool_calls"
    (tc,) = msg["tool_calls"]
    assert tc["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert joined["finish_reason"] == "tool_calls" and "content" not in joined


def test_template_variables_switch_qwen3_thinking_off(qwen3: ServerState) -> None:
    body = {"messages": ASK, "max_tokens": 1, "temperature": 0}
    on = call(qwen3, "POST", CHAT, json=body).json()["usage"]["prompt_tokens"]
    off = call(qwen3, "POST", CHAT, json={**body, "chat_template_kwargs": {
        "enable_thinking": False}}).json()["usage"]["prompt_tokens"]
    budget0 = call(qwen3, "POST", CHAT, json={**body, "reasoning_budget": 0}).json()
    # the template writes an empty <think>\n\n</think>\n\n into the prompt when thinking is off
    assert off > on and budget0["usage"]["prompt_tokens"] == off


def test_budget_of_eight_thinking_tokens(r1: ServerState) -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(r1.config.model_path))
    forced = tok.encode(FORCED_CLOSE, special=True, add_bos=False)
    body = {"messages": ASK, "max_tokens": 20, "temperature": 0, "reasoning_budget": 8,
            "logprobs": True}
    r = call(r1, "POST", CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = [tok.encode(t["token"], special=True, add_bos=False)
           for t in choice["logprobs"]["content"]]
    pieces = [t["token"] for t in choice["logprobs"]["content"]]
    assert [i for (i,) in ids[8:8 + len(forced)]] == forced
    assert "</think>" not in "".join(pieces[:8])
    assert choice["message"]["reasoning_content"] == "".join(pieces[:8]).strip()
    assert choice["message"]["content"] == "".join(pieces[8 + len(forced):]).lstrip()
    unlimited = call(r1, "POST", CHAT, json={**body, "reasoning_budget": -1}).json()
    assert "</think>" not in "".join(
        t["token"] for t in unlimited["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize(("extra", "param"), [
    ({"reasoning_format": "bogus"}, "reasoning_format"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"reasoning_budget": -2}, "reasoning_budget"),
    ({"reasoning_budget": "8"}, "reasoning_budget"),
])
def test_bad_reasoning_fields_are_400(qwen3: ServerState, extra: dict[str, Any],
                                      param: str) -> None:
    r = call(qwen3, "POST", CHAT, json={"messages": ASK, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_template_failing_on_a_variable_is_400(think_model: Callable[..., Path]) -> None:
    for st in _state(think_model("failing", FAILING)):
        r = call(st, "POST", CHAT, json={"messages": ASK, "max_tokens": 2,
                                          "chat_template_kwargs": {"fail_on": "purpose"}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "cannot render purpose" in err["message"]
        assert err["param"] == "chat_template_kwargs"
        ok = call(st, "POST", CHAT, json={"messages": ASK, "max_tokens": 2})
        assert ok.status_code == 200
