"""`MtpProposer`: the target's own MTP (NextN) head as the core's proposer (`--spec mtp`).

A Qwen3.5 file may carry a multi-token-prediction block after its trunk (`HParams.mtp_head`,
`models.qwen35.build_mtp_head`). At position q the head takes token q and the target's final
normed hidden state of row q - 1 (zeros at 0) and scores token q + 1, attending over its own
KV cells of positions 0..q; llama.cpp's draft-mtp pairs them the same way. So:

- the target reports every row's hidden state as it computes it (`Engine.hidden_sink`,
  `GraphParams.hidden_out`: prompt chunks, decode steps, verifies, recurrent replays); the
  proposer keeps, per slot and position, the row and the token it was computed for (one
  generation of `run` / `chat` attaches it and `detach`es it after, so the target's later
  forwards without speculation compute only their last rows; a server's slots stay attached);
- `propose` first catches each slot's head KV up to the sequence: the positions past the common
  prefix of what the head holds and the sequence, through the pending token at pos0 (whose row
  is recomputed for its logits), each row paired with the recorded hidden state before it, in
  forwards of at most `chunk` rows; the last row's logits give the first draft token;
- then drafts autoregressively, one multi-sequence forward per step over every slot still
  drafting: the drafted token at the next position paired with the head's own normed output
  row (its hidden state), until k tokens or the head's top probability falls under `p_min`
  (`confident_top`; a draft stopped one short of a verify bucket adds its unsure top,
  `fills_bucket`). Every draft is greedy: a point-mass guess, so the verifier stays exact
  for sampled requests too.

The head's rows past pos0 are the drafts' (not the target's hidden states): the slot's record
of what its head KV holds stops at pos0, so the next catch-up rewrites them from genuine rows.
Rejected proposals need no other undo. The head's KV is its own Engine's (backend-owned cells
of its one layer, the target's slot layout). The target's rows are the verifier's: exactness
and batch invariance are the target's alone, whatever the head proposes. A position whose
hidden state the target never reported in that slot (a prefix the server copied from another
slot) is paired with whatever the record holds there: a weaker guess, never a wrong output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from minfer.engine.core.policy import Proposal, confident_top, fills_bucket
from minfer.engine.core.proposer import DraftAsk
from minfer.engine.core.runner import build_batch
from minfer.engine.core.scheduler import Plan, Work, common_prefix

if TYPE_CHECKING:
    from minfer.engine.forward import Batch, Engine


class MtpProposer:
    """The MTP head drafting for one target engine's slots (the core's thread only)."""

    def __init__(self, make_head: Callable[[int], Engine], *, p_min: float,
                 chunk: int = 512) -> None:
        """make_head(n_ctx): an Engine over the file's MTP head (`HParams.mtp_head`) with at
        least n_ctx cells, made when a target is attached (again when a larger one is)."""
        self.make_head = make_head
        self.p_min = p_min
        self.chunk = chunk
        self.head: Engine | None = None
        self.target: Engine | None = None
        self.n_ctx_slot = 0
        self.hidden = np.zeros((0, 0, 0), np.float32)  # [slot, position, n_embd]: target rows
        self.known = np.zeros((0, 0), np.int64)  # [slot, position]: their tokens (-1: none)
        self.cached: list[list[int]] = []  # per slot: the tokens the head's KV holds
        self._rows = np.zeros((0, 0), np.float32)  # the head's last normed output rows
        self.n_forwards = 0

    def attach(self, target: Engine, n_ctx_slot: int | None = None) -> None:
        """Read `target`'s hidden states from now on, its cells split into slots of
        n_ctx_slot (None: one slot of all its cells). Unwraps a KV mirror (`.engine`)."""
        target = getattr(target, "engine", target)
        n_ctx_slot = n_ctx_slot or target.n_ctx
        if target is self.target and n_ctx_slot == self.n_ctx_slot:
            target.hidden_sink = self._record  # again after a `detach`
            return
        if self.target is not None and self.target is not target:
            self.target.hidden_sink = None
        if self.head is None or self.head.n_ctx < target.n_ctx:
            self.head = self.make_head(target.n_ctx)
            self.head.hidden_sink = self._head_rows
        n_slots = target.n_ctx // n_ctx_slot
        self.target, self.n_ctx_slot = target, n_ctx_slot
        self.hidden = np.zeros((n_slots, n_ctx_slot, target.hparams.n_embd), np.float32)
        self.known = np.full((n_slots, n_ctx_slot), -1, np.int64)
        self.cached = [[] for _ in range(n_slots)]
        target.hidden_sink = self._record

    def detach(self) -> None:
        """Stop reading the target's hidden states (its forwards stop computing them) until
        the next `attach`; the record stays for the positions it holds."""
        if self.target is not None and self.target.hidden_sink == self._record:
            self.target.hidden_sink = None

    # -- the two engines' rows -----------------------------------------------------------------
    def _record(self, batch: Batch, hidden: np.ndarray) -> None:
        """The target's every-row hidden states of one forward, by slot and position."""
        slots, at = np.divmod(batch.cells, self.n_ctx_slot)
        self.hidden[slots, at] = hidden
        self.known[slots, at] = batch.tokens

    def _head_rows(self, batch: Batch, rows: np.ndarray) -> None:
        self._rows = rows.copy()

    # -- Proposer ------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Build the head's first graphs in slot 0 (its record stays empty: never reused)."""
        if self.head is None:
            return
        zeros = np.zeros((2, self.head.hparams.n_embd), np.float32)
        self._forward(Plan((Work(-1, 0, 0, (0, 0), True),)), zeros)
        self._forward(Plan((Work(-1, 0, 2, (0,), True),)), zeros[:1])

    def forget(self) -> None:
        """Drop every slot's record of the head's KV (its state is unknown after a failure)."""
        self.cached = [[] for _ in self.cached]

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        """Up to ask.k greedy drafts per ask (fewer where the head is unsure)."""
        if self.head is None:
            return {}
        asks = [a for a in asks if a.tokens and self._room(a) > 0]
        out = {a.seq_id: Proposal([]) for a in asks}
        logits, rows = self._catch_up(asks)
        live = [a for a in asks if a.seq_id in logits]
        while live:
            works: list[Work] = []
            given: list[np.ndarray] = []
            for a in live:
                drafted = out[a.seq_id].tokens
                token = confident_top(logits[a.seq_id], self.p_min)
                if token is None:
                    if fills_bucket(len(drafted)):
                        drafted.append(int(np.argmax(logits[a.seq_id])))
                    continue
                drafted.append(token)
                if len(drafted) < self._room(a):
                    works.append(Work(a.seq_id, a.slot, len(a.tokens) - 1 + len(drafted),
                                      (token,), True))
                    given.append(rows[a.seq_id])
            going = {w.seq_id for w in works}
            live = [a for a in live if a.seq_id in going]
            if works:
                logits, rows = self._forward(Plan(tuple(works)), np.stack(given))
        return out

    def _room(self, ask: DraftAsk) -> int:
        """ask.k, capped so that no draft row's cell passes the slot."""
        return min(ask.k, self.n_ctx_slot - len(ask.tokens) + 1)

    def _catch_up(self, asks: Sequence[DraftAsk]
                  ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Feed each ask's slot the positions its head KV lacks through the pending token, in
        forwards of at most `chunk` rows; the logits and normed output row of each pending
        token."""
        start = {a.seq_id: min(common_prefix(self.cached[a.slot], a.tokens), len(a.tokens) - 1)
                 for a in asks}
        logits: dict[int, np.ndarray] = {}
        rows: dict[int, np.ndarray] = {}
        while any(start[a.seq_id] < len(a.tokens) for a in asks):
            works: list[Work] = []
            given: list[np.ndarray] = []
            budget = self.chunk
            for a in asks:
                s = start[a.seq_id]
                n = min(len(a.tokens) - s, budget)
                if n <= 0:
                    continue
                works.append(Work(a.seq_id, a.slot, s, a.tokens[s:s + n],
                                  s + n == len(a.tokens)))
                given.append(self._pairs(a.slot, s, n))
                start[a.seq_id] = s + n
                budget -= n
            got, out_rows = self._forward(Plan(tuple(works)), np.concatenate(given))
            logits.update(got)
            rows.update(out_rows)
            for w in works:
                held = self.cached[w.slot]
                del held[w.start_pos:]
                held.extend(w.tokens)
        return logits, rows

    def _pairs(self, slot: int, start: int, n: int) -> np.ndarray:
        """The target's hidden states paired with positions start..start + n - 1: each
        position's row before it (zeros before position 0)."""
        given = np.zeros((n, self.hidden.shape[2]), np.float32)
        first = max(start - 1, 0)
        given[first - start + 1:] = self.hidden[slot, first:start + n - 1]
        return given

    def _forward(self, plan: Plan, given: np.ndarray
                 ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """One multi-sequence forward of the head; each asking work's logits and normed output
        row (its next step's hidden state)."""
        assert self.head is not None
        batch, _ = build_batch(plan, self.n_ctx_slot)
        out = self.head.forward_batch(replace(batch, hidden=given))
        self.n_forwards += 1
        asking = [w.seq_id for w in plan.works if w.logits]
        return ({s: out[i] for i, s in enumerate(asking)},
                {s: self._rows[i] for i, s in enumerate(asking)})
