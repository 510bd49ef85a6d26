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
a conversation's requests to the replica that keeps it (minfer.server.response_ids).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from minfer.server.errors import APIError
from minfer.server.prepare import Prepared
from minfer.server.relay import Frames, collect, prepare_for, sse, stream, submit
from minfer.server.response_ids import CHAIN_HEADER, chain_of, response_id
from minfer.server.responses.schemas import Item, MessageItem, ResponsesRequest
from minfer.server.responses.store import ITEMS, ResponseStore
from minfer.server.responses.translate import (
    Envelope,
    ItemEvents,
    chat_request,
    output_items,
    status_of,
)
from minfer.server.state import ServerState
from minfer.server.worker import Delta, Done, Failed


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
        prepared = await run_in_threadpool(prepare_for, lm, chat)
        handle = submit(state, lm, prepared.gen)
        env = Envelope(body, lm.name, response_id(chain))
        if body.stream:
            return stream(lm, [handle], _Events(prepared, env, keep))
        [got] = await collect(lm, [handle], request)
        reply = prepared.output.reply(got.text, got.done.finish_reason)
        response = env.response(status_of(reply.finish), output_items(reply), got.done.usage)
        keep(response)
        return JSONResponse(response)


class _Events(Frames):
    """The response's stream: `response.created`, `.in_progress`, the output items' events as
    the reply's deltas come, then `response.completed` / `.incomplete` (or `error` and
    `response.failed`), each numbered."""

    def __init__(self, prepared: Prepared, env: Envelope,
                 keep: Callable[[dict[str, Any]], None]) -> None:
        self.reply = prepared.output.reply_stream()
        self.items = ItemEvents()
        self.env = env
        self.keep = keep
        self.seq = 0

    def _sse(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self.seq
        self.seq += 1
        return sse(event, event["type"])

    def start(self) -> list[str]:
        return [self._sse({"type": kind, "response": self.env.response("in_progress", [])})
                for kind in ("response.created", "response.in_progress")]

    def delta(self, index: int, event: Delta) -> list[str]:
        return [self._sse(e) for e in self.items.push(self.reply.push(event.text))]

    def failed(self, index: int, event: Failed) -> list[str]:
        failed = self.env.response("failed", self.items.items)
        failed["error"] = {"code": "server_error", "message": event.message}
        return [self._sse({"type": "error", "code": "server_error", "message": event.message,
                           "param": None}),
                self._sse({"type": "response.failed", "response": failed})]

    def done(self, index: int, event: Done) -> list[str]:
        frames = [self._sse(e) for e in self.items.push(self.reply.finish()) + self.items.finish()]
        status = status_of(event.finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        response = self.env.response(status, self.items.items, event.usage)
        self.keep(response)
        return [*frames, self._sse({"type": kind, "response": response})]
