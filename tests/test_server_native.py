"""llama-server's native routes (`POST /infill`, `POST /completion`) and `suffix` in
`/v1/completions` in-process (ASGI), on a tiny model whose vocabulary has Qwen2.5-Coder's FIM
tokens and the fake engine: llama-server's reply shape, streaming, the prompt layout counted in
usage, refusal (400) for a model without FIM tokens, every bad input a 400 naming the field, and
input far past the context cut, never refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minfer.gguf.reader import GGUFFile
from minfer.server.state import ServerState
from minfer.tokenizer import Tokenizer
from minfer.tokenizer.infill import Budget, ExtraFile, infill_prompt
from minfer.tools.synth import write_tiny_model
from tests.test_server_app import call, make_state

FIM = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
       "<|file_sep|>")
N_CTX = 256


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fim") / "coder.gguf", extra_tokens=FIM)


@pytest.fixture(scope="module")
def state(coder: Path) -> Iterator[ServerState]:
    st = make_state(coder, n_ctx=N_CTX, slots=1)
    st.start()
    assert st.wait_ready(20)
    yield st
    st.stop()


def _tok(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(path))


def test_infill_has_llama_servers_shape_and_counts_the_layout(state: ServerState,
                                                              coder: Path) -> None:
    body = {"input_prefix": "def f(x):\n    ", "input_suffix": "\nprint(f(1))\n",
            "input_extra": [{"filename": "a.py", "text": "A = 1\n"}, {"text": "B = 2\n"}],
            "prompt": "    return", "n_predict": 6, "temperature": 0}
    r = call(state, "POST", "/infill", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert isinstance(got["content"], str) and got["stop"] is True
    assert got["stop_type"] in ("eos", "limit") and got["tokens_predicted"] <= 6
    tok = _tok(coder)
    ids = infill_prompt(tok, body["input_prefix"], body["input_suffix"],
                        extra=[ExtraFile("A = 1\n", "a.py"), ExtraFile("B = 2\n")],
                        prompt=tok.encode("    return", add_bos=False),
                        budget=Budget(n_batch=N_CTX, n_predict=6, n_ctx=N_CTX))
    assert got["tokens_evaluated"] == len(ids)


def test_infill_streams_content_chunks_then_one_stop(state: ServerState) -> None:
    r = call(state, "POST", "/infill", json={"input_prefix": "x = ", "input_suffix": "\n",
                                             "n_predict": 5, "stream": True})
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["tokens_predicted"] <= 5


def test_completions_suffix_is_fill_in_the_middle(state: ServerState, coder: Path) -> None:
    r = call(state, "POST", "/v1/completions", json={"prompt": "def g():\n    ",
                                                     "suffix": "\n", "max_tokens": 4})
    assert r.status_code == 200, r.text
    tok = _tok(coder)
    ids = infill_prompt(tok, "def g():\n    ", "\n",
                        budget=Budget(n_batch=N_CTX, n_predict=4, n_ctx=N_CTX))
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_model_without_fim_tokens_is_refused_with_a_400(tiny_qwen2: Path) -> None:
    st = make_state(tiny_qwen2, n_ctx=N_CTX, slots=1)
    st.start()
    try:
        assert st.wait_ready(20)
        for path, body in (("/infill", {"input_prefix": "a", "input_suffix": "b"}),
                           ("/v1/completions", {"prompt": "a", "suffix": "b"})):
            r = call(st, "POST", path, json=body)
            assert r.status_code == 400
            assert "fill-in-the-middle" in r.json()["error"]["message"]
    finally:
        st.stop()


@pytest.mark.parametrize(("body", "param"), [
    ({"input_suffix": "b"}, "input_prefix"),
    ({"input_prefix": "a"}, "input_suffix"),
    ({"input_prefix": 5, "input_suffix": "b"}, "input_prefix"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "x.py"}]},
     "input_extra.0.text"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": {"text": "x"}}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "n_predict": -1}, "n_predict"),
    ({"input_prefix": ["a", 10**9], "input_suffix": "b"}, "input_prefix"),
])
def test_bad_input_is_a_400_naming_the_field(state: ServerState, body: dict[str, Any],
                                             param: str) -> None:
    r = call(state, "POST", "/infill", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_far_past_the_context_is_cut_never_refused(state: ServerState) -> None:
    r = call(state, "POST", "/infill", json={"input_prefix": "a = 1\n" * 2000,
                                             "input_suffix": "b = 2\n" * 2000,
                                             "input_extra": [{"text": "c = 3\n" * 2000}],
                                             "n_predict": 4})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_evaluated"] < N_CTX


def test_n_predict_zero_generates_nothing(state: ServerState) -> None:
    r = call(state, "POST", "/infill", json={"input_prefix": "a", "input_suffix": "b",
                                             "n_predict": 0})
    assert r.status_code == 200 and r.json()["content"] == ""


class _Script:
    """A sampler that draws the given ids in turn."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = iter(ids)

    def sample(self, logits: Any) -> int:
        return next(self.ids)

    def accept(self, token_id: int) -> None:
        pass


