"""A stand-in engine for testing the server without compiled kernels: logits from KV contents.

`HashEngine` keeps one token id per KV cell. A forward writes each token into its cell, then
derives each requested row's logits from a hash of (the window it reads, its position): so a row's
output depends on exactly the data the real engine's row would read, and on nothing else in the
batch. A scheduler bug (a wrong cell, window or position, a stale prompt-cache hit, a row mixed up
with another sequence's) changes the text, which is what the tests compare. It checks a batch as
strictly as `Engine.forward_batch` does.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING

import numpy as np

from minfer.errors import ContextOverflowError, MinferError
from minfer.graph.alloc import check_cell_copy

if TYPE_CHECKING:
    from minfer.engine.forward import Batch


class HashEngine:
    def __init__(self, n_ctx: int, n_vocab: int, *, step_s: float = 0.0,
                 token_s: float = 0.0, scale: float = 4.0, avoid: frozenset[int] = frozenset()):
        """step_s / token_s: simulated cost per forward and per token; avoid: ids pushed down
        (e.g. end-of-generation ids, so greedy texts run to max_tokens)."""
        self._n_ctx = n_ctx
        self.n_vocab = n_vocab
        self.kv = np.full(n_ctx, -1, dtype=np.int64)
        self.step_s = step_s
        self.token_s = token_s
        self.scale = scale
        self.avoid = np.asarray(sorted(avoid), dtype=np.int64)
        self.calls: list[Batch] = []
        self.copies: list[tuple[int, int, int]] = []

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def forward_batch(self, batch: Batch) -> np.ndarray:
        self._check(batch)
        self.calls.append(batch)
        if self.step_s or self.token_s:
            time.sleep(self.step_s + self.token_s * batch.n_tokens)
        self.kv[batch.cells] = batch.tokens
        out = np.empty((len(batch.out_rows), self.n_vocab), dtype=np.float32)
        for i, r in enumerate(batch.out_rows):
            window = self.kv[batch.kv_start[r] : batch.kv_end[r]]
            if np.any(window < 0):
                raise MinferError("a row reads a KV cell nothing wrote")
            out[i] = self.row_logits(window, int(batch.positions[r]))
        return out

    def copy_cells(self, src: int, dst: int, n: int) -> None:
        """Cells [src, src + n) into [dst, dst + n), as `Engine.copy_cells` (checked as strictly:
        in range, not overlapping, and only cells something wrote)."""
        check_cell_copy(src, dst, n, self._n_ctx)
        if np.any(self.kv[src:src + n] < 0):
            raise MinferError("a copy reads a KV cell nothing wrote")
        self.kv[dst:dst + n] = self.kv[src:src + n]
        self.copies.append((src, dst, n))

    def row_logits(self, window: np.ndarray, position: int) -> np.ndarray:
        digest = hashlib.blake2b(window.tobytes() + position.to_bytes(8, "little"),
                                 digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        logits = (rng.standard_normal(self.n_vocab) * self.scale).astype(np.float32)
        if len(self.avoid):
            logits[self.avoid] -= 100.0
        return logits

    def _check(self, b: Batch) -> None:
        nt = b.n_tokens
        if nt == 0:
            raise MinferError("empty batch")
        for name in ("positions", "cells", "kv_start", "kv_end"):
            if getattr(b, name).shape != (nt,):
                raise MinferError(f"batch field {name} must have {nt} entries")
        if int(b.cells.max()) >= self._n_ctx or int(b.positions.max()) >= self._n_ctx:
            raise ContextOverflowError("a position or cell is outside the context")
        if len(set(b.cells.tolist())) != nt:
            raise MinferError("two tokens of one batch write the same cell")
        if np.any(b.kv_start > b.cells) or np.any(b.kv_end != b.cells + 1):
            raise MinferError("a token's window must end at its own cell")
        if np.any(b.cells - b.kv_start != b.positions):
            raise MinferError("position must equal the offset of the cell in its slot")
        rows = b.out_rows
        if len(rows) == 0 or np.any(np.diff(rows) <= 0) or rows[0] < 0 or rows[-1] >= nt:
            raise MinferError("output rows must be ascending and index the batch")
