"""How many rows a node works on: what the torch backend's claim is judged by, without torch."""

from __future__ import annotations

from minfer.graph import ir
from minfer.graph.ir import ComputeGraph, Node


def node_rows(node: Node, graph: ComputeGraph) -> int:
    """Rows the node works on; KV store and load take them from the K they store."""
    if isinstance(node.op, ir.KvcacheStore):
        return graph.nodes[node.srcs[0]].shape[0]
    if isinstance(node.op, ir.KvcacheLoad):
        return node_rows(graph.nodes[node.srcs[0]], graph)
    return node.shape[0] if node.shape else 0