class _Bytes:
    eot_ids: frozenset[int] = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return b"\n" if token_id == 0 else b"x"


def test_time_limit_ends_at_the_first_newline_after_it() -> None:
    import time

    import numpy as np

    from minfer.engine.core.request import GenRequest, Request

    req = Request(GenRequest(prompt=[1], max_tokens=10, sampler=_Script([1, 1, 1, 0, 1, 0]),
                             t_max_predict_ms=5), _Bytes(), n_ctx_slot=64)
    logits = np.zeros(4, np.float32)
    req.step(logits)
    time.sleep(0.01)
    for _ in range(2):  # past the limit, but no newline yet
        req.step(logits)
        assert req.finish is None
    req.step(logits)  # the newline
    assert req.finish == "length" and req.ids == [1, 1, 1, 0]
    free = Request(GenRequest(prompt=[1], max_tokens=10, sampler=_Script([0] * 10)), _Bytes(),
                   n_ctx_slot=64)
    for _ in range(3):
        free.step(logits)
    assert free.finish is None


def test_an_editor_that_goes_away_frees_the_slot_and_the_next_keystroke_reuses_the_cache(
        coder: Path) -> None:
    """On the real engine: a streaming /infill abandoned after its first chunk frees the slot
    within a few steps; the next request (the prefix grown by two characters) finds the
    abandoned request's prefix in the slot's cache."""
    import time

    import httpx

    from tests.test_server_process import Server

    srv = Server(coder, "--slots", "1", "--n-ctx", "512")
    try:
        srv.wait_ready()
        prefix, suffix = "def total(items):\n    return " * 8, "\n\nprint(total([1, 2]))\n"
        body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 300,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", srv.base + "/infill", json=body, timeout=30) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))
        deadline = time.monotonic() + 5
        while True:
            busy = [line for line in httpx.get(srv.base + "/metrics").text.splitlines()
                    if line.startswith("minfer_slots_busy")]
            if busy and float(busy[0].split()[-1]) == 0:
                break
            assert time.monotonic() < deadline, "the slot was not freed"
            time.sleep(0.05)
        again = httpx.post(srv.base + "/infill", timeout=30,
                           json={**body, "input_prefix": prefix + "su", "stream": False,
                                 "n_predict": 4}).json()
        assert again["tokens_cached"] >= again["tokens_evaluated"] // 2
    finally:
        assert srv.stop() == 0, srv.output()


# -- POST /completion (llama-server's native completion) -------------------------------------------
def test_completion_has_llama_servers_shape_and_matches_v1_completions(state: ServerState,
                                                                      coder: Path) -> None:
    body = {"prompt": "def f(x):", "n_predict": 6, "temperature": 0}
    got = call(state, "POST", "/completion", json=body).json()
    assert got["stop"] is True and got["stop_type"] in ("eos", "limit")
    assert got["tokens_predicted"] <= 6 and got["tokens_evaluated"] == len(
        _tok(coder).encode("def f(x):"))
    assert set(got["timings"]) >= {"prompt_n", "predicted_n", "predicted_per_second"}
    oai = call(state, "POST", "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 6,
                                                       "temperature": 0}).json()
    assert got["content"] == oai["choices"][0]["text"]
    chunks = [json.loads(line[6:]) for line in call(
        state, "POST", "/completion", json={**body, "stream": True}).text.split("\n")
        if line.startswith("data: ")]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == got["content"]


def test_completion_prompt_mixes_ids_and_texts_as_llama_server(state: ServerState,
                                                               coder: Path) -> None:
    tok = _tok(coder)
    head, tail = tok.encode("def f(x):"), tok.encode(" return", add_bos=False)
    whole = call(state, "POST", "/completion", json={"prompt": head + tail, "n_predict": 4,
                                                     "temperature": 0}).json()
    mixed = call(state, "POST", "/completion", json={"prompt": [*head, " return"],
                                                     "n_predict": 4, "temperature": 0}).json()
    assert mixed["tokens_evaluated"] == whole["tokens_evaluated"] == len(head) + len(tail)
    assert mixed["content"] == whole["content"]


