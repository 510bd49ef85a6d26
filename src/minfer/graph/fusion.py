"""The fusion pass: rewrites a built graph into fewer, larger nodes.

Fusions here rewrite in place and leave the replaced producers orphaned (still in the node list,
unreachable from the outputs), so the graph stays a faithful record and the allocator simply
gives orphans no buffer. Every fusion is toggled by ContextParams, so the unfused twin remains
buildable and tested against the fused one.
"""

from __future__ import annotations

import dataclasses

from minfer.graph import ir
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams


def fuse(graph: ComputeGraph, params: GraphParams) -> ComputeGraph:
    if params.ctx.fuse_swiglu:
        fuse_swiglu(graph)
    if params.ctx.fuse_add_norm and params.ctx.backends == ("cpu",):
        fuse_add_norm(graph)
    if params.ctx.fuse_norm_quant and params.ctx.backends == ("cpu",):
        fuse_norm_quant(graph)
    if params.ctx.fuse_bias and params.ctx.backends == ("cpu",):
        fuse_bias(graph)
    if params.ctx.fuse_rope_store and params.ctx.backends == ("cpu",):
        fuse_rope_store(graph)
    if params.ctx.fuse_gate_up and params.ctx.backends == ("cpu",):
        fuse_gate_up_quant(graph)
    if params.ctx.fuse_attn_quant and params.ctx.backends == ("cpu",):
        fuse_attn_quant(graph)
    return graph


# activation op -> (its gated fusion, the fused node's name suffix)
_GATED: dict[type[ir.Op], tuple[ir.Op, str]] = {
    ir.Silu: (ir.SwiGLU(), "swiglu"),
    ir.Gelu: (ir.GeGLU(), "geglu"),
}


def fuse_swiglu(graph: ComputeGraph) -> int:
    """Mul(Silu(gate), up) -> SwiGLU(gate, up), and Mul(Gelu(gate), up) -> GeGLU(gate, up),
    where the activation has no other reader."""
    users = graph.consumers()
    fused = 0
    for node in graph.nodes:
        if not isinstance(node.op, ir.Mul):
            continue
        act = graph.nodes[node.srcs[0]]
        gated = _GATED.get(type(act.op))
        if gated is None or users[act.id] != [node.id]:
            continue
        node.op, suffix = gated
        node.name = f"ffn_{suffix}" if node.name == "ffn_act" else f"{node.name}_{suffix}"
        node.srcs = (act.srcs[0], node.srcs[1])
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


def fuse_add_norm(graph: ComputeGraph) -> int:
    """RmsNorm(Add(a, b)) -> AddRmsNorm(a, b, total): the norm's node computes the sum too and
    writes it into the add's buffer, the add becoming a `Written` node (no work). Only where
    a and b have the sum's shape and every other reader of the sum comes after the norm (they
    read it once written). The CPU backend runs it as one step where the op tape had two (the
    residual stream's add and the next norm: two per layer). CPU-only graphs: no other
    backend runs it."""
    users = graph.consumers()
    fused = 0
    for node in graph.nodes:
        if not isinstance(node.op, ir.RmsNorm):
            continue
        add = graph.nodes[node.srcs[0]]
        if not isinstance(add.op, ir.Add) or any(
                graph.nodes[s].shape != add.shape for s in add.srcs) or any(
                u < node.id for u in users[add.id] if u != node.id):
            continue
        node.op = ir.AddRmsNorm(node.op.eps)
        node.srcs = (*add.srcs, add.id)
        add.op, add.srcs = ir.Written(), ()
        fused += 1
    return fused


_PROJECTIONS = (ir.MatMul, ir.FusedGateUp, ir.Moe)  # the nodes that quantize their input


def fuse_norm_quant(graph: ComputeGraph) -> int:
    """RmsNorm / AddRmsNorm whose first reader is a projection of its rows (MatMul, FusedGateUp)
    -> the same op with `quant_for` naming that projection's weight: the CPU backend then makes
    the activation's quantization (Q8_0 or Q8_K, as that weight's kernel reads it) in the norm's
    step instead of a step of its own before the projection, the same buffer the projections
    read (q / k / v, gate / up). Only where no other projection comes between them (the
    backend keeps one quantized activation per shape and form). The backend keeps the separate
    step wherever the projection would not read it (a float weight, the sgemm path). CPU-only
    graphs: no other backend runs it."""
    users = graph.consumers()
    fused = 0
    for node in graph.nodes:
        if not isinstance(node.op, ir.RmsNorm | ir.AddRmsNorm) or not users[node.id]:
            continue
        first = graph.nodes[min(users[node.id])]
        if not isinstance(first.op, ir.MatMul | ir.FusedGateUp) or first.srcs[0] != node.id \
                or any(isinstance(graph.nodes[i].op, _PROJECTIONS)
                       for i in range(node.id + 1, first.id)):
            continue
        node.op = dataclasses.replace(node.op, quant_for=first.meta.weights[0])
        fused += 1
    return fused


