"""The transformer families' synthetic models: qwen2 / qwen3 / llama / gemma3 and the
qwen2moe / qwen3moe mixtures of experts.

Owns `write_tiny_model` (the model every unit test runs), `write_model_like_qwen25_05b`
(random weights in the development model's exact shapes and tensor types, for speed tests) and
`write_moe_like_qwen3_a3b` (the speed benchmark's mixture of experts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from .vocab import TinyVocab, add_tokenizer, build_tiny_vocab
from .weights import WeightTypes, random_matrix, type_for


def write_tiny_model(
    path: str | Path,
    *,
    arch: str = "qwen2",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    head_dim: int | None = None,
    vocab: TinyVocab | None = None,
    weight_types: WeightTypes = QType.F32,
    weight_type: WeightTypes | None = None,
    tied: bool = True,
    seed: int = 0,
    chat_template: str | None = None,
    n_ctx_train: int = 2048,
    rope_base: float = 10000.0,
    extra_tokens: Sequence[str] = (),
    sliding_window: int = 0,
    rope_freqs: bool = False,
    softcaps: tuple[float, float] = (0.0, 0.0),
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_shexp: int = 0,
    router_std: float = 1.0,
) -> Path:
    """Write a random-weight qwen2/qwen3/llama/gemma3 GGUF with a working tokenizer; return its
    path.

    `weight_types` (alias `weight_type`) is one type or a role → type mapping over ROLES (norms
    and biases stay F32). `chat_template=None` writes the ChatML default, "" writes none.
    qwen2 gets q/k/v biases; qwen3 and gemma3 get attn_q_norm / attn_k_norm and no biases;
    gemma3 also its post-attention / post-FFN norms, `sliding_window` (every 6th layer global)
    and `softcaps` = (attention, final logits; 0 = none); llama with `rope_freqs` gets a
    `rope_freqs.weight` of per-pair divisors (Llama 3.1 style). qwen2moe / qwen3moe (the
    attention of qwen2 / qwen3) get `n_expert` experts `n_ff` wide per block, `n_expert_used`
    of them routed per token by an F32 router of std `router_std`, and (qwen2moe, n_ff_shexp >
    0) a shared expert with its sigmoid gate; the experts take the ffn_* roles' types.
    """
    archs = ("qwen2", "qwen3", "llama", "gemma3", "qwen2moe", "qwen3moe")
    if arch not in archs:
        raise ValueError(f"write_tiny_model writes {', '.join(archs)}, not {arch!r}")
    moe = arch.endswith("moe")
    path = Path(path)
    types = weight_type if weight_type is not None else weight_types
    vocab = vocab or build_tiny_vocab(extra_tokens=extra_tokens)
    hd = head_dim or n_embd // n_head
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, use_temp_file=True)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff)
        if n_ff_shexp and arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(n_ff_shexp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if head_dim is not None or arch in ("qwen3", "gemma3", "qwen3moe"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(rope_base)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if softcaps[0]:
        w.add_attn_logit_softcapping(softcaps[0])
    if softcaps[1]:
        w.add_final_logit_softcapping(softcaps[1])
    w.add_layer_norm_rms_eps(1e-6)
    add_tokenizer(w, vocab, chat_template)

    def matrix(name: str, role: str, n_out: int, n_in: int, std: float = 0.05) -> None:
        data, raw_dtype = random_matrix(rng, n_out, n_in, std=std, qtype=type_for(types, role),
                                         name=name)
        w.add_tensor(name, data, raw_dtype=raw_dtype)

    def vector(name: str, n: int, *, mean: float, std: float) -> None:
        w.add_tensor(name, (mean + std * rng.standard_normal(n)).astype(np.float32))

    def experts(name: str, role: str, n_out: int, n_in: int) -> None:
        data, raw_dtype = random_matrix(rng, n_expert * n_out, n_in, std=0.05,
                                         qtype=type_for(types, role), name=name)
        w.add_tensor(name, data.reshape(n_expert, n_out, -1), raw_dtype=raw_dtype)

    def ffn(blk: str) -> None:
        if not moe:
            matrix(f"{blk}.ffn_gate.weight", "ffn_gate", n_ff, n_embd)
            matrix(f"{blk}.ffn_up.weight", "ffn_up", n_ff, n_embd)
            matrix(f"{blk}.ffn_down.weight", "ffn_down", n_embd, n_ff)
            return
        w.add_tensor(f"{blk}.ffn_gate_inp.weight",
                     (router_std * rng.standard_normal((n_expert, n_embd))).astype(np.float32))
        experts(f"{blk}.ffn_gate_exps.weight", "ffn_gate", n_ff, n_embd)
        experts(f"{blk}.ffn_up_exps.weight", "ffn_up", n_ff, n_embd)
        experts(f"{blk}.ffn_down_exps.weight", "ffn_down", n_embd, n_ff)
        if n_ff_shexp and arch == "qwen2moe":
            # ne [n_embd, 1], as llama.cpp's converter writes it
            w.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight",
                         (0.3 * rng.standard_normal((1, n_embd))).astype(np.float32))
            matrix(f"{blk}.ffn_gate_shexp.weight", "ffn_gate", n_ff_shexp, n_embd)
            matrix(f"{blk}.ffn_up_shexp.weight", "ffn_up", n_ff_shexp, n_embd)
            matrix(f"{blk}.ffn_down_shexp.weight", "ffn_down", n_embd, n_ff_shexp)

    n_vocab = len(vocab.tokens)
    matrix("token_embd.weight", "token_embd", n_vocab, n_embd, std=0.1)
    for i in range(n_layer):
        blk = f"blk.{i}"
        vector(f"{blk}.attn_norm.weight", n_embd, mean=1.0, std=0.05)
        for proj, n_out in (("q", n_head * hd), ("k", n_head_kv * hd), ("v", n_head_kv * hd)):
            matrix(f"{blk}.attn_{proj}.weight", f"attn_{proj}", n_out, n_embd)
            if arch in ("qwen2", "qwen2moe"):
                vector(f"{blk}.attn_{proj}.bias", n_out, mean=0.0, std=0.02)
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            vector(f"{blk}.attn_q_norm.weight", hd, mean=1.0, std=0.05)
            vector(f"{blk}.attn_k_norm.weight", hd, mean=1.0, std=0.05)
        matrix(f"{blk}.attn_output.weight", "attn_output", n_embd, n_head * hd)
        if arch == "gemma3":
            vector(f"{blk}.post_attention_norm.weight", n_embd, mean=1.0, std=0.05)
            vector(f"{blk}.post_ffw_norm.weight", n_embd, mean=1.0, std=0.05)
        vector(f"{blk}.ffn_norm.weight", n_embd, mean=1.0, std=0.05)
        ffn(blk)
    vector("output_norm.weight", n_embd, mean=1.0, std=0.05)
    if rope_freqs:  # divisors growing from 1 to 8 over the pairs, as Llama 3.1's low frequencies
        w.add_tensor("rope_freqs.weight", np.geomspace(1.0, 8.0, hd // 2).astype(np.float32))
    if not tied:
        matrix("output.weight", "output", n_vocab, n_embd, std=0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# The development model's tensor types by role (it alternates ffn_down Q4_K/Q6_K and attn_v
# Q5_0/Q8_0 across layers; one type per role is close enough for speed work).
QWEN25_05B_TYPES: Mapping[str, QType] = {
    "token_embd": QType.Q5_0, "output": QType.Q8_0, "attn_v": QType.Q8_0,
    "ffn_down": QType.Q4_K, "default": QType.Q5_0,
}


def write_model_like_qwen25_05b(path: str | Path, *, weight_type: WeightTypes = QWEN25_05B_TYPES,
                                seed: int = 0) -> Path:
    """Random weights in Qwen2.5-0.5B's shapes (24 layers, 896 wide, vocab 151,936): ~0.5 GB."""
    return write_tiny_model(
        path, arch="qwen2", n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864,
        vocab=build_tiny_vocab(vocab_size=151936), weight_types=weight_type, tied=False,
        seed=seed, n_ctx_train=32768, rope_base=1000000.0,
    )


