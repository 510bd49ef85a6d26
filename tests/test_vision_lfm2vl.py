"""LFM2-VL mmproj files (`lfm2`) against llama.cpp's mtmd and transformers on the same images.

tests/fixtures/lfm2vl/ comes from benchmarks/make_lfm2vl_fixtures.py: a tiny random
Lfm2VlForConditionalGeneration converted by llama.cpp 0.3.36 (f32), a generated 320 x 256
image (a 20 x 16 patch grid, 10 x 8 merged tokens, no resize) and a 150 x 100 one (resized up to
320 x 224); `ref.npz` holds transformers' pixels, features, prompt ids, logits and greedy
answer, `mtmd.{json,npz}` llama.cpp's chunks, image rows, greedy answer and logits; also for
`big.png` (1000 x 700, which llama.cpp tiles: 3 x 2 tiles of 512 and a 608 x 416 thumbnail,
1783 image rows): its chunks, rows, greedy answer and logits (`big`, `big_embd`, `big_logits`).

Measured: minfer's rows are llama.cpp's to ~1e-6 in most rows (the tiled image: median 7e-7,
max 2.7e-4); a few rows are up to 3e-4 of
the largest value apart, where a GELU input (ggml looks GELU up in an f16 table) sits at an f16
rounding midpoint and the two round it a step apart (as Gemma 3's projection in
test_vision_mtmd.py). llama.cpp's and minfer's projector GELU is that tanh table, transformers'
the erf form: both are 4.2e-4 of the largest value from transformers' features.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from minfer.gguf.clip import ClipParams
from minfer.gguf.reader import GGUFFile

FIXTURES = Path(__file__).parent / "fixtures" / "lfm2vl"
REF = np.load(FIXTURES / "ref.npz")
MTMD = json.loads((FIXTURES / "mtmd.json").read_text())
MTMD_NPZ = np.load(FIXTURES / "mtmd.npz")
PROMPT = [{"role": "user", "content": [{"type": "image", "path": str(FIXTURES / "image.png")},
                                       {"type": "text", "text": "What is in the image?"}]}]


BIG = [{"role": "user", "content": [{"type": "image", "path": str(FIXTURES / "big.png")},
                                    {"type": "text", "text": "What is in the image?"}]}]


def _params() -> ClipParams:
    return ClipParams.from_gguf(GGUFFile.open(FIXTURES / "mmproj.gguf"))


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _row_rel(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got - want).max(axis=1) / np.abs(want).max()


def test_clip_params_read_as_clip_cpp() -> None:
    cp = _params()
    assert (cp.projector, cp.patch_size, cp.n_merge, cp.patches_per_side) == ("lfm2", 16, 2, 16)
    assert (cp.n_embd, cp.n_layer, cp.n_head, cp.n_embd_text) == (32, 3, 2, 64)
    assert cp.dynamic and cp.pixel_limits == (64 * 1024, 256 * 1024)


def test_pixels_equal_llama_cpp_and_transformers() -> None:
    """No resize at 320 x 256; the normalized patches are clip.cpp's formula and transformers'
    pixel_values (its patches (y, x, channel)) to float rounding; 150 x 100 goes up to
    clip.cpp's smart size 320 x 224 (the fewest pixels)."""
    from minfer.engine.vision.image import lfm2_tiles, patches, preprocess

    cp = _params()
    px = preprocess((FIXTURES / "image.png").read_bytes(), cp)
    assert np.stack(px.chunks).shape == (1, 3, 256, 320) and px.grid == (16, 20)
    want = REF["pixels"].reshape(320, 16, 16, 3).transpose(0, 3, 1, 2).reshape(320, -1)
    np.testing.assert_allclose(patches(px.chunks[0], 16), want, rtol=0, atol=1e-6)
    small = preprocess((FIXTURES / "small.png").read_bytes(), cp)
    assert np.stack(small.chunks).shape == (1, 3, 224, 320)
    assert MTMD["small_chunks"][1]["n_tokens"] == 7 * 10
    assert not lfm2_tiles(720, 720, cp) and lfm2_tiles(736, 736, cp)  # 22.5: to even


