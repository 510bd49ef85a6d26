"""The HTTP app in-process (ASGI), on the tiny model's tokenizer and the fake engine.

Response shapes field for field, streaming, stop strings, logprobs, usage and cached tokens,
every bad-input class answered with the right 4xx and an OpenAI error body, the API key, the
bounded queue, /health during loading, /metrics, /tokenize and /detokenize.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from minfer.engine.config import EngineConfig
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.server.app import create_app
from minfer.server.state import ServerConfig, ServerState
from tests.fake_engine import HashEngine

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
HELLO = [{"role": "user", "content": "Say hello"}]


def make_state(model: Path, *, step_s: float = 0.0, gate: threading.Event | None = None,
               n_ctx: int = 256, **config: Any) -> ServerState:
    """A server over a fake engine (`HashEngine`); n_ctx: per slot; config: ServerConfig's."""
    f = GGUFFile.open(model)
    hp = HParams.from_gguf(f)
    eot = frozenset(int(i) for i, t in enumerate(f.metadata["tokenizer.ggml.tokens"].tolist())
                    if t in ("<|im_end|>", "<|endoftext|>"))

    def factory(n_ctx: int) -> HashEngine:
        if gate is not None:
            gate.wait(10)
        return HashEngine(n_ctx, hp.n_vocab, step_s=step_s, avoid=eot)

    config.setdefault("slots", 2)
    return ServerState(ServerConfig(model_path=model, engine=EngineConfig.build(n_ctx=n_ctx),
                                    **config), engine_factory=factory)


def running(model: Path, *, ready_s: float = 30, **config: Any) -> Iterator[ServerState]:
    """A started `make_state` server for a fixture to yield from; stopped after its tests."""
    st = make_state(model, **config)
    st.start()
    assert st.wait_ready(ready_s)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def state(tiny_qwen2: Path) -> Iterator[ServerState]:
    st = make_state(tiny_qwen2)
    st.start()
    assert st.wait_ready(20)
    yield st
    st.stop()


