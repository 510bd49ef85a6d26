"""Synthetic Qwen3.5 (`qwen35`): Gated DeltaNet layers, every `full_attention_interval`-th
layer gated full attention, in llama.cpp's layout (its converter's tensor names and ssm.* keys).

`write_qwen35` writes any size (the unit tests' tiny one by default); `write_model_like_qwen35`
the real Qwen3.5-0.8B / 2B shapes in llama-quantize's Q4_K_M mix, for the speed comparison with
llama.cpp. The shapes are the checkpoints' config.json text_config (vocab 248,320, tied
embeddings, 24 layers = 6 x (3 DeltaNet + 1 attention), 8 query / 2 KV heads of 256 with a
quarter of each rotated (interleaved MRoPE sections 11/11/10), DeltaNet 16 key / 16 value heads
of 128, conv kernel 4): 0.8B 1024 wide with FFN 3584, 2B 2048 wide with FFN 6144.
Weights are normal with std gain / sqrt(fan-in), so activations stay O(1) at any width.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from minfer.tools.quantize.mix import FType, ModelShape

from .vocab import TinyVocab, add_tokenizer, build_tiny_vocab
from .weights import Tensors, WeightTypes, begin, finish, mixed_types

QWEN35_SIZES: dict[str, dict[str, int]] = {
    "0.8b": {"n_embd": 1024, "n_ff": 3584},
    "2b": {"n_embd": 2048, "n_ff": 6144},
}


def write_qwen35(
    path: str | Path,
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_ff: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    ssm_heads: tuple[int, int] = (2, 4),
    ssm_head_dim: int = 16,
    conv_kernel: int = 4,
    full_attention_interval: int = 4,
    rope_dim: int = 8,
    rope_sections: Sequence[int] = (2, 1, 1),
    vocab: TinyVocab | None = None,
    weight_types: WeightTypes | FType = QType.F32,
    tied: bool = False,
    seed: int = 0,
    n_ctx_train: int = 4096,
    rope_base: float = 10000.0,
    gain: float = 0.5,
) -> Path:
    """Write a random-weight qwen35 GGUF with a working tokenizer; return its path.

    `ssm_heads` = (key heads, value heads) of the DeltaNet layers, each `ssm_head_dim` wide;
    `weight_types` one type, a role → type mapping (roles: ROLES and attn_qkv, attn_gate,
    ssm_out, ssm_alpha, ssm_beta) or a llama-quantize file type whose mix picks each tensor's.
    """
    path = Path(path)
    vocab = vocab or build_tiny_vocab()
    n_vocab = len(vocab.tokens)
    nk, nv = ssm_heads
    conv_ch = (2 * nk + nv) * ssm_head_dim
    value_dim = nv * ssm_head_dim
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    recurrent = [(i + 1) % full_attention_interval != 0 for i in range(n_layer)]

    def std(n_in: int) -> float:
        return gain / float(np.sqrt(n_in))

    def body(t: Tensors) -> None:
        t.matrix("token_embd.weight", "token_embd", n_vocab, n_embd, std=1.0)
        for i in range(n_layer):
            blk = f"blk.{i}"
            t.vector(f"{blk}.attn_norm.weight", n_embd, mean=1.0, std=0.05)
            if recurrent[i]:
                t.matrix(f"{blk}.attn_qkv.weight", "attn_qkv", conv_ch, n_embd, std=std(n_embd))
                t.matrix(f"{blk}.attn_gate.weight", "attn_gate", value_dim, n_embd,
                         std=std(n_embd))
                # the conv taps (ne [kernel, channels]) stay F32, as llama-quantize keeps them
                t.vector(f"{blk}.ssm_conv1d.weight", (conv_ch, conv_kernel), mean=0.0,
                         std=0.5)
                t.vector(f"{blk}.ssm_dt.bias", nv, mean=0.5, std=0.2)
                t.vector(f"{blk}.ssm_a", nv, mean=-1.0, std=0.3)  # -exp(A_log): a decay
                t.matrix(f"{blk}.ssm_alpha.weight", "ssm_alpha", nv, n_embd, std=std(n_embd))
                t.matrix(f"{blk}.ssm_beta.weight", "ssm_beta", nv, n_embd, std=std(n_embd))
                t.vector(f"{blk}.ssm_norm.weight", ssm_head_dim, mean=1.0, std=0.05)
                t.matrix(f"{blk}.ssm_out.weight", "ssm_out", n_embd, value_dim,
                         std=std(value_dim))
            else:  # gated attention: q and its gate from one projection, q / k normed
                t.matrix(f"{blk}.attn_q.weight", "attn_q", 2 * q_dim, n_embd, std=std(n_embd))
                t.matrix(f"{blk}.attn_k.weight", "attn_k", kv_dim, n_embd, std=std(n_embd))
                t.matrix(f"{blk}.attn_v.weight", "attn_v", kv_dim, n_embd, std=std(n_embd))
                t.vector(f"{blk}.attn_q_norm.weight", head_dim, mean=1.0, std=0.05)
                t.vector(f"{blk}.attn_k_norm.weight", head_dim, mean=1.0, std=0.05)
                t.matrix(f"{blk}.attn_output.weight", "attn_output", n_embd, q_dim,
                         std=std(q_dim))
            t.vector(f"{blk}.post_attention_norm.weight", n_embd, mean=1.0, std=0.05)
            t.matrix(f"{blk}.ffn_gate.weight", "ffn_gate", n_ff, n_embd, std=std(n_embd))
            t.matrix(f"{blk}.ffn_up.weight", "ffn_up", n_ff, n_embd, std=std(n_embd))
            t.matrix(f"{blk}.ffn_down.weight", "ffn_down", n_embd, n_ff, std=std(n_ff))
        t.vector("output_norm.weight", n_embd, mean=1.0, std=0.05)
        if not tied:
            t.matrix("output.weight", "output", n_vocab, n_embd, std=std(n_embd))

    type_of = mixed_types(body, ModelShape("qwen35", n_layer, n_head, n_head_kv), weight_types)
    w = begin(path, "qwen35", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
              n_head_kv=n_head_kv, head_dim=head_dim, n_ctx_train=n_ctx_train,
              rope_base=rope_base, eps=1e-6)
    w.add_rope_dimension_count(rope_dim)
    w.add_rope_dimension_sections([*rope_sections, 0][:4])
    w.add_ssm_conv_kernel(conv_kernel)
    w.add_ssm_state_size(ssm_head_dim)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(value_dim)
    w.add_full_attention_interval(full_attention_interval)
    w.add_array("qwen35.attention.recurrent_layers", recurrent)
    if isinstance(weight_types, FType):
        w.add_file_type(int(weight_types))
    add_tokenizer(w, vocab, None)
    body(Tensors(w, np.random.default_rng(seed), type_of))
    finish(w)
    return path


def write_model_like_qwen35(path: str | Path, size: str = "0.8b", *,
                            weight_types: WeightTypes | FType = FType.MOSTLY_Q4_K_M,
                            seed: int = 0) -> Path:
    """Random weights in Qwen3.5-0.8B's or -2B's shapes (`size` "0.8b" | "2b"), by default in
    llama-quantize's Q4_K_M mix: ~0.5 / ~1.2 GB."""
    if size not in QWEN35_SIZES:
        raise ValueError(f"size {size!r}: one of {', '.join(QWEN35_SIZES)}")
    return write_qwen35(
        path, n_layer=24, n_head=8, n_head_kv=2, head_dim=256, ssm_heads=(16, 16),
        ssm_head_dim=128, conv_kernel=4, full_attention_interval=4, rope_dim=64,
        rope_sections=(11, 11, 10), vocab=build_tiny_vocab(vocab_size=248320),
        weight_types=weight_types, tied=True, seed=seed, n_ctx_train=262144,
        rope_base=10_000_000.0, **QWEN35_SIZES[size])