def test_big_image_is_tiled_as_llama_cpp() -> None:
    """1000 x 700 is past twice the most pixels: a 3 x 2 grid (aspect 1.5 closest to 1.43) of
    512-pixel tiles over the image letterboxed into 1536 x 1024 (1463 x 1024 centred on black:
    36 columns left, 37 right), then the smart-resized thumbnail 608 x 416 (19 x 13 merged tokens):
    mtmd's chunk sizes. The grid rule at a few aspects (clip.cpp's get_grid_layout)."""
    from minfer.engine.vision.image import lfm2_grid, preprocess

    cp = _params()
    px = preprocess((FIXTURES / "big.png").read_bytes(), cp)
    assert px.grid == (2, 3)
    assert [c.shape for c in px.chunks] == [(3, 512, 512)] * 6 + [(3, 416, 608)]
    black = (0 - np.array(cp.image_mean, np.float32)) / np.array(cp.image_std, np.float32)
    side = np.broadcast_to(black[:, None, None], (3, 512, 37))
    np.testing.assert_allclose(px.chunks[0][:, :, :36], side[:, :, :36], rtol=0, atol=1e-6)
    np.testing.assert_allclose(px.chunks[5][:, :, -37:], side, rtol=0, atol=1e-6)
    assert not np.allclose(px.chunks[0][:, :, 36], black[:, None])
    sizes = [c["n_tokens"] for c in MTMD["big"]["chunks"] if c["type"] == "image"]
    assert sizes == [256] * 6 + [19 * 13]
    assert lfm2_grid(1000, 700) == (3, 2) and lfm2_grid(700, 1000) == (2, 3)
    assert lfm2_grid(1000, 1000) == (2, 2) and lfm2_grid(4000, 500) == (8, 1)
    assert lfm2_grid(3000, 300) == (10, 1) and lfm2_grid(900, 1000) == (2, 2)


def test_tiled_prompt_layout_is_mtmds() -> None:
    """<|image_start|>, per tile <|img_row_r_col_c|> (tokenized text: one special token here)
    and its rows, <|img_thumbnail|> and the thumbnail's rows, <|image_end|>: mtmd's ids, image
    blocks at its image chunks."""
    from minfer.api import Model
    from minfer.engine.vision.image import EncodedImage
    from minfer.engine.vision.prompt import layout

    model = Model(FIXTURES / "model.gguf", n_ctx=256)
    sizes = (256,) * 6 + (247,)
    image = EncodedImage(np.zeros((sum(sizes), 64), np.float32), sizes, (2, 3), "lfm2")
    tok = model.tokenizer
    ids, blocks = layout(MTMD["prompt"], [image], tok.token_id, first=tok.encode_prompt,
                         rest=lambda t: tok.encode(t, add_bos=False))
    want = [t for c in MTMD["big"]["chunks"]
            for t in (c["tokens"] if c["type"] == "text" else [-1] * c["n_tokens"])]
    assert len(ids) == len(want) == MTMD["big"]["n_tokens"] == 1819
    assert all(w in (-1, t) for t, w in zip(ids, want, strict=True))
    assert [b.at for b in blocks] == [i for i, w in enumerate(want)
                                      if w == -1 and (i == 0 or want[i - 1] != -1)]
    text = tok.decode(ids)
    assert text.count("<image>") == 1783 and "<|img_row_2_col_3|>" + "<image>" in text
    assert "<|img_thumbnail|>" + "<image>" * 247 + "<|image_end|>" in text


def test_image_rows_match_llama_cpp_and_transformers() -> None:
    from minfer.engine.vision.encoder import VisionEncoder

    enc = VisionEncoder(FIXTURES / "mmproj.gguf")
    image = enc.encode((FIXTURES / "image.png").read_bytes())
    assert (image.per_chunk, image.projector) == (80, "lfm2")
    small = enc.encode((FIXTURES / "small.png").read_bytes()).rows
    for got, want in ((image.rows, MTMD_NPZ["embd"]), (small, MTMD_NPZ["small_embd"])):
        assert got.shape == want.shape
        rows = _row_rel(got, want)
        assert float(np.median(rows)) < 1e-5 and float(rows.max()) < 5e-4
    assert _rel(image.rows, REF["features"]) < 6e-4
    assert _rel(MTMD_NPZ["embd"], REF["features"]) < 6e-4  # llama.cpp's own gap


@pytest.mark.slow
def test_tiled_image_matches_llama_cpp() -> None:
    """The tiled image's rows are mtmd's (as the one-tile image's); the greedy answer after it
    is mtmd's and the last prompt logits within 1e-3. Its 1819 tokens are past the tiny
    model's trained context (512, which `Model` caps at; llama.cpp ran it at 2048): the engine
    is made with n_ctx 2048."""
    from minfer.api import Model
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams

    model = Model(FIXTURES / "model.gguf", n_ctx=256)
    ids, _, embd = model.chat_images(BIG)
    rows = np.concatenate([e.rows for e in embd])
    assert rows.shape == MTMD_NPZ["big_embd"].shape == (1783, 64)
    rel = _row_rel(rows, MTMD_NPZ["big_embd"])
    assert float(np.median(rel)) < 1e-5 and float(rel.max()) < 5e-4
    f = GGUFFile.open(FIXTURES / "model.gguf")
    engine = Engine(f, HParams.from_gguf(f), n_ctx=2048)
    logits = engine.forward(ids, 0, embd=[(e.at, e.rows, e.causal) for e in embd])[-1]
    assert _rel(logits, MTMD_NPZ["big_logits"][0]) < 1e-3
    greedy: list[int] = []
    for _ in MTMD["big"]["greedy"]:
        greedy.append(int(np.argmax(logits)))
        logits = engine.forward(greedy[-1:], len(ids) + len(greedy) - 1)[-1]
    assert greedy == MTMD["big"]["greedy"]


