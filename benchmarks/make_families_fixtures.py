"""Regenerate tests/fixtures/families/: tiny random SmolLM3 and Phi-3 checkpoints converted by
llama.cpp, with transformers' logits on the same token ids.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_families_fixtures.py \
        --convert /path/to/llama.cpp/convert_hf_to_gguf.py --gguf-py /path/to/llama.cpp/gguf-py

(llama.cpp 0.3.36's converter: the llama-cpp-python sdist's vendor/llama.cpp.) Each model is
written with `transformers` (random weights, seed 0, n_embd 64, GQA 4/2, norms away from 1,
the 320-piece SentencePiece vocabulary of make_llama_fixtures.py), saved as safetensors,
converted by llama.cpp's own `convert_hf_to_gguf.py` to f32 and to q8_0, and run on the ids by
transformers (float64 weights, eager attention). Models:

- `smollm3`: SmolLM3Config, 4 layers, so layer 3 is the one without RoPE (`no_rope_layers`
  from `no_rope_layer_interval` 4, which llama.cpp fixes at 4); tied output;
- `phi3`: Phi3Config as Phi-4-mini has it: partial rotary (0.75: 12 of 16 head dims), GQA,
  fused `qkv_proj` and `gate_up_proj`, tied output, no rope scaling;
- `phi3_longrope`: Phi3Config as Phi-3-mini-128k has it: LongRoPE (`rope_type` longrope with
  short and long factors) over 256 original positions stretched to 1024, untied output. Its
  `ids` (16 tokens) run on the short factors; `ids_long` (300 tokens, past the original
  context) on the long ones, which transformers picks by sequence length and llama.cpp by
  context size.

The GGUF files and `logits.npz` (keys `<name>.hf`, `<name>.hf_long`, `ids`, `ids_long`) are
committed, so the tests need neither transformers nor llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from make_llama_fixtures import IDS, N_VOCAB, _tokenizer

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "families"
IDS_LONG = [1, *np.random.default_rng(1).integers(3, N_VOCAB, 299).tolist()]
LONG = ("phi3_longrope",)


def _configs() -> dict[str, object]:
    from transformers import Phi3Config, SmolLM3Config

    common = {"vocab_size": N_VOCAB, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
              "initializer_range": 0.3}
    rng = np.random.default_rng(2)
    short = (1.0 + rng.random(6)).round(3).tolist()  # 6 rotary pairs: 12 of 16 head dims
    long = (1.0 + 8.0 * rng.random(6)).round(3).tolist()
    return {
        "smollm3": SmolLM3Config(**common, num_hidden_layers=4, max_position_embeddings=256,
                                 rope_theta=10000.0, tie_word_embeddings=True),
        "phi3": Phi3Config(**common, num_hidden_layers=2, max_position_embeddings=256,
                           original_max_position_embeddings=256, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75}),
        "phi3_longrope": Phi3Config(
            **common, num_hidden_layers=2, max_position_embeddings=1024,
            original_max_position_embeddings=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.75, "short_factor": short,
                             "long_factor": long, "original_max_position_embeddings": 256}),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convert", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py folder")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    OUT.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {"ids": np.array(IDS, np.int32),
                                     "ids_long": np.array(IDS_LONG, np.int32)}
    env = {**os.environ, "PYTHONPATH": args.gguf_py}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in _configs().items():
            torch.manual_seed(0)
            hf = Path(tmp) / name
            hf.mkdir()
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            with torch.no_grad():  # norms away from 1, so a wrong norm shows
                for p_name, p in model.named_parameters():
                    if p_name.endswith("norm.weight"):
                        p.copy_(1.0 + 0.1 * torch.randn_like(p))
            model.save_pretrained(hf)
            _tokenizer(hf)
            for outtype, suffix in (("f32", ""), ("q8_0", "-q8_0")):
                subprocess.run([sys.executable, args.convert, str(hf), "--outtype", outtype,
                                "--outfile", str(OUT / f"{name}{suffix}.gguf")], check=True,
                               env=env, stdout=subprocess.DEVNULL)
            model = model.double()
            with torch.no_grad():
                arrays[f"{name}.hf"] = model(torch.tensor([IDS])).logits[0].numpy().astype(
                    np.float32)
                if name in LONG:
                    arrays[f"{name}.hf_long"] = model(torch.tensor([IDS_LONG])).logits[0] \
                        .numpy().astype(np.float32)
    np.savez_compressed(OUT / "logits.npz", **arrays)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
