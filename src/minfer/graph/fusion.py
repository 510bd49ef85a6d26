"""The fusion pass: rewrites a built graph into fewer, larger nodes.

Fusions here rewrite in place and leave the replaced producers orphaned (still in the node list,
unreachable from the outputs), so the graph stays a faithful record and the allocator simply
gives orphans no buffer. Every fusion is toggled by ContextParams, so the unfused twin remains
buildable and tested against the fused one.
"""

from __future__ import annotations

from minfer.graph import ir
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams


def fuse(graph: ComputeGraph, params: GraphParams) -> ComputeGraph:
    if params.ctx.fuse_swiglu:
        fuse_swiglu(graph)
    return graph


def fuse_swiglu(graph: ComputeGraph) -> int:
    """Mul(Silu(gate), up) -> SwiGLU(gate, up) where the Silu has no other reader."""
    users = graph.consumers()
    fused = 0
    for node in graph.nodes:
        if not isinstance(node.op, ir.Mul):
            continue
        silu = graph.nodes[node.srcs[0]]
        if not isinstance(silu.op, ir.Silu) or users[silu.id] != [node.id]:
            continue
        node.op = ir.SwiGLU()
        node.name = "ffn_swiglu" if node.name == "ffn_act" else node.name + "_swiglu"
        node.srcs = (silu.srcs[0], node.srcs[1])
        fused += 1
    return fused


def live_nodes(graph: ComputeGraph) -> list[bool]:
    """Nodes reachable backwards from the outputs; the rest were orphaned by fusion."""
    live = [False] * len(graph.nodes)
    for out in graph.outputs:
        live[out] = True
    for node in reversed(graph.nodes):
        if live[node.id]:
            for src in node.srcs:
                live[src] = True
    return live
