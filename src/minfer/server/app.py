"""The FastAPI app: the API surfaces' routes over the engine thread, plus the routes they share.

Here: `GET /health`, `GET /metrics`, the model list (`GET /v1/models` and one model's
`GET /v1/models/{id}`, also without the `/v1` prefix: OpenAI's list, or Anthropic's page for a
client that sends `anthropic-version`), llama-server's `POST /tokenize`, `POST /detokenize`,
`GET /props` and `POST /apply-template`, the lifespan (the model loads in the background) and
the middleware (CORS only with `--cors-origin`). The OpenAI-compatible routes are
`openai/routes.py`'s (the Responses API `responses/routes.py`'s), Anthropic's Messages
`anthropic/routes.py`'s, Ollama's `ollama/routes.py`'s,
llama.cpp's native `/completion` and `/infill` are `native.py`'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

import minfer
from minfer.errors import MinferError
from minfer.server.anthropic.routes import anthropic_routes
from minfer.server.embeddings import embedding_routes
from minfer.server.errors import (
    APIError,
    bad_request,
    from_minfer_error,
    install_handlers,
    is_anthropic,
)
from minfer.server.middleware import RequestGuard
from minfer.server.native import native_routes
from minfer.server.ollama.routes import ollama_routes
from minfer.server.openai.routes import openai_routes
from minfer.server.output import chat_messages, plan_output
from minfer.server.prepare import request_reasoning
from minfer.server.responses.routes import responses_routes
from minfer.server.schemas import (
    ApplyTemplateRequest,
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from minfer.server.state import ServerState


def create_app(state: ServerState, *, own_state: bool = True) -> FastAPI:
    """The app over state. With own_state, the app's lifespan starts the state (the model loads
    in the background) and stops it at shutdown; tests that start and stop it themselves (or
    clients that cycle the lifespan, as schemathesis does per test) pass own_state=False."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if own_state:
            state.start()
        yield
        if own_state:
            state.draining = True
            await run_in_threadpool(state.stop)

    app = FastAPI(title="minfer", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.minfer = state
    install_handlers(app)
    app.add_middleware(RequestGuard, state=state)
    if state.config.cors_origins:  # outermost: preflight requests need no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.cors_origins),
                           allow_methods=["*"], allow_headers=["*"])
    _routes(app, state)
    _model_routes(app, state)
    openai_routes(app, state)
    anthropic_routes(app, state)
    responses_routes(app, state)
    ollama_routes(app, state)
    native_routes(app, state)
    embedding_routes(app, state)
    return app


def _routes(app: FastAPI, state: ServerState) -> None:
    """The routes of every surface: health, metrics, llama-server's tokenize / detokenize."""

    @app.get("/health")
    async def health() -> JSONResponse:
        status = state.status
        body: dict[str, Any] = {"status": status}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """llama-server's answer to its body (`tokens`), vLLM's to a `prompt` (`tokens`,
        `count`, `max_model_len`, `token_strs` when asked)."""
        lm = state.model()
        tok = lm.tokenizer
        try:
            text = body.text()
        except ValueError as exc:
            raise bad_request(str(exc), param="content") from None
        vllm = body.prompt is not None
        special = body.add_special_tokens if vllm else body.add_special
        ids = await run_in_threadpool(tok.encode, text, special=True,
                                      add_bos=None if special else False)
        if vllm:
            out: dict[str, Any] = {"count": len(ids), "max_model_len": lm.limits.n_ctx_slot,
                                   "tokens": ids}
            if body.return_token_strs:
                out["token_strs"] = [tok.token_text(i) for i in ids]
            return out
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": tok.token_bytes(i).decode("utf-8", "replace")}
                           for i in ids]}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's: the tokenizer's class and its tokenizer_config fields (special tokens and
        their ids, vocabulary size, the context, the chat template)."""
        lm = state.model()
        tok = lm.tokenizer

        def text(i: int | None) -> str | None:
            return None if i is None else tok.token_text(i)

        return {"tokenizer_class": type(tok).__name__, "name_or_path": lm.name,
                "bos_token": text(tok.bos_id) if tok.add_bos else None,
                "bos_token_id": tok.bos_id, "eos_token": text(tok.eos_id),
                "eos_token_id": tok.eos_id, "vocab_size": tok.n_vocab,
                "add_bos_token": tok.add_bos, "model_max_length": lm.limits.n_ctx_slot,
                "chat_template": getattr(lm.template, "source", None)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        tok = state.model().tokenizer
        bad = [t for t in body.tokens if not 0 <= t < tok.n_vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                              f"(0..{tok.n_vocab - 1})", param="tokens", code="invalid_token_id")
        raw = b"".join(tok.token_bytes(t) for t in body.tokens)
        return {"content": raw.decode("utf-8", errors="replace")}

    @app.get("/props")
    async def props() -> dict[str, Any]:
        """llama-server's server properties (the parts a client reads)."""
        lm = state.model()
        cfg = state.config
        return {"default_generation_settings": {"n_ctx": lm.limits.n_ctx_slot,
                                                "n_predict": cfg.n_predict},
                "total_slots": cfg.slots, "model_path": str(cfg.model_path),
                "chat_template": getattr(lm.template, "source", ""),
                "modalities": {"vision": lm.vision is not None, "audio": False},
                "build_info": f"minfer {minfer.__version__}"}

    @app.post("/apply-template")
    async def apply_template(body: ApplyTemplateRequest) -> dict[str, Any]:
        """llama-server's: the chat template applied to messages, not generated from."""
        lm = await state.acquire(body.model)
        chat = ChatCompletionRequest.model_validate(body.model_dump(exclude_none=True))
        plan = plan_output(chat, lm.tokenizer.n_vocab, lm.grammar_vocab,
                           template_source=lm.template.source)
        try:
            text = lm.template.render(chat_messages(chat.messages, lm.template.source,
                                                    lm.template.variables, plan.tools),
                                      add_generation_prompt=True,
                                      tools=plan.tools,
                                      **request_reasoning(chat, lm.reasoning).template_vars())
        except MinferError as exc:
            raise from_minfer_error(exc, param="messages") from None
        return {"prompt": text}


