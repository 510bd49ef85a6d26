"""Idefics3 (SmolVLM) mmproj files against transformers on the same image.

tests/fixtures/idefics3/ comes from benchmarks/make_idefics3_fixtures.py: a tiny random
Idefics3ForConditionalGeneration converted by llama.cpp 0.3.36 (text GGUF + `--mmproj`, f32),
a generated 60 x 40 image (2 x 2 tiles of 32 plus the overview), transformers' pixels
(Idefics3ImageProcessorPil), image features, the prompt's ids as llama.cpp's mtmd lays them out,
the logits of every prompt position and the greedy continuation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from minfer.gguf.clip import ClipParams
from minfer.gguf.reader import GGUFFile

FIXTURES = Path(__file__).parent / "fixtures" / "idefics3"
REF = np.load(FIXTURES / "ref.npz")
PROMPT = [{"role": "user", "content": [{"type": "image", "path": str(FIXTURES / "image.png")},
                                       {"type": "text", "text": "What is in the image?"}]}]


def _params() -> ClipParams:
    return ClipParams.from_gguf(GGUFFile.open(FIXTURES / "mmproj.gguf"))


def test_clip_params_read_as_clip_cpp() -> None:
    cp = _params()
    assert (cp.projector, cp.image_size, cp.patch_size, cp.n_merge) == ("idefics3", 32, 8, 2)
    assert (cp.n_embd, cp.n_layer, cp.n_head, cp.n_embd_text) == (48, 2, 4, 64)
    assert cp.longest_edge == 64 and cp.n_image_tokens == 4


def test_old_file_without_longest_edge_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from minfer.errors import ModelError

    f = GGUFFile.open(FIXTURES / "mmproj.gguf")
    monkeypatch.delitem(f.metadata, "clip.vision.preproc_image_size")
    with pytest.raises(ModelError, match="preproc_image_size"):
        ClipParams.from_gguf(f)


def test_tiles_and_overview_equal_transformers() -> None:
    """Resized to the longest edge (64 x 42), stretched to whole tiles (64 x 64), 2 x 2 tiles
    row-major then the overview: the pixels Idefics3ImageProcessorPil computes."""
    from minfer.engine.vision.image import preprocess

    px = preprocess((FIXTURES / "image.png").read_bytes(), _params())
    assert px.grid == (2, 2)
    assert np.stack(px.chunks).shape == REF["pixels"].shape == (5, 3, 32, 32)
    np.testing.assert_allclose(px.chunks, REF["pixels"], atol=1e-5)


def test_tiling_rules_as_mtmd() -> None:
    """llama.cpp's sizes: the short side int(longest / aspect) rounded up to even, tiles
    rounded up; a portrait image the same way round; an image within one tile still one tile
    plus the overview (transformers would not split it)."""
    from PIL import Image

    from minfer.engine.vision.image import tiles

    chunks, grid = tiles(Image.new("RGB", (30, 70), (9, 9, 9)), 32, 64)
    assert grid == (2, 1) and len(chunks) == 3  # 28 x 64 -> 32 x 64
    chunks, grid = tiles(Image.new("RGB", (100, 21), (9, 9, 9)), 32, 96)
    assert grid == (1, 3) and len(chunks) == 4  # 96 x int(20.16) = 20 -> even 20
    chunks, grid = tiles(Image.new("RGB", (10, 10), (9, 9, 9)), 32, 32)
    assert grid == (1, 1) and len(chunks) == 2
    assert all(c.shape == (32, 32, 3) for c in chunks)


def test_image_features_match_transformers() -> None:
    from minfer.engine.vision.encoder import VisionEncoder

    enc = VisionEncoder(FIXTURES / "mmproj.gguf")
    got = np.concatenate([enc.encode_pixels(c) for c in REF["pixels"]])
    want = REF["features"]
    assert got.shape == want.shape == (20, 64)
    # llama.cpp's numbers (the patch embedding in f16: test_vision_mtmd holds minfer to
    # llama.cpp's rows within 1e-4), 2.5e-4 from transformers' exact f32 ones here
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3
    image = enc.encode((FIXTURES / "image.png").read_bytes())
    assert (image.grid, image.per_chunk, image.projector) == ((2, 2), 4, "idefics3")
    np.testing.assert_array_equal(image.rows, got)


def test_encoder_graph_shows_the_pixel_shuffle() -> None:
    from minfer.engine.vision.encoder import VisionEncoder

    kinds = [n.op.kind for n in VisionEncoder(FIXTURES / "mmproj.gguf")._graph.nodes]
    assert "JoinRows" in kinds and "Pool" not in kinds and kinds.count("SeqAttn") == 2


def test_chat_prompt_lays_the_image_out_as_mtmd() -> None:
    """Tiles `<fake_token_around_image><row_r_col_c>` + 4 `<image>` each, `\\n` between tile
    rows, `\\n\\n<fake_token_around_image><global-img>` + the overview's rows +
    `<fake_token_around_image>`: the ids llama.cpp's mtmd would decode (the fixture's), each
    chunk a causal block of rows."""
    from minfer.api import Model

    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    assert ids == REF["ids"].tolist()
    assert [e.n for e in embd] == [4] * 5 and all(e.causal for e in embd)
    image = model.tokenizer.token_id("<image>")
    assert all(ids[e.at:e.at + 4] == [image] * 4 for e in embd)
    text = model.tokenizer.decode(ids)
    assert "<row_1_col_2>" in text and "\n\n<fake_token_around_image><global-img>" in text


def test_logits_after_the_image_match_transformers() -> None:
    from minfer.api import Model
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams

    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    f = GGUFFile.open(FIXTURES / "model.gguf")
    engine = Engine(f, HParams.from_gguf(f), n_ctx=128)
    got = engine.forward(ids, 0, n_out=len(ids), embd=[(e.at, e.rows, e.causal) for e in embd])
    want = REF["logits"]
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3


def test_greedy_answer_matches_transformers_generate() -> None:
    """The Python API's greedy tokens after the image are transformers' generate's (the tiny
    model's logits have no near-ties on this prompt: asserted, so a tie would show here)."""
    from minfer.api import Model
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    want = REF["greedy"].tolist()
    logits = REF["logits"][-1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] > 1e-3  # the first choice is not a near-tie
    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    *_, done = model.stream(ids, max_tokens=len(want), embd=embd,
                            sampling=SamplerParams(temp=0.0))
    assert isinstance(done, Finished) and done.ids == want


def test_minfer_run_with_an_image(capsys: pytest.CaptureFixture[str]) -> None:
    """`minfer run --image FILE` on the tiny SmolVLM (its mmproj found beside it): the prompt
    holds the image's 20 placeholders and the reply's first tokens are transformers' greedy
    ones for the same chat."""
    from minfer.cli.main import main

    args = ["run", str(FIXTURES / "model.gguf"), "--json", "What is in the image?", "--temp",
            "0", "-n", "8", "-c", "128", "--image", str(FIXTURES / "image.png")]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == REF["ids"].tolist()
    n = len(out["ids"])
    assert n >= 1 and out["ids"] == REF["greedy"].tolist()[:n]
