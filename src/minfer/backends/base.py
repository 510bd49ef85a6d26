"""The backend protocol: what a compute device must offer the scheduler.

A backend says which nodes it can run (`supports_op`) and binds each node it runs to the buffers
the allocator planned (`bind_node`): the calls that make up its steps of the op tape, the only
way a graph runs. Per-node assignment picks, for each node, the first backend in the session's
preference order that supports it; the scheduler groups consecutive nodes of one backend into
splits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from minfer.graph.alloc import KVRegions
from minfer.graph.ir import ComputeGraph, Node


@dataclass
class ExecContext:
    """What a node needs besides its sources: weights by name, the KV regions, scratch."""

    weights: Any  # minfer.engine.weights.ModelWeights
    kv: KVRegions
    memo: dict[Any, Any] = field(default_factory=dict)  # per-forward cache (quantized inputs)
    # Every row's arithmetic independent of the batch around it (the server's guarantee that a
    # greedy request yields the same ids whatever else runs): integer-dot matmuls at any size.
    batch_invariant: bool = False
    # Matmuls on f32 copies of the weights through the batch-invariant f32 GEMM (small models
    # whose f32 weights fit: encoders), f32 activations: precision and prefill speed at once.
    dense_f32: bool = False
    # The engine's steps usually carry many rows (the server's continuous batching): weights
    # take the layout fastest for many rows even where one row alone would read another
    # faster (`kernels.packable`). Fixed per engine, so every tape of it reads one layout.
    batched: bool = False
    # The backend may run the tape's steps its own way (`Backend.compose`: the CPU backend's
    # parallel regions); off, every step is a call of its own.
    composed: bool = True


class Backend(Protocol):
    name: str

    def supports_op(self, node: Node, graph: ComputeGraph) -> bool: ...

    def bind_node(
        self,
        node: Node,
        srcs: list[np.ndarray | None],
        out: np.ndarray | None,
        ctx: ExecContext,
    ) -> list[Callable[[], None]]:
        """The node's calls over these fixed buffers (its steps of the op tape), with
        everything resolved that stays fixed for them; run in order, they compute the node."""
        ...

    def compose(self, steps: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """A split's bound steps as the tape calls them, in order: the same work, and the
        same results, perhaps fewer calls (the CPU backend's parallel regions)."""
        ...


@runtime_checkable
class KVHost(Protocol):
    """A backend that owns the KV cache's memory formats (the host CPU backend): which formats
    exist, which head sizes each fits, and the zeroed `[n_ctx, row]` array of one layer's K or V
    in a format, and moving a layer's cells to new positions (`move_kv`: K re-keyed by the
    caller). The engine asks it; nothing above the backends knows a format's layout. Every
    op falls back to it, so it also says which weight types a model may hold. A recurrent
    layer's state is the same kind of memory: `new_conv_state` makes one layer's region
    holding every sequence's short-convolution state (LFM2, Qwen3.5), `new_delta_state` a
    Gated DeltaNet layer's second region (its state matrices), read and written only by the
    backend's kernels; `snapshot_state` / `restore_state` copy one sequence's row of such a
    region out and back (a state checkpoint, `minfer.backends.checkpoints`)."""

    kv_types: tuple[str, ...]

    def check_weight_types(self, types: dict[str, int]) -> None: ...

    def check_kv_types(self, k_type: str, v_type: str, head_dim: int) -> None: ...

    def kv_quantized(self, kv_type: str) -> bool: ...

    def new_kv_cache(self, kv_type: str, n_ctx: int, width: int) -> np.ndarray: ...

    def new_conv_state(self, n_seq: int, l_cache: int, n_embd: int) -> np.ndarray:
        """The zeroed short-convolution state of one layer for n_seq sequences (each: the
        last l_cache - 1 inputs of every channel)."""
        ...

    def new_delta_state(self, n_seq: int, n_v_heads: int, head_dim: int) -> np.ndarray:
        """The zeroed gated-delta-rule state of one layer for n_seq sequences (each: one
        head_dim x head_dim f32 matrix per value head)."""
        ...

    def snapshot_state(self, state: np.ndarray, seq: int) -> np.ndarray:
        """An owned copy of sequence seq's row of one layer's state region."""
        ...

    def restore_state(self, state: np.ndarray, seq: int, snapshot: np.ndarray) -> None:
        """Sequence seq's row of one layer's state region back to a `snapshot_state` copy."""
        ...

    def move_kv(self, k: np.ndarray, v: np.ndarray, *, src_start: int, src_end: int,
                dst_start: int, head_dim: int,
                rekey: Callable[[np.ndarray], np.ndarray] | None) -> None:
        """Move one layer's cells [src_start, src_end) to [dst_start, ...) (the ranges may
        overlap): V's rows as they are, K's rows as their values `[n, width]` (whatever the
        format) passed through `rekey` (a context shift's re-rotation) and stored back; with
        no `rekey` (a layer without RoPE) K's rows too as they are."""
        ...

