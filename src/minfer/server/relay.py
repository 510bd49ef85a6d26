"""Between a route and the engine thread: prepare a request, queue it, then relay its events.

Every API surface (OpenAI's, Anthropic's, Ollama's, the Responses API, llama.cpp's native
routes) translates its body onto the shared request bodies, then goes this one way:
`prepare_for` (body → `GenRequest` against the loaded model), `submit` (503 when the queue is
full or the server is draining), then either `collect` (whole replies; while it waits it checks
that the client is still there, and raises `ClientGone` when it left, which the app answers 499)
or `stream` (the events as the surface's `Frames` write them: SSE or NDJSON, every request's
events as they come). Either way, when the reply ends, fails or the client leaves, every
request's slot is given back at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from minfer.engine.core.request import GenRequest, TokenLogprob
from minfer.engine.core.scheduler import QueueFullError
from minfer.server.errors import APIError, ClientGone, unavailable
from minfer.server.prepare import Prepared, prepare
from minfer.server.schemas import GenerationRequest
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Event, Failed, Handle

POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


@dataclass
class Collected:
    text: str
    done: Done
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # a scored prompt's


def prepare_for(lm: LoadedModel, req: GenerationRequest, context: Sequence[int] = ()
                ) -> Prepared:
    """`prepare` against the loaded model (its tokenizer, template, limits, grammar vocabulary
    and reasoning options); tokenizing can take a while: routes run it on a worker thread."""
    return prepare(req, lm.tokenizer, lm.template, lm.limits, grammar_vocab=lm.grammar_vocab,
                   reasoning=lm.reasoning, context=context, vision=lm.vision)


def submit(state: ServerState, lm: LoadedModel, gen: GenRequest) -> Handle:
    """Queue gen on the model's engine thread; its events arrive on the returned handle."""
    handle = Handle(asyncio.get_running_loop())
    try:
        lm.generator.submit(gen, handle)
    except QueueFullError as exc:
        state.metrics.rejected.inc()
        raise unavailable(str(exc), retry_after=1, code="queue_full") from None
    except RuntimeError:
        raise unavailable("the server is shutting down", code="shutting_down") from None
    return handle


def submit_all(state: ServerState, lm: LoadedModel, gens: Sequence[GenRequest]) -> list[Handle]:
    """Every request queued, or none: a refusal (a full queue) takes back those queued."""
    handles: list[Handle] = []
    try:
        for gen in gens:
            handles.append(submit(state, lm, gen))
    except BaseException:
        for h in handles:
            lm.generator.cancel(h)
        raise
    return handles


async def collect(lm: LoadedModel, handles: Sequence[Handle], request: Request
                  ) -> list[Collected]:
    """Every request's whole reply, in order: APIError when one failed, ClientGone when the
    client left; either way (and once all are done) every slot is given back."""
    reading = [asyncio.ensure_future(_collect(h, request)) for h in handles]
    try:
        return list(await asyncio.gather(*reading))
    finally:  # one failed or the client left: the others stop too
        for task in reading:
            task.cancel()
        for h in handles:
            lm.generator.cancel(h)  # a no-op for a finished request


async def _collect(handle: Handle, request: Request) -> Collected:
    texts: list[str] = []
    lps: list[TokenLogprob] = []
    prompt_lps: list[TokenLogprob] = []
    while True:
        try:
            event = await asyncio.wait_for(handle.events.get(), POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                raise ClientGone() from None
            continue
        if isinstance(event, Delta):
            texts.append(event.text)
            lps.extend(event.logprobs)
            prompt_lps.extend(event.prompt_logprobs or ())
        elif isinstance(event, Failed):
            raise APIError(event.status, event.message)
        else:
            return Collected("".join(texts), event, lps, prompt_lps)


class Frames:
    """How a surface writes a stream: the frames (SSE events, NDJSON lines) for its start, each
    request's events (`index`: the request's place in `stream`'s handles) and its end."""

    def start(self) -> list[str]:
        return []

    def delta(self, index: int, event: Delta) -> list[str]:
        raise NotImplementedError

    def failed(self, index: int, event: Failed) -> list[str]:
        """The last frames: a failed request ends the whole stream."""
        raise NotImplementedError

    def done(self, index: int, event: Done) -> list[str]:
        raise NotImplementedError

    def end(self) -> list[str]:
        """After every request's `done`."""
        return []


def stream(lm: LoadedModel, handles: Sequence[Handle], frames: Frames, *,
           media_type: str = SSE) -> StreamingResponse:
    """The requests' events as a streamed response, written by frames."""
    return StreamingResponse(_frames(lm, handles, frames), media_type=media_type,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _frames(lm: LoadedModel, handles: Sequence[Handle], frames: Frames
                  ) -> AsyncIterator[str]:
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    relays = [asyncio.ensure_future(_relay(i, h, events)) for i, h in enumerate(handles)]
    try:
        for frame in frames.start():
            yield frame
        running = len(handles)
        while running:
            i, event = await events.get()
            if isinstance(event, Failed):
                for frame in frames.failed(i, event):
                    yield frame
                return
            if isinstance(event, Delta):
                out = frames.delta(i, event)
            else:
                running -= 1
                out = frames.done(i, event)
            for frame in out:
                yield frame
        for frame in frames.end():
            yield frame
    finally:
        for relay in relays:
            relay.cancel()
        for h in handles:
            lm.generator.cancel(h)  # the client left (or we are done): free the slots now


async def _relay(index: int, handle: Handle, into: asyncio.Queue[tuple[int, Event]]) -> None:
    """One request's events into the stream's queue, tagged with its index, up to its last."""
    while True:
        event: Event = await handle.events.get()
        into.put_nowait((index, event))
        if isinstance(event, Done | Failed):
            return


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event: its data (JSON, or a literal such as `[DONE]`), named or not."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {payload}\n\n"


def ndjson(body: dict[str, Any]) -> str:
    """One NDJSON line."""
    return json.dumps(body, ensure_ascii=False) + "\n"
