"""The runners: one `Plan` → one forward → logits per sequence.

`Runner` builds one multi-sequence `Batch` (the server's slots). Slot s owns KV cells [s *
n_ctx_slot, (s + 1) * n_ctx_slot) of an engine created with n_ctx = n_slots * n_ctx_slot. A token
at position p of slot s writes cell s * n_ctx_slot + p and reads cells [s * n_ctx_slot, its cell];
positions restart at 0 in every slot. So batching several sequences changes only the data of the
batch, never the graph's topology. A model with recurrent layers holds one state per slot (the
engine's sequences are the slots' cell ranges: `Engine.hold_sequences`), checkpointed after each
prompt chunk (`checkpoints` lists where, for the scheduler); before a speculative verify the
runner keeps the slot's state in its spare, and `replay` recomputes the kept tokens from it.

`SequenceRunner` runs the plans of a one-slot core (`minfer run`, chat, the Python API) through
`forward(tokens, start_pos, n_out)`: an Engine, or a `KVMirror` that records what the KV holds.
A one-slot plan has at most one work, so its batch is `Batch.single`'s, the batch `Runner` would
build for slot 0; a work that carries proposals is forwarded with `batch_invariant=True`, so each
verified row is bitwise the row a one-token decode computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from minfer.engine.core.request import mrope_positions
from minfer.engine.core.scheduler import Plan, Work

if TYPE_CHECKING:
    from minfer.engine.forward import Batch, Engine


class BatchEngine(Protocol):
    """What the runner needs of `minfer.engine.forward.Engine` (tests pass a fake)."""

    @property
    def n_ctx(self) -> int: ...

    def forward_batch(self, batch: Batch) -> np.ndarray: ...

    def copy_cells(self, src: int, dst: int, n: int) -> None: ...


class SequenceEngine(Protocol):
    """What `SequenceRunner` needs: one sequence whose cells are its positions (an Engine, a
    KVMirror over one, a test's fake)."""

    @property
    def n_ctx(self) -> int: ...

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1) -> np.ndarray: ...


class StepRunner(Protocol):
    """Executes a plan: the logits of every sequence that asked for them."""

    def run(self, plan: Plan) -> dict[int, np.ndarray]: ...


class ReplayRunner(StepRunner, Protocol):
    """A runner over a recurrent model (`recurrent`), which can take rejected proposals back."""

    def replay(self, work: Work) -> None:
        """Recompute work's tokens from the recurrent state kept before a verify (only a
        runner over a recurrent model is asked)."""
        ...


def build_batch(plan: Plan, n_ctx_slot: int) -> tuple[Batch, list[int]]:
    """The batch for plan, and the seq ids whose logits its out rows hold (in row order)."""
    # imported here: the engine module loads the compiled kernels, which the scheduler and the
    # HTTP layer (and their tests, on a fake engine) do not need
    from minfer.engine.forward import Batch

    tokens: list[int] = []
    positions: list[np.ndarray] = []
    bases: list[np.ndarray] = []
    out_rows: list[int] = []
    out_ids: list[int] = []
    firsts: list[int] = []  # each work's first batch row
    for w in plan.works:
        n = len(w.tokens) + len(w.draft)
        firsts.append(len(tokens))
        tokens.extend(w.tokens)
        tokens.extend(w.draft)
        positions.append(np.arange(w.start_pos, w.start_pos + n, dtype=np.int32))
        bases.append(np.full(n, w.slot * n_ctx_slot, dtype=np.int32))
        if w.rows or w.logits:  # every fed row, or the last known token's and each proposal's
            first = len(tokens) - n if w.rows else len(tokens) - 1 - len(w.draft)
            for row in range(first, len(tokens)):
                out_rows.append(row)
                out_ids.append(w.seq_id)
    if not out_rows:  # a step of prompt chunks only: the graph still returns one row
        out_rows.append(len(tokens) - 1)
    given = [(first + e.at, e.rows, e.causal) for first, w in zip(firsts, plan.works, strict=True)
             for e in w.embd]
    pos = np.concatenate(positions)
    base = np.concatenate(bases)
    cells = base + pos
    rope_pos = None
    if any(w.mrope for w in plan.works):  # M-RoPE rows after (or in) an image
        rope_pos = np.concatenate([mrope_positions(w.mrope, w.start_pos, len(p))
                                   for w, p in zip(plan.works, positions, strict=True)], axis=1)
    batch = Batch(
        tokens=np.asarray(tokens, dtype=np.int32),
        positions=pos,
        cells=cells,
        kv_start=base,
        kv_end=cells + 1,
        out_rows=np.asarray(out_rows, dtype=np.int32),
        rope_pos=rope_pos,
    )
    for at, rows, causal in given:
        batch = batch.with_rows(at, rows, causal=causal)
    return batch, out_ids