def test_tower_is_bound_once_per_patch_grid() -> None:
    """The graph's params are the grid: the same grid reuses its tower, another binds one."""
    from minfer.engine.vision.encoder import VisionEncoder

    enc = VisionEncoder(FIXTURES / "mmproj.gguf")
    rng = np.random.default_rng(0)
    a = enc.encode_pixels(rng.standard_normal((3, 256, 320)).astype(np.float32))
    first = enc._towers[(16, 20)]
    b = enc.encode_pixels(rng.standard_normal((3, 256, 320)).astype(np.float32))
    assert enc._towers[(16, 20)] is first and a.shape == b.shape == (80, 64)
    c = enc.encode_pixels(rng.standard_normal((3, 224, 320)).astype(np.float32))
    assert c.shape == (70, 64) and list(enc._towers) == [(16, 20), (14, 20)]
    kinds = [n.op.kind for n in enc._graph.nodes]
    assert kinds.count("SeqAttn") == 3 and kinds.count("JoinRows") == 1


def test_prompt_layout_is_mtmds() -> None:
    from minfer.api import Model

    model = Model(FIXTURES / "model.gguf", n_ctx=256)
    ids, _, embd = model.chat_images(PROMPT)
    assert ids == REF["ids"].tolist()
    want = [t for c in MTMD["chunks"]
            for t in (c["tokens"] if c["type"] == "text" else [-1] * c["n_tokens"])]
    assert len(ids) == len(want) == MTMD["n_tokens"]
    assert all(w in (-1, t) for t, w in zip(ids, want, strict=True))
    (block,) = embd
    assert (block.n, block.causal) == (80, True)
    text = model.tokenizer.decode(ids)
    assert "<|image_start|>" + "<image>" * 80 + "<|image_end|>" in text


def test_logits_and_greedy_answer_match() -> None:
    """The prompt's logits with the image are transformers' (5e-3 of the largest: its erf GELU
    in the projector), llama.cpp's last one within 1e-3; the greedy answer is both's."""
    from minfer.api import Model
    from minfer.engine.forward import Engine
    from minfer.engine.generate import Finished
    from minfer.gguf.hparams import HParams
    from minfer.sampling.params import SamplerParams

    model = Model(FIXTURES / "model.gguf", n_ctx=256)
    ids, _, embd = model.chat_images(PROMPT)
    f = GGUFFile.open(FIXTURES / "model.gguf")
    engine = Engine(f, HParams.from_gguf(f), n_ctx=256)
    got = engine.forward(ids, 0, n_out=len(ids), embd=[(e.at, e.rows, e.causal) for e in embd])
    assert _rel(got, REF["logits"]) < 5e-3  # the image rows' GELU gap (module docstring)
    want = MTMD["greedy"]
    assert want == REF["greedy"].tolist()
    *_, done = model.stream(ids, max_tokens=len(want), embd=embd,
                            sampling=SamplerParams(temp=0.0), top_logits=3)
    assert isinstance(done, Finished) and done.ids == want
    assert _rel(got[-1], MTMD_NPZ["logits"][0]) < 1e-3


@pytest.mark.slow
def test_live_mtmd_gives_the_committed_results(tmp_path: Path) -> None:
    """llama.cpp's mtmd re-run now (skipped without a reference interpreter): the same
    chunks, greedy answer and image rows as the fixture."""
    from tests import mtmd_ref
    from tests.test_vision_mtmd import _ref_python

    python = _ref_python()
    live = mtmd_ref.run(python, FIXTURES / "model.gguf", FIXTURES / "mmproj.gguf",
                        FIXTURES / "image.png", MTMD["prompt"], tmp_path / "live.npz",
                        n_greedy=8)
    assert live["chunks"] == MTMD["chunks"] and live["greedy"] == MTMD["greedy"]
    now = np.load(tmp_path / "live.npz")
    np.testing.assert_allclose(now["embd"], MTMD_NPZ["embd"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(now["logits"], MTMD_NPZ["logits"], rtol=0, atol=1e-4)
    big = mtmd_ref.run(python, FIXTURES / "model.gguf", FIXTURES / "mmproj.gguf",
                       FIXTURES / "big.png", MTMD["prompt"], tmp_path / "big.npz", n_greedy=8,
                       n_ctx=2048)
    assert big == MTMD["big"]
    now = np.load(tmp_path / "big.npz")
    np.testing.assert_allclose(now["embd"], MTMD_NPZ["big_embd"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(now["logits"], MTMD_NPZ["big_logits"], rtol=0, atol=1e-4)