def fuse_bias(graph: ComputeGraph) -> int:
    """MatMul with a bias -> MatMul(fused_bias=True): the CPU backend adds the bias in the
    projection's kernel (each thread to the rows it computed, the same f32 add) where the
    unfused tape had an add step after it, which waited for every thread's rows (Qwen2's
    q / k / v biases: three serial steps a layer). The backend keeps the add step wherever the
    kernel has no bias epilogue (the sgemm path, float weights). CPU-only graphs."""
    fused = 0
    for node in graph.nodes:
        if isinstance(node.op, ir.MatMul) and len(node.meta.weights) > 1:
            node.op = dataclasses.replace(node.op, fused_bias=True)
            fused += 1
    return fused


def fuse_rope_store(graph: ComputeGraph) -> int:
    """KvcacheStore(Rope(k), v) after Rope(q) -> one KvcacheStore that ropes both: k roped
    straight into the KV region (the roped k's node orphaned, no buffer), q into rope_q's
    buffer, now a `Written` node. Only where the two ropes are the layer's last two nodes of
    that kind, read the same positions and factors, differ only in their head count, the roped
    k has no other reader and every reader of the roped q comes after the store. The CPU
    backend runs it as one step where the tape had three (each serial at decode). CPU-only
    graphs."""
    users = graph.consumers()
    fused = 0
    for store in graph.nodes:
        op = store.op
        if not isinstance(op, ir.KvcacheStore) or op.rope_k is not None:
            continue
        rk = graph.nodes[store.srcs[0]]
        if not isinstance(rk.op, ir.Rope) or users[rk.id] != [store.id] \
                or rk.op.head_dim != op.head_dim:
            continue
        rq = next((n for n in reversed(graph.nodes[:rk.id]) if isinstance(n.op, ir.Rope)), None)
        if rq is None or not isinstance(rq.op, ir.Rope) or rq.meta.layer != store.meta.layer \
                or rq.srcs[1:] != rk.srcs[1:] or rq.meta.weights != rk.meta.weights \
                or dataclasses.replace(rq.op, n_head=rk.op.n_head) != rk.op \
                or not all(u > store.id for u in users[rq.id]):
            continue
        store.op = dataclasses.replace(op, rope_q=rq.op, rope_k=rk.op)
        store.srcs = (rk.srcs[0], *store.srcs[1:3], rq.srcs[0], rq.srcs[1], rq.id)
        store.meta = dataclasses.replace(store.meta, weights=rk.meta.weights)
        rq.op, rq.srcs = ir.Written(), ()
        fused += 1
    return fused


def _only_projection(graph: ComputeGraph, users: list[list[int]], node: ir.Node) -> str:
    """The weight of the MatMul that is the node's only reader, projecting its rows; "" if
    there is none such."""
    if len(users[node.id]) != 1:
        return ""
    reader = graph.nodes[users[node.id][0]]
    if not isinstance(reader.op, ir.MatMul) or reader.srcs[0] != node.id:
        return ""
    return reader.meta.weights[0]


def fuse_gate_up_quant(graph: ComputeGraph) -> int:
    """FusedGateUp (the builder's, under `fuse_gate_up`) whose only reader is the down
    projection of its rows -> the same op with `quant_for` naming the down weight: the CPU
    backend then runs gate, up, SwiGLU and the down activation's quantization as one split
    step (`kernels.linear.gate_up`: each thread its blocks of the result) where the tape had
    the two projections, a serial SwiGLU and a serial quantize between barriers. The backend
    keeps the separate steps wherever the fused one cannot stand for them (a float or sgemm
    path, GeGLU, gate and up of different types). CPU-only graphs."""
    return _quant_for_projection(graph, ir.FusedGateUp)


def fuse_attn_quant(graph: ComputeGraph) -> int:
    """Attn whose only reader is the output projection of its rows -> the same op with
    `quant_for` naming that weight: the CPU backend's attention step then quantizes the heads
    each thread computed (`kernels.attn.attend`: where a KV head's group of query heads is
    whole quantization blocks), and the o-proj follows it with no serial quantize step between.
    Not where something else reads the attention's rows first (Qwen3.5's output gate).
    CPU-only graphs."""
    return _quant_for_projection(graph, ir.Attn)


def _quant_for_projection(graph: ComputeGraph, kind: type[ir.FusedGateUp | ir.Attn]) -> int:
    users = graph.consumers()
    fused = 0
    for node in graph.nodes:
        op = node.op
        weight = _only_projection(graph, users, node) if isinstance(op, kind) else ""
        if weight and isinstance(op, ir.FusedGateUp | ir.Attn):
            node.op = dataclasses.replace(op, quant_for=weight)
            fused += 1
    return fused
