"""gpt-oss's forward pass (`gpt-oss`: gpt-oss-20b / 120b) as builder calls, after llama.cpp's
`src/models/openai-moe.cpp`.

The shared pre-norm block (`models.transformer.prenorm_layer`), every difference read from the
HParams (`gguf.hparams._gptoss`):
- attention with q/k/v and output biases, NEOX RoPE with YaRN on every layer, and a learned
  sink logit per head in each softmax (`attn_sinks`, `ir.Attn.sinks`); the even layers attend
  through a sliding window (128 cells in the released models), the odd ones globally;
- the pre-FFN norm is the file's `post_attention_norm`;
- a mixture of experts (32 of which 4 used in the 20B model): router logits with a bias, the
  top-k logits soft-maxed among themselves, experts with gate / up / down biases and the
  clamped SwiGLU (`ir.Moe`'s "softmax_weight" gating and "swiglu_oai" activation); the
  experts' weights in whatever type the file holds (MXFP4 in the released files).
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.gguf.hparams import HParams
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.transformer import build_decoder, prenorm_layer


def build_gptoss(
    hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]]
) -> ComputeGraph:
    return build_decoder(hp, params, weight_shapes, layer=prenorm_layer)
