"""The Gemma 4 forward pass (text decoder: E2B / E4B / 31B / 26B-A4B) as builder calls,
after llama.cpp's `src/models/gemma4.cpp`: Gemma 3's block (`gemma3_layer`: sandwich norms,
per-head q / k norms, GeGLU, interleaved sliding-window and global layers with their own rope
bases) with the parts `HParams` reads for Gemma 4 and `models.transformer` builds:

- attention scale 1 and V RMS-normed per head without a weight;
- the sliding and the global layers with their own head sizes and rotary dims; the global
  layers rotate a quarter of their head ("proportional" RoPE: `rope_freqs` holds 1e30 for
  the pairs left unrotated);
- the last `attention.shared_kv_layers` layers project only q and attend over the KV of the
  last earlier layer of their kind;
- per-layer token embeddings: every layer adds norm(proj(gelu(gate(h)) * its per-layer
  input)) after its FFN (`transformer.per_layer_embd`), then scales its output by its
  `layer_output_scale`;
- the final logit soft-cap (`HParams.final_softcap`, in `build_decoder`).

The 26B / 31B's global layers with fewer K/V heads and no `attn_v` (V is K's projection) run
through the same pieces; the 26B-A4B's FFN is `experts_beside_ffn`: the dense GeGLU and the
routed experts ([gate | up] stacked in one tensor, an output scale per expert), each behind
its own norms, summed before the post-FFN norm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph import ir
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.gemma3 import geglu_ffn, gemma3_layer
from minfer.models.transformer import Layer, build_decoder, per_layer_embd


def build_gemma4(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=gemma4_layer,
                         embd_scale=math.sqrt(hp.n_embd))


def gemma4_layer(b: GraphBuilder, ctx: Layer, il: int, h: int) -> int:
    h = gemma3_layer(b, ctx, il, h, ffn=experts_beside_ffn if ctx.hp.n_ff_exp else geglu_ffn)
    if ctx.hp.n_embd_per_layer:
        h = per_layer_embd(b, ctx, il, h)
    if ctx.hp.layer_scales:
        h = b.scale("layer_out_scale", h, ctx.hp.layer_scales[il], layer=il)
    return h


def experts_beside_ffn(b: GraphBuilder, ctx: Layer, il: int, h: int) -> int:
    """The 26B-A4B's FFN: the dense GeGLU and the routed experts side by side, each behind its
    own norms, summed. The router reads rms_norm(h) / sqrt(n_embd) times its per-channel scale;
    the top-k soft-max weights are renormalised and times each expert's output scale."""
    hp, blk = ctx.hp, f"blk.{il}."
    dense = b.rms_norm("ffn_post_norm_1", geglu_ffn(b, ctx, il, h),
                       blk + "post_ffw_norm_1.weight", hp.rms_eps, layer=il)
    r = b.rms_norm("ffn_router_norm", h, blk + "ffn_gate_inp.scale", hp.rms_eps, layer=il)
    r = b.scale("ffn_router_scaled", r, 1.0 / math.sqrt(hp.n_embd), layer=il)
    logits = b.matmul("ffn_moe_logits", r, blk + "ffn_gate_inp.weight", layer=il)
    x = b.rms_norm("ffn_pre_norm_2", h, blk + "pre_ffw_norm_2.weight", hp.rms_eps, layer=il)
    gate_up = blk + "ffn_gate_up_exps.weight"
    op = ir.Moe(il, hp.n_expert, hp.n_expert_used, hp.expert_norm, act="gelu",
                fused_gate_up=True, down_scale=True)
    y = b.moe("ffn_moe", x, logits, (gate_up, gate_up, blk + "ffn_down_exps.weight",
                                     blk + "ffn_down_exps.scale"), op)
    y = b.rms_norm("ffn_post_norm_2", y, blk + "post_ffw_norm_2.weight", hp.rms_eps, layer=il)
    return b.add("ffn_moe_combined", dense, y, layer=il)
