"""OpenAI's Responses API: `POST /v1/responses` (a `response` object, or its streamed events).

A body is translated into the chat request (translate.py) and goes the same way as
`/v1/chat/completions`: prepare, the engine thread, the reasoning split and the tool-call
parser. Only the shapes differ: output items (`reasoning`, `message` with `output_text`,
`function_call`), `status` `completed` or `incomplete` (`max_output_tokens`), usage as input /
output tokens, and SSE events named by their `type` (`response.created`, `.in_progress`, the
items' events, `response.completed` / `.incomplete`; `error` then `response.failed` when a
request fails mid-stream), each with its `sequence_number`.

Responses are stored unless `store: false` (the last `KEPT`, in this process's memory): a
request's `previous_response_id` continues that response's conversation (its input and output
items before the new input; its `instructions` are not carried over, as OpenAI's are not), and
`GET` / `DELETE /v1/responses/{id}` read and drop one. An id not kept (never stored, dropped,
pushed out) is a 404. Every id carries its conversation's chain after `resp_` (a new one, the
one Ray's front names in `CHAIN_HEADER`, or the previous response's), by which the front sends
a conversation's requests to the replica that keeps it (ray.affinity).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from minfer.server.errors import APIError
from minfer.server.openai.prepare import Prepared, prepare
from minfer.server.ray.affinity import CHAIN_HEADER, chain_of, response_id
from minfer.server.relay import collect_or_gone, submit
from minfer.server.responses.schemas import Item, MessageItem, ResponsesRequest
from minfer.server.responses.store import ITEMS, ResponseStore
from minfer.server.responses.translate import (
    Envelope,
    ItemEvents,
    chat_request,
    output_items,
    status_of,
)
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Failed, Handle


def with_history(body: ResponsesRequest, store: ResponseStore) -> tuple[ResponsesRequest,
                                                                         list[Item]]:
    """The request with its previous response's conversation before its input, and that whole
    input as items (what a stored response keeps)."""
    items: list[Item] = ([MessageItem(role="user", content=body.input)]
                         if isinstance(body.input, str) else list(body.input))
    if body.previous_response_id is not None:
        try:
            previous = store.get(body.previous_response_id)
        except APIError:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' "
                           "not found.", param="previous_response_id",
                           code="previous_response_not_found") from None
        items = [*previous.conversation, *items]
        body = body.model_copy(update={"input": items})
    return body, items


def responses_routes(app: FastAPI, state: ServerState) -> None:
    """Add `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}` to app."""
    store = state.responses

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return store.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses")
    @app.post("/responses", include_in_schema=False)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        lm = await state.acquire(body.model)
        # the chain its id carries (Ray's front routes a chain to one replica: ray.affinity)
        previous = body.previous_response_id
        chain = chain_of(previous) if previous else request.headers.get(CHAIN_HEADER)
        body, items = with_history(body, store)

        def keep(response: dict[str, Any]) -> None:
            if body.store is not False:
                store.put(response, [*items, *ITEMS.validate_python(response["output"])])

        chat = chat_request(body)
        prepared = await run_in_threadpool(prepare, chat, lm.tokenizer, lm.template,
                                           lm.limits, grammar_vocab=lm.grammar_vocab,
                                           reasoning=lm.reasoning)
        handle = submit(state, lm, prepared.gen)
        env = Envelope(body, lm.name, response_id(chain))
        if body.stream:
            return StreamingResponse(_stream(lm, handle, prepared, env, keep),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        got = await collect_or_gone(lm, handle, request)
        if got is None:  # the client left
            return Response(status_code=499)
        reply = prepared.output.reply(got.text, got.done.finish_reason)
        response = env.response(status_of(reply.finish), output_items(reply), got.done.usage)
        keep(response)
        return JSONResponse(response)


async def _stream(lm: LoadedModel, handle: Handle, prepared: Prepared, env: Envelope,
                  keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
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
                response = env.response(status, items.items, event.usage)
                keep(response)
                yield sse({"type": kind, "response": response})
                break
    finally:
        lm.generator.cancel(handle)
