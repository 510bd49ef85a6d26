"""`EngineCore`: the one step loop behind `minfer run`, chat, the Python API and `minfer serve`.

A step is schedule → (propose) → batch → forward → sample → stop gates → text: the scheduler
decides who runs (`scheduler.py`), the proposer guesses ahead for decoding sequences
(`proposer.py`), the runner executes the plan (`runner.py`) and each `Request` draws its tokens
(`request.py`). The core is synchronous and has no threads; `step()` runs the three phases in
turn. A caller that shares the core with another thread (the server's engine thread) runs them
itself: `schedule` and `update` touch the scheduler (under its lock), `execute` runs the forward
and the draws (outside it).

A request alone is a batch of one: `generate()` runs a one-slot core whose runner is a
`SequenceRunner`, so a lone request's rows are the one-token decode rows it always computed.

Speculation: for each decoding sequence the request's `DraftLength` chooses k; the proposer's
guesses (cut to a verify bucket) ride in the sequence's work, the forward computes a row per
proposal (verify rows are batch-invariant), and the rows are drawn in order until a proposal is
not kept. Kept proposals are already in the KV (`Scheduler.accept_drafted`); the cells of the
others are overwritten later.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import cast

import numpy as np

from minfer.engine.core.policy import BatchPayoff, DraftLength, Proposal, StepCost, bucket_floor
from minfer.engine.core.proposer import DraftAsk, Proposer
from minfer.engine.core.request import Emitted, GenRequest, Request, Vocab
from minfer.engine.core.runner import ReplayRunner, StepRunner
from minfer.engine.core.scheduler import Plan, Scheduler, Sequence
from minfer.engine.speculative import SpecConfig

log = logging.getLogger("minfer.engine")


@dataclass(frozen=True)
class Scheduled:
    """What `schedule` decided: the plan, and what to ask the proposer."""

    plan: Plan
    asks: tuple[DraftAsk, ...] = ()


@dataclass
class Output:
    """What one step did for one request: its drawn tokens, and how it ended (if it did)."""

    seq_id: int
    request: Request
    emitted: list[Emitted] = field(default_factory=list)
    finish: str | None = None  # see request.py; "failed" when sampling raised `error`
    error: Exception | None = None
    drafted: int = 0  # proposals verified this step
    accepted: int = 0  # ... and drawn as proposed


@dataclass
class Executed:
    """A plan after its forward: the outputs of the sequences that drew, and what to feed back."""

    plan: Plan
    outputs: list[Output]
    kept: dict[int, list[int]]  # seq id -> verified proposals (their rows are in the KV)
    next_token: dict[int, int]  # seq id -> the token the next step feeds


class EngineCore:
    """Continuous batching over one runner: add / abort requests, `step` until idle."""

    def __init__(self, runner: StepRunner, vocab: Vocab, *, n_slots: int, n_ctx_slot: int,
                 chunk: int = 128, max_waiting: int = 64, proposer: Proposer | None = None,
                 speculation: SpecConfig | None = None, idle_chunk: int | None = None) -> None:
        self.vocab = vocab
        self.n_ctx_slot = n_ctx_slot
        self.scheduler = Scheduler(n_slots=n_slots, n_ctx_slot=n_ctx_slot, chunk=chunk,
                                   max_waiting=max_waiting, idle_chunk=idle_chunk)
        self.runner = runner
        self.proposer = proposer
        self.speculation = (speculation or SpecConfig()) if proposer is not None else None
        self.requests: dict[int, Request] = {}
        self.step_cost = StepCost()  # the batch's price of a row (caps proposals: `_asks`)
        self.payoff = BatchPayoff()  # whether proposing pays at a stream count (`_asks`)

    @property
    def runner(self) -> StepRunner:
        return self._runner

    @runner.setter
    def runner(self, runner: StepRunner) -> None:
        """The runner; its model's recurrent state (if any) sets how the scheduler reuses
        slots' caches (`Scheduler.recurrent`)."""
        self._runner = runner
        self.scheduler.recurrent = bool(getattr(runner, "recurrent", False))
        self.scheduler.checkpoints = getattr(runner, "checkpoints", None)

    # -- requests in and out -------------------------------------------------------------------
    def add(self, seq_id: int, req: GenRequest, *, length: DraftLength | None = None) -> Request:
        """Queue a request (QueueFullError when the queue is full); its state, to read later.
        length: the draft-length policy to use (a Speculator's, kept across generations)."""
        spec = self.speculation
        if spec is None:
            length = None
        elif length is None:
            length = DraftLength(spec.draft_max, adaptive=spec.adaptive)
        state = Request(req, self.vocab, n_ctx_slot=self.n_ctx_slot, length=length)
        self.scheduler.add(Sequence(seq_id, list(req.prompt), len(req.prompt),
                                    score_k=req.prompt_logprobs, scores=state.prompt_logprobs,
                                    embd=req.embd))
        self.requests[seq_id] = state
        return state

    def abort(self, seq_id: int) -> Request | None:
        """Drop a request now (done, cancelled, failed); its slot keeps the computed tokens."""
        state = self.requests.pop(seq_id, None)
        seq = self.scheduler.running.get(seq_id)
        if state is not None and seq is not None:
            state.n_cached = seq.n_cached
        self.scheduler.finish(seq_id)
        return state

    def cancel(self, seq_id: int) -> None:
        """Mark a request cancelled: it draws nothing more; `reap` drops it."""
        state = self.requests.get(seq_id)
        if state is not None:
            state.cancelled = True

    def reap(self) -> list[int]:
        """Drop the cancelled requests; their ids."""
        gone = [s for s, r in self.requests.items() if r.cancelled]
        for seq_id in gone:
            self.abort(seq_id)
        return gone

    @property
    def busy(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """Schedule, execute and update once; the step's outputs (none when idle)."""
        scheduled = self.schedule()
        if not scheduled.plan.works:
            return []
        return self.update(self.execute(scheduled))

    def schedule(self) -> Scheduled:
        """Admit and plan the next forward; what to ask the proposer for its decodes."""
        plan = self.scheduler.schedule()
        if self.proposer is None:
            return Scheduled(plan)
        return Scheduled(plan, tuple(self._asks(plan)))

    def execute(self, scheduled: Scheduled) -> Executed:
        """Propose, run the forward (a failure raises: the caller fails the plan's requests)
        and draw every sequence that got logits."""
        t0 = time.perf_counter()
        plan, qs = self._with_proposals(scheduled) if scheduled.asks else (scheduled.plan, {})
        t1 = time.perf_counter()
        rows = self.runner.run(plan)
        t2 = time.perf_counter()
        decode_only = all(len(w.tokens) == 1 for w in plan.works)  # decode and verify rows
        self._record_forward(plan, decode_only, t2 - t1, t2 - t0)
        done = Executed(plan, [], {}, {})
        drafts = {w.seq_id: w.draft for w in plan.works if w.draft} if scheduled.asks else {}
        scored = {w.seq_id: w for w in plan.works if w.rows}
        for seq_id, row in rows.items():
            state = self.requests.get(seq_id)
            if state is None or state.cancelled:  # aborted or cancelled during the forward
                continue
            if seq_id in scored:  # a scored prompt chunk: its rows, then maybe the first draw
                w = scored[seq_id]
                state.score_prompt(row, w.start_pos)
                if not w.logits:
                    continue
                row = row[-1]
            out = Output(seq_id, state)
            try:
                kept, token = self._draw(state, out, row, drafts.get(seq_id, ()),
                                         qs.get(seq_id))
            except Exception as exc:
                log.exception("sampling failed")
                out.finish, out.error = "failed", exc
            else:
                out.finish = state.finish
                done.kept[seq_id] = kept
                if token is not None and state.finish is None:
                    done.next_token[seq_id] = token
            done.outputs.append(out)
        if self.scheduler.recurrent:
            self._replay_rejected(plan, done)
        if self.proposer is not None and decode_only:
            decodes = [w for w in plan.works if w.logits]
            tokens = sum(1 + len(done.kept.get(w.seq_id, ())) for w in decodes)
            self.payoff.record(len(decodes), bool(scheduled.asks), tokens, t2 - t0)
        return done

    def update(self, done: Executed) -> list[Output]:
        """Feed the drawn tokens back to the scheduler; finished requests leave."""
        self.scheduler.advance(done.plan)
        for out in done.outputs:
            if out.seq_id not in self.requests:  # aborted meanwhile
                continue
            kept = done.kept.get(out.seq_id)
            if kept:
                self.scheduler.accept_drafted(out.seq_id, kept)
            if out.finish is not None:
                self.abort(out.seq_id)
            elif out.seq_id in done.next_token:
                self.scheduler.append(out.seq_id, done.next_token[out.seq_id])
        return done.outputs

    def _replay_rejected(self, plan: Plan, done: Executed) -> None:
        """A recurrent state took in every proposal a verify fed: where some were not kept,
        it goes back to the verify's start and takes in the kept tokens again (bitwise their
        decode rows), so it holds exactly the sequence's computed tokens."""
        runner = cast(ReplayRunner, self.runner)
        for w in plan.works:
            kept = tuple(done.kept.get(w.seq_id, ()))
            if w.draft and len(kept) < len(w.draft):
                runner.replay(replace(w, tokens=w.tokens + kept, draft=(), logits=False))

    # -- drawing -------------------------------------------------------------------------------
    def _draw(self, state: Request, out: Output, rows: np.ndarray, draft: tuple[int, ...],
              q: list[np.ndarray] | None) -> tuple[list[int], int | None]:
        """(the proposals kept, the next token): rows [1 + k, n_vocab] are drawn in order until
        a proposal is not kept (one row and no draft: a plain step). q: the proposer's
        distribution for each proposal (None: point-mass guesses)."""
        if not draft:
            emitted = state.step(rows)
            if emitted is not None:
                out.emitted.append(emitted)
            return [], None if emitted is None else emitted.token
        kept: list[int] = []
        token: int | None = None
        for i, row in enumerate(rows):
            proposed = draft[i] if i < len(draft) else None
            emitted = state.step(row, proposed, q[i] if q and proposed is not None else None)
            if emitted is None:
                break
            out.emitted.append(emitted)
            token = emitted.token
            if token != proposed:
                break
            out.accepted += 1
            if state.finish is not None:  # at an end plain decoding would not forward it
                break
            kept.append(token)
        out.drafted = len(draft)
        self._record_outcome(state, len(draft), out.accepted)
        return kept, token

    @staticmethod
    def _record_outcome(state: Request, drafted: int, accepted: int) -> None:
        state.spec.steps += 1
        state.spec.drafted += drafted
        state.spec.accepted += accepted
        state.timings.decode_tokens += accepted
        if state.length is not None:
            state.length.record_outcome(drafted, accepted)

    # -- speculation ---------------------------------------------------------------------------
    def _asks(self, plan: Plan) -> list[DraftAsk]:
        """What to ask the proposer for the plan's decoding sequences: each one's DraftLength,
        capped by what a row costs the batch (`StepCost.draft_cap`: beside many streams a
        compute-bound step makes every proposed row cost them all)."""
        asks: list[DraftAsk] = []
        n_streams = sum(1 for w in plan.works if w.logits)
        if not self.payoff.propose(n_streams):  # plain steps yield more at this stream count
            return asks
        for w in plan.works:
            seq = self.scheduler.running.get(w.seq_id)
            if seq is None or not w.logits or not seq.decoding or seq.n_pending != 1:
                continue
            state = self.requests.get(w.seq_id)
            k = self._draft_length(state, self.n_ctx_slot - seq.n_computed - 1)
            if k and state is not None and state.length is not None and n_streams > 1:
                k = min(k, self.step_cost.draft_cap(n_streams, state.length.kept_share))
            if k and state is not None:
                greedy = state.verifier is None or state.verifier.greedy
                asks.append(DraftAsk(w.seq_id, w.slot, tuple(seq.tokens), k, greedy,
                                     state.length))
        return asks

    def _draft_length(self, state: Request | None, room: int) -> int:
        """How many tokens to propose for a decoding sequence (its DraftLength; 0: none)."""
        if state is None or state.length is None or room < 1:
            return 0
        left = state.req.max_tokens - state.n_generated
        return state.length.choose(min(room, left), rated_asks_most=getattr(
            self.proposer, "rated_asks_most", True))

    def _with_proposals(self, scheduled: Scheduled
                        ) -> tuple[Plan, dict[int, list[np.ndarray]]]:
        """The plan with the proposer's guesses (a failed proposer: the plan as it was), and
        the proposer's q of each sequence that has them."""
        assert self.proposer is not None and self.speculation is not None
        try:
            t0 = time.perf_counter()
            drafts = self.proposer.propose(scheduled.asks)
            seconds: float | None = time.perf_counter() - t0
            price = getattr(self.proposer, "price", None)  # a draft's: long catch-ups left out
            if price is not None:
                seconds = price(seconds)
            if seconds is not None:
                self._record_proposals(scheduled.asks, drafts, seconds)
        except Exception:  # proposals only speed things up: carry on without them
            log.exception("the proposer failed")
            self.proposer.forget()
            return scheduled.plan, {}
        keep = max(1, self.speculation.draft_min)
        works = []
        qs: dict[int, list[np.ndarray]] = {}
        for w in scheduled.plan.works:
            proposal = drafts.get(w.seq_id)
            if proposal is not None and len(proposal.tokens) >= keep:
                state = self.requests.get(w.seq_id)
                length = state.length if state is not None else None
                # to a verify bucket, or none where a plain step pays (`DraftLength.fit`)
                proposal = proposal.cut(bucket_floor(len(proposal.tokens)) if length is None
                                        else length.fit(proposal))
                if proposal.tokens:
                    w = replace(w, draft=tuple(proposal.tokens))
                    if proposal.q is not None:
                        qs[w.seq_id] = proposal.q
            works.append(w)
        return replace(scheduled.plan, works=tuple(works)), qs

    def _record_proposals(self, asks: tuple[DraftAsk, ...], drafts: dict[int, Proposal],
                          seconds: float) -> None:
        """The proposer's cost, for the DraftLength of each sequence it proposed for (all
        waited for it; a step that only caught up on a prompt says nothing of drafting)."""
        for ask in asks:
            state = self.requests.get(ask.seq_id)
            proposal = drafts.get(ask.seq_id)
            if state is not None and state.length is not None and proposal and proposal.tokens:
                state.length.record_proposal(ask.k, seconds)
        self.step_cost.record_proposal(max((len(p.tokens) for p in drafts.values()), default=0),
                                       seconds)

    def _record_forward(self, plan: Plan, decode_only: bool, forward_s: float,
                        seconds: float) -> None:
        """A step's cost: the forward's (`StepCost`, from steps of decode and verify rows only,
        `decode_only`: a prompt chunk's rows cost otherwise), the timings of each request in it
        (`seconds`, the proposals included), and for the DraftLength of each decoding one, a
        plain step or a verify of 1 + k rows (the forward alone, neighbours included:
        DraftLength prices the proposals apart, `record_proposal`)."""
        if decode_only:
            self.step_cost.record(sum(1 + len(w.draft) for w in plan.works), forward_s)
        for w in plan.works:
            state = self.requests.get(w.seq_id)
            if state is None:
                continue
            if state.n_generated == 0 and not w.draft:
                state.timings.prefill_s += seconds
                continue
            state.timings.decode_s += seconds
            state.timings.decode_tokens += 1
            if state.length is None or not w.logits or len(w.tokens) != 1:
                continue
            if w.draft:
                state.length.record_verify(1 + len(w.draft), forward_s)
            else:
                state.length.record_plain(forward_s)
