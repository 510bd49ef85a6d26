"""Synthetic GGUF models: random weights, real shapes and a working byte-level BPE tokenizer.

- `vocab`: the tokenizer (`build_tiny_vocab`, `TinyVocab`, `add_tokenizer`).
- `weights`: random matrices in any type minfer writes, `Tensors` (a writer's tensors, in one
  type per role or a llama-quantize file type's mix).
- `dense`: qwen2 / qwen3 / llama / gemma3 / qwen2moe / qwen3moe (`write_tiny_model`, the model
  every unit test runs; `write_model_like_qwen25_05b`, `write_moe_like_qwen3_a3b` for speed).
- `qwen35`: Qwen3.5's Gated DeltaNet hybrid (`write_qwen35`, `write_model_like_qwen35`).
- `gptoss`: gpt-oss (`write_gptoss`, `write_model_like_gptoss_20b`, MXFP4 experts).
- `bert`: the BERT encoder (`write_tiny_bert`); `edit`: `copy_gguf` (a file with one defect).
- `mmproj`: full-size and tiny vision towers as llama.cpp's converter writes them (SigLIP as
  Gemma 3's projector, Qwen3-VL's merger, Idefics3 / SmolVLM), with a one-layer text model of
  their width, and SmolVLM-500M's text model in full.
"""

from .bert import BERT_SPECIALS, build_tiny_wordpiece, write_tiny_bert
from .dense import (
    QWEN3_MOE_BENCH_TYPES,
    QWEN25_05B_TYPES,
    write_model_like_qwen25_05b,
    write_moe_like_qwen3_a3b,
    write_tiny_model,
)
from .edit import copy_gguf
from .gptoss import write_gptoss, write_model_like_gptoss_20b
from .qwen35 import QWEN35_SIZES, write_model_like_qwen35, write_qwen35
from .vocab import (
    CONTROL_TOKENS,
    DEFAULT_CHAT_TEMPLATE,
    USER_TOKENS,
    TinyVocab,
    build_tiny_vocab,
    bytes_to_unicode,
    train_merges,
)
from .weights import ROLES, WeightTypes

__all__ = ["BERT_SPECIALS", "CONTROL_TOKENS", "DEFAULT_CHAT_TEMPLATE", "QWEN3_MOE_BENCH_TYPES",
           "QWEN25_05B_TYPES", "QWEN35_SIZES", "ROLES", "USER_TOKENS", "TinyVocab", "WeightTypes",
           "build_tiny_vocab", "build_tiny_wordpiece", "bytes_to_unicode", "copy_gguf",
           "train_merges", "write_gptoss", "write_model_like_gptoss_20b",
           "write_model_like_qwen25_05b", "write_model_like_qwen35", "write_moe_like_qwen3_a3b",
           "write_qwen35", "write_tiny_bert", "write_tiny_model"]
