"""Graph dumps: Graphviz DOT (nodes coloured by backend) and JSON (nodes, edges, payloads).

The JSON dump carries the GraphParams that produced the graph, so a dump is enough to explain
why two runs built different graphs.
"""

from __future__ import annotations

import dataclasses
import json
from enum import Enum
from typing import Any

from minfer.graph.fusion import live_nodes
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams

BACKEND_COLOURS = {"cpu": "#cfe2ff", "torch": "#ffe5b4", None: "#eeeeee"}


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    return value


def to_json(graph: ComputeGraph, params: GraphParams) -> dict[str, Any]:
    live = live_nodes(graph)
    nodes = [
        {
            "id": n.id,
            "name": n.name,
            "op": n.op.kind,
            "payload": _plain(n.op),
            "srcs": list(n.srcs),
            "shape": list(n.shape),
            "dtype": n.dtype.value,
            "backend": n.backend,
            "layer": n.meta.layer,
            "weights": list(n.meta.weights),
            "orphaned": not live[n.id],
        }
        for n in graph.nodes
    ]
    edges = [[s, n.id] for n in graph.nodes for s in n.srcs]
    return {
        "uid": graph.uid,
        "params": _plain(params),
        "inputs": {k.value: v for k, v in graph.inputs.items()},
        "outputs": list(graph.outputs),
        "nodes": nodes,
        "edges": edges,
    }


def to_dot(graph: ComputeGraph, params: GraphParams) -> str:
    live = live_nodes(graph)
    inputs = set(graph.inputs.values())
    lines = [
        "digraph minfer {",
        f'  label="{params.gtype.value} n_tokens={params.n_tokens} n_out={params.n_out}";',
        "  node [shape=box, style=filled, fontname=monospace, fontsize=9];",
    ]
    for n in graph.nodes:
        payload = ", ".join(f"{k}={v}" for k, v in _plain(n.op).items() if k != "input_kind")
        layer = f" L{n.meta.layer}" if n.meta.layer >= 0 else ""
        label = f"{n.id}: {n.name}{layer}\\n{n.op.kind}({payload})\\n{list(n.shape)}"
        colour = BACKEND_COLOURS.get(n.backend, "#eeeeee")
        extra = ""
        if n.id in inputs:
            extra = ", shape=invhouse, penwidth=2"
        elif n.id in graph.outputs:
            extra = ", shape=doubleoctagon, penwidth=2"
        elif not live[n.id]:
            extra = ", style=dashed"
        lines.append(f'  n{n.id} [label="{label}", fillcolor="{colour}"{extra}];')
    for n in graph.nodes:
        for s in n.srcs:
            lines.append(f"  n{s} -> n{n.id};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def dump_json(graph: ComputeGraph, params: GraphParams) -> str:
    return json.dumps(to_json(graph, params), indent=1)
