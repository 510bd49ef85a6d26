"""Llama-family GGUF files written by llama.cpp's own converter, against transformers and
llama.cpp on the same weights and token ids.

tests/fixtures/llama/ comes from benchmarks/make_llama_fixtures.py: tiny random checkpoints
(2 layers, n_embd 64, GQA 4/2, weights with std 0.3 so attention is sharp and a wrong RoPE shows)
made with transformers' LlamaConfig / MistralConfig, converted with
`convert_hf_to_gguf.py --outtype f32`, and run by transformers (float64) and llama.cpp (f32 KV).
With F32 weights and an f32 KV cache, minfer differs from both by f32 rounding only (measured
max |Δ| 9e-6 to 3e-5 on logits up to ~10, the same as transformers against llama.cpp); an f16
KV cache adds the keys' and values' f16 rounding (measured 0.023-0.027).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

FIXTURES = Path(__file__).parent / "fixtures" / "llama"
REF = np.load(FIXTURES / "logits.npz")
IDS = REF["ids"].tolist()


def _logits(name: str, kv_type: str) -> np.ndarray:
    f = GGUFFile.open(FIXTURES / f"{name}.gguf")
    e = Engine(f, HParams.from_gguf(f), n_ctx=64, kv_type=kv_type)
    return e.forward(IDS, 0, n_out=len(IDS))


@pytest.mark.parametrize("name", ["llama", "llama31", "mistral"])
def test_matches_transformers_and_llamacpp(name: str) -> None:
    got = _logits(name, "f32")
    for ref in ("hf", "llamacpp"):
        np.testing.assert_allclose(got, REF[f"{name}.{ref}"], rtol=0, atol=1e-4)
    f16 = _logits(name, "f16")
    np.testing.assert_allclose(f16, REF[f"{name}.llamacpp"], rtol=0, atol=0.05)
    assert (f16.argmax(-1) == REF[f"{name}.hf"].argmax(-1)).all()


def test_converted_layouts() -> None:
    """What the converter wrote: normal-mode RoPE for every `llama` file, Llama 3.1's
    rope_freqs and a tied output in llama31, untied outputs elsewhere."""
    for name, freqs, tied in (("llama", False, False), ("llama31", True, True),
                              ("mistral", False, False)):
        hp = HParams.from_gguf(GGUFFile.open(FIXTURES / f"{name}.gguf"))
        assert (hp.arch, hp.rope_style) == ("llama", "norm")
        assert (hp.has_rope_freqs, hp.tie_embeddings, hp.has_qkv_bias) == (freqs, tied, False)
