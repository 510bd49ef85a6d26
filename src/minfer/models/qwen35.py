"""Qwen3.5's forward pass (`qwen35` dense, `qwen35moe`) as builder calls.

The pre-norm block of `models.transformer.prenorm_layer`, its FFN pre-norm stored as
`post_attention_norm`, in every layer: three of every four (the file's `recurrent_layers`)
mix with a Gated DeltaNet (`gated_delta_net`), the others with gated full attention (the q
projection doubled per head into query | gate, q / k RMS norms, NEOX RoPE over the rotated
quarter, the output times sigmoid(gate): `transformer.attention` where `HParams.attn_gated`);
every FFN is SwiGLU, or in `qwen35moe` a mixture of experts (`transformer.moe_ffn`: soft-maxed
router, top k renormalised, the shared expert behind its sigmoid gate). All of it read from the
HParams, as llama.cpp's `llama_model_qwen35` / `llama_model_qwen35moe` build it.

The MTP (NextN) block after the trunk is not run by the model's graph; over the head's view of
the file (`HParams.mtp_head`) `build_mtp_head` builds it as llama.cpp's `graph_mtp` does: the
token's embedding and the target's hidden state of the row before (input HIDDEN), each
RMS-normed (`nextn.enorm`, `nextn.hnorm`), side by side (embedding first) through `eh_proj`;
one pre-norm block with gated full attention over its own KV cells (the layer's number is the
block's, n_layer - 1 of the view); the shared head norm and LM head (the block's own
`nextn.shared_head_*` where the file has them, else the model's). Its outputs are the logits
and the normed rows they come from: the hidden state the head's next step takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from minfer.gguf.hparams import HParams
from minfer.graph import ir
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph, InputKind
from minfer.graph.params import GraphParams, GraphType
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
    if hp.first_layer:
        return build_mtp_head(hp, params, weight_shapes)
    return build_decoder(hp, params, weight_shapes,
                         layer=partial(prenorm_layer, recurrent=gated_delta_net))


def build_mtp_head(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    """The MTP head's graph over `HParams.mtp_head()`'s view (see the module docstring)."""
    b = GraphBuilder(weight_shapes)
    nt, il = params.n_tokens, hp.first_layer
    nextn = f"blk.{il}.nextn."

    def own(name: str, shared: str) -> str:
        return nextn + name if nextn + name in weight_shapes else shared

    ids = b.input(InputKind.TOKEN_IDS, nt)
    ctx = Layer(hp, params, pos=b.input(InputKind.POSITIONS, nt),
                cells=b.input(InputKind.KV_CELLS, nt), start=b.input(InputKind.KV_START, nt),
                end=b.input(InputKind.KV_END, nt),
                tail=b.input(InputKind.TAIL_IDS, params.n_out)
                if params.gtype is GraphType.PREFILL else -1)
    hidden = b.input_rows(InputKind.HIDDEN, nt, hp.n_embd)
    e = b.weight_rows("mtp_embd", own("embed_tokens.weight", "token_embd.weight"), ids)
    e = b.rms_norm("mtp_enorm", e, nextn + "enorm.weight", hp.rms_eps, layer=il)
    h = b.rms_norm("mtp_hnorm", hidden, nextn + "hnorm.weight", hp.rms_eps, layer=il)
    h = b.matmul("mtp_eh_proj", b.concat("mtp_concat", e, h, layer=il),
                 nextn + "eh_proj.weight", layer=il)
    h = prenorm_layer(b, ctx, il, h)
    x = b.rms_norm("mtp_head_norm", h, own("shared_head_norm.weight", hp.output_norm_name),
                   hp.rms_eps)
    head = own("shared_head_head.weight",
               "token_embd.weight" if hp.tie_embeddings else "output.weight")
    b.output(b.matmul("output", x, head, rows=params.ctx.vocab_limit))
    b.output(x)
    return b.graph
