"""The OpenAI-compatible routes: `POST /v1/chat/completions`, `POST /v1/completions` (stream or
not) and `GET /v1/models` (each also answers without the `/v1` prefix).

A request is validated (schemas.py), turned into a GenRequest (prepare.py, on a worker thread
since tokenizing can take a while), queued on the engine thread (minfer.server.worker), and its
events are relayed as one JSON body or as SSE chunks (responses.py); a chat reply's text goes
through the reasoning split and, when tools were offered, the tool-call parser (structured.py).
A client that goes away cancels its request, which frees its slot at the engine's next step.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from minfer.engine.core.request import TokenLogprob
from minfer.server.errors import APIError
from minfer.server.openai.prepare import Prepared, prepare
from minfer.server.openai.responses import Envelope, chat_logprobs, completion_logprobs
from minfer.server.openai.schemas import ChatCompletionRequest, CompletionRequest
from minfer.server.relay import collect_or_gone, submit
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Event, Failed, Handle


def openai_routes(app: FastAPI, state: ServerState) -> None:
    """Add the OpenAI routes to app."""

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(state.facts(name).modified),
             "owned_by": "minfer"} for name in state.names()]}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _complete(state, request, body, "chat")

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(state, request, body, "completion")


async def _complete(state: ServerState, request: Request,
                    body: ChatCompletionRequest | CompletionRequest, kind: str) -> Response:
    lm = await state.acquire(body.model)
    prepared = await run_in_threadpool(prepare, body, lm.tokenizer, lm.template, lm.limits,
                                       grammar_vocab=lm.grammar_vocab, reasoning=lm.reasoning)
    handle = submit(state, lm, prepared.gen)
    env = Envelope(kind, lm.name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(lm, handle, env, prepared, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    got = await collect_or_gone(lm, handle, request)
    if got is None:  # the client left
        return Response(status_code=499)
    logprobs = None
    if prepared.gen.logprobs is not None:
        logprobs = _logprobs_fn(lm, env.kind)(got.logprobs, 0)
    fields, finish = prepared.output.finalize(got.text, got.done.finish_reason)
    return JSONResponse(env.full(fields, finish, got.done.usage, logprobs))


def _logprobs_fn(lm: LoadedModel, kind: str) -> Callable[[list[TokenLogprob], int],
                                                            dict[str, Any]]:
    tb = lm.tokenizer.token_bytes
    if kind == "chat":
        return lambda lps, _offset: chat_logprobs(lps, tb)
    return lambda lps, offset: completion_logprobs(lps, tb, offset)


def _sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def _stream(lm: LoadedModel, handle: Handle, env: Envelope, prepared: Prepared,
                  include_usage: bool) -> AsyncIterator[str]:
    to_logprobs = _logprobs_fn(lm, env.kind)
    want_lps = prepared.gen.logprobs is not None
    reply = prepared.output.reply_stream() if env.kind == "chat" else None
    offset = 0
    try:
        if reply is not None:
            role_fields = {"content": None} if reply.tools is not None else None
            yield _sse(env.chunk(role=True, with_usage=include_usage, fields=role_fields))
        while True:
            event: Event = await handle.events.get()
            if isinstance(event, Delta):
                lp = to_logprobs(event.logprobs, offset) if want_lps else None
                offset += len(event.text)
                if reply is None:
                    yield _sse(env.chunk(text=event.text, logprobs=lp, with_usage=include_usage))
                    continue
                for chunk in _delta_chunks(env, reply.push(event.text), lp, include_usage):
                    yield _sse(chunk)
            elif isinstance(event, Failed):
                yield _sse(APIError(event.status, event.message).body())
                break
            elif isinstance(event, Done):
                finish = event.finish_reason
                if reply is not None:
                    for chunk in _delta_chunks(env, reply.finish(), None, include_usage):
                        yield _sse(chunk)
                    if reply.tool_calls and finish == "stop":
                        finish = "tool_calls"
                yield _sse(env.chunk(finish=finish, with_usage=include_usage))
                if include_usage:
                    yield _sse(env.usage_chunk(event.usage))
                break
        yield _sse("[DONE]")
    finally:
        lm.generator.cancel(handle)  # the client left (or we are done): free the slot now


def _delta_chunks(env: Envelope, deltas: list[dict[str, Any]], logprobs: dict[str, Any] | None,
                  include_usage: bool) -> list[dict[str, Any]]:
    """Chunks for ReplyStream deltas; a step's logprobs ride on its first chunk (on an empty
    delta when the parsers held all of its text back)."""
    if not deltas and logprobs is not None:
        deltas = [{}]
    chunks = []
    for i, delta in enumerate(deltas):
        chunks.append(env.chunk(fields=delta, logprobs=logprobs if i == 0 else None,
                                with_usage=include_usage))
    return chunks
