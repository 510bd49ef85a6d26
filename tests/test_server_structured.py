"""Structured output through the HTTP app in-process (tiny model's tokenizer, fake engine).

`response_format` json_object / json_schema and GBNF `grammar` produce text that parses and
validates; a bad schema or grammar is a 400 naming the field; concurrent constrained requests
(batched, sharing a cached prompt) each get exactly their solo output; a grammar that allows no
further token ends the request with "stop" without drawing a token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from minfer.engine.core.request import GenRequest, Request
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from minfer.server.app import create_app
from minfer.server.state import ServerState
from minfer.server.worker import Delta, Done, Usage, finish_reason
from tests.test_server_app import CHAT, COMP, HELLO, call, make_state, sse

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                       "strict": True}}


@pytest.fixture(scope="module")
def state(tiny_qwen2: Path) -> Iterator[ServerState]:
    st = make_state(tiny_qwen2, n_ctx=512, slots=2)
    st.start()
    assert st.wait_ready(30)
    assert st.model().grammar_vocab is not None
    yield st
    st.stop()


def token_id(state: ServerState, text: str) -> int:
    (tid,) = call(state, "POST", "/tokenize", json={"content": text}).json()["tokens"]
    return int(tid)


def test_json_object_output_parses(state: ServerState) -> None:
    close = token_id(state, "}")  # random logits would write strings for ever: end the object
    body = {"messages": HELLO, "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_object"}, "logit_bias": {str(close): 100}}
    r = call(state, "POST", CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_json_schema_output_validates(state: ServerState, path: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    base = {"messages": HELLO} if path == CHAT else {"prompt": "Answer in JSON:"}
    r = call(state, "POST", path, json={**base, "max_tokens": 200, "temperature": 0,
                                        "response_format": JSON_SCHEMA})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_streamed_json_equals_the_whole_response(state: ServerState) -> None:
    body = {"messages": HELLO, "max_tokens": 200, "temperature": 0,
            "response_format": JSON_SCHEMA}
    whole = call(state, "POST", CHAT, json=body).json()["choices"][0]["message"]["content"]
    chunks = sse(call(state, "POST", CHAT, json={**body, "stream": True}))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_gbnf_grammar_is_followed(state: ServerState) -> None:
    r = call(state, "POST", CHAT, json={"messages": HELLO, "max_tokens": 10, "temperature": 1,
                                        "seed": 3, "grammar": 'root ::= "yes" | "no"'})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] in ("yes", "no")
    assert choice["finish_reason"] == "stop"


def test_text_response_format_is_free_text(state: ServerState) -> None:
    r = call(state, "POST", CHAT, json={"messages": HELLO, "max_tokens": 5, "temperature": 0,
                                        "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": 12}}}},
     "response_format", "type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": "nope"}}, "response_format",
     "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"grammar": "root ::= ("}, "grammar", "GBNF"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar",
     "either"),
]


@pytest.mark.parametrize(("extra", "param", "word"), BAD)
def test_bad_schema_or_grammar_is_a_400(state: ServerState, extra: dict[str, Any], param: str,
                                        word: str) -> None:
    r = call(state, "POST", CHAT, json={"messages": HELLO, "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert word in err["message"]


def test_batched_constrained_requests_equal_their_solo_runs(state: ServerState) -> None:
    """Each slot's mask follows its own tokens: three greedy JSON requests (two sharing a
    cached prompt, one sampled) batched in two slots give their solo answers."""
    bodies = [{"messages": HELLO, "max_tokens": 200, "temperature": 0,
               "response_format": JSON_SCHEMA},
              {"messages": [{"role": "user", "content": "Another"}], "max_tokens": 200,
               "temperature": 0.8, "seed": 5, "response_format": JSON_SCHEMA},
              {"messages": HELLO, "max_tokens": 200, "temperature": 0,
               "response_format": {"type": "json_object"}, "grammar": None}]
    solo = [call(state, "POST", CHAT, json=b).json()["choices"][0]["message"]["content"]
            for b in bodies]

    async def together() -> list[str]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            rs = await asyncio.gather(*(c.post(CHAT, json=b) for b in bodies * 2))
        return [r.json()["choices"][0]["message"]["content"] for r in rs]

    assert asyncio.run(together()) == solo * 2


class StopsAfter:
    """A mask that allows everything for n tokens, then nothing (is_stopped)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.accepted: list[int] = []

    def apply(self, logits: np.ndarray) -> None:
        assert len(self.accepted) < self.n, "sampled under a stopped grammar"

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def reset(self) -> None:
        self.accepted.clear()

    def is_stopped(self) -> bool:
        return len(self.accepted) >= self.n


class Vocab:
    eot_ids = frozenset({0})

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([97 + token_id % 26])


def run_generation(mask: StopsAfter, max_tokens: int) -> tuple[list[Any], int]:
    """One request's draws on a fixed logits row, as the server's events."""
    sampler = Sampler(SamplerParams(temp=0.0), 32, seed=1, logit_mask=mask)
    sampler.reset([1])
    state = Request(GenRequest([1], max_tokens, sampler, constraint=mask), Vocab(),
                    n_ctx_slot=64)
    logits = np.zeros(32, dtype=np.float32)
    logits[5] = 1.0
    texts = []
    while state.finish is None:
        emitted = state.step(logits)
        if emitted is not None:
            texts.append(emitted.text)
    texts.append(state.tail)
    events: list[Any] = [Delta(t) for t in texts if t]
    events.append(Done(finish_reason(state.finish), Usage(1, state.n_generated, 0)))
    return events, state.n_generated


def test_a_grammar_with_no_next_token_ends_with_stop() -> None:
    mask = StopsAfter(3)
    events, n = run_generation(mask, max_tokens=10)
    assert n == 3 and mask.accepted == [5, 5, 5]  # ended right after the 3rd, nothing drawn
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "fff"
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "stop"


def test_a_grammar_stopped_from_the_start_draws_nothing() -> None:
    events, n = run_generation(StopsAfter(0), max_tokens=10)
    assert n == 0 and events[-1].finish_reason == "stop"
    assert events[-1].usage.completion_tokens == 0
