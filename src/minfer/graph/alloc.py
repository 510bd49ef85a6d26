"""The allocator: persistent KV regions plus liveness-planned activation buffers.

KV regions (one K and one V array per layer, `[n_ctx, n_kv_embd]`) are created once for the
session and survive every graph rebuild; a rebuild only re-plans the activation buffers.

Planning walks the graph in build (= execution) order: a node takes the smallest free slot that
fits, and a slot returns to the free list after the node's last reader has run. Graph outputs are
held to the end. Slots are backed by a pool of float32 arrays that the allocator keeps across
plans, so alternating shapes do not reallocate. Orphaned nodes, KV loads and KV stores get no
buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


class KVRegions:
    """Per-layer K and V arrays, sized once from n_ctx; they outlive every graph.

    Each is `[n_ctx, row]` in its cache format, made by the backend that owns the formats
    (`new_cache(kv_type, n_ctx, n_kv_embd)`, `minfer.backends.base.KVHost.new_kv_cache`)."""

    def __init__(self, *, n_layer: int, n_ctx: int, n_kv_embd: int,
                 new_cache: Callable[[str, int, int], np.ndarray], kv_type: str = "f16",
                 k_type: str | None = None, v_type: str | None = None) -> None:
        self.n_ctx = n_ctx
        self.n_kv_embd = n_kv_embd
        self.k_type = k_type or kv_type
        self.v_type = v_type or kv_type
        self.k = [new_cache(self.k_type, n_ctx, n_kv_embd) for _ in range(n_layer)]
        self.v = [new_cache(self.v_type, n_ctx, n_kv_embd) for _ in range(n_layer)]

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
