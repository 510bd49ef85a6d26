"""The Gemma 3 forward pass (text decoder) as builder calls, after llama.cpp's
`src/models/gemma3.cpp`.

- The token embedding is scaled by sqrt(n_embd) (`inp_scaled`).
- Sandwich norms: RMSNorm before and after both attention and FFN (`attn_norm`,
  `post_attention_norm`, `ffn_norm`, `post_ffw_norm`). Gemma's norms are x * (1 + w) in the
  original checkpoints; llama.cpp's converter stores 1 + w, so the GGUF weight is used as-is.
- Per-head RMSNorm of Q and K before RoPE (NEOX), grouped-query attention.
- Interleaved sliding-window attention: layers flagged in `HParams.swa_layers` (5 of every 6 by
  default) read only the last `sliding_window` cells and rotate with their own rope base
  (`rope.freq_base_swa`, 10000 by default); the others attend globally with `rope.freq_base`.
  The window is a field of the layer's Attn op; the window bounds themselves stay data.
- Attention scale from `HParams.kq_scale` (1/sqrt(head_dim), or llama.cpp's 27B rule).
- A GELU(tanh)-gated FFN (GeGLU), a tied output projection, and the optional soft-capping of
  attention scores and final logits when the metadata asks for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.transformer import (
    Layer,
    LayerFn,
    attention,
    build_decoder,
    gated_ffn,
    keep_tail,
)


def build_gemma3(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=gemma3_layer,
                         embd_scale=math.sqrt(hp.n_embd))


def geglu_ffn(b: GraphBuilder, ctx: Layer, il: int, h: int) -> int:
    """The FFN of the residual h before its post-norm: GeGLU of ffn_norm(h)."""
    x = b.rms_norm("ffn_norm", h, f"blk.{il}.ffn_norm.weight", ctx.hp.rms_eps, layer=il)
    return gated_ffn(b, ctx, il, x, act="gelu")


def gemma3_layer(b: GraphBuilder, ctx: Layer, il: int, h: int, ffn: LayerFn = geglu_ffn) -> int:
    """The sandwich-normed block; `ffn` the FFN before its post-norm (Gemma 4's may add
    experts to it)."""
    hp, blk = ctx.hp, f"blk.{il}."
    x = b.rms_norm("attn_norm", h, blk + "attn_norm.weight", hp.rms_eps, layer=il)
    o = attention(b, ctx, il, x)  # [nt, n_embd]
    o, h = keep_tail(b, ctx, il, o, h)
    o = b.rms_norm("attn_post_norm", o, blk + "post_attention_norm.weight", hp.rms_eps, layer=il)
    h = b.add("attn_resid", h, o, layer=il)
    d = ffn(b, ctx, il, h)
    d = b.rms_norm("ffn_post_norm", d, blk + "post_ffw_norm.weight", hp.rms_eps, layer=il)
    return b.add("ffn_resid", h, d, layer=il)
