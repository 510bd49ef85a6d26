"""The backend protocol: what a compute device must offer the scheduler.

A backend says which nodes it can run (`supports_op`) and runs one node at a time on buffers the
allocator planned (`execute_node`). Per-node assignment picks, for each node, the first backend in
the session's preference order that supports it; the scheduler groups consecutive nodes of one
backend into splits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

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


class Backend(Protocol):
    name: str

    def supports_op(self, node: Node, graph: ComputeGraph) -> bool: ...

    def execute_node(
        self,
        node: Node,
        srcs: list[np.ndarray | None],
        out: np.ndarray | None,
        ctx: ExecContext,
    ) -> None: ...
