"""minfer.tools.synth.mmproj: tiny-dims variants of the synthetic SigLIP (gemma3) and Qwen3-VL
(qwen3vl_merger) towers load and encode in minfer (finite rows of the right shape), and carry the
metadata and tensor types llama.cpp's converter writes (the text model's input width matches)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from minfer.engine.vision.encoder import VisionEncoder
from minfer.gguf.reader import GGUFFile
from minfer.tools.synth.mmproj import (
    write_qwen3vl_mmproj,
    write_siglip_mmproj,
    write_text_for_mmproj,
)


def test_siglip_tiny_encodes(tmp_path: Path) -> None:
    path = write_siglip_mmproj(tmp_path / "siglip.gguf", n_layer=2, n_embd=64, n_head=4,
                               n_ff=96, patch=14, image_size=112, n_embd_text=128)
    f = GGUFFile.open(path)
    assert f.metadata["clip.projector_type"] == "gemma3"
    types = {n: int(t.ggml_type) for n, t in f.tensors.items()}
    assert types["v.blk.1.ffn_down.weight"] == types["mm.input_projection.weight"] == QType.F16
    assert types["v.patch_embd.weight"] == types["v.blk.0.ln1.bias"] == QType.F32
    enc = VisionEncoder(path)
    rows = enc.encode_pixels(np.random.default_rng(0).uniform(-1, 1, (3, 112, 112)))
    assert rows.shape == (4, 128) and np.isfinite(rows).all() and rows.std() > 0.1
    text = GGUFFile.open(write_text_for_mmproj(tmp_path / "text.gguf", path))
    assert text.metadata["gemma3.embedding_length"] == 128


def test_qwen3vl_tiny_encodes(tmp_path: Path) -> None:
    path = write_qwen3vl_mmproj(tmp_path / "qwen3vl.gguf", n_layer=3, n_embd=64, n_head=4,
                                n_ff=96, patch=16, n_pos=16, deepstack=(0, 2), n_embd_text=128,
                                weight_type=QType.Q8_0)
    enc = VisionEncoder(path)
    cp = enc.params
    assert (cp.projector, cp.n_merge, cp.deepstack, cp.image_size) == (
        "qwen3vl_merger", 2, (0, 2), 64)
    assert int(enc.file.tensors["v.position_embd.weight"].ggml_type) == QType.F32
    rows = enc.encode_pixels(np.random.default_rng(1).uniform(-1, 1, (3, 64, 96)))
    assert rows.shape == (2 * 3, 3 * 128) and np.isfinite(rows).all()  # main | 2 deepstack
    text = GGUFFile.open(write_text_for_mmproj(tmp_path / "text.gguf", path))
    assert text.metadata["general.architecture"] == "qwen3vl"
    assert text.metadata["qwen3vl.n_deepstack_layers"] == 2
    assert text.metadata["qwen3vl.embedding_length"] == 128
