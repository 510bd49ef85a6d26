"""The engine thread: the only code that touches the Engine.

Each step it reaps cancelled requests, asks the scheduler for a plan, lets the draft model (if
any, `server/drafter.py`) propose for the plan's decoding sequences, runs the plan as one
multi-sequence forward (both outside the lock), then samples every sequence that got logits and
feeds the chosen tokens back to the scheduler. The event loop only `submit`s and `cancel`s; a
lock guards the scheduler (held for bookkeeping, never during a forward), and a condition wakes an
idle thread.

numba's thread count is per thread, so the engines (the target's and the draft's) are created
(and `set_threads` called) on this thread, not the one that configured the server.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from minfer.engine.speculative import SpecConfig, bucket_floor, lookup
from minfer.server.drafter import DraftAsk, SlotDrafter
from minfer.server.generation import Failed, Generation, GenRequest, Handle, Vocab
from minfer.server.metrics import Metrics
from minfer.server.runner import BatchEngine, Runner
from minfer.server.scheduler import Plan, Scheduler, Sequence

log = logging.getLogger("minfer.server")

EngineFactory = Callable[[int], BatchEngine]  # total n_ctx -> engine


class Worker:
    def __init__(
        self,
        make_engine: EngineFactory,
        vocab: Vocab,
        *,
        n_slots: int,
        n_ctx_slot: int,
        chunk: int = 128,
        max_waiting: int = 64,
        metrics: Metrics | None = None,
        speculation: SpecConfig | None = None,
        make_draft: EngineFactory | None = None,
    ) -> None:
        self.vocab = vocab
        # proposals verified in the batch's forward: prompt lookup per slot (`--lookup-ngram`,
        # under the scheduler's lock) or a draft model (`-md`, make_draft; batched across slots)
        on = speculation is not None and (speculation.lookup_ngram > 0 or make_draft is not None)
        self.speculation = speculation if on else None
        self._make_draft = make_draft if on else None
        self.drafter: SlotDrafter | None = None  # created on the engine thread
        self.n_ctx_slot = n_ctx_slot
        self.metrics = metrics or Metrics()
        self.scheduler = Scheduler(n_slots=n_slots, n_ctx_slot=n_ctx_slot, chunk=chunk,
                                   max_waiting=max_waiting,
                                   propose=self._propose if self._lookup else None)
        self._make_engine = make_engine
        self._cv = threading.Condition()
        self._gens: dict[int, Generation] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.steps = 0

    @property
    def _lookup(self) -> bool:
        return self.speculation is not None and self._make_draft is None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="minfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel everything still queued or running and join the thread."""
        with self._cv:
            self._stopping = True
            for gen in self._gens.values():
                gen.handle.cancel()
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
        gen = Generation(req, handle, self.vocab, n_ctx_slot=self.n_ctx_slot)
        if self.speculation is not None:
            gen.enable_speculation()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self.scheduler.add(Sequence(seq_id, list(req.prompt), len(req.prompt)))
            handle.seq_id = seq_id
            self._gens[seq_id] = gen
            self._cv.notify()

    def abort_all(self, message: str) -> None:
        """End every queued and running request now with a 503 (the drain timeout ran out)."""
        with self._cv:
            for seq_id in list(self._gens):
                self._end(seq_id, None, Failed(message, status=503))
            self._cv.notify()

    def cancel(self, handle: Handle) -> None:
        handle.cancel()
        with self._cv:
            self._cv.notify()

    def busy(self) -> bool:
        with self._cv:
            return bool(self._gens)

    # -- the engine thread ---------------------------------------------------------------------
    def _main(self) -> None:
        try:
            n_ctx = len(self.scheduler.slots) * self.n_ctx_slot
            runner = Runner(self._make_engine(n_ctx), self.n_ctx_slot)
            if self._make_draft is not None and self.speculation is not None:
                self.drafter = SlotDrafter(self._make_draft(n_ctx), self.n_ctx_slot,
                                           p_min=self.speculation.p_min,
                                           chunk=self.scheduler.chunk)
            if self.n_ctx_slot >= 3:
                runner.warm_up()
                if self.drafter is not None:
                    self.drafter.warm_up()
        except BaseException as exc:
            log.exception("could not create the engine")
            self.error = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop(runner)
        except BaseException as exc:  # a bug: fail every request rather than leave it hanging
            log.exception("the engine thread died")
            self.error = exc
            with self._cv:
                self._stopping = True
                for seq_id in list(self._gens):
                    self._end(seq_id, None, Failed(f"the engine stopped: {exc}"))

    def _loop(self, runner: Runner) -> None:
        while True:
            with self._cv:
                self._reap_cancelled()
                plan = self.scheduler.schedule()
                if not plan.works:
                    if self._stopping:
                        return
                    self._cv.wait(0.5)
                    continue
                asks = self._draft_asks(plan)
            if asks:
                plan = self._with_drafts(plan, asks)
            self._step(runner, plan)

    def _step(self, runner: Runner, plan: Plan) -> None:
        try:
            t0 = time.perf_counter()
            rows = runner.run(plan)
            self._record_forward(plan, time.perf_counter() - t0)
        except Exception as exc:  # a failed forward fails its requests, never the server
            log.exception("forward failed")
            with self._cv:
                for w in plan.works:
                    self._end(w.seq_id, None, Failed(f"the forward pass failed: {exc}"))
            return
        self.steps += 1
        drafts = {w.seq_id: w.draft for w in plan.works if w.draft}
        decisions = [(seq_id, *self._verify(seq_id, row, drafts.get(seq_id, ())))
                     for seq_id, row in rows.items()]
        with self._cv:
            self.scheduler.advance(plan)
            for seq_id, kept, token, reason in decisions:
                if kept and seq_id in self.scheduler.running:
                    self.scheduler.accept_drafted(seq_id, kept)
                if reason is None and token is not None:
                    self.scheduler.append(seq_id, token)
                elif reason is not None:
                    self._end(seq_id, reason)

    def _verify(self, seq_id: int, rows: np.ndarray, draft: tuple[int, ...]
                ) -> tuple[list[int], int | None, str | None]:
        """(the proposals kept, the next token, a finish reason): rows [1 + k, n_vocab] are
        drawn in order until a proposal is not kept (one row and no draft: a plain step)."""
        if not draft:
            return [], *self._sample(seq_id, rows)
        gen = self._gens.get(seq_id)
        if gen is None:  # aborted during the forward
            return [], None, None
        kept: list[int] = []
        token: int | None = None
        reason: str | None = None
        n_agreed = 0  # proposals drawn as proposed (the last may end the sequence: not kept)
        for i, row in enumerate(rows):
            proposed = draft[i] if i < len(draft) else None
            token, reason = self._sample(seq_id, row, proposed)
            if token is None or token != proposed:
                break
            n_agreed += 1
            if reason is not None:
                break
            kept.append(token)
        if token is None and reason is None:  # cancelled during the forward: nothing verified
            return [], None, None
        gen.drafted += len(draft)
        gen.accepted += n_agreed
        gen.length.record_outcome(len(draft), n_agreed)
        self.metrics.draft_tokens.inc(len(draft))
        self.metrics.draft_accepted.inc(n_agreed)
        return kept, token, reason  # a token that ended the sequence is not fed back

    def _draft_asks(self, plan: Plan) -> list[DraftAsk]:
        """What to ask the draft model for the plan's decoding sequences (lock held)."""
        if self.drafter is None:
            return []
        asks = []
        for w in plan.works:
            seq = self.scheduler.running.get(w.seq_id)
            if seq is None or not w.logits or w.draft or not seq.decoding or seq.n_pending != 1:
                continue
            k = self._draft_length(w.seq_id, self.n_ctx_slot - seq.n_computed - 1)
            if k:
                asks.append(DraftAsk(w.seq_id, w.slot, tuple(seq.tokens), k))
        return asks

    def _with_drafts(self, plan: Plan, asks: list[DraftAsk]) -> Plan:
        """plan with the draft model's proposals (a failed draft forward: plan as it was)."""
        assert self.drafter is not None and self.speculation is not None
        try:
            t0 = time.perf_counter()
            drafts = self.drafter.propose(asks)
            self._record_proposals(asks, drafts, time.perf_counter() - t0)
        except Exception:  # the draft only speeds things up: carry on without it
            log.exception("the draft model's forward failed")
            self.drafter.forget()
            return plan
        keep = max(1, self.speculation.draft_min)
        works = []
        for w in plan.works:
            draft = drafts.get(w.seq_id, [])
            if len(draft) >= keep:
                w = replace(w, draft=tuple(draft[:bucket_floor(len(draft))]))
            works.append(w)
        return Plan(tuple(works))

    def _record_proposals(self, asks: list[DraftAsk], drafts: dict[int, list[int]],
                          seconds: float) -> None:
        """The draft model's cost, for the DraftLength of each slot it proposed for (all slots
        waited for it; a step that only caught up on a prompt says nothing of drafting)."""
        for ask in asks:
            gen = self._gens.get(ask.seq_id)
            if gen is not None and drafts.get(ask.seq_id):
                gen.length.record_proposal(ask.k, seconds)

    def _record_forward(self, plan: Plan, seconds: float) -> None:
        """A step's cost, for the DraftLength of each decoding sequence in it: a plain step or
        a verify of 1 + k rows (what the sequence waited for, neighbours included)."""
        if self.speculation is None:
            return
        for w in plan.works:
            gen = self._gens.get(w.seq_id)
            if gen is None or not w.logits or len(w.tokens) != 1 or gen.n_generated == 0:
                continue
            if w.draft:
                gen.length.record_verify(1 + len(w.draft), seconds)
            else:
                gen.length.record_plain(seconds)

    def _draft_length(self, seq_id: int, room: int) -> int:
        """How many tokens to propose for a decoding sequence (its DraftLength; 0: none)."""
        gen = self._gens.get(seq_id)
        spec = self.speculation
        if gen is None or gen.verifier is None or spec is None or room < 1:
            return 0
        left = gen.req.max_tokens - gen.n_generated
        return gen.length.choose(min(room, left, spec.draft_max))

    def _propose(self, seq_id: int, tokens: list[int], room: int) -> list[int]:
        """Prompt lookup for a decoding sequence (scheduler callback, lock held)."""
        spec = self.speculation
        k = self._draft_length(seq_id, room)
        if k == 0 or spec is None:
            return []
        draft = lookup(np.asarray(tokens, dtype=np.int64), spec.lookup_ngram, k)
        if len(draft) < max(1, spec.draft_min):
            return []
        return draft[:bucket_floor(len(draft))]

    def _sample(self, seq_id: int, row: np.ndarray, proposed: int | None = None
                ) -> tuple[int | None, str | None]:
        gen = self._gens.get(seq_id)
        if gen is None or gen.handle.cancelled:  # aborted or cancelled during the forward
            return None, None
        try:
            token, reason = gen.step(row, proposed)
        except Exception as exc:
            log.exception("sampling failed")
            gen.handle.post(Failed(f"sampling failed: {exc}"))
            return None, "failed"
        m = self.metrics
        m.generated_tokens.inc()
        if gen.first_token_s is not None and gen.n_generated == 1:
            m.ttft.observe(gen.first_token_s)
        elif gen.last_gap is not None:
            m.tpot.observe(gen.last_gap)
        return token, reason

    def _reap_cancelled(self) -> None:
        for seq_id in [s for s, g in self._gens.items() if g.handle.cancelled]:
            self._end(seq_id, None)

    def _end(self, seq_id: int, reason: str | None, failure: Failed | None = None) -> None:
        """Free a sequence's slot (lock held) and post its last event."""
        gen = self._gens.pop(seq_id, None)
        seq = self.scheduler.running.get(seq_id)
        self.scheduler.finish(seq_id)
        if gen is None:
            return
        if failure is not None:
            gen.handle.post(failure)
        elif reason not in (None, "failed"):
            gen.n_cached = seq.n_cached if seq is not None else 0
            done = gen.done(reason)
            self.metrics.prompt_tokens.inc(done.usage.prompt_tokens)
            self.metrics.cached_tokens.inc(done.usage.cached_tokens)
            gen.handle.post(done)
