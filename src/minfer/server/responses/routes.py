"""OpenAI's Responses API: `POST /v1/responses` (a `response` object, or its streamed events).

A body is translated into the chat request (translate.py) and goes the same way as
`/v1/chat/completions`: prepare, the engine thread, the reasoning split and the tool-call
parser. Only the shapes differ: output items (`reasoning`, `message` with `output_text`,
`function_call`), `status` `completed` or `incomplete` (`max_output_tokens`), usage as input /
output tokens, and SSE events named by their `type` (`response.created`, `.in_progress`, the
items' events, `response.completed` / `.incomplete`; `error` then `response.failed` when a
request fails mid-stream), each with its `sequence_number`. Nothing is stored: `store` is
accepted and `previous_response_id` is a 400.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from minfer.server.openai.prepare import Prepared, prepare
from minfer.server.relay import collect_or_gone, submit
from minfer.server.responses.schemas import ResponsesRequest
from minfer.server.responses.translate import (
    Envelope,
    ItemEvents,
    chat_request,
    output_items,
    status_of,
)
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Failed, Handle


def responses_routes(app: FastAPI, state: ServerState) -> None:
    """Add `POST /v1/responses` to app."""

    @app.post("/v1/responses")
    @app.post("/responses", include_in_schema=False)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        lm = await state.acquire(body.model)
        chat = chat_request(body, n_ctx=lm.limits.n_ctx_slot)
        prepared = await run_in_threadpool(prepare, chat, lm.tokenizer, lm.template,
                                           lm.limits, grammar_vocab=lm.grammar_vocab,
                                           reasoning=lm.reasoning)
        handle = submit(state, lm, prepared.gen)
        env = Envelope(body, lm.name)
        if body.stream:
            return StreamingResponse(_stream(lm, handle, prepared, env),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        got = await collect_or_gone(lm, handle, request)
        if got is None:  # the client left
            return Response(status_code=499)
        reply = prepared.output.reply(got.text, got.done.finish_reason)
        return JSONResponse(env.response(status_of(reply.finish), output_items(reply),
                                         got.done.usage))


async def _stream(lm: LoadedModel, handle: Handle, prepared: Prepared,
                  env: Envelope) -> AsyncIterator[str]:
    reply = prepared.output.reply_stream()
    items = ItemEvents()
    seq = 0

    def sse(event: dict[str, Any]) -> str:
        nonlocal seq
        event["sequence_number"] = seq
        seq += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    try:
        yield sse({"type": "response.created", "response": env.response("in_progress", [])})
        yield sse({"type": "response.in_progress", "response": env.response("in_progress", [])})
        while True:
            event = await handle.events.get()
            if isinstance(event, Delta):
                for e in items.push(reply.push(event.text)):
                    yield sse(e)
            elif isinstance(event, Failed):
                yield sse({"type": "error", "code": "server_error", "message": event.message,
                           "param": None})
                failed = env.response("failed", items.items)
                failed["error"] = {"code": "server_error", "message": event.message}
                yield sse({"type": "response.failed", "response": failed})
                break
            elif isinstance(event, Done):
                for e in items.push(reply.finish()) + items.finish():
                    yield sse(e)
                status = status_of(event.finish_reason)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield sse({"type": kind,
                           "response": env.response(status, items.items, event.usage)})
                break
    finally:
        lm.generator.cancel(handle)
