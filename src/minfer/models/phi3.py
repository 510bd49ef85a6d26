"""Phi-3 and Phi-4-mini's forward pass (`phi3`) as builder calls.

The pre-norm block of `models.transformer` with Phi-3's layout, all read from the HParams as
llama.cpp's `llama_model_phi3` reads the file: one fused q|k|v projection (`attn_qkv`, sliced
into q, k and v), one `ffn_up` holding the gate and up halves (SwiGLU over them), partial NEOX
rotary (`rope.dimension_count` below the head size: the rest of each head passes through),
LongRoPE where the file has `rope_factors_long` / `rope_factors_short` (the long factors when
the context is longer than the original one, with `rope.scaling.attn_factor` scaling cos and
sin), and a tied or untied output. The file's sliding window is not used: llama.cpp 0.3.36
turns Phi-3's off.
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.transformer import build_decoder, prenorm_layer


def build_phi3(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=prenorm_layer)
