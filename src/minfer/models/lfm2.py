"""LFM2's forward pass (`lfm2`: LFM2 / LFM2.5, 350M-2.6B) as builder calls.

The pre-norm block of `models.transformer.prenorm_layer` in every layer: in the recurrent ones
(those with no K/V heads in the file's `attention.head_count_kv`) a gated short convolution
(`transformer.short_conv`: in_proj to B | C | x, the causal depthwise convolution over the
sequence's carried state, out_proj) takes attention's place; the attention layers have per-head
q / k RMS norms and NEOX RoPE; every FFN is SwiGLU; the final norm is stored as
`token_embd_norm`, the output tied to the embedding unless the file has `output.weight`. All
of it is read from the HParams, as llama.cpp's `llama_model_lfm2` builds it.
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.transformer import build_decoder, prenorm_layer


def build_lfm2(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=prenorm_layer)