def call(state: ServerState, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def sse(resp: httpx.Response) -> list[Any]:
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_completion_has_the_openai_shape(state: ServerState) -> None:
    r = call(state, "POST", CHAT, json={"model": "anything", "messages": HELLO,
                                         "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and body["model"] == "qwen2"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 12 and u["prompt_tokens"] > 5
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens_details"]["cached_tokens"] >= 0


def test_chat_stream_sends_role_then_content_then_finish_then_usage(state: ServerState) -> None:
    req = {"messages": HELLO, "max_tokens": 10, "temperature": 0}
    whole = call(state, "POST", CHAT, json=req).json()["choices"][0]["message"]["content"]
    r = call(state, "POST", CHAT, json={**req, "stream": True,
                                        "stream_options": {"include_usage": True}})
    chunks = sse(r)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == whole


def test_completions_accept_text_or_token_ids(state: ServerState) -> None:
    ids = call(state, "POST", "/tokenize", json={"content": "def main():"}).json()["tokens"]
    a = call(state, "POST", COMP, json={"prompt": "def main():", "max_tokens": 8,
                                        "temperature": 0}).json()
    b = call(state, "POST", COMP, json={"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    assert a["object"] == "text_completion" and a["id"].startswith("cmpl-")
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["prompt_tokens"] == len(ids)
    chunks = sse(call(state, "POST", COMP, json={"prompt": ids, "max_tokens": 8,
                                                 "temperature": 0, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == a["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[0]


def test_default_completion_length_is_16_tokens_like_openai(state: ServerState) -> None:
    body = call(state, "POST", COMP, json={"prompt": "x", "temperature": 0}).json()
    assert body["usage"]["completion_tokens"] == 16


def test_stop_string_cuts_the_text_before_it(state: ServerState) -> None:
    req = {"prompt": "Once upon", "max_tokens": 40, "temperature": 0}
    full = call(state, "POST", COMP, json=req).json()["choices"][0]["text"]
    printable = [i for i in range(5, len(full) - 2) if full[i:i + 2].isprintable()]
    cut = printable[len(printable) // 2]
    stop = full[cut:cut + 2]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        r = call(state, "POST", COMP, json={**req, "stop": [stop, "never-seen"],
                                            "stream": stream})
        if stream:
            chunks = sse(r)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == expected and reason == "stop"


def test_logprobs_are_a_log_softmax_with_sorted_alternatives(state: ServerState) -> None:
    body = call(state, "POST", CHAT, json={"messages": HELLO, "max_tokens": 5, "temperature": 0,
                                           "logprobs": True, "top_logprobs": 3}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert entry["logprob"] == pytest.approx(tops[0])  # greedy took the best token
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    comp = call(state, "POST", COMP, json={"prompt": "a", "max_tokens": 4, "temperature": 0,
                                           "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert len(comp["tokens"]) == len(comp["token_logprobs"]) == len(comp["top_logprobs"]) == 4
    assert all(len(t) <= 2 for t in comp["top_logprobs"])


def test_a_repeated_prompt_is_served_from_the_prompt_cache(state: ServerState) -> None:
    req = {"prompt": "The quick brown fox jumps over", "max_tokens": 3, "temperature": 0}
    first = call(state, "POST", COMP, json=req).json()
    second = call(state, "POST", COMP, json=req).json()
    n = first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_n_choices_are_separate_draws_each_as_a_lone_request_draws_it(state: ServerState
                                                                       ) -> None:
    req = {"messages": HELLO, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    one = call(state, "POST", CHAT, json=req).json()
    nxt = call(state, "POST", CHAT, json={**req, "seed": 8}).json()
    body = call(state, "POST", CHAT, json={**req, "n": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in body["choices"]]
    # draw i samples with seed + i: the first is the lone request's, the next seed's second
    assert texts[0] == one["choices"][0]["message"]["content"]
    assert texts[1] == nxt["choices"][0]["message"]["content"]
    assert len(set(texts)) > 1
    u, u1 = body["usage"], one["usage"]
    assert u["prompt_tokens"] == u1["prompt_tokens"]  # the prompt counts once
    assert u["completion_tokens"] == 3 * u1["completion_tokens"]
    assert all(c["finish_reason"] == "length" for c in body["choices"])


def test_a_completion_prompt_list_gets_n_choices_per_prompt_in_order(state: ServerState
                                                                      ) -> None:
    req = {"max_tokens": 5, "temperature": 0}
    a = call(state, "POST", COMP, json={**req, "prompt": "def f(x):"}).json()
    ids = call(state, "POST", "/tokenize", json={"content": "class A:"}).json()["tokens"]
    b = call(state, "POST", COMP, json={**req, "prompt": ids}).json()
    texts = [a["choices"][0]["text"], b["choices"][0]["text"]]
    both = call(state, "POST", COMP, json={**req, "prompt": ["def f(x):", "class A:"],
                                           "n": 2}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in both["choices"]] == [texts[0], texts[0], texts[1], texts[1]]
    assert both["usage"]["prompt_tokens"] == (a["usage"]["prompt_tokens"]
                                              + b["usage"]["prompt_tokens"])
    assert both["usage"]["completion_tokens"] == 4 * 5
    as_ids = call(state, "POST", COMP, json={**req, "prompt": [ids, ids]}).json()
    assert [c["text"] for c in as_ids["choices"]] == [texts[1], texts[1]]


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_a_stream_of_n_choices_names_each_chunks_choice(state: ServerState, path: str) -> None:
    req: dict[str, Any] = {"max_tokens": 7, "temperature": 0.9, "seed": 3, "n": 2}
    req |= {"messages": HELLO} if path == CHAT else {"prompt": "def f(x):"}
    whole = call(state, "POST", path, json=req).json()
    chunks = sse(call(state, "POST", path, json={**req, "stream": True,
                                                 "stream_options": {"include_usage": True}}))
    assert len({c["id"] for c in chunks}) == 1
    texts = ["", ""]
    finishes: list[Any] = [None, None]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        assert finishes[i] is None  # nothing of a choice after its finish
        part = choice["delta"].get("content") if path == CHAT else choice["text"]
        texts[i] += part or ""
        finishes[i] = choice["finish_reason"]
    assert finishes == ["length", "length"]
    key = "message" if path == CHAT else None
    assert texts == [c[key]["content"] if key else c["text"] for c in whole["choices"]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 14
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]  # (the cached differ)


@pytest.mark.parametrize("headers", [{"content-type": "application/x-www-form-urlencoded"}, {}])
def test_a_json_body_without_a_json_content_type_is_read_as_json(state: ServerState,
                                                                 headers: dict[str, str]) -> None:
    """`curl -d '{...}'` says the body is a form; llama-server reads it as JSON, and so do we."""
    body = json.dumps({"messages": HELLO, "max_tokens": 2, "temperature": 0}).encode()
    r = call(state, "POST", CHAT, content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    bad = call(state, "POST", CHAT, content=b"messages=hi", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


BAD = [
    (CHAT, b"{not json", 400, None),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    (CHAT, {"messages": HELLO, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": HELLO, "temperature": 2.5}, 400, "temperature"),
    (CHAT, {"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": HELLO, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "messages"),
    (CHAT, {"messages": HELLO, "n": 0}, 400, "n"),
    (CHAT, {"messages": HELLO, "n": 129}, 400, "n"),
    (CHAT, {"messages": HELLO, "stop": 5}, 400, None),
    (CHAT, {"messages": HELLO, "stop": [""]}, 400, None),
    (CHAT, {"messages": HELLO, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": HELLO, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}}, 400,
     "response_format"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
    (COMP, {"prompt": [10**9]}, 400, "prompt"),
    (COMP, {"prompt": [-1]}, 400, None),
    (COMP, {"prompt": ""}, 400, "prompt"),
    (COMP, {"prompt": ["a", "b"] * 33, "n": 2}, 400, "n"),
    (COMP, {"prompt": ["a", ""]}, 400, "prompt"),
    (COMP, {"prompt": "x", "suffix": "y", "echo": True}, 400, "echo"),
    (COMP, {"prompt": "x", "seed": "1"}, 400, "seed"),
    (COMP, {}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/tokenize", {"content": 5}, 400, "content"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_gets_a_4xx_with_an_openai_error_body(state: ServerState, path: str,
                                                         body: Any, status: int,
                                                         param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = call(state, "POST", path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert state.model().worker.scheduler.n_busy == 0


def test_a_model_is_retrieved_by_its_name_and_another_is_a_404(state: ServerState) -> None:
    listed = call(state, "GET", "/v1/models").json()["data"]
    (name,) = [m["id"] for m in listed]
    one = call(state, "GET", f"/v1/models/{name}")
    assert one.status_code == 200 and one.json() == listed[0]
    assert call(state, "GET", f"/v1/models/{name}:latest").json() == listed[0]
    miss = call(state, "GET", "/v1/models/nope")
    assert miss.status_code == 404 and miss.json()["error"]["code"] == "model_not_found"


def test_unknown_path_and_method_are_openai_errors(state: ServerState) -> None:
    r = call(state, "GET", "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = call(state, "GET", CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_api_key_guards_everything_but_health(tiny_qwen2: Path) -> None:
    st = make_state(tiny_qwen2, api_key="sekret")
    st.start()
    assert st.wait_ready(20)
    try:
        assert call(st, "GET", "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = call(st, "GET", path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = call(st, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = call(st, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "qwen2"
    finally:
        st.stop()


def test_health_is_503_while_loading_then_200(tiny_qwen2: Path) -> None:
    gate = threading.Event()
    st = make_state(tiny_qwen2, gate=gate)
    st.start()
    try:
        r = call(st, "GET", "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = call(st, "POST", COMP, json={"prompt": "x"})
        assert r.status_code == 503 and "retry-after" in r.headers
        gate.set()
        assert st.wait_ready(20)
        assert call(st, "GET", "/health").json() == {"status": "ok"}
    finally:
        gate.set()
        st.stop()


def test_a_full_queue_answers_503_with_retry_after(tiny_qwen2: Path) -> None:
    st = make_state(tiny_qwen2, slots=1, queue=1, step_s=0.02)
    st.start()
    assert st.wait_ready(20)

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=30) as c:
            req = {"prompt": "hello", "max_tokens": 10}
            return await asyncio.gather(*(c.post(COMP, json=req) for _ in range(6)))

    try:
        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes[:2] == [200, 200] and set(codes[2:]) == {503}
        full = next(r for r in asyncio.run(burst()) if r.status_code == 503)
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        assert st.model().worker.scheduler.n_busy == 0
    finally:
        st.stop()


def test_oversized_body_is_413(state: ServerState) -> None:
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    r = call(state, "POST", COMP, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_tokenize_and_detokenize_round_trip(state: ServerState) -> None:
    r = call(state, "POST", "/tokenize", json={"content": "hello <|im_start|> world",
                                               "with_pieces": True})
    pieces = r.json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "hello <|im_start|> world"
    ids = [p["id"] for p in pieces]
    r = call(state, "POST", "/detokenize", json={"tokens": ids})
    assert r.json() == {"content": "hello <|im_start|> world"}


def test_metrics_count_requests_tokens_and_latency(state: ServerState) -> None:
    call(state, "POST", COMP, json={"prompt": "count me", "max_tokens": 4})
    call(state, "POST", COMP, json={"prompt": ""})
    text = call(state, "GET", "/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(samples['minfer_requests_total{endpoint="/v1/completions",status="200"}']) >= 1
    assert float(samples['minfer_requests_total{endpoint="/v1/completions",status="400"}']) >= 1
    assert float(samples["minfer_generated_tokens_total"]) >= 4
    assert float(samples["minfer_prompt_tokens_total"]) >= 2
    assert float(samples["minfer_time_to_first_token_seconds_count"]) >= 1
    assert float(samples["minfer_time_per_output_token_seconds_count"]) >= 3
    for gauge in ("queue_depth", "slots_busy", "kv_cells_used", "kv_cells_total"):
        assert f"minfer_{gauge}" in samples
    assert '# TYPE minfer_time_to_first_token_seconds histogram' in text


def test_llama_cpps_further_sampler_fields_reach_the_sampler(state: ServerState) -> None:
    """typical_p, min_keep, repeat_last_n (its penalty_last_n), DRY and mirostat, as llama.cpp's
    server takes them beside OpenAI's fields (and Ollama's options); a value the sampler
    refuses is a 400 naming it."""
    from minfer.server.ollama.schemas import ChatRequest
    from minfer.server.ollama.translate import chat_request
    from minfer.server.prepare import sampler_params
    from minfer.server.schemas import ChatCompletionRequest

    extra = {"typical_p": 0.9, "min_keep": 2, "repeat_last_n": 32, "dry_multiplier": 0.8,
             "dry_base": 1.5, "dry_allowed_length": 3, "dry_penalty_last_n": 128,
             "dry_sequence_breakers": ["\n", ";"], "mirostat": 2, "mirostat_tau": 4.0,
             "mirostat_eta": 0.2}
    p = sampler_params(ChatCompletionRequest.model_validate({"messages": HELLO, **extra}))
    assert (p.typical_p, p.min_keep, p.penalty_last_n, p.dry_multiplier, p.dry_base,
            p.dry_allowed_length, p.dry_penalty_last_n, p.dry_sequence_breakers, p.mirostat,
            p.mirostat_tau, p.mirostat_eta) == (0.9, 2, 32, 0.8, 1.5, 3, 128, ("\n", ";"), 2,
                                                 4.0, 0.2)
    options = {k: extra[k] for k in ("typical_p", "repeat_last_n", "mirostat", "mirostat_tau",
                                     "mirostat_eta")}
    q = sampler_params(chat_request(ChatRequest.model_validate(
        {"model": "m", "messages": HELLO, "options": options})))
    assert (q.typical_p, q.penalty_last_n, q.mirostat, q.mirostat_tau, q.mirostat_eta) == (
        0.9, 32, 2, 4.0, 0.2)
    r = call(state, "POST", CHAT, json={"messages": HELLO, "max_tokens": 4, "seed": 1, **extra})
    assert r.status_code == 200, r.text
    r = call(state, "POST", CHAT, json={"messages": HELLO, "dry_sequence_breakers": [""]})
    assert r.status_code == 400 and "dry_sequence_breakers" in r.json()["error"]["message"]
