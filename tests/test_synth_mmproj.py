"""minfer.tools.synth.mmproj: tiny-dims variants of the synthetic SigLIP (gemma3), Qwen3-VL
(qwen3vl_merger) and Idefics3 (SmolVLM) towers load and encode in minfer (finite rows of the right
shape), and carry the metadata and tensor types llama.cpp's converter writes (the text model's
input width matches; Idefics3's text model holds the markers its image prompt needs)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from minfer.engine.vision.encoder import VisionEncoder
from minfer.gguf.reader import GGUFFile
from minfer.tools.synth.mmproj import (
    IDEFICS3_TOKENS,
    idefics3_vocab,
    write_idefics3_mmproj,
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


def test_idefics3_tiny_encodes_and_lays_out_an_image(tmp_path: Path) -> None:
    from PIL import Image

    from minfer.api import Model

    path = write_idefics3_mmproj(tmp_path / "mmproj.gguf", n_layer=2, n_embd=64, n_head=4,
                                 n_ff=96, patch=8, image_size=32, scale=2, longest_edge=64,
                                 n_embd_text=64)
    enc = VisionEncoder(path)
    cp = enc.params
    assert (cp.projector, cp.n_merge, cp.longest_edge) == ("idefics3", 2, 64)
    assert int(enc.file.tensors["mm.model.fc.weight"].ggml_type) == QType.F16
    rows = enc.encode_pixels(np.random.default_rng(2).uniform(-1, 1, (3, 32, 32)))
    assert rows.shape == (4, 64) and np.isfinite(rows).all() and rows.std() > 0.1
    write_text_for_mmproj(tmp_path / "model.gguf", path)
    png = io.BytesIO()
    Image.new("RGB", (60, 40), (10, 120, 200)).save(png, "PNG")
    model = Model(tmp_path / "model.gguf", n_ctx=256)  # its mmproj found beside it
    ids, _, blocks = model.chat_images([{"role": "user", "content": [
        {"type": "image", "data": png.getvalue()}, {"type": "text", "text": "what is it"}]}])
    assert [b.n for b in blocks] == [4] * 5  # 2 x 2 tiles of 32 and the overview
    tok = model.tokenizer
    for marker in IDEFICS3_TOKENS[:3]:  # one id each, as mtmd looks them up
        assert tok.token_id(marker) is not None and ids.count(tok.token_id(marker)) > 0
    assert len(tok.encode("\n\n", special=True, add_bos=False)) == 1
    assert len(idefics3_vocab(1000).tokens) == 1000
