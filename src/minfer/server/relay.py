"""Between a route and the engine thread: queue a prepared request, then read its events.

Every API surface (OpenAI's, llama.cpp's `/infill`, …) submits its `GenRequest` here and relays
the events back in its own shape. `submit` answers 503 when the queue is full or the server is
draining; `collect` reads a whole reply, checking while it waits that the client is still there
(`ClientGone` when it left, so the route can give the slot back at once; `collect_or_gone`
does that for it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request

from minfer.engine.core.request import GenRequest, TokenLogprob
from minfer.engine.core.scheduler import QueueFullError
from minfer.server.errors import APIError, unavailable
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Failed, Handle

POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class ClientGone(Exception):
    pass


@dataclass
class Collected:
    text: str
    done: Done
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # a scored prompt's


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


async def collect(handle: Handle, request: Request) -> Collected:
    """The whole reply (APIError for a failed request, ClientGone when the client left)."""
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


async def collect_or_gone(lm: LoadedModel, handle: Handle, request: Request) -> Collected | None:
    """The whole reply, or None when the client left (its slot is given back either way)."""
    try:
        return await collect(handle, request)
    except ClientGone:
        return None
    finally:
        lm.generator.cancel(handle)  # a no-op once the request is done
