"""The speculative generation loop: propose k tokens, verify them in one forward, keep a prefix.

Same contract as `minfer.engine.generate.generate` (which hands over to `generate_speculative`
when given a `Speculator`): prefill, then sample first, forward second, through the same
`TokenStepper` gates, yielding Pieces and one Finished.

One step: the token t just drawn, followed by the proposals d1..dk, is forwarded at the write
position in one ordinary graph with n_out = k + 1 (`batch_invariant=True`: each row is bitwise
the row a one-token decode would compute, so a verified token is exactly the token plain decoding
would have produced). Row i holds the target's logits after d_i. The tokens are then drawn in
order from those rows:

- greedy (temp 0): the stepper's own draw; d_i is accepted iff it is that token — the output is
  plain greedy decoding's, token for token, penalties and grammar included;
- sampling: d_i is accepted with probability min(1, p(d_i) / q(d_i)), p the sampler chain's
  distribution (`Sampler.distribution`) and q the proposer's (a point mass for prompt lookup);
  a rejection draws from normalise(max(0, p - q)) instead. The output is distributed as the
  target's (Leviathan et al. 2023, Chen et al. 2023);
- mirostat (no fixed distribution) or a sampler without `distribution`: the token is drawn as
  usual and d_i kept iff it is that token (exact too; a seed gives plain decoding's output).

The first token not accepted (a rejection, or the draw after the last proposal) is the next
step's t. Rows written for rejected proposals are rolled back by moving the write position:
attention never reads past a token's own cell, and the next forward overwrites them; a
`KVMirror` (chat) is rewound to the kept cells at once, and at the end exactly the cells plain
decoding would have written remain.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from minfer.engine.speculative import (
    DraftLength,
    Proposal,
    Proposer,
    SpecConfig,
    SpecStats,
    SpeculativeError,
    bucket_floor,
)
from minfer.engine.stepper import Constraint, Step, TokenStepper, TokenText

if TYPE_CHECKING:
    from minfer.engine.generate import Finished, Piece
    from minfer.sampling.sampler import Sampler


class VerifyForward(Protocol):
    """An Engine, or a KVMirror over one."""

    @property
    def n_ctx(self) -> int: ...

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1, *,
                batch_invariant: bool = False) -> np.ndarray: ...


@dataclass
class Speculator:
    """One proposer with its length policy and counts; reusable across generations."""

    proposer: Proposer
    config: SpecConfig = field(default_factory=SpecConfig)
    stats: SpecStats = field(default_factory=SpecStats)
    length: DraftLength = field(init=False)

    def __post_init__(self) -> None:
        self.length = DraftLength(self.config.draft_max, adaptive=self.config.adaptive)

    def propose(self, history: Sequence[int], room: int, *, greedy: bool) -> Proposal:
        k = self.length.choose(room)
        if k == 0:
            return Proposal([])
        t0 = time.perf_counter()
        proposal = self.proposer.propose(history, k, greedy=greedy)
        self.length.record_proposal(k, time.perf_counter() - t0)
        if len(proposal.tokens) < max(1, self.config.draft_min):
            return Proposal([])
        return proposal.cut(bucket_floor(len(proposal.tokens)))


class Verifier:
    """Draws each position's token, deciding on the proposal there (see module docstring)."""

    def __init__(self, stepper: TokenStepper, sampler: Any) -> None:
        self.stepper = stepper
        self.sampler = sampler
        self.greedy = bool(getattr(sampler, "greedy", True))
        # accept/reject needs the distribution; without one (mirostat, whose distribution moves
        # with its own draws, or a foreign sampler) the token is drawn as usual and the proposal
        # kept iff it is that token: exact as well (each emitted token is one ordinary draw, so
        # a seed gives plain decoding's output), only accepted less often
        self.accept_reject = (not self.greedy and hasattr(sampler, "distribution")
                              and getattr(sampler, "mirostat", None) is None)

    def step(self, logits: np.ndarray, proposed: int | None, q: np.ndarray | None) -> Step:
        if proposed is None or not self.accept_reject or self.stepper.grammar_done():
            return self.stepper.step(logits)
        s: Sampler = self.sampler
        ids, probs = s.distribution(logits)
        hit = np.flatnonzero(ids == proposed)
        p_d = float(probs[hit[0]]) if hit.size else 0.0
        q_d = 1.0 if q is None else float(q[proposed])
        if q_d > 0.0 and s.random() < min(1.0, p_d / q_d):
            return self.stepper.commit(proposed)
        residual = probs.astype(np.float64)
        if q is None:
            residual[hit] = 0.0  # p - (point mass at d), clipped at 0
        else:
            residual = np.maximum(residual - q[ids], 0.0)
        if not residual.sum() > 0.0:  # p == q: nothing is left over, draw from p
            residual = probs.astype(np.float64)
        return self.stepper.commit(int(ids[s.choose(residual)]))


