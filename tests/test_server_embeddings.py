"""Embeddings and reranking over HTTP, in-process (ASGI), on tiny synthetic models and the real
engine: OpenAI's /v1/embeddings through the official client (float and base64 alike), token-id
inputs, llama-server's /v1/rerank, Ollama's /api/embed and /api/embeddings, concurrent
requests sharing forwards with unchanged vectors, and every bad input a 400 in its API's shape
naming what is wrong."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest

from minfer.engine.embed import normalize
from minfer.gguf.reader import GGUFFile
from minfer.server.app import create_app
from minfer.server.state import ServerConfig, ServerState
from minfer.tokenizer import Tokenizer
from minfer.tools.synth import write_tiny_bert
from tests.test_server_app import call, make_state

from .oracle import OracleBert

EMB = "/v1/embeddings"
TEXTS = ["the quick brown fox", "hello world", "x"]


def _started(st: ServerState) -> ServerState:
    st.start()
    assert st.wait_ready(60), st.error
    return st


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("emb") / "minilm.gguf")


@pytest.fixture(scope="module")
def bert(bert_path: Path) -> Iterator[ServerState]:
    st = _started(ServerState(ServerConfig(model_path=bert_path)))
    yield st
    st.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    path = write_tiny_bert(tmp_path_factory.mktemp("emb") / "ranker.gguf", cls_head=1,
                           pooling=4)
    st = _started(ServerState(ServerConfig(model_path=path)))
    yield st
    st.stop()


def _oracle(path: Path, texts: list[str]) -> np.ndarray:
    tok = Tokenizer.from_gguf(GGUFFile.open(path))
    o = OracleBert(str(path))
    return np.stack([normalize(o.pool(tok.encode(t), "mean").astype(np.float32))
                     for t in texts])


def test_the_openai_client_gets_the_models_vectors(bert: ServerState, bert_path: Path) -> None:
    async def go() -> tuple[Any, Any]:
        transport = httpx.ASGITransport(app=create_app(bert, own_state=False))
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x",
                                    http_client=httpx.AsyncClient(transport=transport))
        b64 = await client.embeddings.create(model="minilm", input=TEXTS)  # base64 on the wire
        flt = await client.embeddings.create(model="minilm", input=TEXTS,
                                             encoding_format="float")
        return b64, flt

    b64, flt = asyncio.run(go())
    got = np.array([d.embedding for d in b64.data])
    assert np.array_equal(got, np.array([d.embedding for d in flt.data]))
    np.testing.assert_allclose(got, _oracle(bert_path, TEXTS), atol=3e-5)
    assert [d.index for d in b64.data] == [0, 1, 2] and b64.model == "minilm"
    n_tokens = sum(len(Tokenizer.from_gguf(GGUFFile.open(bert_path)).encode(t)) for t in TEXTS)
    assert b64.usage.prompt_tokens == b64.usage.total_tokens == n_tokens


def test_inputs_as_token_ids_and_raw_base64(bert: ServerState) -> None:
    ids = Tokenizer.from_gguf(GGUFFile.open(bert.config.model_path)).encode("hello world")
    by_text = call(bert, "POST", EMB, json={"input": "hello world"}).json()
    by_ids = call(bert, "POST", EMB, json={"input": ids}).json()
    many = call(bert, "POST", EMB, json={"input": [ids, ids[:2]], "encoding_format": "base64"})
    assert by_text["data"][0]["embedding"] == by_ids["data"][0]["embedding"]
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
            for d in many.json()["data"]]
    assert np.array_equal(vecs[0], np.array(by_ids["data"][0]["embedding"], np.float32))
    assert len(vecs) == 2 and not np.array_equal(vecs[0], vecs[1])
    raw = call(bert, "POST", EMB, json={"input": "hello world", "embd_normalize": -1}).json()
    assert np.linalg.norm(raw["data"][0]["embedding"]) > 1.5  # unnormalised


def test_concurrent_requests_share_forwards_with_the_same_vectors(bert: ServerState) -> None:
    alone = [call(bert, "POST", EMB, json={"input": t}).json()["data"][0]["embedding"]
             for t in TEXTS]

    async def go() -> list[Any]:
        transport = httpx.ASGITransport(app=create_app(bert, own_state=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            rs = await asyncio.gather(*(c.post(EMB, json={"input": [t, *TEXTS]})
                                        for t in TEXTS * 3))
        return [r.json() for r in rs]

    for i, body in enumerate(go_all := asyncio.run(go())):
        vecs = [d["embedding"] for d in body["data"]]
        assert vecs[0] == alone[i % 3] and vecs[1:] == alone
    assert len(go_all) == 9


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["ok", []]}, "input.str", "valid string"),
    ({"input": [[5, 6], [5, 99999]]}, "input[1]", "outside the vocabulary"),
    ({"input": "fox " * 200}, "input[0]", "more than this model reads"),
    ({"input": "fox", "encoding_format": "int8"}, "encoding_format", "float|base64"),
    ({"input": "fox", "dimensions": 7}, "dimensions", "64 dimensions"),
])
def test_bad_embedding_requests_are_openai_400s(bert: ServerState, body: dict[str, Any],
                                                param: str, words: str) -> None:
    r = call(bert, "POST", EMB, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"]
    assert err["param"] == param


def test_long_inputs_are_cut_when_asked(bert: ServerState) -> None:
    r = call(bert, "POST", EMB, json={"input": "fox " * 200, "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 128


def test_an_embedding_model_does_not_generate(bert: ServerState) -> None:
    r = call(bert, "POST", "/v1/chat/completions",
             json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    r = call(bert, "POST", "/v1/rerank", json={"query": "a", "documents": ["b"]})
    assert r.status_code == 400 and "--reranking" in r.json()["error"]["message"]


def test_rerank_sorts_documents_by_the_classifier(reranker: ServerState) -> None:
    docs = ["the quick brown fox", "hello world", "lazy dog in the sun", "tea"]
    r = call(reranker, "POST", "/v1/rerank",
             json={"query": "fox", "documents": docs, "top_n": 3, "return_documents": True})
    assert r.status_code == 200, r.text
    body = r.json()
    scores = [x["relevance_score"] for x in body["results"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    top = body["results"][0]
    assert top["document"]["text"] == docs[top["index"]]
    # each score is the pair's classifier output, however many documents came with it
    one = call(reranker, "POST", "/rerank",
               json={"query": "fox", "documents": [docs[top["index"]]]}).json()
    assert one["results"][0]["relevance_score"] == top["relevance_score"]
    assert body["usage"]["prompt_tokens"] > 0
    r = call(reranker, "POST", EMB, json={"input": "fox"})
    assert r.status_code == 400 and "/v1/rerank" in r.json()["error"]["message"]
    r = call(reranker, "POST", "/v1/rerank", json={"query": "fox", "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_ollama_embed_and_embeddings(bert: ServerState, bert_path: Path) -> None:
    async def go() -> tuple[Any, Any]:
        transport = httpx.ASGITransport(app=create_app(bert, own_state=False))
        c = ollama.AsyncClient(host="http://test", transport=transport)
        return await c.embed(model="minilm", input=TEXTS), \
            await c.embeddings(model="minilm:latest", prompt="hello world")

    embed, legacy = asyncio.run(go())
    got = np.array(embed.embeddings)
    np.testing.assert_allclose(got, _oracle(bert_path, TEXTS), atol=3e-5)
    assert embed.prompt_eval_count > 0 and embed.model == "minilm:latest"
    assert np.allclose(normalize(np.array(legacy.embedding, np.float32)), got[1], atol=1e-6)
    r = call(bert, "POST", "/api/embed", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = call(bert, "POST", "/api/show", json={"model": "minilm"})
    assert r.status_code == 200 and r.json()["capabilities"] == ["embedding"]
    r = call(bert, "POST", "/api/embed", json={"model": "minilm", "input": [], "x": 1})
    assert r.status_code == 400 and "must not be empty" in r.json()["error"]


def test_a_generative_model_embeds_when_asked(tiny_qwen2: Path) -> None:
    off = _started(make_state(tiny_qwen2))
    try:
        r = call(off, "POST", EMB, json={"input": "hello"})
        assert r.status_code == 400 and "--embeddings" in r.json()["error"]["message"]
    finally:
        off.stop()
    on = _started(make_state(tiny_qwen2, embeddings=True))
    try:
        r = call(on, "POST", EMB, json={"input": ["hello", "world"]})
        assert r.status_code == 200, r.text
        vecs = np.array([d["embedding"] for d in r.json()["data"]])
        assert vecs.shape == (2, 64) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0)
        chat = call(on, "POST", "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert chat.status_code == 200  # it still generates
        caps = call(on, "POST", "/api/show", json={"model": tiny_qwen2.stem}).json()["capabilities"]
        assert caps[:2] == ["completion", "embedding"]
    finally:
        on.stop()


def test_llama_servers_own_embeddings_route(bert: ServerState, tmp_path: Path) -> None:
    """`/embedding(s)`: `content` or `input`, each input's vectors in a list; per token when
    the model does not pool."""
    oai = call(bert, "POST", EMB, json={"input": ["hello world", "x"]}).json()
    native = call(bert, "POST", "/embeddings", json={"content": ["hello world", "x"]})
    assert native.status_code == 200
    body = native.json()
    assert [b["index"] for b in body] == [0, 1]
    assert [b["embedding"][0] for b in body] == [d["embedding"] for d in oai["data"]]
    assert call(bert, "POST", "/embedding", json={"input": "x"}).json()[0]["embedding"] == \
        [oai["data"][1]["embedding"]]
    r = call(bert, "POST", "/embeddings", json={"model": "minilm"})
    assert r.status_code == 400 and "content" in r.json()["error"]["message"]
    flat = write_tiny_bert(tmp_path / "flat.gguf", pooling=0)
    st = _started(ServerState(ServerConfig(model_path=flat)))
    try:
        ids = Tokenizer.from_gguf(GGUFFile.open(flat)).encode("hello world")
        rows = call(st, "POST", "/embeddings", json={"content": "hello world"}).json()
        assert np.array(rows[0]["embedding"]).shape == (len(ids), 64)
        r = call(st, "POST", EMB, json={"input": "hello world"})
        assert r.status_code == 400 and "not OpenAI-compatible" in r.json()["error"]["message"]
    finally:
        st.stop()


def test_the_servers_default_norm(bert_path: Path) -> None:
    """`--embd-normalize` sets what a request without `embd_normalize` gets."""
    st = _started(ServerState(ServerConfig(model_path=bert_path, embd_normalize=-1)))
    try:
        raw = call(st, "POST", EMB, json={"input": "hello world"}).json()["data"][0]["embedding"]
        unit = call(st, "POST", EMB, json={"input": "hello world", "embd_normalize": 2}).json()
        assert np.linalg.norm(raw) > 1.5
        np.testing.assert_allclose(unit["data"][0]["embedding"],
                                   np.array(raw) / np.linalg.norm(raw), atol=1e-6)
    finally:
        st.stop()
