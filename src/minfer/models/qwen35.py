"""Qwen3.5's forward pass (`qwen35` dense, `qwen35moe`) as builder calls.

The pre-norm block of `models.transformer.prenorm_layer`, its FFN pre-norm stored as
`post_attention_norm`, in every layer: three of every four (the file's `recurrent_layers`)
mix with a Gated DeltaNet (`gated_delta_net`), the others with gated full attention (the q
projection doubled per head into query | gate, q / k RMS norms, NEOX RoPE over the rotated
quarter, the output times sigmoid(gate): `transformer.attention` where `HParams.attn_gated`);
every FFN is SwiGLU, or in `qwen35moe` a mixture of experts (`transformer.moe_ffn`: soft-maxed
router, top k renormalised, the shared expert behind its sigmoid gate). The MTP (NextN) blocks
after the trunk are not run. All of it read from the HParams, as llama.cpp's
`llama_model_qwen35` / `llama_model_qwen35moe` build it.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from minfer.gguf.hparams import HParams
from minfer.graph import ir
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.transformer import Layer, build_decoder, prenorm_layer


def gated_delta_net(b: GraphBuilder, ctx: Layer, il: int, x: int) -> int:
    """Layer il's Gated DeltaNet on the normed input x: q | k | v, the z gate and the per-head
    alpha / beta projected; the causal convolution over the sequence's carried inputs then SiLU
    (`ir.SsmConv`); the gated delta rule over its state matrices (`ir.DeltaNet`); the gated
    RMSNorm (each value head normed by `ssm_norm`, times silu(z)); the output projection."""
    hp, blk = ctx.hp, f"blk.{il}."
    qkv = b.matmul("ssm_qkv", x, blk + "attn_qkv.weight", layer=il)
    z = b.matmul("ssm_z", x, blk + "attn_gate.weight", layer=il)
    alpha = b.matmul("ssm_alpha", x, blk + "ssm_alpha.weight", layer=il)
    beta = b.matmul("ssm_beta", x, blk + "ssm_beta.weight", layer=il)
    conv = b.ssm_conv(qkv, ctx.pos, ctx.seq, blk + "ssm_conv1d.weight",
                      ir.SsmConv(il, hp.conv_channels, hp.shortconv_l_cache))
    y = b.delta_net(conv, alpha, beta, ctx.pos, ctx.seq, (blk + "ssm_dt.bias", blk + "ssm_a"),
                    ir.DeltaNet(il, hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_dim,
                                hp.rms_eps))
    y = b.qk_norm("ssm_norm", y, blk + "ssm_norm.weight",
                  ir.QkNorm(hp.rms_eps, hp.ssm_v_heads, hp.ssm_head_dim), layer=il)
    y = b.swiglu("ssm_norm_gated", z, y, layer=il)
    return b.matmul("ssm_out", y, blk + "ssm_out.weight", layer=il)


def build_qwen35(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes,
                         layer=partial(prenorm_layer, recurrent=gated_delta_net))
