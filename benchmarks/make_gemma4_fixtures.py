"""Regenerate tests/fixtures/gemma4/: a tiny random Gemma 4 text decoder converted by llama.cpp,
with transformers' logits on the same token ids.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_gemma4_fixtures.py \
        --convert /path/to/llama.cpp/convert_hf_to_gguf.py --gguf-py /path/to/llama.cpp/gguf-py

(llama.cpp 0.3.36's converter: the llama-cpp-python sdist's vendor/llama.cpp.) The model is
transformers 5.x's `Gemma4ForCausalLM` (random weights, seed 0, norms away from 1, the
320-piece SentencePiece vocabulary of make_llama_fixtures.py) with every part of E2B / E4B's
text path at toy size: 7 layers `[swa, swa, full, swa, full, swa, full]` (sliding window 5, so the
16-token run slides), head size 16 in the sliding layers and 32 in the global ones (rotary on
a quarter of it, "proportional"), per-layer token embeddings of 8 per layer, the last 2
layers reading the KV of layers 3 (sliding) and 4 (global; the layers llama.cpp's rule and
transformers' agree on) with double-wide FFNs (`use_double_wide_mlp`), layer scalars away from
1 and a final soft-cap of 30. Converted to f32; `logits.npz` holds `ids`, transformers' float32
logits (eager attention, `gemma4.hf`) and the same with its GELU computed as llama.cpp's
(`gemma4.hf_gelu_table`: the input rounded to f16 and looked up in ggml's table, which minfer
reproduces bit for bit). Both are committed, so the tests need neither transformers nor
llama.cpp.

Two more models, 4 layers each, no per-layer embeddings, no shared KV: `gemma4_31b`, the 31B's
attention at toy size ([swa, full, swa, full], the global layers with 1 K/V head of 2 and no
`v_proj`: V is K's projection, `attention_k_eq_v`), and `gemma4_26b`, the same attention with
the 26B-A4B's experts ([swa, swa, full, full], 4 experts of width 32, top 2, beside each
layer's dense FFN; router and per-expert scales away from 1).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from make_llama_fixtures import IDS, N_VOCAB, _tokenizer

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gemma4"


def _configs() -> dict[str, object]:
    from transformers import Gemma4TextConfig

    common = {"vocab_size": N_VOCAB, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
              "sliding_window": 5, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, "initializer_range": 0.3, "tie_word_embeddings": True}
    return {
        "gemma4": Gemma4TextConfig(
            **common, vocab_size_per_layer_input=N_VOCAB, intermediate_size=128,
            num_hidden_layers=7, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"]),
        "gemma4_31b": Gemma4TextConfig(
            **common, intermediate_size=96, num_hidden_layers=4, hidden_size_per_layer_input=0,
            num_kv_shared_layers=0, attention_k_eq_v=True, num_global_key_value_heads=1,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"]),
        "gemma4_26b": Gemma4TextConfig(
            **common, intermediate_size=96, num_hidden_layers=4, hidden_size_per_layer_input=0,
            num_kv_shared_layers=0, attention_k_eq_v=True, num_global_key_value_heads=1,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "full_attention"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convert", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py folder")
    args = ap.parse_args()
    from transformers import AutoTokenizer, Gemma4ForCausalLM

    OUT.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": args.gguf_py}
    arrays: dict[str, np.ndarray] = {"ids": np.array(IDS, np.int32)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in _configs().items():
            torch.manual_seed(0)
            hf = Path(tmp) / name
            hf.mkdir()
            model = Gemma4ForCausalLM._from_config(config, attn_implementation="eager")
            with torch.no_grad():  # norms and layer scalars away from 1, so a wrong one shows
                for p_name, p in model.named_parameters():
                    if p_name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                        p.copy_(1.0 + 0.1 * torch.randn_like(p))
                for b_name, buf in model.named_buffers():
                    if b_name.endswith("layer_scalar"):
                        buf.copy_(0.5 + torch.rand_like(buf))
            model.save_pretrained(hf)
            _tokenizer(hf)
            AutoTokenizer.from_pretrained(hf).save_pretrained(hf)  # llama.cpp reads its json
            subprocess.run([sys.executable, args.convert, str(hf), "--outtype", "f32",
                            "--outfile", str(OUT / f"{name}.gguf")], check=True, env=env,
                           stdout=subprocess.DEVNULL)
            model = model.float().eval()
            with torch.no_grad():
                arrays[f"{name}.hf"] = model(torch.tensor([IDS])).logits[0].numpy()
                for layer in model.model.layers:  # GELU as llama.cpp (and minfer) computes it
                    layer.mlp.act_fn = layer.act_fn = _TableGelu()
                    if hasattr(layer, "experts"):
                        layer.experts.act_fn = _TableGelu()
                arrays[f"{name}.hf_gelu_table"] = model(torch.tensor([IDS])).logits[0].numpy()
    np.savez_compressed(OUT / "logits.npz", **arrays)  # type: ignore[arg-type]


def _table_gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's GELU: the input rounded to f16 and looked up in its table (x from 10 on, 0 at
    -10 and below); minfer's GELU_TABLE holds the same entries."""
    from minfer.backends.cpu.kernels.elementwise.gelu import GELU_TABLE

    bits = x.numpy().astype(np.float16).view(np.uint16).astype(np.int64)
    y = torch.from_numpy(GELU_TABLE[bits])
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


class _TableGelu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _table_gelu(x)


if __name__ == "__main__":
    main()
