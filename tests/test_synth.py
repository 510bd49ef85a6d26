"""Synthetic models: vocabulary layout, K-quant reference quantizers, shapes and tensor types."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

from minfer.engine.forward import Engine
from minfer.gguf import GGUFFile
from minfer.gguf.hparams import HParams
from minfer.tools.quantize import FType
from minfer.tools.quantize.simple import quantize
from minfer.tools.synth import (
    CONTROL_TOKENS,
    build_tiny_vocab,
    bytes_to_unicode,
    copy_gguf,
    write_gptoss,
    write_model_like_qwen25_05b,
    write_qwen35,
    write_tiny_model,
)


def test_vocab_layout() -> None:
    vocab = build_tiny_vocab(extra_tokens=["<extra>"])
    byte_symbols = list(bytes_to_unicode().values())
    assert vocab.tokens[:256] == byte_symbols and len(set(byte_symbols)) == 256
    assert vocab.tokens[0] == "!" and bytes_to_unicode()[ord(" ")] == "Ġ"
    assert "Ġthe" in vocab.tokens and len(vocab.merges) >= 50
    for merge in vocab.merges:
        a, b = merge.split(" ")
        assert a in vocab.tokens and b in vocab.tokens and a + b in vocab.tokens
    for tok in CONTROL_TOKENS:
        assert vocab.token_types[vocab.id(tok)] == 3
    assert vocab.token_types[vocab.id("<tool_call>")] == 4
    assert vocab.token_types[vocab.id("<extra>")] == 4
    assert len(vocab.tokens) == len(set(vocab.tokens)) == len(vocab.token_types)
    padded = build_tiny_vocab(vocab_size=1000)
    assert len(padded.tokens) == 1000 and padded.tokens[-1] == "[PAD999]"


def test_tokenizer_metadata(tiny_qwen2: Path) -> None:
    m = GGUFFile.open(tiny_qwen2).metadata
    tokens = m["tokenizer.ggml.tokens"]
    assert (m["tokenizer.ggml.model"], m["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert tokens[m["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert tokens[m["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert m["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in m["tokenizer.chat_template"]
    assert len(m["tokenizer.ggml.token_type"]) == len(tokens)


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.Q5_0,
                                   QType.Q2_K, QType.Q3_K])
def test_quantize_round_trip(qtype: QType) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    x[0] = 0.0  # all-zero blocks must not divide by zero
    x[1, :256] = np.abs(x[1, :256])  # all-positive block (no negative min)
    y = quants.dequantize(quantize(x, qtype), qtype)
    bits = {QType.Q4_K: 4, QType.Q5_K: 5, QType.Q6_K: 6, QType.Q8_0: 8, QType.Q5_0: 5,
            QType.Q2_K: 2, QType.Q3_K: 3}[qtype]
    rel = np.sqrt(np.mean((y - x) ** 2)) / x.std()
    assert rel < 2.0 ** (2 - bits), rel
    np.testing.assert_array_equal(y[0], 0.0)


def test_block_size_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Q4_K"):
        write_tiny_model(tmp_path / "m.gguf", weight_types=QType.Q4_K)
    with pytest.raises(ValueError, match="cannot quantize"):
        quantize(np.zeros((2, 48), np.float32), QType.Q8_0)


def test_weight_type_per_role(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", weight_type={"ffn_up": QType.Q8_0}, tied=False,
                            seed=3)
    f = GGUFFile.open(path)
    assert f.tensors["blk.1.ffn_up.weight"].type_name == "Q8_0"
    assert f.tensors["blk.1.ffn_gate.weight"].type_name == "F32"
    assert f.tensors["output.weight"].shape == (64, len(f.metadata["tokenizer.ggml.tokens"]))
    norm = f.array("blk.0.attn_norm.weight")
    assert 0.8 < norm.mean() < 1.2
    assert 0.01 < f.array("blk.0.attn_q.weight").std() < 0.2


def test_seed_is_deterministic(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", seed=7).read_bytes()
    assert write_tiny_model(tmp_path / "b.gguf", seed=7).read_bytes() == a
    assert write_tiny_model(tmp_path / "c.gguf", seed=8).read_bytes() != a


def test_no_chat_template_and_copy(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", chat_template="")
    assert "tokenizer.chat_template" not in GGUFFile.open(path).metadata
    copy = copy_gguf(path, tmp_path / "c.gguf", metadata={"general.name": "copy"})
    f = GGUFFile.open(copy)
    assert f.metadata["general.name"] == "copy"
    assert HParams.from_gguf(f) == HParams.from_gguf(GGUFFile.open(path))


@pytest.mark.slow
def test_model_like_qwen25_05b(tmp_path: Path) -> None:
    f = GGUFFile.open(write_model_like_qwen25_05b(tmp_path / "big.gguf"))
    hp = HParams.from_gguf(f)
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_vocab) == (
        24, 896, 14, 2, 4864, 151936)
    assert f.tensors["blk.3.ffn_down.weight"].type_name == "Q4_K"
    assert abs(f.file_size - 491_400_064) < 0.1 * 491_400_064


def _logits(path: Path) -> tuple[HParams, np.ndarray]:
    f = GGUFFile.open(path)
    hp = HParams.from_gguf(f)
    ids = [1, 50, 300, 7, 99, 120, 5, 42]
    return hp, Engine(f, hp, n_ctx=64, kv_type="f32").forward(ids, 0, n_out=len(ids))


def test_tiny_qwen35_loads_and_runs(tmp_path: Path) -> None:
    """The Gated DeltaNet hybrid as llama.cpp lays it out: layers 0-2 recurrent, 3 attention,
    the ssm.* sizes read back; finite logits that vary with the input (the same file gives
    llama.cpp's logits within 1e-4, checked by hand at writing)."""
    hp, logits = _logits(write_qwen35(tmp_path / "q35.gguf"))
    assert hp.arch == "qwen35" and hp.recurrent_layers == (True, True, True, False)
    assert (hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_dim, hp.shortconv_l_cache) == (2, 4, 16, 4)
    assert np.isfinite(logits).all() and logits.std(axis=0).mean() > 1e-3


def test_tiny_gptoss_in_the_mxfp4_moe_mix_loads_and_runs(tmp_path: Path) -> None:
    """gpt-oss with sinks, biases and the sliding window on the even layers; written in
    llama-quantize's MXFP4_MOE mix (experts MXFP4, other matrices Q8_0, router F32)."""
    path = write_gptoss(tmp_path / "oss.gguf", weight_types=FType.MOSTLY_MXFP4_MOE)
    f = GGUFFile.open(path)
    assert f.tensors["blk.1.ffn_down_exps.weight"].type_name == "MXFP4"
    assert f.tensors["blk.1.attn_q.weight"].type_name == "Q8_0"
    assert f.tensors["output.weight"].type_name == "Q8_0"
    assert f.tensors["blk.0.ffn_gate_inp.weight"].type_name == "F32"
    hp, logits = _logits(path)
    assert hp.attn_sinks and hp.moe_bias and hp.swa_layers[:2] == (True, False)
    assert np.isfinite(logits).all() and logits.std(axis=0).mean() > 1e-3
