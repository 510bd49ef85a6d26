"""Regenerate tests/fixtures/lfm2/: a tiny random LFM2 checkpoint converted by llama.cpp, with
transformers' float32 logits on the same token ids.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_lfm2_fixtures.py

(llama.cpp 0.3.36's converter as tests/llama_convert.py finds or fetches it, told the tiny
tokenizer's pre-tokenizer, `qwen2`, which its hash table cannot know.) The model is
written with transformers 5.x's `Lfm2ForCausalLM` (random weights, seed 0, n_embd 64, 4 layers
conv | attention | conv | conv, so the last layer keeps a prefill's tail after a short
convolution; GQA 4/2, `conv_L_cache` 3, norms away from 1, tied output) and the byte-level BPE
tokenizer with the ChatML template of tests/hf_tiny.py, saved as safetensors, converted by
llama.cpp's own `convert_hf_to_gguf.py --outtype f32`, and run on the ids by transformers in
float32 (eager attention).

`lfm2.gguf` and `logits.npz` (keys `hf`: every position's logits, `ids`) are committed, so the
tests need neither transformers nor llama.cpp.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "lfm2"
LAYER_TYPES = ["conv", "full_attention", "conv", "conv"]


def main() -> None:
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_tiny import write_bpe_tokenizer
    from llama_convert import reference_convert

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "lfm2"
        hf.mkdir()
        vocab = write_bpe_tokenizer(hf)
        config = Lfm2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5,
                            conv_L_cache=3, block_auto_adjust_ff_dim=False,
                            layer_types=LAYER_TYPES, tie_word_embeddings=True,
                            initializer_range=0.2, bos_token_id=None, eos_token_id=vocab - 1,
                            pad_token_id=vocab - 3)
        torch.manual_seed(0)
        model = Lfm2ForCausalLM(config).eval()
        with torch.no_grad():  # norms away from 1, so a wrong norm shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
        model.save_pretrained(hf)
        reference_convert([(hf, OUT / "lfm2.gguf", "f32", "qwen2")])
        ids = np.random.default_rng(3).integers(0, vocab - 3, 40).tolist()
        model = Lfm2ForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)
    np.savez_compressed(OUT / "logits.npz", hf=logits, ids=np.array(ids, np.int32))


if __name__ == "__main__":
    main()
