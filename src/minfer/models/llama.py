"""The Llama family's forward pass (Llama 2 / 3 / 3.1 / 3.2, Mistral 7B, TinyLlama, SmolLM and
the other files that declare `llama`) as builder calls.

The pre-norm block of `models.transformer` with the Llama specifics, all read from the HParams:
RoPE in llama.cpp's normal mode (adjacent pairs rotate, not NEOX halves), no biases,
grouped-query attention, a SwiGLU FFN, the optional `rope_freqs` tensor of per-pair frequency
divisors (Llama 3.1 / 3.2's long-context scaling, as ggml_rope_ext's freq_factors), and an
output projection that is tied to the embedding when `output.weight` is absent.
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.transformer import build_decoder, prenorm_layer


def build_llama(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=prenorm_layer)
