"""The Qwen forward pass (Qwen2, Qwen2.5, Qwen3, DeepSeek-R1-Distill-Qwen, and the mixtures of
experts Qwen2-MoE and Qwen3-MoE) as builder calls.

Qwen2 has q/k/v biases; Qwen3 has none but normalizes Q and K per head before RoPE and takes its
head size from `attention.key_length`. Both use NEOX RoPE, grouped-query attention and a SwiGLU
FFN (routed experts in the MoE files, Qwen2-MoE's with a gated shared expert), and tie the
output projection to the embedding when `output.weight` is absent: the shared pre-norm block
of `models.transformer`, every optional part read from the HParams.

Every node is named by role and layer. Prefill graphs keep only the last `n_out` rows after the
last layer's attention output projection (the tail rows); decode graphs have no tail nodes.
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.transformer import build_decoder, prenorm_layer


def build_qwen(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=prenorm_layer)
