"""The Qwen forward pass (Qwen2, Qwen2.5, Qwen3, DeepSeek-R1-Distill-Qwen) as builder calls.

Qwen2 has q/k/v biases; Qwen3 has none but normalizes Q and K per head before RoPE and takes its
head size from `attention.key_length`. Both use NEOX RoPE, grouped-query attention and a SwiGLU
FFN, and tie the output projection to the embedding when `output.weight` is absent.

Every node is named by role and layer. Prefill graphs keep only the last `n_out` rows after the
last layer's attention output projection (the tail rows); decode graphs have no tail nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph import ir
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph, InputKind
from minfer.graph.params import GraphParams, GraphType


def build_qwen(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    b = GraphBuilder(weight_shapes)
    nt, ctx = params.n_tokens, params.ctx
    prefill = params.gtype is GraphType.PREFILL
    # Inputs first (even tail_ids, read only at the last layer): one leaf block, one split.
    ids = b.input(InputKind.TOKEN_IDS, nt)
    pos = b.input(InputKind.POSITIONS, nt)
    cells = b.input(InputKind.KV_CELLS, nt)
    start = b.input(InputKind.KV_START, nt)
    end = b.input(InputKind.KV_END, nt)
    tail = b.input(InputKind.TAIL_IDS, params.n_out) if prefill else -1

    rope = ir.Rope("neox", hp.rope_base, hp.n_head, hp.head_dim, hp.rope_dim)
    rope_k = ir.Rope("neox", hp.rope_base, hp.n_head_kv, hp.head_dim, hp.rope_dim)
    attn = ir.Attn(0, hp.n_head, hp.n_head_kv, hp.head_dim, 1.0 / math.sqrt(hp.head_dim))
    n_kv_embd = hp.n_head_kv * hp.head_dim

    h = b.embedding("token_embd.weight", ids)  # [nt, n_embd]
    for il in range(hp.n_layer):
        blk = f"blk.{il}."
        x = b.rms_norm("attn_norm", h, blk + "attn_norm.weight", hp.rms_eps, layer=il)
        q = b.matmul("attn_q", x, blk + "attn_q.weight", bias=_bias(hp, blk + "attn_q"), layer=il)
        k = b.matmul("attn_k", x, blk + "attn_k.weight", bias=_bias(hp, blk + "attn_k"), layer=il)
        v = b.matmul("attn_v", x, blk + "attn_v.weight", bias=_bias(hp, blk + "attn_v"), layer=il)
        if hp.has_qk_norm:
            q = b.qk_norm("attn_q_norm", q, blk + "attn_q_norm.weight",
                          ir.QkNorm(hp.rms_eps, hp.n_head, hp.head_dim), layer=il)
            k = b.qk_norm("attn_k_norm", k, blk + "attn_k_norm.weight",
                          ir.QkNorm(hp.rms_eps, hp.n_head_kv, hp.head_dim), layer=il)
        q = b.rope("rope_q", q, pos, rope, layer=il)
        k = b.rope("rope_k", k, pos, rope_k, layer=il)
        store = b.kv_store(il, k, v, cells)
        kv = b.kv_load(il, store, n_ctx=ctx.n_ctx, n_kv_embd=n_kv_embd)
        a = b.attn(q, kv, start, end, ir.Attn(il, attn.n_head, attn.n_head_kv, attn.head_dim,
                                              attn.scale))
        o = b.matmul("attn_output", a, blk + "attn_output.weight", layer=il)  # [nt, n_embd]
        if prefill and il == hp.n_layer - 1:
            o = b.get_rows("tail_attn_out", o, tail, layer=il)  # [n_out, n_embd]
            h = b.get_rows("tail_resid", h, tail, layer=il)
        h = b.add("attn_resid", h, o, layer=il)
        x = b.rms_norm("ffn_norm", h, blk + "ffn_norm.weight", hp.rms_eps, layer=il)
        f = _ffn(b, x, blk, il, params)
        d = b.matmul("ffn_down", f, blk + "ffn_down.weight", layer=il)
        h = b.add("ffn_resid", h, d, layer=il)

    x = b.rms_norm("output_norm", h, "output_norm.weight", hp.rms_eps)
    out_weight = "token_embd.weight" if hp.tie_embeddings else "output.weight"
    logits = b.matmul("output", x, out_weight)  # [n_out, n_vocab]
    b.output(logits)
    return b.graph


def _bias(hp: HParams, prefix: str) -> str | None:
    return prefix + ".bias" if hp.has_qkv_bias else None


def _ffn(b: GraphBuilder, x: int, blk: str, il: int, params: GraphParams) -> int:
    gate_w, up_w = blk + "ffn_gate.weight", blk + "ffn_up.weight"
    if params.ctx.fuse_gate_up and params.gtype is GraphType.DECODE:
        return b.fused_gate_up("ffn_gate_up", x, gate_w, up_w, layer=il)
    gate = b.matmul("ffn_gate", x, gate_w, layer=il)
    up = b.matmul("ffn_up", x, up_w, layer=il)
    # Written unfused; the fusion pass rewrites Mul(Silu(gate), up) into SwiGLU when enabled.
    return b.mul("ffn_act", b.silu("ffn_silu", gate, layer=il), up, layer=il)
