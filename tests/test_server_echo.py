"""`/v1/completions` with `echo`: the prompt's text before the reply and, with `logprobs`, each
prompt token scored (the first one null, as OpenAI writes it) — what evaluation harnesses send
(`echo`, `logprobs`, `max_tokens` 0 or 1) to read a text's log-likelihood.

On the fake engine: a prompt token's score is the logprob a draw at that position gets, the
prompt cache never skips a scored row, a stream joins to the whole reply. On the tiny model's
real engine: the scores are the log-softmax of `Engine.forward`'s rows over the whole prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minfer.server.state import ServerState
from tests.test_server_app import COMP, call, running, sse

PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def state(tiny_qwen2: Path) -> Iterator[ServerState]:
    yield from running(tiny_qwen2, ready_s=20, n_ctx=512, slots=2)


def complete(state: ServerState, **body: Any) -> dict[str, Any]:
    r = call(state, "POST", COMP, json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


def ids_of(state: ServerState, text: str) -> list[int]:
    return call(state, "POST", "/tokenize", json={"content": text}).json()["tokens"]  # type: ignore[no-any-return]


def test_echo_puts_the_prompt_before_the_reply(state: ServerState) -> None:
    plain = complete(state, prompt=PROMPT, max_tokens=6)["text"]
    assert complete(state, prompt=PROMPT, max_tokens=6, echo=True)["text"] == PROMPT + plain
    assert complete(state, prompt=PROMPT, max_tokens=0, echo=True)["text"] == PROMPT
    ids = ids_of(state, PROMPT)
    assert complete(state, prompt=ids, max_tokens=6, echo=True)["text"] == PROMPT + plain


def test_a_prompt_tokens_score_is_the_draw_at_its_position(state: ServerState) -> None:
    ids = ids_of(state, PROMPT)
    drawn = complete(state, prompt=ids, max_tokens=1, logprobs=3)
    token = ids_of(state, drawn["text"])
    scored = complete(state, prompt=ids + token, max_tokens=0, echo=True, logprobs=3)
    lp = scored["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and "".join(lp["tokens"]) == scored["text"]
    assert lp["token_logprobs"][-1] == drawn["logprobs"]["token_logprobs"][0]
    assert lp["top_logprobs"][-1] == drawn["logprobs"]["top_logprobs"][0]
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and 1 <= len(lp["top_logprobs"][1]) <= 3
    assert lp["text_offset"][1] == len(lp["tokens"][0])
    again = complete(state, prompt=ids + token, max_tokens=0, echo=True, logprobs=3)
    assert again["logprobs"] == lp  # the prompt cache holds these cells now: still scored


def test_echo_with_logprobs_then_the_draws(state: ServerState) -> None:
    ids = ids_of(state, PROMPT)
    whole = complete(state, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1)
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4 and whole["text"].startswith(PROMPT)
    assert lp["text_offset"][len(ids)] == len(PROMPT)
    chunks = sse(call(state, "POST", COMP, json={"prompt": PROMPT, "max_tokens": 4, "echo": True,
                                                 "logprobs": 1, "temperature": 0,
                                                 "stream": True}))
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in pieces) == whole["text"]
    assert pieces[0]["text"] == PROMPT and pieces[0]["logprobs"]["token_logprobs"][0] is None
    streamed = [v for p in pieces if p["logprobs"] for v in p["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


def test_a_repeated_scored_prompt_comes_from_the_cache_with_the_same_scores(
        state: ServerState, tiny_qwen2: Path) -> None:
    """What an evaluation harness sends: one context, then several continuations of it. The
    second identical request reports its cached tokens and the very same logprobs; one sharing
    only the context gets the logprobs a fresh server gives it."""
    body = {"max_tokens": 0, "echo": True, "logprobs": 2}
    r = call(state, "POST", COMP, json={"prompt": PROMPT * 2, **body})
    again = call(state, "POST", COMP, json={"prompt": PROMPT * 2, **body}).json()
    n = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert again["choices"][0]["logprobs"] == r.json()["choices"][0]["logprobs"]
    tail = PROMPT * 2 + "print(add(1, 2))\n"
    shared = call(state, "POST", COMP, json={"prompt": tail, **body}).json()
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - 2
    fresh = next(running(tiny_qwen2, ready_s=20, n_ctx=512, slots=2))
    try:
        alone = call(fresh, "POST", COMP, json={"prompt": tail, **body}).json()
    finally:
        fresh.stop()
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert shared["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]


def test_text_offsets_count_a_character_split_over_tokens_once(
        state: ServerState, tiny_qwen2: Path) -> None:
    """An emoji or an accented letter is several byte tokens in the tiny vocabulary: each
    token's offset is where it starts in the echoed text (a token inside a character: where
    that character starts), as OpenAI's legacy API gives it."""
    from minfer.gguf.reader import GGUFFile
    from minfer.tokenizer import Tokenizer

    prompt = "ab \U0001F600 c\u00e9 d \u4e2d\u6587!"
    ids = ids_of(state, prompt)
    tok = Tokenizer.from_gguf(GGUFFile.open(tiny_qwen2))
    sizes = [len(tok.token_bytes(i)) for i in ids]
    raw = prompt.encode()
    assert sum(sizes) == len(raw) and any(  # a token that is not whole characters
        tok.token_bytes(i).decode(errors="replace") != tok.token_bytes(i).decode(
            errors="ignore") for i in ids)
    # each token's start: the characters its bytes complete before it
    want = [len(raw[:sum(sizes[:n])].decode(errors="ignore")) for n in range(len(ids))]
    got = complete(state, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert got["text"] == prompt and got["logprobs"]["text_offset"] == want
    assert want[-1] == len(prompt) - 1  # the pieces' lengths would put it past the end
    chunks = sse(call(state, "POST", COMP, json={"prompt": prompt, "max_tokens": 2, "echo": True,
                                                 "logprobs": 1, "stream": True}))
    first = chunks[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["text_offset"] == want


def test_echo_and_suffix_together_are_a_400(state: ServerState) -> None:
    r = call(state, "POST", COMP, json={"prompt": "a", "suffix": "b", "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_scores_on_the_real_engine_are_the_forward_rows(tiny_qwen2: Path) -> None:
    """Through the batched runner (prompt chunks of 16 rows) the scores equal the log-softmax of
    one whole-prompt forward's rows (batch-invariant engines, as the server's: a row's logits
    do not depend on the chunking)."""
    from minfer.engine.config import EngineConfig
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile
    from minfer.server.state import ServerConfig

    st = ServerState(ServerConfig(model_path=tiny_qwen2, engine=EngineConfig.build(n_ctx=512),
                                  slots=2, chunk=16))
    st.start()
    try:
        assert st.wait_ready(60)
        ids = ids_of(st, PROMPT * 3)
        got = complete(st, prompt=ids, max_tokens=0, echo=True, logprobs=2)["logprobs"]
        # a prompt sharing a prefix takes those scores from the cache and computes the rest in
        # other chunks than on its own (k 3: the cached scores have too few alternatives)
        other = [*ids[:40], *ids_of(st, "x = 1\n"), *ids[40:]]
        r = call(st, "POST", COMP, json={"prompt": other, "max_tokens": 0, "echo": True,
                                         "logprobs": 2}).json()
        alone = complete(st, prompt=other, max_tokens=0, echo=True, logprobs=3)["logprobs"]
    finally:
        st.stop()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 39
    shared = r["choices"][0]["logprobs"]
    assert shared["token_logprobs"] == alone["token_logprobs"]  # bit for bit
    assert shared["top_logprobs"][1:] == [dict(list(t.items())[:2])
                                          for t in alone["top_logprobs"][1:]]
    f = GGUFFile.open(tiny_qwen2)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=256, batch_invariant=True)  # as the server's
    rows = engine.forward(ids, 0, len(ids))
    x = rows.astype(np.float64)
    want = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(
        1, keepdims=True)))
    expect = [float(want[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    np.testing.assert_allclose(got["token_logprobs"][1:], expect, rtol=0, atol=1e-5)
