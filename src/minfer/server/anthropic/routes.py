"""Anthropic's Messages API: `POST /v1/messages` (a `message`, or the streamed events) and
`POST /v1/messages/count_tokens`.

A body is translated into the OpenAI chat request (translate.py) and goes the same way as
`/v1/chat/completions`: prepare, the engine thread, the reasoning split and the tool-call parser.
Only the shapes differ: content blocks (`thinking`, `text`, `tool_use`), `stop_reason`
(`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`), usage as input / output tokens, SSE
frames with `event:` lines (`message_start`, `ping`, `content_block_*`, `message_delta`,
`message_stop`; `error` when a request fails mid-stream) and Anthropic's error objects.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from minfer.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from minfer.server.anthropic.translate import (
    BlockEvents,
    Event,
    chat_request,
    message_body,
    new_id,
    stop_reason,
    usage_body,
)
from minfer.server.errors import anthropic_error_body
from minfer.server.openai.prepare import Prepared, prepare
from minfer.server.relay import collect_or_gone, submit
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Failed, Handle, Usage


def anthropic_routes(app: FastAPI, state: ServerState) -> None:
    """Add the Messages routes to app."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        lm = await state.acquire(body.model)
        prepared = await _prepare(lm, body)
        handle = submit(state, lm, prepared.gen)
        msg_id = new_id("msg_")
        if body.stream:
            return StreamingResponse(_stream(lm, handle, prepared, msg_id, body.model),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        got = await collect_or_gone(lm, handle, request)
        if got is None:  # the client left
            return Response(status_code=499)
        reply = prepared.output.reply(got.text, got.done.finish_reason)
        return JSONResponse(message_body(msg_id, body.model, reply, got.done.stop_sequence,
                                         got.done.usage))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        prepared = await _prepare(await state.acquire(body.model), body)
        return {"input_tokens": len(prepared.gen.prompt)}


async def _prepare(lm: LoadedModel, body: CountTokensRequest) -> Prepared:
    chat = chat_request(body)
    return await run_in_threadpool(prepare, chat, lm.tokenizer, lm.template, lm.limits,
                                   grammar_vocab=lm.grammar_vocab, reasoning=lm.reasoning)


def _sse(event: Event) -> str:
    return f"event: {event[0]}\ndata: {json.dumps(event[1], ensure_ascii=False)}\n\n"


async def _stream(lm: LoadedModel, handle: Handle, prepared: Prepared, msg_id: str,
                  model: str) -> AsyncIterator[str]:
    reply = prepared.output.reply_stream()
    blocks = BlockEvents()
    start = Usage(len(prepared.gen.prompt), 0, 0)
    try:
        yield _sse(("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage_body(start, 0)}}))
        yield _sse(("ping", {"type": "ping"}))
        while True:
            event = await handle.events.get()
            if isinstance(event, Delta):
                for e in blocks.push(reply.push(event.text)):
                    yield _sse(e)
            elif isinstance(event, Failed):
                yield _sse(("error", anthropic_error_body(event.status, event.message)))
                break
            elif isinstance(event, Done):
                for e in blocks.push(reply.finish()) + blocks.finish():
                    yield _sse(e)
                finish = "tool_calls" if reply.tool_calls and event.finish_reason == "stop" \
                    else event.finish_reason
                yield _sse(("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(finish, event.stop_sequence),
                              "stop_sequence": event.stop_sequence},
                    "usage": usage_body(event.usage)}))
                yield _sse(("message_stop", {"type": "message_stop"}))
                break
    finally:
        lm.generator.cancel(handle)
