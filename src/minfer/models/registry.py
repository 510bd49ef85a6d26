"""Which architectures minfer runs, and the graph builder for each.

An architecture not listed here is refused by name; nothing falls back to a look-alike.
DeepSeek-R1-Distill-Qwen files declare `qwen2` and load as such; Mistral 7B, TinyLlama and
SmolLM files declare `llama` (SmolLM3 its own `smollm3`); Phi-4-mini files declare `phi3`;
gpt-oss files `gpt-oss`. Qwen3.5's MoE (`qwen35moe`) is Qwen3.5's builder: the FFNs are
experts where the HParams say so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from minfer.errors import ModelError
from minfer.gguf.hparams import HParams
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.bert import build_bert
from minfer.models.gemma3 import build_gemma3
from minfer.models.gemma4 import build_gemma4
from minfer.models.gptoss import build_gptoss
from minfer.models.lfm2 import build_lfm2
from minfer.models.llama import build_llama
from minfer.models.phi3 import build_phi3
from minfer.models.qwen import build_qwen
from minfer.models.qwen35 import build_qwen35
from minfer.models.smollm3 import build_smollm3

GraphBuildFn = Callable[[HParams, GraphParams, Mapping[str, tuple[int, ...]]], ComputeGraph]

ARCHITECTURES: dict[str, GraphBuildFn] = {
    "bert": build_bert,
    "gemma3": build_gemma3,
    "gemma4": build_gemma4,
    "gpt-oss": build_gptoss,
    "lfm2": build_lfm2,
    "llama": build_llama,
    "phi3": build_phi3,
    "qwen2": build_qwen,
    "qwen2moe": build_qwen,
    "qwen3": build_qwen,
    "qwen35": build_qwen35,
    "qwen35moe": build_qwen35,
    "qwen3moe": build_qwen,
    "qwen3vl": build_qwen,
    "qwen3vlmoe": build_qwen,
    "smollm3": build_smollm3,
}


def graph_builder_for(arch: str) -> GraphBuildFn:
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelError(
            f"architecture {arch!r} is not supported (minfer runs: {supported})"
        ) from None