def _model_routes(app: FastAPI, state: ServerState) -> None:
    """The served models, in the shape of the API the client speaks (OpenAI's or Anthropic's)."""

    def describe(name: str, anthropic: bool) -> dict[str, Any]:
        facts = state.facts(name)
        if anthropic:
            n_ctx = facts.metadata.get(f"{facts.architecture}.context_length")
            return model_info(name, facts.modified, n_ctx if isinstance(n_ctx, int) else None)
        return {"id": name, "object": "model", "created": int(facts.modified),
                "owned_by": "minfer", "capabilities": capabilities(name, facts.role)}

    def capabilities(name: str, role: str) -> list[str]:
        """What the model does, as llama-server lists it: "completion" (or "embedding" for an
        encoder), and "vision" where a vision encoder (an mmproj) is loaded with it."""
        vision = any(lm.name == name and lm.vision is not None for lm in state.loaded())
        return ["completion" if role == "generate" else "embedding"] + (
            ["vision"] if vision else [])

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models(request: Request, limit: int = 20, after_id: str | None = None,
                     before_id: str | None = None) -> dict[str, Any]:
        """The served models: OpenAI's list, or Anthropic's page (`limit`, `after_id`,
        `before_id`) for a client that sends `anthropic-version`."""
        anthropic = is_anthropic(request.url.path, request.headers)
        infos = [describe(name, anthropic) for name in state.names()]
        if anthropic:
            return model_page(infos, limit=limit, after_id=after_id, before_id=before_id)
        return {"object": "list", "data": infos}

    @app.get("/v1/models/{model_id:path}")
    @app.get("/models/{model_id:path}", include_in_schema=False)
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        """One served model (`client.models.retrieve`, OpenAI's or Anthropic's), by its exact
        name (`:latest` optional: Ollama's spelling); another is a 404, even where a request's
        model name is free."""
        name = model_id.removesuffix(":latest")
        if name not in state.names():
            raise APIError(404, f"model '{model_id}' is not served here (models: "
                           f"{', '.join(state.names())})", param="model",
                           code="model_not_found")
        return describe(name, is_anthropic(request.url.path, request.headers))


def model_info(name: str, modified: float, n_ctx_train: int | None) -> dict[str, Any]:
    """One served model as Anthropic's Models API describes one (`client.models.retrieve`):
    its name as id and display name, the file's modification time as its creation."""
    info: dict[str, Any] = {
        "type": "model", "id": name, "display_name": name, "lifecycle": "active",
        "created_at": datetime.fromtimestamp(modified, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if n_ctx_train:
        info["max_input_tokens"] = n_ctx_train
    return info


def model_page(infos: list[dict[str, Any]], *, limit: int, after_id: str | None,
               before_id: str | None) -> dict[str, Any]:
    """A page of the model list (`client.models.list`): at most `limit` models after
    `after_id`, or the last `limit` before `before_id`, with Anthropic's cursors."""
    if not 1 <= limit <= 1000:
        raise bad_request(f"limit must be between 1 and 1000, got {limit}", param="limit")
    if after_id is not None and before_id is not None:
        raise bad_request("after_id and before_id cannot be given together", param="before_id")
    ids = [m["id"] for m in infos]
    for param, cursor in (("after_id", after_id), ("before_id", before_id)):
        if cursor is not None and cursor not in ids:
            raise bad_request(f"{param}: no model {cursor!r} is served here", param=param)
    if before_id is not None:
        rest = infos[:ids.index(before_id)]
        page = rest[-limit:]
    else:
        rest = infos[ids.index(after_id) + 1:] if after_id is not None else infos
        page = rest[:limit]
    return {"data": page, "has_more": len(rest) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}
