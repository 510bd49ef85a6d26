"""Synthetic gpt-oss (`gpt-oss`): attention with sinks and q / k / v / o biases, the sliding
window on every other layer, a biased router over experts with biases, in llama.cpp's layout.

`write_gptoss` writes any size (the unit tests' tiny one by default); `write_model_like_gptoss_20b`
gpt-oss-20b's per-layer shapes (config.json: 2880 wide, 64 query / 8 KV heads of 64, experts
2880 wide, 4 routed per token, window 128, vocab 201,088, rope base 150,000 with YaRN x32 over
4096) in llama-quantize's MXFP4_MOE mix (experts MXFP4, every other matrix Q8_0), scaled down to
16 of its 24 layers and 8 of its 32 experts: ~3.4 GB, and each layer reads per token exactly
the bytes a gpt-oss-20b layer reads (4 experts' 3 x 2880 x 2880 MXFP4 weights, the Q8_0
attention), 16 / 24 of its layers' worth in all (plus the Q8_0 output, the same).
Weights are normal with std gain / sqrt(fan-in), so activations stay O(1) at any width.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import RopeScalingType

from minfer.tools.quantize.mix import FType, ModelShape

from .vocab import TinyVocab, add_tokenizer, build_tiny_vocab
from .weights import Tensors, WeightTypes, begin, finish, mixed_types


def write_gptoss(
    path: str | Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    n_expert: int = 4,
    n_expert_used: int = 2,
    sliding_window: int = 8,
    vocab: TinyVocab | None = None,
    weight_types: WeightTypes | FType = QType.F32,
    seed: int = 0,
    n_ctx_train: int = 256,
    rope_base: float = 150000.0,
    yarn: tuple[float, int] = (4.0, 64),
    gain: float = 0.5,
) -> Path:
    """Write a random-weight gpt-oss GGUF with a working tokenizer; return its path.

    `yarn` = (factor, original context); `weight_types` one type, a role → type mapping (the
    experts take the ffn_* roles) or a llama-quantize file type whose mix picks each tensor's.
    """
    path = Path(path)
    vocab = vocab or build_tiny_vocab()
    n_vocab = len(vocab.tokens)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim

    def std(n_in: int) -> float:
        return gain / float(np.sqrt(n_in))

    def body(t: Tensors) -> None:
        t.matrix("token_embd.weight", "token_embd", n_vocab, n_embd, std=1.0)
        for i in range(n_layer):
            blk = f"blk.{i}"
            t.vector(f"{blk}.attn_norm.weight", n_embd, mean=1.0, std=0.05)
            for proj, n_out in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                t.matrix(f"{blk}.attn_{proj}.weight", f"attn_{proj}", n_out, n_embd,
                         std=std(n_embd))
                t.vector(f"{blk}.attn_{proj}.bias", n_out, mean=0.0, std=0.1)
            t.matrix(f"{blk}.attn_output.weight", "attn_output", n_embd, q_dim, std=std(q_dim))
            t.vector(f"{blk}.attn_output.bias", n_embd, mean=0.0, std=0.1)
            t.vector(f"{blk}.attn_sinks.weight", n_head, mean=0.0, std=1.0)
            t.vector(f"{blk}.post_attention_norm.weight", n_embd, mean=1.0, std=0.05)
            # the router stays F32 (llama-quantize never quantizes ffn_gate_inp)
            t.vector(f"{blk}.ffn_gate_inp.weight", (n_expert, n_embd), mean=0.0,
                     std=std(n_embd) * 4)
            t.vector(f"{blk}.ffn_gate_inp.bias", n_expert, mean=0.0, std=0.3)
            for proj, n_out, n_in in (("gate", n_ff, n_embd), ("up", n_ff, n_embd),
                                      ("down", n_embd, n_ff)):
                t.experts(f"{blk}.ffn_{proj}_exps.weight", f"ffn_{proj}", n_expert, n_out, n_in,
                          std=std(n_in))
                t.vector(f"{blk}.ffn_{proj}_exps.bias", (n_expert, n_out), mean=0.0, std=0.1)
        t.vector("output_norm.weight", n_embd, mean=1.0, std=0.05)
        t.matrix("output.weight", "output", n_vocab, n_embd, std=std(n_embd))

    type_of = mixed_types(body, ModelShape("gpt-oss", n_layer, n_head, n_head_kv, n_expert),
                          weight_types)
    w = begin(path, "gpt-oss", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
              n_head_kv=n_head_kv, head_dim=head_dim, n_ctx_train=n_ctx_train,
              rope_base=rope_base, eps=1e-5)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(yarn[0])
    w.add_rope_scaling_orig_ctx_len(yarn[1])
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(n_ff)
    w.add_sliding_window(sliding_window)
    if isinstance(weight_types, FType):
        w.add_file_type(int(weight_types))
    add_tokenizer(w, vocab, None, pre="gpt-4o")
    body(Tensors(w, np.random.default_rng(seed), type_of))
    finish(w)
    return path


def write_model_like_gptoss_20b(path: str | Path, *, n_layer: int = 16, n_expert: int = 8,
                                weight_types: WeightTypes | FType = FType.MOSTLY_MXFP4_MOE,
                                seed: int = 0) -> Path:
    """Random weights in gpt-oss-20b's per-layer shapes, `n_layer` of its 24 layers and
    `n_expert` of its 32 experts (4 routed per token), by default in the MXFP4_MOE mix."""
    return write_gptoss(
        path, n_layer=n_layer, n_embd=2880, n_ff=2880, n_head=64, n_head_kv=8, head_dim=64,
        n_expert=n_expert, n_expert_used=4, sliding_window=128,
        vocab=build_tiny_vocab(vocab_size=201088), weight_types=weight_types, seed=seed,
        n_ctx_train=131072, rope_base=150000.0, yarn=(32.0, 4096))
