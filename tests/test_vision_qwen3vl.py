"""Qwen3-VL mmproj files (`qwen3vl_merger`) against transformers on the same image.

tests/fixtures/qwen3vl/ comes from benchmarks/make_qwen3vl_fixtures.py: a tiny random
Qwen3VLForConditionalGeneration converted by llama.cpp 0.3.36 (f32), a generated 64 x 48 image
(8 x 6 patches of 8, 4 x 3 merged tokens), transformers' pixel_values (each frame twice, patches
in merge-window order) and image features (the merger's and the deepstack merger's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minfer.gguf.clip import ClipParams
from minfer.gguf.reader import GGUFFile

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3vl"
REF = np.load(FIXTURES / "ref.npz")


def _params() -> ClipParams:
    return ClipParams.from_gguf(GGUFFile.open(FIXTURES / "mmproj.gguf"))


def test_clip_params_read_as_clip_cpp() -> None:
    cp = _params()
    assert (cp.projector, cp.patch_size, cp.n_merge, cp.deepstack) == (
        "qwen3vl_merger", 8, 2, (0,))
    assert (cp.n_embd, cp.n_layer, cp.n_head, cp.n_embd_text, cp.patches_per_side) == (
        32, 2, 2, 64, 4)
    assert cp.dynamic and cp.pixel_limits == (8 * 256, 4096 * 256)


def test_smart_resize_as_clip_cpp() -> None:
    from minfer.engine.vision.image import smart_size

    assert smart_size(64, 48, 16, 2048, 4096 * 256) == (64, 48)  # already aligned
    assert smart_size(70, 41, 16, 2048, 4096 * 256) == (64, 48)  # rounded
    assert smart_size(20, 20, 16, 2048, 4096 * 256) == (48, 48)  # up to the fewest pixels
    assert smart_size(1000, 500, 16, 2048, 64 * 256) == (176, 80)  # down to the most
    assert smart_size(8, 200, 16, 2048, 4096 * 256) == (16, 208)  # at least one merge


def test_pixels_equal_transformers() -> None:
    """No resize at 64 x 48; normalised, the patches (c, y, x) in merge-window order are
    transformers' pixel_values' first frame."""
    from minfer.engine.vision.image import patches, preprocess

    cp = _params()
    px = preprocess((FIXTURES / "image.png").read_bytes(), cp)
    assert px.chunks.shape == (1, 3, 48, 64) and px.grid == (6, 8)
    rows = patches(px.chunks[0], 8)
    order = np.arange(48).reshape(3, 2, 4, 2).transpose(0, 2, 1, 3).reshape(-1)
    want = REF["pixels"].reshape(48, 3, 2, 64)
    np.testing.assert_array_equal(want[:, :, 0], want[:, :, 1])  # the frame twice
    np.testing.assert_allclose(rows[order], want[:, :, 0].reshape(48, -1), atol=1e-5)


def test_image_features_match_transformers() -> None:
    from minfer.engine.vision.encoder import VisionEncoder

    enc = VisionEncoder(FIXTURES / "mmproj.gguf")
    image = enc.encode((FIXTURES / "image.png").read_bytes())
    assert (image.grid, image.per_chunk, image.projector) == ((3, 4), 12, "qwen3vl_merger")
    want = np.concatenate([REF["features"], REF["deepstack"][0]], axis=1)
    assert image.rows.shape == want.shape == (12, 128)
    assert float(np.abs(image.rows - want).max() / np.abs(want).max()) < 1e-4


def test_encoder_graph_is_one_tower_per_grid() -> None:
    from minfer.engine.vision.encoder import VisionEncoder

    enc = VisionEncoder(FIXTURES / "mmproj.gguf")
    rng = np.random.default_rng(0)
    a = enc.encode_pixels(rng.standard_normal((3, 32, 48)).astype(np.float32))
    assert a.shape == (6, 128)
    kinds = [n.op.kind for n in enc._graph.nodes]
    assert kinds.count("SeqAttn") == 2 and kinds.count("JoinRows") == 2
    assert sum(1 for n in enc._graph.nodes if n.op.kind == "Rope") == 4
