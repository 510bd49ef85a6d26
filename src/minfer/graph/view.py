"""A prepared graph as the viz page draws it: every node with its payload, place and buffer.

`describe` extends the JSON dump of `minfer.graph.export` with what only a prepared graph
knows: the backend each node runs on, the buffer slot it writes and the other nodes that reuse
that slot, which nodes the fusion pass wrote (and which it orphaned), which nodes run on the
tail rows of a prefill, and the GGUF type of every weight a node reads. Node and edge lists are
the graph's own, one for one (orphans included), so counts can be checked against the graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minfer.graph import ir
from minfer.graph.cache import PreparedGraph
from minfer.graph.export import _plain
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphType

FUSED_OPS = (ir.SwiGLU, ir.FusedGateUp, ir.AddRmsNorm)
TAIL_SELECT = ("tail_attn_out", "tail_resid")


def tail_nodes(graph: ComputeGraph, gtype: GraphType) -> list[bool]:
    """Nodes computed on the kept tail rows only: the tail selections and everything after."""
    tail = [False] * len(graph.nodes)
    if gtype is not GraphType.PREFILL:
        return tail
    for node in graph.nodes:
        tail[node.id] = node.name in TAIL_SELECT or any(tail[s] for s in node.srcs)
    return tail


def group_of(node: ir.Node) -> str:
    """The box a node collapses into: its layer ("L3"), or "" for nodes outside the layers."""
    return f"L{node.meta.layer}" if node.meta.layer >= 0 else ""


def describe(prepared: PreparedGraph, tensor_types: Mapping[str, str]) -> dict[str, Any]:
    """{"kind", "uid", "n_tokens", "n_out", "nodes": [...], "edges": [[src, dst], ...]}."""
    graph, plan = prepared.graph, prepared.plan
    params = prepared.params
    tail = tail_nodes(graph, params.gtype)
    sharers: dict[int, list[int]] = {}
    for node_id, slot in enumerate(plan.slot_of):
        if slot >= 0:
            sharers.setdefault(slot, []).append(node_id)
    inputs = set(graph.inputs.values())
    nodes = []
    for n in graph.nodes:
        slot = plan.slot_of[n.id]
        buffer = None
        if slot >= 0:
            buffer = {"slot": slot, "elements": plan.slot_sizes[slot],
                      "shared_with": [i for i in sharers[slot] if i != n.id]}
        nodes.append({
            "id": n.id, "name": n.name, "op": n.op.kind, "role": n.meta.role or n.name,
            "layer": n.meta.layer, "group": group_of(n), "backend": n.backend,
            "shape": list(n.shape), "dtype": n.dtype.value, "payload": _plain(n.op),
            "srcs": list(n.srcs),
            "weights": [{"name": w, "type": tensor_types.get(w, "?")} for w in n.meta.weights],
            "buffer": buffer, "fused": isinstance(n.op, FUSED_OPS),
            "orphaned": not plan.live[n.id], "tail": tail[n.id], "input": n.id in inputs,
            "output": n.id in graph.outputs,
        })
    return {
        "kind": params.gtype.value, "uid": graph.uid, "n_tokens": params.n_tokens,
        "n_out": params.n_out, "backends": list(params.ctx.backends), "nodes": nodes,
        "edges": [[s, n.id] for n in graph.nodes for s in n.srcs],
    }