def generate_speculative(
    engine: VerifyForward,
    vocab: TokenText,
    sampler: Any,
    prompt_ids: Sequence[int],
    *,
    speculator: Speculator,
    context: Sequence[int] = (),
    max_tokens: int,
    stops: Sequence[str] = (),
    start_pos: int = 0,
    batch_size: int = 512,
    top_logits: int = 0,
    constraint: Constraint | None = None,
) -> Iterator[Piece | Finished]:
    """`generate`, verifying proposals. context: the tokens already in the KV before start_pos
    (the proposers see the whole sequence from position 0)."""
    from minfer.engine.generate import start

    if len(context) != start_pos:
        raise SpeculativeError(f"speculative decoding needs the {start_pos} tokens before the "
                               f"prompt, got {len(context)}")
    history = [*context, *prompt_ids]
    logits, run = start(engine, vocab, sampler, prompt_ids, start_pos=start_pos,
                        batch_size=batch_size, stops=stops, constraint=constraint,
                        top_logits=top_logits,  # a draft model prefills the prompt too
                        prepared=lambda: speculator.proposer.prepare(history))
    pos = start_pos + len(prompt_ids)
    verifier = Verifier(run.stepper, sampler)
    stats, length = SpecStats(), speculator.length
    proposal, rows, at = Proposal([]), np.empty((0, 0), np.float32), 0
    try:
        while len(run.ids) < max_tokens:
            proposed = proposal.tokens[at] if at < len(proposal.tokens) else None
            q = proposal.q[at] if proposed is not None and proposal.q is not None else None
            step = run.draw(verifier.step, logits, proposed, q)
            if step is None:
                break
            piece = run.take(step)
            history.append(run.ids[-1])
            if piece is not None:
                yield piece
            if proposed is not None and step.token == proposed:  # its row is already in the KV
                stats.accepted += 1
                at += 1
                if at == len(proposal.tokens):
                    length.record_outcome(len(proposal.tokens), at)
                if run.ends(step, max_tokens):  # at a stop, plain decoding would not forward
                    break  # it: nor keep its row
                pos += 1
                logits = rows[at]
                continue
            if proposed is not None:
                length.record_outcome(len(proposal.tokens), at)
            if run.ends(step, max_tokens):
                break
            if pos >= engine.n_ctx:
                run.reason = "context"
                break
            room = min(max_tokens - len(run.ids), engine.n_ctx - pos - 1)
            td = time.perf_counter()
            proposal = speculator.propose(history, room, greedy=verifier.greedy)
            tv = time.perf_counter()
            tokens = [run.ids[-1], *proposal.tokens]
            if proposal.tokens:
                rows = engine.forward(tokens, pos, n_out=len(tokens), batch_invariant=True)
                length.record_verify(len(tokens), time.perf_counter() - tv)
                stats.steps += 1
                stats.drafted += len(proposal.tokens)
            else:
                rows = engine.forward(tokens, pos)
                length.record_plain(time.perf_counter() - tv)
            run.timings.decode_s += time.perf_counter() - td
            run.timings.decode_tokens += 1
            pos += 1
            at = 0
            logits = rows[0]
    finally:  # rows of proposals never verified, or rejected, are not kept (also on close)
        _rewind(engine, pos)
    _add_stats(speculator.stats, stats)
    run.timings.decode_tokens += stats.accepted
    yield from run.finish(pos, stats)


def _rewind(engine: object, cursor: int) -> None:
    """A KVMirror forgets cells from `cursor` on (an Engine has no record to correct)."""
    rewind = getattr(engine, "rewind", None)
    if callable(rewind):
        rewind(cursor)


def _add_stats(total: SpecStats, one: SpecStats) -> None:
    total.steps += one.steps
    total.drafted += one.drafted
    total.accepted += one.accepted
