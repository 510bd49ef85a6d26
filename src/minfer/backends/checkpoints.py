"""Recurrent-state checkpoints: copies of a sequence's state at a position, bounded per sequence.

A recurrent layer's state (LFM2's short convolution; Qwen3.5's convolution and delta-rule
matrices, `KVRegions.state_regions`) holds every token so far and cannot be cut
back to a prefix, so reusing a prefix of a sequence's cells needs the state as it stood there.
`StateCheckpoints` keeps, per sequence, up to `limit` copies of its state regions (one array per
recurrent layer, copied by the backend that owns the regions: `KVHost.snapshot_state`), each
tagged with the position (tokens taken in) it stood at, plus one spare (the state before a
speculative verify, overwritten by the next). A checkpoint at position p stays valid while the
sequence's cells [0, p) stay as they are: a write at position q drops every checkpoint past q
(`invalidate`). Full, it drops the lowest position (later ones serve more prompts: a chat's
next turn, an edit near the end, a regenerated reply).
"""

from __future__ import annotations

import numpy as np

from minfer.backends.base import KVHost
from minfer.graph.alloc import KVRegions

Snapshot = list[np.ndarray]


class StateCheckpoints:
    """Per sequence, {position: the state's copies at it}, at most `limit`, plus one spare."""

    def __init__(self, host: KVHost, kv: KVRegions, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"state checkpoints must be >= 0, got {limit}")
        self.host = host
        self.kv = kv
        self.limit = limit
        self._saved: list[dict[int, Snapshot]] = []
        self._spare: list[tuple[int, Snapshot] | None] = []
        self.reset()

    def reset(self) -> None:
        """Forget every checkpoint (the regions were remade: `KVRegions.hold_sequences`)."""
        self._saved = [{} for _ in range(self.kv.n_seq)]
        self._spare = [None] * self.kv.n_seq

    def positions(self, seq: int, *, spare: bool = False) -> list[int]:
        """The positions sequence seq has a checkpoint at, ascending (its spare's too if
        `spare`)."""
        held = self._spare[seq]
        extra = {held[0]} if spare and held is not None else set()
        return sorted({*self._saved[seq], *extra})

    def _copy(self, seq: int) -> Snapshot:
        return [self.host.snapshot_state(s, seq) for s in self.kv.state_regions]

    def save(self, seq: int, pos: int) -> None:
        """Keep sequence seq's state as it stands (having taken in pos tokens)."""
        saved = self._saved[seq]
        if self.limit == 0 or pos <= 0 or pos in saved:
            return
        if len(saved) >= self.limit:
            lowest = min(saved)
            if pos < lowest:
                return
            del saved[lowest]
        saved[pos] = self._copy(seq)

    def save_spare(self, seq: int, pos: int) -> None:
        """Keep the state at pos in the sequence's one spare (a verify's starting point)."""
        self._spare[seq] = (pos, self._copy(seq))

    def has(self, seq: int, pos: int) -> bool:
        spare = self._spare[seq]
        return pos in self._saved[seq] or (spare is not None and spare[0] == pos)

    def restore(self, seq: int, pos: int, *, into: int | None = None) -> None:
        """Sequence seq's state back to its checkpoint at pos (`has` first); into: the live
        state of that other sequence instead (a slot taking over another's prompt prefix)."""
        spare = self._spare[seq]
        snap = self._saved[seq].get(pos)
        if snap is None:
            assert spare is not None and spare[0] == pos, f"no checkpoint at {pos}"
            snap = spare[1]
        for region, copy in zip(self.kv.state_regions, snap, strict=True):
            self.host.restore_state(region, seq if into is None else into, copy)

    def invalidate(self, seq: int, pos: int) -> None:
        """The sequence's cells from pos on are rewritten: drop checkpoints past pos."""
        saved = self._saved[seq]
        for p in [p for p in saved if p > pos]:
            del saved[p]
        spare = self._spare[seq]
        if spare is not None and spare[0] > pos:
            self._spare[seq] = None

    @property
    def nbytes(self) -> int:
        """Bytes every checkpoint (spares included) holds."""
        snaps = [s for saved in self._saved for s in saved.values()]
        snaps += [sp[1] for sp in self._spare if sp is not None]
        return sum(a.nbytes for snap in snaps for a in snap)
