"""The engine thread: the only code that touches the Engine; the events it posts to requests.

The thread drives an `EngineCore` (minfer.engine.core): each step it reaps cancelled requests
and lets the core schedule (under the lock), runs the core's forward and draws (outside it), then
feeds the result back (under the lock again) and posts each request's events to its `Handle`.
The event loop only `submit`s and `cancel`s; a lock guards the core's scheduler (held for
bookkeeping, never during a forward), and a condition wakes an idle thread.

A `Handle` lives on the event loop; `post` crosses threads with `call_soon_threadsafe`, and
`cancel` (a client gone) is a flag the engine thread reads before each step.

numba's thread count is per thread, so the engines (the target's and the draft's) are created
(and `set_threads` called) on this thread, not the one that configured the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from minfer.engine.assembly import proposer
from minfer.engine.core.core import EngineCore, Output
from minfer.engine.core.mtp import MtpProposer
from minfer.engine.core.policy import Proposal
from minfer.engine.core.proposer import DraftAsk, Proposer, SlotDrafter
from minfer.engine.core.request import GenRequest, TokenLogprob, Vocab
from minfer.engine.core.runner import BatchEngine, Runner
from minfer.engine.core.scheduler import Plan, Scheduler
from minfer.engine.speculative import SpecConfig
from minfer.engine.warmup import announce_cold_start, engine_marker_or_none, mark_warm
from minfer.errors import MinferError
from minfer.server.metrics import Metrics

log = logging.getLogger("minfer.server")

EngineFactory = Callable[[int], BatchEngine]  # total n_ctx -> engine


@dataclass(frozen=True)
class Delta:
    """Text that became safe to show, and the tokens sampled in this step (with logprobs)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # a scored prompt's tokens 1.. (GenRequest.prompt_logprobs): posted once, before any text,
    # in a delta of their own; None in every other delta
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length"
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the request
    prompt_ms: float = 0.0  # the engine's time on the request's (uncached) prompt
    predicted_ms: float = 0.0  # and on its decode steps


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500


Event = Delta | Done | Failed


class Handle:
    """The event loop's end of a request: an asyncio queue fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False
        self.seq_id = -1
        self.t_submit = time.perf_counter()
        self.t_last: float | None = None  # when its last token was drawn
        self.scored = False  # a scored prompt's logprobs were posted

    def post(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled = True


def finish_reason(finish: str) -> str:
    """OpenAI's name for how a request ended: "length" at a limit, else "stop"."""
    return "length" if finish in ("length", "context") else "stop"


