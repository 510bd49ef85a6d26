"""The allocator: persistent KV regions plus liveness-planned activation buffers.

KV regions (one K and one V array per layer, `[n_ctx, n_kv_embd]`) are created once for the
session and survive every graph rebuild; a rebuild only re-plans the activation buffers. A
recurrent layer (LFM2's short convolution, Qwen3.5's Gated DeltaNet) has no KV cells but a
state region instead, one row per sequence (a Gated DeltaNet layer a second one, its state
matrices), made by the backend and as persistent as the cells.

Planning walks the graph in build (= execution) order: a node takes the smallest free slot that
fits, and a slot returns to the free list after the node's last reader has run. Graph outputs are
held to the end. Slots are backed by a pool of float32 arrays that the allocator keeps across
plans, so alternating shapes do not reallocate. Orphaned nodes, KV loads and KV stores get no
buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from minfer.graph import ir
from minfer.graph.fusion import live_nodes
from minfer.graph.ir import ComputeGraph, DType


@dataclass(frozen=True)
class BufferPlan:
    """node id -> slot (or -1 for no buffer); the element count each slot must hold."""

    slot_of: tuple[int, ...]
    slot_sizes: tuple[int, ...]
    live: tuple[bool, ...]

    def intervals(self, graph: ComputeGraph) -> list[tuple[int, int, int]]:
        """(slot, first node, last use) per buffered node — for checking no two live overlap."""
        last = _last_uses(graph, self.live)
        return [(s, i, last[i]) for i, s in enumerate(self.slot_of) if s >= 0]


def _last_uses(graph: ComputeGraph, live: tuple[bool, ...] | list[bool]) -> list[int]:
    last = [node.id for node in graph.nodes]
    for node in graph.nodes:
        if live[node.id]:
            for src in node.srcs:
                last[src] = max(last[src], node.id)
    end = len(graph.nodes)
    for out in graph.outputs:
        last[out] = end  # held past the last node: read by the caller
    return last


def _needs_buffer(node: ir.Node) -> bool:
    return not isinstance(node.op, ir.KvcacheStore | ir.KvcacheLoad)


def plan_buffers(graph: ComputeGraph) -> BufferPlan:
    live = tuple(live_nodes(graph))
    last = _last_uses(graph, live)
    slot_of = [-1] * len(graph.nodes)
    sizes: list[int] = []
    free: list[int] = []
    release_at: dict[int, list[int]] = {}
    for node in graph.nodes:
        if live[node.id] and _needs_buffer(node):
            need = math.prod(node.shape)
            fits = [s for s in free if sizes[s] >= need]
            if fits:
                slot = min(fits, key=lambda s: sizes[s])
                free.remove(slot)
            elif free:  # grow the largest free slot rather than open a new one
                slot = max(free, key=lambda s: sizes[s])
                free.remove(slot)
                sizes[slot] = need
            else:
                slot = len(sizes)
                sizes.append(need)
            slot_of[node.id] = slot
            release_at.setdefault(last[node.id], []).append(slot)
        free.extend(release_at.pop(node.id, []))
    return BufferPlan(tuple(slot_of), tuple(sizes), live)


def check_cell_copy(src: int, dst: int, n: int, n_ctx: int) -> None:
    """Refuse a copy of n >= 1 cells [src, src + n) to [dst, dst + n) that leaves the context
    or whose ranges overlap (ValueError)."""
    if n < 1 or min(src, dst) < 0 or max(src, dst) + n > n_ctx or abs(src - dst) < n:
        raise ValueError(f"cannot copy {n} KV cells from {src} to {dst} (context of {n_ctx} "
                         "cells)")


_NO_STATE = np.empty((0, 0, 0), np.float32)


class KVRegions:
    """Per-layer K and V arrays, sized once from n_ctx; they outlive every graph.

    Each is `[n_ctx, row]` in its cache format, made by the backend that owns the formats
    (`new_cache(kv_type, n_ctx, n_kv_embd)`, `minfer.backends.base.KVHost.new_kv_cache`).
    A layer listed as `recurrent` has no cells (empty K and V) but a state region of n_seq
    rows, `new_state(n_seq)` (`KVHost.new_conv_state`): the cells split into n_seq equal
    ranges, one per sequence, and a sequence's recurrent state is the row of its range. Where
    `new_matrix_state(n_seq)` is given (`KVHost.new_delta_state`), every recurrent layer also
    holds that second region (`matrix_states`: Qwen3.5's delta-rule matrices)."""

    def __init__(self, *, n_layer: int, n_ctx: int, n_kv_embd: int | Sequence[int],
                 new_cache: Callable[[str, int, int], np.ndarray], kv_type: str = "f16",
                 k_type: str | None = None, v_type: str | None = None,
                 recurrent: Sequence[bool] = (),
                 new_state: Callable[[int], np.ndarray] | None = None, n_seq: int = 1,
                 new_matrix_state: Callable[[int], np.ndarray] | None = None) -> None:
        self.n_ctx = n_ctx
        # one row width for every layer, or each layer's (0: no cells, it reads another's)
        widths = [n_kv_embd] * n_layer if isinstance(n_kv_embd, int) else list(n_kv_embd)
        if len(widths) != n_layer:
            raise ValueError("per-layer KV widths need one entry per layer")
        self.n_kv_embd = max(widths, default=0)
        self.k_type = k_type or kv_type
        self.v_type = v_type or kv_type
        self.recurrent = tuple(recurrent) or (False,) * n_layer
        if len(self.recurrent) != n_layer or (any(self.recurrent) and new_state is None):
            raise ValueError("recurrent layers need one flag per layer and a state maker")
        self._new_state = new_state
        self._new_matrix_state = new_matrix_state
        rows = [0 if r or not w else n_ctx for r, w in zip(self.recurrent, widths, strict=True)]
        widths = [w or self.n_kv_embd for w in widths]
        self.k = [new_cache(self.k_type, n, w) for n, w in zip(rows, widths, strict=True)]
        self.v = [new_cache(self.v_type, n, w) for n, w in zip(rows, widths, strict=True)]
        self.n_seq = 0
        self.states: list[np.ndarray] = []
        self.matrix_states: list[np.ndarray] = []
        self.hold_sequences(n_seq)

    def hold_sequences(self, n_seq: int) -> None:
        """Split the cells into n_seq sequences, each with a zeroed state row in every
        recurrent layer (new regions: anything bound to the old ones must be bound again)."""
        if n_seq < 1 or self.n_ctx % n_seq:
            raise ValueError(f"{self.n_ctx} cells do not split into {n_seq} sequences")
        self.n_seq = n_seq
        self.states = [self._new_state(n_seq) if r and self._new_state else _NO_STATE
                       for r in self.recurrent]
        self.matrix_states = [self._new_matrix_state(n_seq) if r and self._new_matrix_state
                              else _NO_STATE for r in self.recurrent]

    @property
    def seq_cells(self) -> int:
        """Cells of each sequence's range."""
        return self.n_ctx // self.n_seq

    @property
    def state_regions(self) -> list[np.ndarray]:
        """Every recurrent state region (each recurrent layer's conv state, then its matrix
        state where it has one): what a sequence's state is, for copies and checkpoints."""
        return [s for s in self.states + self.matrix_states if s.size]

    @property
    def state_bytes_per_seq(self) -> int:
        """Recurrent-state bytes one sequence takes over all layers."""
        return sum(s.nbytes for s in self.state_regions) // self.n_seq

    def copy_state(self, src: int, dst: int) -> None:
        """Sequence src's recurrent state (every layer) into sequence dst's."""
        for state in self.state_regions:
            state[dst] = state[src]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one cell takes over all layers (K and V)."""
        return self.nbytes // self.n_ctx if self.n_ctx else 0

    def copy_cells(self, src: int, dst: int, n: int) -> None:
        """Cells [src, src + n) into cells [dst, dst + n) in every layer's K and V, as stored
        (any cache format: a cell's row is self-contained); `check_cell_copy` first."""
        check_cell_copy(src, dst, n, self.n_ctx)
        for cache in (*self.k, *self.v):
            cache[dst:dst + n] = cache[src:src + n]


class Allocator:
    """Owns the KV regions and the slot pool; hands each plan its buffers."""

    def __init__(self, kv: KVRegions) -> None:
        self.kv = kv
        self._pool: list[np.ndarray] = []
        self.generation = 0  # bumped whenever a pool array is (re)allocated

    def buffers(self, graph: ComputeGraph, plan: BufferPlan) -> list[np.ndarray | None]:
        """One array view per node (None for nodes without a buffer), backed by the pool."""
        for slot, size in enumerate(plan.slot_sizes):
            if slot >= len(self._pool):
                self._pool.append(np.empty(size, np.float32))
                self.generation += 1
            elif self._pool[slot].size < size:
                self._pool[slot] = np.empty(size, np.float32)
                self.generation += 1
        views: list[np.ndarray | None] = []
        for node in graph.nodes:
            slot = plan.slot_of[node.id]
            if slot < 0:
                views.append(None)
                continue
            flat = self._pool[slot][: math.prod(node.shape)]
            if node.dtype is DType.I32:
                flat = flat.view(np.int32)
            views.append(flat.reshape(node.shape))
        return views

    @property
    def pool_bytes(self) -> int:
        return sum(a.nbytes for a in self._pool)
