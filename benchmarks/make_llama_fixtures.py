"""Regenerate tests/fixtures/llama/: tiny random Llama-family checkpoints converted by llama.cpp,
with transformers' and llama.cpp's logits on the same token ids.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_llama_fixtures.py \
        --convert /path/to/llama.cpp/convert_hf_to_gguf.py \
        --gguf-py /path/to/llama.cpp/gguf-py --ref-python /tmp/refvenv/bin/python

Each model is written with `transformers` (random weights, seed 0, 2 layers, n_embd 64, GQA,
a 320-piece SentencePiece vocabulary trained here so the converter has a tokenizer), saved as
safetensors, converted by llama.cpp's own `convert_hf_to_gguf.py --outtype f32`, and run on
IDS by transformers (float64 weights, eager attention) and by llama.cpp (llama-cpp-python in
`--ref-python`, flash-attn off, f32 KV). Models:

- `llama`: LlamaConfig, untied output (Llama 2 / 3 layout);
- `llama31`: LlamaConfig with Llama 3.1's `rope_scaling` (rope_type llama3), which the
  converter turns into a `rope_freqs` tensor; tied output (Llama 3.2 layout);
- `mistral`: MistralConfig (converted to the `llama` architecture);
- `llama_yarn`: LlamaConfig with YaRN `rope_scaling` (factor 4 over 64 trained positions),
  which the converter writes as `rope.scaling.type = yarn` (normal-mode rope);
- `qwen2_yarn`: Qwen2Config (q/k/v biases, NEOX rope) with YaRN and its beta_fast / beta_slow
  given (which llama.cpp does not read for qwen2: the ramp's ends come out the same here),
  converted to the `qwen2` architecture;
- `llama_bias`: LlamaConfig with `attention_bias` and `mlp_bias` (q/k/v/o and gate/up/down
  biases, random so they show).

The GGUF files and `logits.npz` (keys `<name>.hf`, `<name>.llamacpp`, `ids`) are committed,
so the tests need neither transformers nor llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama"
IDS = [1, 17, 250, 33, 99, 5, 301, 42, 77, 128, 64, 200, 3, 150, 11, 290]
# The YaRN models run a longer text (key `ids_long`): past their original context, where the
# interpolated low-frequency pairs turn far enough for the blend to show.
IDS_LONG = [1, *np.random.default_rng(0).integers(3, 320, 199).tolist()]
N_VOCAB = 320
_TEXT = ("The quick brown fox jumps over the lazy dog. A small model is enough for a test. "
         "Numbers 0123456789 and words: alpha beta gamma delta epsilon.\n") * 40

_LLAMACPP = """
import sys, json, numpy as np, llama_cpp
path, ids = sys.argv[1], json.loads(sys.argv[2])
m = llama_cpp.Llama(path, n_ctx=256, logits_all=True, verbose=False, n_threads=2,
                    flash_attn=False, type_k=0, type_v=0)
m.eval(ids)
np.save(sys.argv[3], np.array(m.scores[:len(ids)], dtype=np.float32))
"""


def _configs() -> dict[str, object]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {"vocab_size": N_VOCAB, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1,
              "eos_token_id": 2, "initializer_range": 0.3}
    llama31_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                    "rope_theta": 500000.0}
    return {
        "llama": LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0),
        "llama31": LlamaConfig(**common, tie_word_embeddings=True, rope_scaling=llama31_rope,
                               rope_theta=500000.0),
        "mistral": MistralConfig(**common, tie_word_embeddings=False, rope_theta=1e6,
                                 sliding_window=None),
        "llama_yarn": LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 10000.0}, rope_theta=10000.0),
        "llama_bias": LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0,
                                  attention_bias=True, mlp_bias=True),
        "qwen2_yarn": Qwen2Config(**common, tie_word_embeddings=True, rope_scaling={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
            "beta_fast": 16.0, "beta_slow": 2.0, "rope_theta": 1e6}, rope_theta=1e6,
            use_sliding_window=False),
    }


def _tokenizer(dest: Path) -> None:
    import sentencepiece as spm

    text = dest / "text.txt"
    text.write_text(_TEXT)
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(dest / "tokenizer"),
                                   vocab_size=N_VOCAB, model_type="bpe", bos_id=1, eos_id=2,
                                   unk_id=0, pad_id=-1, minloglevel=2, hard_vocab_limit=False)
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convert", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py folder")
    ap.add_argument("--ref-python", required=True, help="python with llama-cpp-python")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    OUT.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {"ids": np.array(IDS, np.int32),
                                     "ids_long": np.array(IDS_LONG, np.int32)}
    env = {**os.environ, "PYTHONPATH": args.gguf_py}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in _configs().items():
            ids = IDS_LONG if name.endswith("_yarn") else IDS
            torch.manual_seed(0)
            hf = Path(tmp) / name
            hf.mkdir()
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            with torch.no_grad():  # norms away from 1, so a wrong norm shows
                for p_name, p in model.named_parameters():
                    if p_name.endswith("norm.weight"):
                        p.copy_(1.0 + 0.1 * torch.randn_like(p))
                    if p_name.endswith(".bias"):  # transformers starts them at 0
                        p.copy_(0.3 * torch.randn_like(p))
            model.save_pretrained(hf)
            _tokenizer(hf)
            gguf_path = OUT / f"{name}.gguf"
            subprocess.run([sys.executable, args.convert, str(hf), "--outtype", "f32",
                            "--outfile", str(gguf_path)], check=True, env=env,
                           stdout=subprocess.DEVNULL)
            with torch.no_grad():
                ref = model.double()(torch.tensor([ids])).logits[0].numpy()
            arrays[f"{name}.hf"] = ref.astype(np.float32)
            out = Path(tmp) / f"{name}.npy"
            subprocess.run([args.ref_python, "-c", _LLAMACPP, str(gguf_path), json.dumps(ids),
                            str(out)], check=True)
            arrays[f"{name}.llamacpp"] = np.load(out)
    np.savez_compressed(OUT / "logits.npz", **arrays)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
