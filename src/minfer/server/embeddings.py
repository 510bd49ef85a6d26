"""Embeddings and reranking over HTTP: OpenAI's `POST /v1/embeddings`, llama-server's own
`POST /embeddings` (and `/embedding`: `content` or `input`, a list of vectors per input, one
per token with pooling none) and its `POST /v1/rerank` (also `/rerank`, `/reranking`), and the
shared checks Ollama's `/api/embed` uses.

An embeddings `input` is a string, a list of strings, a list of token ids or a list of such
lists; each becomes one input (special tokens added to texts as the vocabulary does). A rerank
request scores each of `documents` against `query` (strings, or objects with a `text`), sorted
by relevance, `top_n` of them. Inputs are checked before anything runs: an empty list, an empty
input, a token id outside the vocabulary or an input longer than the model reads is a 400
naming its index (`truncate: true` cuts long ones instead). `encoding_format: "base64"` (the
official client's default) sends each vector as its little-endian f32 bytes in base64.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import FastAPI
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from minfer.engine.embed import Embedder, Encoded, InputError
from minfer.server.embed_worker import EmbedWorker, QueueFull
from minfer.server.errors import APIError, unavailable
from minfer.server.schemas import _Strict
from minfer.server.state import ServerState

Input = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Strict):
    input: Input
    model: str | None = None
    encoding_format: str = Field("float", pattern="^(float|base64)$")
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate: bool = False
    embd_normalize: int | None = Field(None, ge=-1)  # None: the server's --embd-normalize


class NativeEmbeddingRequest(_Strict):
    """llama-server's `/embedding(s)`: `content` (or `input`), any pooling."""

    content: Input | None = None
    input: Input | None = None
    model: str | None = None
    truncate: bool = False
    embd_normalize: int | None = Field(None, ge=-1)  # None: the server's --embd-normalize


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Strict):
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    truncate: bool = False


def encode_inputs(embedder: Embedder, raw: Input, *, truncate: bool,
                  param: str = "input") -> list[Encoded]:
    """The request's inputs as the model reads them, checked (a 400 naming the first bad
    one's index)."""
    items: list[Any]
    if isinstance(raw, str) or (raw and all(isinstance(x, int) for x in raw)):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise APIError(400, f"'{param}' must not be empty", param=param)
    encoded = [Encoded(list(x)) if isinstance(x, list) else embedder.encode_text(x)
               for x in items]
    try:
        return embedder.check(encoded, truncate=truncate)
    except InputError as exc:
        raise APIError(400, str(exc), param=f"{param}[{exc.index}]") from None


async def run_embeddings(worker: EmbedWorker, inputs: list[Encoded],
                         norm: int) -> list[np.ndarray]:
    try:
        return await worker.embed(inputs, norm)
    except QueueFull as exc:
        raise unavailable(str(exc), retry_after=1, code="queue_full") from None
    except RuntimeError as exc:
        raise unavailable(str(exc), code="shutting_down") from None


def _ready(worker: EmbedWorker) -> Embedder:
    embedder = worker.embedder
    if embedder is None:
        raise unavailable("the embedding model is loading", retry_after=2,
                          code="model_not_ready")
    return embedder


def embedding_routes(app: FastAPI, state: ServerState) -> None:
    """Add the embeddings and rerank routes to app."""

    @app.post("/embeddings")
    @app.post("/embedding", include_in_schema=False)
    async def native(body: NativeEmbeddingRequest) -> list[dict[str, Any]]:
        """llama-server's own shape: `[{"index", "embedding": [vector, ...]}]`, one vector
        per input when pooled, one per token with pooling none."""
        raw = body.content if body.content is not None else body.input
        if raw is None:
            raise APIError(400, '"input" or "content" must be provided', param="input")
        lm = await state.acquire(body.model, purpose="embed")
        worker = lm.embedder()
        embedder = _ready(worker)
        inputs = await run_in_threadpool(encode_inputs, embedder, raw, truncate=body.truncate)
        vectors = await run_embeddings(worker, inputs, _norm(state, body.embd_normalize))
        return [{"index": i, "embedding": (v if v.ndim == 2 else v[None]).tolist()}
                for i, v in enumerate(vectors)]

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        lm = await state.acquire(body.model, purpose="embed")
        worker = lm.embedder()
        embedder = _ready(worker)
        if embedder.pooling == "none":
            raise APIError(400, "pooling type 'none' is not OpenAI-compatible: start the "
                           "server with --pooling mean, cls or last", param="input")
        if body.dimensions is not None and body.dimensions != embedder.n_embd:
            raise APIError(400, f"this model's embeddings have {embedder.n_embd} dimensions; "
                           f"it cannot return {body.dimensions}", param="dimensions")
        inputs = await run_in_threadpool(encode_inputs, embedder, body.input,
                                         truncate=body.truncate)
        vectors = await run_embeddings(worker, inputs, _norm(state, body.embd_normalize))
        n_tokens = sum(len(e.ids) for e in inputs)
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "model": lm.name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    @app.post("/v1/rerank")
    @app.post("/rerank", include_in_schema=False)
    @app.post("/v1/reranking", include_in_schema=False)
    @app.post("/reranking", include_in_schema=False)
    async def rerank(body: RerankRequest) -> dict[str, Any]:
        lm = await state.acquire(body.model, purpose="rerank")
        worker = lm.embedder(rerank=True)
        embedder = _ready(worker)
        if not body.documents:
            raise APIError(400, "'documents' must not be empty", param="documents")
        texts = [d if isinstance(d, str) else d.text for d in body.documents]

        def encode() -> list[Encoded]:
            try:
                return embedder.rerank_inputs(body.query, texts, truncate=body.truncate)
            except InputError as exc:
                raise APIError(400, f"document {exc.index} with the query: {exc}",
                               param=f"documents[{exc.index}]") from None

        inputs = await run_in_threadpool(encode)
        scores = [float(v[0]) for v in await run_embeddings(worker, inputs, -1)]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                item["document"] = {"text": texts[i]}
            results.append(item)
        n_tokens = sum(len(e.ids) for e in inputs)
        return {"model": lm.name, "object": "list", "results": results,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def _norm(state: ServerState, asked: int | None) -> int:
    return state.config.embd_normalize if asked is None else asked


def _encoded(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]