class Worker:
    def __init__(
        self,
        make_engine: EngineFactory,
        vocab: Vocab,
        *,
        n_slots: int,
        n_ctx_slot: int,
        chunk: int = 128,
        idle_chunk: int | None = None,
        max_waiting: int = 64,
        metrics: Metrics | None = None,
        speculation: SpecConfig | None = None,
        make_draft: EngineFactory | None = None,
        mtp: MtpProposer | None = None,
    ) -> None:
        self.vocab = vocab
        # proposals verified in the batch's forward: prompt lookup (`--lookup-ngram`), a draft
        # model (`-md`, make_draft; created on the engine thread), or both (`HybridProposer`),
        # or the model's own MTP head (`--spec mtp`: attached to the engine on its thread),
        # batched across slots
        on = speculation is not None and (speculation.lookup_ngram > 0 or make_draft is not None
                                          or mtp is not None)
        self.speculation = speculation if on else None
        self._make_draft = make_draft if on else None
        self.mtp = mtp if on else None
        self.drafter: SlotDrafter | None = None
        self.n_slots = n_slots
        self.n_ctx_slot = n_ctx_slot
        self.chunk = chunk
        self.max_waiting = max_waiting
        self.metrics = metrics or Metrics()
        self._make_engine = make_engine
        self._cv = threading.Condition()
        self._handles: dict[int, Handle] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.steps = 0
        # requests queue in the core until the engine thread has made the engine (`_main`)
        first: Proposer | None = None
        if self.speculation is not None:
            first = _NoDraftYet() if make_draft or self.mtp else proposer(self.speculation,
                                                                           None)
        self.core = EngineCore(_NotReady(), vocab, n_slots=n_slots, n_ctx_slot=n_ctx_slot,
                               chunk=chunk, idle_chunk=idle_chunk, max_waiting=max_waiting,
                               proposer=first, speculation=self.speculation)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="minfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel everything still queued or running and join the thread."""
        with self._cv:
            self._stopping = True
            for seq_id, handle in self._handles.items():
                handle.cancel()
                self.core.cancel(seq_id)
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the event loop's side -----------------------------------------------------------------
    def submit(self, req: GenRequest, handle: Handle) -> None:
        """Queue a request (QueueFullError when the queue is full); events go to handle."""
        seq_id = next(self._ids)
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self.core.add(seq_id, req)
            handle.seq_id = seq_id
            handle.t_submit = time.perf_counter()
            self._handles[seq_id] = handle
            self._cv.notify()

    def abort_all(self, message: str) -> None:
        """End every queued and running request now with a 503 (the drain timeout ran out)."""
        with self._cv:
            for seq_id in list(self._handles):
                self._fail(seq_id, Failed(message, status=503))
            self._cv.notify()

    def cancel(self, handle: Handle) -> None:
        handle.cancel()
        with self._cv:
            self.core.cancel(handle.seq_id)
            self._cv.notify()

    def busy(self) -> bool:
        with self._cv:
            return bool(self._handles)

    # -- the engine thread ---------------------------------------------------------------------
    def _main(self) -> None:
        try:
            n_ctx = self.n_slots * self.n_ctx_slot
            runner = Runner(self._make_engine(n_ctx), self.n_ctx_slot)
            if self._make_draft is not None and self.speculation is not None:
                self.drafter = SlotDrafter(self._make_draft(n_ctx), self.n_ctx_slot,
                                           p_min=self.speculation.p_min, chunk=self.chunk)
            if self.mtp is not None:
                self.mtp.attach(runner.engine, self.n_ctx_slot)  # type: ignore[arg-type]
            if self.n_ctx_slot >= 3:
                marker = engine_marker_or_none(runner.engine)
                cold = announce_cold_start(marker, log.info)
                runner.warm_up()
                if self.drafter is not None:
                    self.drafter.warm_up()
                if self.mtp is not None:
                    self.mtp.warm_up()
                if cold and marker is not None:
                    mark_warm(marker)
        except BaseException as exc:
            if not isinstance(exc, MinferError):  # a model's or a setting's: said by the loader
                log.exception("could not create the engine")
            self.error = exc
            self.ready.set()
            return
        with self._cv:
            self.core.runner = runner
            if self.speculation is not None and (self.drafter or self.mtp) is not None:
                self.core.proposer = proposer(self.speculation, self.drafter, self.mtp)
        self.ready.set()
        try:
            self._loop()
        except BaseException as exc:  # a bug: fail every request rather than leave it hanging
            log.exception("the engine thread died")
            self.error = exc
            with self._cv:
                self._stopping = True
                for seq_id in list(self._handles):
                    self._fail(seq_id, Failed(f"the engine stopped: {exc}"))

    def _loop(self) -> None:
        core = self.core
        while True:
            with self._cv:
                for seq_id, handle in self._handles.items():
                    if handle.cancelled:
                        core.cancel(seq_id)
                for seq_id in core.reap():
                    self._handles.pop(seq_id, None)
                scheduled = core.schedule()
                if not scheduled.plan.works:
                    if self._stopping:
                        return
                    self._cv.wait(0.5)
                    continue
            try:
                executed = core.execute(scheduled)
            except Exception as exc:  # a failed forward fails its requests, never the server
                log.exception("forward failed")
                with self._cv:
                    for w in scheduled.plan.works:
                        self._fail(w.seq_id, Failed(f"the forward pass failed: {exc}"))
                continue
            self.steps += 1
            with self._cv:
                outputs = core.update(executed)
                for out in outputs:
                    self._post(out)

    def _post(self, out: Output) -> None:
        """A step's events of one request, and the metrics they feed (lock held)."""
        handle = self._handles.get(out.seq_id)
        if handle is None:
            return
        m = self.metrics
        state = out.request
        m.draft_tokens.inc(out.drafted)
        m.draft_accepted.inc(out.accepted)
        if out.error is not None:
            handle.post(Failed(f"sampling failed: {out.error}"))
            self._handles.pop(out.seq_id, None)
            return
        if state.req.prompt_logprobs is not None and not handle.scored:  # its prompt is done
            handle.scored = True
            handle.post(Delta("", [], state.prompt_logprobs))
        for i, e in enumerate(out.emitted):
            m.generated_tokens.inc()
            now = time.perf_counter()
            if handle.t_last is None:
                m.ttft.observe(now - handle.t_submit)
            else:
                m.tpot.observe(now - handle.t_last)
            handle.t_last = now
            last = out.finish is not None and i == len(out.emitted) - 1
            text = e.text + (state.tail if last else "")
            if text or e.logprob is not None:
                handle.post(Delta(text, [] if e.logprob is None else [e.logprob]))
        if out.finish is None:
            return
        if not out.emitted and state.tail:
            handle.post(Delta(state.tail, []))
        del self._handles[out.seq_id]
        usage = Usage(len(state.req.prompt), state.n_generated, state.n_cached)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        t = state.timings
        handle.post(Done(finish_reason(out.finish), usage, state.stepper.matcher.matched,
                         t.prefill_s * 1e3, t.decode_s * 1e3))

    def _fail(self, seq_id: int, failure: Failed) -> None:
        """End a request now with `failure` (lock held)."""
        self.core.abort(seq_id)
        handle = self._handles.pop(seq_id, None)
        if handle is not None:
            handle.post(failure)


class _NotReady:
    """The core's runner until the engine thread has made the engine (never run: the thread
    steps the core only after replacing it)."""

    def run(self, plan: Plan) -> dict[int, np.ndarray]:
        raise RuntimeError("the engine is not ready")


class _NoDraftYet:
    """The core's proposer until the engine thread has made the draft model (proposes nothing)."""

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        return {}

    def warm_up(self) -> None:
        return None

    def forget(self) -> None:
        return None
