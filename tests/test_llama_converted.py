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

from dataclasses import replace
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
    ids = _ids(name)
    f = GGUFFile.open(FIXTURES / f"{name}.gguf")
    e = Engine(f, HParams.from_gguf(f), n_ctx=256, kv_type=kv_type)
    return e.forward(ids, 0, n_out=len(ids))


def _ids(name: str) -> list[int]:
    """The YaRN models run 200 tokens: past their original 32 / 64 positions."""
    return REF["ids_long"].tolist() if name.endswith("_yarn") else IDS


@pytest.mark.parametrize("name", ["llama", "llama31", "mistral", "llama_yarn", "qwen2_yarn",
                                  "llama_bias"])
def test_matches_transformers_and_llamacpp(name: str) -> None:
    got = _logits(name, "f32")
    # 200 tokens of the YaRN models: transformers and llama.cpp differ by 1.9e-4 there
    atol = 3e-4 if name.endswith("_yarn") else 1e-4
    for ref in ("hf", "llamacpp"):
        np.testing.assert_allclose(got, REF[f"{name}.{ref}"], rtol=0, atol=atol)
    f16 = _logits(name, "f16")
    if name.endswith("_yarn"):  # f16 keys' rounding grows over 200 tokens (measured 0.07-0.11)
        np.testing.assert_allclose(f16, REF[f"{name}.llamacpp"], rtol=0, atol=0.15)
        return
    np.testing.assert_allclose(f16, REF[f"{name}.llamacpp"], rtol=0, atol=0.05)
    assert (f16.argmax(-1) == REF[f"{name}.hf"].argmax(-1)).all()


def test_llama_biases_in_prefill_and_decode() -> None:
    """Llama's attention_bias (q/k/v/o) and mlp_bias (gate/up/down) are read and added; decode
    steps (where the gate and up projections would otherwise be fused) give the same logits."""
    f = GGUFFile.open(FIXTURES / "llama_bias.gguf")
    hp = HParams.from_gguf(f)
    assert (hp.has_qkv_bias, hp.has_out_bias, hp.has_ffn_bias) == (True, True, True)
    for fuse in (False, True):
        e = Engine(f, hp, n_ctx=64, kv_type="f32", fuse_gate_up=fuse)
        e.forward(IDS[:8], 0, n_out=1)
        steps = np.stack([e.forward([t], 8 + i, n_out=1)[0] for i, t in enumerate(IDS[8:])])
        np.testing.assert_allclose(steps, REF["llama_bias.llamacpp"][8:], rtol=0, atol=1e-4)


def test_yarn_read_as_llamacpp_reads_it() -> None:
    """The converter writes YaRN's type, factor and original context (and the betas a config
    gives, which llama.cpp does not read for these architectures: 32 / 1 stay); the rest are
    llama.cpp's defaults. Without the ramp and magnitude the logits are far from both
    references, so the comparison above checks them."""
    llama = HParams.from_gguf(GGUFFile.open(FIXTURES / "llama_yarn.gguf"))
    qwen = HParams.from_gguf(GGUFFile.open(FIXTURES / "qwen2_yarn.gguf"))
    assert llama.yarn is not None and qwen.yarn is not None
    assert (llama.rope_style, llama.rope_freq_scale, llama.yarn.n_ctx_orig) == ("norm", 0.25, 64)
    assert (llama.yarn.ext_factor, llama.yarn.beta_fast, llama.yarn.beta_slow) == (1.0, 32.0, 1.0)
    assert (qwen.arch, qwen.rope_style, qwen.rope_freq_scale) == ("qwen2", "neox", 0.125)
    f = GGUFFile.open(FIXTURES / "qwen2_yarn.gguf")
    assert f.metadata["qwen2.rope.scaling.yarn_beta_fast"] == 16.0
    assert (qwen.yarn.n_ctx_orig, qwen.yarn.beta_fast, qwen.yarn.beta_slow) == (32, 32.0, 1.0)
    assert qwen.layer_rope_yarn(0).mscale == pytest.approx(1 + 0.1 * np.log(8.0), rel=1e-6)
    ids = REF["ids_long"].tolist()
    f = GGUFFile.open(FIXTURES / "llama_yarn.gguf")
    plain = Engine(f, replace(llama, yarn=None), n_ctx=256, kv_type="f32")
    assert np.abs(plain.forward(ids, 0, n_out=len(ids)) - REF["llama_yarn.hf"]).max() > 1.0


def test_yarn_stretches_the_usable_context() -> None:
    """A YaRN config keeps `max_position_embeddings` at the original context (Qwen2.5's
    advice): minfer then allows the stretched one, where a file without YaRN stops at its
    trained context."""
    hp = HParams.from_gguf(GGUFFile.open(FIXTURES / "llama_yarn.gguf"))
    assert hp.yarn is not None and hp.n_ctx_max == 256
    assert replace(hp, n_ctx_train=64).n_ctx_max == 256  # 64 original positions x 4
    assert replace(hp, n_ctx_train=64, yarn=None).n_ctx_max == 64


def test_converted_layouts() -> None:
    """What the converter wrote: normal-mode RoPE for every `llama` file, Llama 3.1's
    rope_freqs and a tied output in llama31, untied outputs elsewhere."""
    for name, freqs, tied in (("llama", False, False), ("llama31", True, True),
                              ("mistral", False, False)):
        hp = HParams.from_gguf(GGUFFile.open(FIXTURES / f"{name}.gguf"))
        assert (hp.arch, hp.rope_style) == ("llama", "norm")
        assert (hp.has_rope_freqs, hp.tie_embeddings, hp.has_qkv_bias) == (freqs, tied, False)