# Qwen3-30B-A3B's block scaled down (half the width, half the experts, 512-wide experts): 48
# layers x 64 experts, 8 routed per token, Q4_K_M-like types (~2.9 GB, ~0.55 GB read per token)
QWEN3_MOE_BENCH_TYPES: Mapping[str, QType] = {
    "token_embd": QType.Q4_K, "output": QType.Q6_K, "attn_v": QType.Q6_K,
    "ffn_down": QType.Q6_K, "default": QType.Q4_K,
}


def write_moe_like_qwen3_a3b(path: str | Path, *, n_layer: int = 48, n_expert: int = 64,
                             weight_type: WeightTypes = QWEN3_MOE_BENCH_TYPES,
                             seed: int = 0) -> Path:
    """Random weights shaped like a scaled-down Qwen3-30B-A3B (qwen3moe: 1024 wide, 16 / 4
    heads of 128, experts 512 wide, 8 of `n_expert` per token, vocabulary 151,936): the speed
    benchmark's mixture of experts."""
    return write_tiny_model(
        path, arch="qwen3moe", n_layer=n_layer, n_embd=1024, n_head=16, n_head_kv=4,
        head_dim=128, n_ff=512, n_expert=n_expert, n_expert_used=8,
        vocab=build_tiny_vocab(vocab_size=151936), weight_types=weight_type, tied=False,
        seed=seed, n_ctx_train=32768, rope_base=1000000.0, router_std=0.05,
    )