def test_completion_stop_word_and_json_schema(state: ServerState) -> None:
    free = call(state, "POST", "/completion", json={"prompt": "a", "n_predict": 12,
                                                    "temperature": 0}).json()["content"]
    word = next(free[i:i + 2] for i in range(2, len(free) - 2)
                if free[i:i + 2].isascii() and free[i:i + 2].isalnum())
    cut = call(state, "POST", "/completion", json={"prompt": "a", "n_predict": 12,
                                                   "temperature": 0, "stop": [word]}).json()
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    assert cut["content"] == free[:free.index(word)]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    got = call(state, "POST", "/completion", json={"prompt": "a", "n_predict": 40,
                                                   "temperature": 0, "json_schema": schema})
    assert got.status_code == 200, got.text
    text = got.json()["content"]
    if got.json()["stop_type"] == "eos":  # a finished object parses
        assert isinstance(json.loads(text)["n"], int)
    assert text.startswith("{")


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "n_probs": 21}, "n_probs"),
    ({"prompt": "a", "n_predict": -2}, "n_predict"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "a", "json_schema": {"type": 12}}, "response_format"),
])
def test_completion_bad_input_is_a_400_naming_the_field(state: ServerState, body: dict[str, Any],
                                                        param: str) -> None:
    r = call(state, "POST", "/completion", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_n_probs_and_ignore_eos(state: ServerState) -> None:
    """`n_probs`: each drawn token's id, text, bytes and logprob with its alternatives, the
    /v1/completions logprobs of the same request (streamed chunk by chunk too); `ignore_eos`:
    the end-of-generation tokens are never drawn, so the reply runs to n_predict."""
    body = {"prompt": "def f(", "n_predict": 8, "temperature": 0, "n_probs": 2}
    whole = call(state, "POST", "/completion", json=body).json()
    probs = whole["completion_probabilities"]
    ref = call(state, "POST", "/v1/completions", json={
        "prompt": "def f(", "max_tokens": 8, "temperature": 0, "logprobs": 2}).json()
    assert [p["logprob"] for p in probs] == ref["choices"][0]["logprobs"]["token_logprobs"]
    assert all(len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["logprob"] >= p["logprob"]
               for p in probs)
    assert "".join(p["token"] for p in probs) == whole["content"]
    streamed = [json.loads(line[6:]) for line in call(
        state, "POST", "/completion", json={**body, "stream": True}).text.splitlines()
        if line.startswith("data: ")]
    assert [p for c in streamed for p in c.get("completion_probabilities", [])] == probs
    eos = {"prompt": "a", "n_predict": 40, "temperature": 0, "ignore_eos": True}
    long = call(state, "POST", "/completion", json=eos).json()
    assert long["tokens_predicted"] == 40 and long["stop_type"] == "limit"
    from minfer.server.prepare import prepare
    from minfer.server.schemas import NativeCompletionRequest

    lm = state.model()
    for ignore in (False, True):
        p = prepare(NativeCompletionRequest(prompt="a", ignore_eos=ignore), lm.tokenizer,
                    lm.template, lm.limits)
        logits = np.zeros(lm.tokenizer.n_vocab, np.float32)
        if p.output.logit_mask is not None:
            p.output.logit_mask.apply(logits)
        eot = sorted(lm.tokenizer.eot_ids)
        assert eot and bool(np.all(np.isneginf(logits[eot]))) == ignore


def test_tokenize_answers_llama_servers_and_vllms_bodies(tiny_qwen2: Path) -> None:
    """lm-evaluation-harness' `local-completions` sends vLLM's body and reads `tokens`;
    llama-server's body keeps its own answer; /tokenizer_info is vLLM's."""
    from tests.test_server_app import running

    for st in running(tiny_qwen2, n_ctx=256, slots=1):
        tok = st.model().tokenizer
        want = tok.encode("Hello world", special=True, add_bos=False)
        llama = call(st, "POST", "/tokenize", json={"content": "Hello world"}).json()
        assert llama == {"tokens": want}
        vllm = call(st, "POST", "/tokenize", json={"prompt": "Hello world",
                                                  "add_special_tokens": False,
                                                  "return_token_strs": True}).json()
        assert vllm == {"count": len(want), "max_model_len": 256, "tokens": want,
                        "token_strs": [tok.token_text(i) for i in want]}
        both = call(st, "POST", "/tokenize", json={"prompt": "a", "content": "b"})
        assert both.status_code == 400 and "content" in both.text
        info = call(st, "GET", "/tokenizer_info").json()
        assert info["eos_token_id"] == tok.eos_id and info["vocab_size"] == tok.n_vocab
        assert info["eos_token"] == tok.token_text(tok.eos_id)
        assert info["model_max_length"] == 256 and "<|im_start|>" in info["chat_template"]
        assert info["tokenizer_class"]


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []]])
def test_an_empty_token_prompt_is_a_400_naming_it(tiny_qwen2: Path, prompt: object) -> None:
    from tests.test_server_app import running

    for st in running(tiny_qwen2, n_ctx=256, slots=1):
        r = call(st, "POST", "/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "prompt"
        assert "empty token list" in r.json()["error"]["message"]
