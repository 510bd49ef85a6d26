"""The OpenAI-compatible routes: `POST /v1/chat/completions`, `POST /v1/completions` (stream or
not), `GET /v1/models` and one model's `GET /v1/models/{id}` (each also answers without the
`/v1` prefix; in Anthropic's shapes for a client that sends `anthropic-version`).

A request is validated (schemas.py), turned into a GenRequest (prepare.py, on a worker thread
since tokenizing can take a while), queued on the engine thread (minfer.server.worker), and its
events are relayed as one JSON body or as SSE chunks (responses.py); `n` choices (and a
completion's prompt list) are that many requests, answered in one body or one stream. A chat
reply's text goes
through the reasoning split and, when tools were offered, the tool-call parser (structured.py).
A client that goes away cancels its request, which frees its slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from minfer.engine.core.request import TokenLogprob
from minfer.server.anthropic.translate import model_info, model_page
from minfer.server.errors import APIError, bad_request, is_anthropic
from minfer.server.openai.prepare import Prepared, choices, prepare
from minfer.server.openai.responses import (
    Envelope,
    chat_logprobs,
    completion_logprobs,
    total_usage,
)
from minfer.server.openai.schemas import ChatCompletionRequest, CompletionRequest
from minfer.server.relay import ClientGone, collect, submit
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Event, Failed, Handle, Usage


def openai_routes(app: FastAPI, state: ServerState) -> None:
    """Add the OpenAI routes to app."""

    def describe(name: str, anthropic: bool) -> dict[str, Any]:
        facts = state.facts(name)
        if anthropic:
            n_ctx = facts.metadata.get(f"{facts.architecture}.context_length")
            return model_info(name, facts.modified, n_ctx if isinstance(n_ctx, int) else None)
        return {"id": name, "object": "model", "created": int(facts.modified),
                "owned_by": "minfer"}

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
    asks = choices(body)
    room = lm.generator.n_slots + lm.generator.max_waiting
    if len(asks) > room:
        raise bad_request(f"{len(asks)} choices asked; this server runs or queues at most {room} "
                          "at once (its slots and queue)", param="n", code="invalid_value")
    prepared = [await run_in_threadpool(prepare, ask, lm.tokenizer, lm.template, lm.limits,
                                        grammar_vocab=lm.grammar_vocab, reasoning=lm.reasoning)
                for ask in asks]
    handles = _submit_all(state, lm, prepared)
    env = Envelope(kind, lm.name)
    n = body.n or 1
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(lm, handles, env, prepared, include_usage, n)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collecting = [asyncio.ensure_future(collect(h, request)) for h in handles]
    try:
        got = await asyncio.gather(*collecting)
    except ClientGone:
        return Response(status_code=499)  # the client left
    finally:  # one choice failed or the client left: the others stop too
        for task in collecting:
            task.cancel()
        for h in handles:
            lm.generator.cancel(h)  # a no-op for a finished request
    to_logprobs = _logprobs_fn(lm, env.kind)
    bodies = []
    for index, (p, c) in enumerate(zip(prepared, got, strict=True)):
        logprobs: dict[str, Any] | None
        if p.gen.prompt_logprobs is not None:  # echo: the prompt's tokens first
            logprobs = completion_logprobs(c.prompt_logprobs + c.logprobs,
                                           lm.tokenizer.token_bytes, first=p.gen.prompt[0])
        else:
            logprobs = to_logprobs(c.logprobs, 0) if p.gen.logprobs is not None else None
        fields, finish = p.output.finalize(c.text, c.done.finish_reason)
        bodies.append(env.choice(index, fields, finish, logprobs))
    return JSONResponse(env.full(bodies, total_usage([c.done.usage for c in got], n)))


def _submit_all(state: ServerState, lm: LoadedModel, prepared: list[Prepared]) -> list[Handle]:
    """Every choice queued, or none: a refusal (a full queue) takes back those queued."""
    handles: list[Handle] = []
    try:
        for p in prepared:
            handles.append(submit(state, lm, p.gen))
    except BaseException:
        for h in handles:
            lm.generator.cancel(h)
        raise
    return handles


def _logprobs_fn(lm: LoadedModel, kind: str) -> Callable[[list[TokenLogprob], int],
                                                            dict[str, Any]]:
    tb = lm.tokenizer.token_bytes
    if kind == "chat":
        return lambda lps, _offset: chat_logprobs(lps, tb)
    return lambda lps, offset: completion_logprobs(lps, tb, offset)


def _sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def _stream(lm: LoadedModel, handles: list[Handle], env: Envelope,
                  prepared: list[Prepared], include_usage: bool, n: int) -> AsyncIterator[str]:
    """SSE chunks of every choice as their events come (each chunk names its choice), then
    the usage and [DONE] once all have finished; a failed choice ends the stream with its
    error."""
    to_logprobs = _logprobs_fn(lm, env.kind)
    replies = [p.output.reply_stream() if env.kind == "chat" else None for p in prepared]
    offsets = [0] * len(handles)
    usages: list[Usage | None] = [None] * len(handles)
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    relays = [asyncio.ensure_future(_relay(i, h, events)) for i, h in enumerate(handles)]
    try:
        for i, reply in enumerate(replies):
            if reply is not None:
                role_fields = {"content": None} if reply.tools is not None else None
                yield _sse(env.chunk(role=True, with_usage=include_usage, fields=role_fields,
                                     index=i))
            elif prepared[i].output.echo and prepared[i].gen.prompt_logprobs is None:
                offsets[i] = len(prepared[i].output.echo)  # echo: the prompt's text first
                yield _sse(env.chunk(text=prepared[i].output.echo, with_usage=include_usage,
                                     index=i))
        while any(u is None for u in usages):
            i, event = await events.get()
            reply = replies[i]
            gen = prepared[i].gen
            if isinstance(event, Delta) and event.prompt_logprobs is not None:
                echo = prepared[i].output.echo  # a scored prompt: echoed with its logprobs
                offsets[i] = len(echo)
                scored = completion_logprobs(event.prompt_logprobs, lm.tokenizer.token_bytes,
                                             first=gen.prompt[0])
                yield _sse(env.chunk(text=echo, logprobs=scored, with_usage=include_usage,
                                     index=i))
            elif isinstance(event, Delta):
                want_lps = prepared[i].gen.logprobs is not None
                lp = to_logprobs(event.logprobs, offsets[i]) if want_lps else None
                offsets[i] += len(event.text)
                if reply is None:
                    yield _sse(env.chunk(text=event.text, logprobs=lp, with_usage=include_usage,
                                         index=i))
                    continue
                for chunk in _delta_chunks(env, reply.push(event.text), lp, include_usage, i):
                    yield _sse(chunk)
            elif isinstance(event, Failed):
                yield _sse(APIError(event.status, event.message).body())
                break
            elif isinstance(event, Done):
                finish = event.finish_reason
                if reply is not None:
                    for chunk in _delta_chunks(env, reply.finish(), None, include_usage, i):
                        yield _sse(chunk)
                    if reply.tool_calls and finish == "stop":
                        finish = "tool_calls"
                yield _sse(env.chunk(finish=finish, with_usage=include_usage, index=i))
                usages[i] = event.usage
        else:
            if include_usage:
                yield _sse(env.usage_chunk(total_usage([u for u in usages if u], n)))
        yield _sse("[DONE]")
    finally:
        for relay in relays:
            relay.cancel()
        for h in handles:
            lm.generator.cancel(h)  # the client left (or we are done): free the slots now


async def _relay(index: int, handle: Handle, into: asyncio.Queue[tuple[int, Event]]) -> None:
    """One choice's events into the stream's queue, tagged with its index, up to its last."""
    while True:
        event: Event = await handle.events.get()
        into.put_nowait((index, event))
        if isinstance(event, Done | Failed):
            return


def _delta_chunks(env: Envelope, deltas: list[dict[str, Any]], logprobs: dict[str, Any] | None,
                  include_usage: bool, index: int) -> list[dict[str, Any]]:
    """Chunks for ReplyStream deltas; a step's logprobs ride on its first chunk (on an empty
    delta when the parsers held all of its text back)."""
    if not deltas and logprobs is not None:
        deltas = [{}]
    chunks = []
    for i, delta in enumerate(deltas):
        chunks.append(env.chunk(fields=delta, logprobs=logprobs if i == 0 else None,
                                with_usage=include_usage, index=index))
    return chunks