class Runner:
    def __init__(self, engine: BatchEngine, n_ctx_slot: int) -> None:
        self.engine = engine
        self.n_ctx_slot = n_ctx_slot
        # a model with recurrent layers keeps one state per slot (`Engine.hold_sequences`)
        self.recurrent = bool(getattr(engine, "recurrent", False))
        if self.recurrent:
            cast("Engine", engine).hold_sequences(engine.n_ctx // n_ctx_slot)

    def warm_up(self) -> None:
        """Compile and build what the first requests need (a prompt chunk, then a decode step)
        by running them in slot 0; the scheduler never reads those cells (its cache is empty)."""
        self.run(Plan((Work(-1, 0, 0, (0, 0), True),)))
        self.run(Plan((Work(-1, 0, 2, (0,), True),)))

    def run(self, plan: Plan) -> dict[int, np.ndarray]:
        """Execute plan; the logits row [n_vocab] of every sequence that asked for one
        (rows [1 + k, n_vocab] for a sequence whose work carries k proposals, [n, n_vocab] for
        a work of n tokens that asks for every row). The plan's
        cell copies (a prompt prefix another slot holds) go first."""
        for c in plan.copies:
            self.engine.copy_cells(c.src * self.n_ctx_slot + c.start,
                                   c.dst * self.n_ctx_slot + c.start, c.n)
        batch, out_ids = build_batch(plan, self.n_ctx_slot)
        if self.recurrent:
            real = cast("Engine", self.engine)
            for w in plan.works:
                if w.draft:
                    real.save_state(w.slot, spare=True)
            logits = real.forward_batch(batch, checkpoint=[
                w.slot for w in plan.works if not w.draft and len(w.tokens) > 1])
        else:
            logits = self.engine.forward_batch(batch)
        out: dict[int, np.ndarray] = {}
        i = 0
        for w in plan.works:
            if w.rows:
                n = len(w.tokens)
                out[w.seq_id] = logits[i:i + n]
                i += n
            elif w.logits:
                n = 1 + len(w.draft)
                out[w.seq_id] = logits[i] if not w.draft else logits[i:i + n]
                i += n
        assert i == len(out_ids)
        return out

    def checkpoints(self, slot: int) -> list[int]:
        """Positions slot's recurrent state may restart from (`Engine.checkpoint_positions`)."""
        return cast("Engine", self.engine).checkpoint_positions(slot)

    def replay(self, work: Work) -> None:
        """Recompute work's tokens (a verify's kept ones) from the state its start was kept at,
        rows bitwise one-token decode rows: the slot's recurrent state then holds just them."""
        batch, _ = build_batch(Plan((work,)), self.n_ctx_slot)
        cast("Engine", self.engine).forward_batch(batch, batch_invariant=True, checkpoint=())


class SequenceRunner:
    """The runner of a one-slot core: a plan's one work as one `forward` of its sequence."""

    def __init__(self, engine: SequenceEngine) -> None:
        self.engine = engine
        self.recurrent = bool(getattr(engine, "recurrent", False))

    def run(self, plan: Plan) -> dict[int, np.ndarray]:
        """As `Runner.run`, for a plan of at most one work (slot 0)."""
        assert not plan.copies, "one slot: no other slot to copy from"
        if not plan.works:
            return {}
        (w,) = plan.works
        # M-RoPE rows of a sequence with images: their rope positions (an Engine's keyword)
        rope = mrope_positions(w.mrope, w.start_pos, len(w.tokens) + len(w.draft)) \
            if w.mrope else None
        if w.draft:  # a verify: its rows bitwise the one-token decode rows
            tokens = [*w.tokens, *w.draft]
            verify = cast("Engine", self.engine)
            if self.recurrent:
                verify.save_state(0, spare=True)
            if rope is None:
                rows = verify.forward(tokens, w.start_pos, 1 + len(w.draft), batch_invariant=True)
            else:  # an M-RoPE sequence with images
                rows = verify.forward(tokens, w.start_pos, 1 + len(w.draft),
                                      batch_invariant=True, rope_pos=rope)
            return {w.seq_id: rows}
        if w.embd or rope is not None:  # an image's rows, or rows after an M-RoPE image (an
            # Engine, or a chat's KVMirror in front of one)
            engine = cast("Engine", self.engine)
            n_out = len(w.tokens) if w.rows else 1
            rows = engine.forward(w.tokens, w.start_pos, n_out,
                                  embd=[(e.at, e.rows, e.causal) for e in w.embd], rope_pos=rope)
            return {w.seq_id: rows} if w.rows else ({w.seq_id: rows[0]} if w.logits else {})
        if w.rows:
            return {w.seq_id: self.engine.forward(w.tokens, w.start_pos, len(w.tokens))}
        logits = self.engine.forward(w.tokens, w.start_pos)
        return {w.seq_id: logits[0]} if w.logits else {}

    def replay(self, work: Work) -> None:
        """As `Runner.replay`, for the one slot."""
        cast("Engine", self.engine).forward(work.tokens, work.start_pos, batch_invariant=True)
