"""The Gemma 4 forward pass (text decoder: E2B / E4B / 31B) as builder calls, after llama.cpp's
`src/models/gemma4.cpp`: Gemma 3's block (`gemma3_layer`: sandwich norms, per-head q / k
norms, GeGLU, interleaved sliding-window and global layers with their own rope bases) with
the parts `HParams` reads for Gemma 4 and `models.transformer` builds:

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
through the same pieces. The 26B-A4B's mixture of experts (a dense FFN beside routed experts
with fused gate|up and per-expert output scales) is not built: its files fail the tensor check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.gemma3 import gemma3_layer
from minfer.models.transformer import Layer, build_decoder, per_layer_embd


def build_gemma4(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=gemma4_layer,
                         embd_scale=math.sqrt(hp.n_embd))


def gemma4_layer(b: GraphBuilder, ctx: Layer, il: int, h: int) -> int:
    h = gemma3_layer(b, ctx, il, h)
    if ctx.hp.n_embd_per_layer:
        h = per_layer_embd(b, ctx, il, h)
    if ctx.hp.layer_scales:
        h = b.scale("layer_out_scale", h, ctx.hp.layer_scales[il], layer=il)
    return h
