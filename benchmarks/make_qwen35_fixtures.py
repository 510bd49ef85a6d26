"""Regenerate tests/fixtures/qwen35/: tiny random Qwen3.5 checkpoints (dense and MoE) converted
by llama.cpp, with transformers' float32 logits on the same token ids.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_qwen35_fixtures.py

The model is transformers 5.x's `Qwen3_5ForCausalLM` (random weights, seed 0, n_embd 64, 4
layers: three Gated DeltaNet then one gated full attention, as `full_attention_interval` 4
lays them out; attention 4 heads of 32 over 2 K/V heads, a quarter of each head rotated with
interleaved MRoPE sections [2, 1, 1]; DeltaNet 2 key heads and 4 value heads of 16, so the
converter's V-head reordering shows; conv kernel 4; norms away from their init, untied output)
with the byte-level BPE tokenizer of tests/hf_tiny.py, saved as safetensors, converted by
llama.cpp 0.3.36's `convert_hf_to_gguf.py --outtype f32 --no-mtp` (the checkpoint has no MTP
block), and run on the ids by transformers in float32 (eager attention, the torch recurrence).

The MoE variant is `Qwen3_5MoeForCausalLM` with the same trunk, every FFN 8 experts of 32
(top 2, renormalised) plus a shared expert of 48 behind its sigmoid gate (`qwen35moe.gguf`,
`logits_moe.npz`).

`qwen35.gguf` and `logits.npz` (keys `hf`: every position's logits, `ids`) are committed, so
the tests need neither transformers nor llama.cpp.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "qwen35"


def main() -> None:
    make(moe=False)
    make(moe=True)


def make(*, moe: bool) -> None:
    import torch
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_tiny import write_bpe_tokenizer
    from llama_convert import reference_convert

    name, npz = ("qwen35moe", "logits_moe.npz") if moe else ("qwen35", "logits.npz")
    model_cls = Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / name
        hf.mkdir()
        vocab = write_bpe_tokenizer(hf)
        common = dict(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=512, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, tie_word_embeddings=False, initializer_range=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True},
            bos_token_id=None, eos_token_id=vocab - 1, pad_token_id=vocab - 3)
        config = Qwen3_5MoeTextConfig(
            **common, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2) if moe else \
            Qwen3_5TextConfig(**common, intermediate_size=128)
        torch.manual_seed(0)
        model = model_cls(config).eval()
        with torch.no_grad():  # norms, decay and step bias away from their init
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(p + 0.1 * torch.randn_like(p))
                elif pname.endswith(("A_log", "dt_bias")):
                    p.copy_(0.5 * torch.randn_like(p))
        model.save_pretrained(hf)
        reference_convert([(hf, OUT / f"{name}.gguf", "f32", "qwen2")], extra=("--no-mtp",))
        ids = np.random.default_rng(3).integers(0, vocab - 3, 40).tolist()
        model = model_cls.from_pretrained(hf, dtype=torch.float32,
                                          attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)
    np.savez_compressed(OUT / npz, hf=logits, ids=np.array(ids, np.int32))

if __name__ == "__main__":
    main()
