"""Backend assignment, splits, and execution in build order.

Assignment gives each node the first backend (in the session's preference order) whose
`supports_op` accepts it; input leaves always live on the host CPU backend. Consecutive nodes
on one backend form a split. Execution walks the splits in order and runs every live node;
nodes orphaned by fusion (no buffer, not a KV op) are skipped.

A prepared graph runs one way: as its op tape (`build_tape`, `Tape.run`), the node list bound
once by each node's backend (`bind_node`: weights, op fields, the path a shape takes and the
shape checks resolved) into a flat list of calls over fixed buffers, rebuilt only when the graph
or its buffers are. A decode step repeats one graph hundreds of times, so the lookups are done
once. The backend may then run a split's steps its own way (`Backend.compose`: the CPU backend
runs each run of them as one parallel region); profiling and tracing walk the same bound steps
node by node (`Tape.run_observed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from minfer.backends.base import Backend, ExecContext
from minfer.errors import GraphError
from minfer.graph import ir
from minfer.graph.ir import ComputeGraph

# Nodes that read or write the KV regions, and the cache formats a backend handles there unless
# it lists its own in `kv_types` (the CPU backend reads every format; others f32/f16 only).
KV_OPS = (ir.KvcacheStore, ir.KvcacheLoad, ir.Attn)
PLAIN_KV_TYPES = ("f32", "f16")


def _reads_kv(backend: Backend, kv_types: tuple[str, str]) -> bool:
    return set(kv_types) <= set(getattr(backend, "kv_types", PLAIN_KV_TYPES))


def assign_backends(graph: ComputeGraph, backends: Sequence[Backend],
                    kv_types: tuple[str, str] = ("f16", "f16")) -> None:
    """Each node to the first backend that takes it; KV nodes only to a backend that handles
    the caches' formats (`kv_types`: K, V), so a quantized cache keeps them on the CPU."""
    for node in graph.nodes:
        if isinstance(node.op, ir.Input):
            node.backend = "cpu"
            continue
        for backend in backends:
            if isinstance(node.op, KV_OPS) and not _reads_kv(backend, kv_types):
                continue
            if backend.supports_op(node, graph):
                node.backend = backend.name
                break
        else:
            raise GraphError(f"no backend runs node {node.id} ({node.name}, {node.op.kind})")


def make_splits(graph: ComputeGraph, live: Sequence[bool]) -> list[tuple[str, list[int]]]:
    splits: list[tuple[str, list[int]]] = []
    for node in graph.nodes:
        if not live[node.id] or isinstance(node.op, ir.Input):
            continue
        assert node.backend is not None
        if splits and splits[-1][0] == node.backend:
            splits[-1][1].append(node.id)
        else:
            splits.append((node.backend, [node.id]))
    return splits


def count_crossings(graph: ComputeGraph, live: Sequence[bool]) -> int:
    """Edges whose producer and consumer run on different backends (the copies per forward)."""
    crossings = 0
    for node in graph.nodes:
        if live[node.id]:
            crossings += sum(graph.nodes[s].backend != node.backend for s in node.srcs)
    return crossings


@dataclass
class Tape:
    """A prepared graph bound to its buffers: each live node's calls, in build order."""

    steps: list[Callable[[], None]]
    ctx: ExecContext  # held by the bound calls; its per-forward memo is cleared on each run
    spans: list[tuple[int, int, int]]  # (node id, first step, end step) per live node
    program: list[Callable[[], None]]  # the steps as `run` calls them (`Backend.compose`)

    def run(self) -> None:
        self.ctx.memo.clear()
        for call in self.program:
            call()

    def run_observed(self, observe: Callable[[int, float], None]) -> None:
        """`run`, calling observe(node id, seconds) after each node's steps (the profiler and
        the tracer: a node's output is read there, before a later node can reuse its buffer)."""
        self.ctx.memo.clear()
        steps = self.steps
        for node_id, first, end in self.spans:
            t0 = time.perf_counter()
            for step in steps[first:end]:
                step()
            observe(node_id, time.perf_counter() - t0)


def build_tape(
    graph: ComputeGraph,
    splits: Sequence[tuple[str, list[int]]],
    buffers: Sequence[np.ndarray | None],
    backends: Mapping[str, Backend],
    ctx: ExecContext,
    node_ids: Sequence[int] | None = None,
) -> Tape:
    """The op tape for this graph and buffers (of `node_ids` only, in build order, when given:
    the warm-up binds single nodes). A `Written` node's span (empty) follows its writer's, so
    the observed walk reads its buffer once filled."""
    wanted = None if node_ids is None else set(node_ids)
    steps: list[Callable[[], None]] = []
    spans: list[tuple[int, int, int]] = []
    written: list[int] = []  # `Written` nodes whose writer is still to come
    program: list[Callable[[], None]] = []
    for backend_name, ids in splits:
        backend = backends[backend_name]
        split_first = len(steps)
        for node_id in ids:
            if wanted is not None and node_id not in wanted:
                continue
            node = graph.nodes[node_id]
            first = len(steps)
            steps.extend(backend.bind_node(node, [buffers[s] for s in node.srcs],
                                           buffers[node_id], ctx))
            if isinstance(node.op, ir.Written):  # observed once its writer has run
                written.append(node_id)
                continue
            spans.append((node_id, first, len(steps)))
            for w in [w for w in written if w in node.srcs]:
                written.remove(w)
                spans.append((w, len(steps), len(steps)))
        split_steps = steps[split_first:]
        program.extend(backend.compose(split_steps) if ctx.composed else split_steps)
    ctx.memo.clear()  # what binding kept there is held by the calls now
    return Tape(steps, ctx, spans, program)
