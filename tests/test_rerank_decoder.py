"""A decoder reranker (Qwen3-Reranker's form): a tiny random Qwen3 converted by llama.cpp's own
converter, which writes rank pooling, the `rerank` prompt template and the yes / no head
`cls.output` (tests/fixtures/rerank, from benchmarks/make_rerank_fixture.py). minfer reads the
last token through the head and a softmax, as llama.cpp does, and formats each pair with the
file's template, as llama-server's /v1/rerank does; the server serves such a file for reranking
only. The scores are llama.cpp's (f32 KV) within f32 rounding."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.engine.config import EngineConfig
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.server.state import ServerConfig, ServerState
from tests.test_server_app import call

FIXTURE = Path(__file__).parent / "fixtures" / "rerank"
MODEL = FIXTURE / "qwen3_reranker.gguf"
REF = json.loads((FIXTURE / "scores_llamacpp.json").read_text())


def test_read_as_a_reranker() -> None:
    f = GGUFFile.open(MODEL)
    hp = HParams.from_gguf(f)
    assert (hp.arch, hp.causal, hp.pooling, hp.n_cls_out) == ("qwen3", True, "rank", 2)
    assert hp.reranker and hp.rank_softmax
    assert "{query}" in f.metadata["tokenizer.chat_template.rerank"]


def test_scores_are_llamacpps() -> None:
    """Each pair's two outputs (P(yes), P(no)) equal llama.cpp's; the score is the first.
    Packed together or alone, a pair's outputs are the same bits (batch-invariant)."""
    embedder = minfer.load(MODEL).embedder()
    want = np.array(REF["llamacpp"])
    inputs = [embedder.rerank_inputs(q, [d])[0] for q, d in REF["pairs"]]
    together = np.stack(embedder.run(inputs))
    np.testing.assert_allclose(together, want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(together.sum(axis=1), 1.0, atol=1e-6)  # the softmax
    alone = np.stack([embedder.run([x])[0] for x in inputs])
    assert np.array_equal(alone, together)
    # the last row is the one read: the first row through the same head is far off
    first = minfer.load(MODEL).embedder("cls").run([inputs[0]], norm=-1)[0]
    head = GGUFFile.open(MODEL).array("cls.output.weight").astype(np.float64)
    logits = head @ first
    p_first = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert abs(p_first[0] - want[0, 0]) > 1e-3
    query, doc = REF["pairs"][0]
    assert embedder.rerank(query, [doc]) == [pytest.approx(want[0, 0], abs=2e-5)]


@pytest.fixture(scope="module")
def served() -> Iterator[ServerState]:
    st = ServerState(ServerConfig(model_path=MODEL, engine=EngineConfig.build(n_ctx=512),
                                     slots=1))
    st.start()
    assert st.wait_ready(60), st.error
    yield st
    st.stop()


def test_served_for_reranking_only(served: ServerState) -> None:
    """No --embeddings needed: /v1/rerank answers with llama.cpp's scores; chat is refused."""
    query = REF["pairs"][0][0]
    docs = [d for q, d in REF["pairs"] if q == query]
    r = call(served, "POST", "/v1/rerank", json={"query": query, "documents": docs})
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    for i in range(len(docs)):
        assert got[i] == pytest.approx(REF["llamacpp"][i][0], abs=2e-5)
    chat = call(served, "POST", "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 400 and "does not generate" in chat.json()["error"]["message"]
