"""HParams: read from metadata with defaults, validated against every required tensor's shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from minfer.errors import GGUFError, ModelError
from minfer.gguf import GGUFFile
from minfer.gguf.hparams import HParams
from minfer.tools.synth import copy_gguf, write_tiny_model


def test_tiny_qwen2(tiny_qwen2: Path) -> None:
    hp = HParams.from_gguf(GGUFFile.open(tiny_qwen2))
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv) == ("qwen2", 2, 64, 4, 2)
    assert (hp.head_dim, hp.rope_dim, hp.n_ff, hp.n_ctx_train) == (16, 16, 128, 2048)
    assert hp.rope_base == 10000.0 and hp.rms_eps == pytest.approx(1e-6)
    assert hp.tie_embeddings and hp.has_qkv_bias and not hp.has_qk_norm
    assert hp.n_vocab == len(GGUFFile.open(tiny_qwen2).metadata["tokenizer.ggml.tokens"])


def test_tiny_qwen3(tiny_qwen3: Path) -> None:
    hp = HParams.from_gguf(GGUFFile.open(tiny_qwen3))
    assert (hp.arch, hp.n_embd, hp.head_dim, hp.n_ff) == ("qwen3", 256, 32, 512)
    assert not hp.tie_embeddings and not hp.has_qkv_bias and hp.has_qk_norm


def test_defaults_for_optional_keys(tmp_path: Path) -> None:
    mha = write_tiny_model(tmp_path / "mha.gguf", n_head=4, n_head_kv=4, rope_base=5e5)
    path = copy_gguf(mha, tmp_path / "m.gguf", metadata={
        "qwen2.rope.freq_base": None, "qwen2.attention.head_count_kv": None})
    hp = HParams.from_gguf(GGUFFile.open(path))
    assert hp.rope_base == 10000.0
    assert hp.n_head_kv == hp.n_head == 4


@pytest.mark.parametrize("key", ["qwen2.block_count", "qwen2.embedding_length",
                                 "qwen2.attention.head_count", "qwen2.feed_forward_length",
                                 "qwen2.context_length", "qwen2.attention.layer_norm_rms_epsilon",
                                 "general.architecture"])
def test_missing_required_key(tmp_path: Path, tiny_qwen2: Path, key: str) -> None:
    path = copy_gguf(tiny_qwen2, tmp_path / "m.gguf", metadata={key: None})
    with pytest.raises(GGUFError, match=key.split(".", 1)[-1].split(".")[-1]):
        HParams.from_gguf(GGUFFile.open(path))


def test_unsupported_architecture(tmp_path: Path, tiny_qwen2: Path) -> None:
    path = copy_gguf(tiny_qwen2, tmp_path / "m.gguf", metadata={"general.architecture": "mamba"})
    with pytest.raises(ModelError, match="'mamba'"):
        HParams.from_gguf(GGUFFile.open(path))


@pytest.mark.parametrize(("change", "tensor"), [
    ({"qwen2.feed_forward_length": 96}, "blk.0.ffn_gate.weight"),
    ({"qwen2.attention.head_count_kv": 1}, "blk.0.attn_k.weight"),
    ({"qwen2.attention.key_length": 8, "qwen2.attention.value_length": 8},
     "blk.0.attn_q.weight"),
    ({"qwen2.embedding_length": 128}, "token_embd.weight"),
    ({"qwen2.block_count": 3}, "blk.2.attn_norm.weight"),
    ({"qwen2.block_count": 1 << 60}, "blk.2.attn_norm.weight"),
])
def test_shape_mismatch_names_the_tensor(tmp_path: Path, tiny_qwen2: Path,
                                         change: dict[str, int], tensor: str) -> None:
    path = copy_gguf(tiny_qwen2, tmp_path / "m.gguf", metadata=change)
    with pytest.raises(GGUFError, match=tensor.replace(".", r"\.")):
        HParams.from_gguf(GGUFFile.open(path))


@pytest.mark.parametrize("tensor", ["blk.1.ffn_down.weight", "output_norm.weight",
                                    "blk.0.attn_v.bias", "blk.1.attn_output.weight"])
def test_missing_tensor(tmp_path: Path, tiny_qwen2: Path, tensor: str) -> None:
    path = copy_gguf(tiny_qwen2, tmp_path / "m.gguf", drop_tensors=[tensor])
    with pytest.raises(GGUFError, match=f"missing tensor '{tensor}'"):
        HParams.from_gguf(GGUFFile.open(path))


@pytest.mark.parametrize(("key", "value"), [("qwen2.block_count", "two"),
                                            ("qwen2.attention.head_count", 0),
                                            ("qwen2.attention.layer_norm_rms_epsilon", -1.0),
                                            ("qwen2.rope.freq_base", float("nan")),
                                            ("qwen2.attention.head_count_kv", 3)])
def test_bad_values(tmp_path: Path, tiny_qwen2: Path, key: str, value: object) -> None:
    path = copy_gguf(tiny_qwen2, tmp_path / "m.gguf", metadata={key: value})
    with pytest.raises(GGUFError, match=key.rsplit(".", 1)[-1]):
        HParams.from_gguf(GGUFFile.open(path))


def test_explicit_head_dim(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", n_embd=64, n_head=4, head_dim=32)
    hp = HParams.from_gguf(GGUFFile.open(path))
    assert hp.head_dim == 32 and hp.rope_dim == 32


@pytest.mark.real_model
def test_real_model(real_model_path: Path) -> None:
    hp = HParams.from_gguf(GGUFFile.open(real_model_path))
    assert hp == HParams(arch="qwen2", n_layer=24, n_embd=896, n_head=14, n_head_kv=2,
                         head_dim=64, n_ff=4864, n_vocab=151936, n_ctx_train=32768,
                         rms_eps=hp.rms_eps, rope_base=1e6, rope_dim=64, tie_embeddings=False,
                         has_qkv_bias=True, has_qk_norm=False)
    assert hp.rms_eps == pytest.approx(1e-6)
