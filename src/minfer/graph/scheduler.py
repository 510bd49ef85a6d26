"""Backend assignment, splits, and execution in build order.

Assignment gives each node the first backend (in the session's preference order) whose
`supports_op` accepts it; input leaves always live on the host CPU backend. Consecutive nodes
on one backend form a split. Execution walks the splits in order and runs every live node;
nodes orphaned by fusion (no buffer, not a KV op) are skipped.

Two ways to run a prepared graph: `execute` interprets it node by node (each node's handler
looks up its weights, op fields and path on every call; the profiler and tracing hook in here),
and the op tape (`build_tape`, `Tape.run`) is the same node list bound once, for graphs whose
backends can bind their nodes (`bind_node`): a flat list of calls over fixed buffers, rebuilt
only when the graph or its buffers are. A decode step repeats one graph hundreds of times, so
the interpreter's per-node lookups are worth doing once.
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


def execute(
    graph: ComputeGraph,
    splits: Sequence[tuple[str, list[int]]],
    buffers: Sequence[np.ndarray | None],
    backends: Mapping[str, Backend],
    ctx: ExecContext,
    profile: dict[str, float] | None = None,
) -> None:
    nodes = graph.nodes
    for backend_name, node_ids in splits:
        backend = backends[backend_name]
        for node_id in node_ids:
            node = nodes[node_id]
            srcs = [buffers[s] for s in node.srcs]
            if profile is None:
                backend.execute_node(node, srcs, buffers[node_id], ctx)
                continue
            t0 = time.perf_counter()
            backend.execute_node(node, srcs, buffers[node_id], ctx)
            key = f"{node.op.kind}:{node.meta.role}"
            profile[key] = profile.get(key, 0.0) + time.perf_counter() - t0


def execute_observed(
    graph: ComputeGraph,
    splits: Sequence[tuple[str, list[int]]],
    buffers: Sequence[np.ndarray | None],
    backends: Mapping[str, Backend],
    ctx: ExecContext,
    observe: Callable[[int, np.ndarray | None, float], None],
) -> None:
    """`execute`, calling observe(node id, its output buffer, seconds) after every node (the
    traced path; its output is read before any later node can reuse the buffer)."""
    nodes = graph.nodes
    for backend_name, node_ids in splits:
        backend = backends[backend_name]
        for node_id in node_ids:
            node = nodes[node_id]
            t0 = time.perf_counter()
            backend.execute_node(node, [buffers[s] for s in node.srcs], buffers[node_id], ctx)
            observe(node_id, buffers[node_id], time.perf_counter() - t0)


@dataclass
class Tape:
    """A prepared graph bound to its buffers: one call per live node, in build order."""

    steps: list[Callable[[], None]]
    ctx: ExecContext  # held by the bound calls; its per-forward memo is cleared on each run

    def run(self) -> None:
        self.ctx.memo.clear()
        for step in self.steps:
            step()


def build_tape(
    graph: ComputeGraph,
    splits: Sequence[tuple[str, list[int]]],
    buffers: Sequence[np.ndarray | None],
    backends: Mapping[str, Backend],
    ctx: ExecContext,
) -> Tape | None:
    """The op tape for this graph and buffers; None when a backend it uses cannot bind nodes
    (the graph is then interpreted by `execute`)."""
    steps: list[Callable[[], None]] = []
    for backend_name, node_ids in splits:
        bind = getattr(backends[backend_name], "bind_node", None)
        if bind is None:
            return None
        for node_id in node_ids:
            node = graph.nodes[node_id]
            steps.extend(bind(node, [buffers[s] for s in node.srcs], buffers[node_id], ctx))
    ctx.memo.clear()  # what binding kept there is held by the calls now
    return Tape(steps, ctx)
