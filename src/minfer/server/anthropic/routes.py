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

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
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
from minfer.server.prepare import Prepared
from minfer.server.relay import Frames, collect, prepare_for, sse, stream, submit
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Failed, Usage


def anthropic_routes(app: FastAPI, state: ServerState) -> None:
    """Add the Messages routes to app."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        lm = await state.acquire(body.model)
        prepared = await _prepare(lm, body)
        handle = submit(state, lm, prepared.gen)
        msg_id = new_id("msg_")
        if body.stream:
            return stream(lm, [handle], _Events(prepared, msg_id, body.model))
        [got] = await collect(lm, [handle], request)
        reply = prepared.output.reply(got.text, got.done.finish_reason)
        return JSONResponse(message_body(msg_id, body.model, reply, got.done.stop_sequence,
                                         got.done.usage))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        prepared = await _prepare(await state.acquire(body.model), body)
        return {"input_tokens": len(prepared.gen.prompt)}


async def _prepare(lm: LoadedModel, body: CountTokensRequest) -> Prepared:
    return await run_in_threadpool(prepare_for, lm, chat_request(body))


def _sse(event: Event) -> str:
    return sse(event[1], event[0])


class _Events(Frames):
    """The Messages stream: `message_start`, `ping`, the content blocks' events as the reply's
    deltas come, `message_delta` (the stop reason and usage), `message_stop`; or `error`."""

    def __init__(self, prepared: Prepared, msg_id: str, model: str) -> None:
        self.prepared = prepared
        self.msg_id = msg_id
        self.model = model
        self.reply = prepared.output.reply_stream()
        self.blocks = BlockEvents()

    def start(self) -> list[str]:
        usage = usage_body(Usage(len(self.prepared.gen.prompt), 0, 0), 0)
        return [_sse(("message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})),
            _sse(("ping", {"type": "ping"}))]

    def delta(self, index: int, event: Delta) -> list[str]:
        return [_sse(e) for e in self.blocks.push(self.reply.push(event.text))]

    def failed(self, index: int, event: Failed) -> list[str]:
        return [_sse(("error", anthropic_error_body(event.status, event.message)))]

    def done(self, index: int, event: Done) -> list[str]:
        events = self.blocks.push(self.reply.finish()) + self.blocks.finish()
        finish = self.reply.finish_reason(event.finish_reason)
        events.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(finish, event.stop_sequence),
                      "stop_sequence": event.stop_sequence},
            "usage": usage_body(event.usage)}))
        events.append(("message_stop", {"type": "message_stop"}))
        return [_sse(e) for e in events]
