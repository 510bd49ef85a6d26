"""SmolLM3's forward pass (`smollm3`: SmolLM3-3B) as builder calls.

Llama's pre-norm block (`models.transformer.prenorm_layer`: normal-mode RoPE, grouped-query
attention, optional q/k/v biases, SwiGLU, tied or untied output) with one difference, read
from the HParams (`no_rope_step`): every 4th layer attends without RoPE (NoPE), as llama.cpp's
`llama_model_smollm3` builds it (`(il + 1) % 4 != 0` rotates; the step is fixed there, not
read from the file).
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.transformer import build_decoder, prenorm_layer


def build_smollm3(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=prenorm_layer)
