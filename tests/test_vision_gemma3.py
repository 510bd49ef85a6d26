"""Gemma 3's vision tower (mmproj) against transformers on the same pixels.

tests/fixtures/vision/ comes from benchmarks/make_vision_fixtures.py: a tiny random
Gemma3ForConditionalGeneration's tower converted by llama.cpp 0.3.36 (`--mmproj`, f32), a
generated 48 x 48 image, transformers' pixel values (Gemma3ImageProcessorPil) and image
features (get_image_features, float32).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minfer.engine.forward import Engine
from minfer.errors import ModelError
from minfer.gguf.clip import ClipParams
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

FIXTURES = Path(__file__).parent / "fixtures" / "vision"
REF = np.load(FIXTURES / "ref.npz")


def test_clip_params_read_as_clip_cpp() -> None:
    cp = ClipParams.from_gguf(GGUFFile.open(FIXTURES / "mmproj.gguf"))
    assert (cp.projector, cp.image_size, cp.patch_size, cp.n_merge) == ("gemma3", 64, 8, 4)
    assert (cp.n_embd, cp.n_layer, cp.n_head, cp.n_embd_text) == (48, 2, 4, 64)
    assert cp.n_image_tokens == 4
    assert cp.image_mean == pytest.approx((0.48, 0.45, 0.41))


def test_unsupported_projector_named(monkeypatch: pytest.MonkeyPatch) -> None:
    f = GGUFFile.open(FIXTURES / "mmproj.gguf")
    monkeypatch.setitem(f.metadata, "clip.projector_type", "qwen3vl")
    with pytest.raises(ModelError, match="'qwen3vl'"):
        ClipParams.from_gguf(f)


def test_preprocessing_equals_transformers() -> None:
    from minfer.engine.vision.image import preprocess

    cp = ClipParams.from_gguf(GGUFFile.open(FIXTURES / "mmproj.gguf"))
    px = preprocess((FIXTURES / "image.png").read_bytes(), cp)
    assert px.grid == (0, 0) and len(px.chunks) == 1
    got = px.chunks[0]
    assert got.shape == REF["pixels"].shape
    np.testing.assert_allclose(got, REF["pixels"], atol=1e-5)


def test_corrupt_image_is_a_clear_error() -> None:
    from minfer.engine.vision.image import ImageError, decode

    with pytest.raises(ImageError, match="cannot be decoded"):
        decode(b"not an image")
    png = (FIXTURES / "image.png").read_bytes()
    with pytest.raises(ImageError):
        decode(png[:200])


def test_gif_first_frame_and_letterbox() -> None:
    from PIL import Image

    from minfer.engine.vision.image import decode, resized

    buf = io.BytesIO()
    frames = [Image.new("RGB", (20, 10), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    img = decode(buf.getvalue())
    sq = resized(img, 40)  # 20 x 10 -> 40 x 20, centred on black
    assert sq.shape == (40, 40, 3)
    assert sq[20, 20, 0] > 200 and sq[20, 20, 1] < 50
    assert sq[0, 20].max() == 0 and sq[39, 20].max() == 0


def test_image_features_match_transformers() -> None:
    from minfer.engine.vision.encoder import VisionEncoder

    enc = VisionEncoder(FIXTURES / "mmproj.gguf")
    got = enc.encode_pixels(REF["pixels"])
    want = REF["features"]
    assert got.shape == want.shape
    # llama.cpp's numbers, not exact f32 ones: the patch embedding in f16 and the f16
    # projection's input rounded to f16 (test_vision_mtmd holds minfer to llama.cpp's rows);
    # llama.cpp's own rows are 3.5e-4 from transformers' here
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3
    # batch-invariant and repeatable: the same image again gives the same bits
    np.testing.assert_array_equal(enc.encode((FIXTURES / "image.png").read_bytes()).rows,
                                  enc.encode_pixels(REF["pixels"]))


def _engine(**fields: Any) -> Engine:
    f = GGUFFile.open(FIXTURES / "model.gguf")
    return Engine(f, HParams.from_gguf(f), n_ctx=128, **fields)


def _image_rows() -> np.ndarray:
    from minfer.engine.vision.encoder import VisionEncoder

    return VisionEncoder(FIXTURES / "mmproj.gguf").encode(
        (FIXTURES / "image.png").read_bytes()).rows


def test_logits_after_an_image_match_transformers() -> None:
    """The image's rows replace the token embeddings of its 4 tokens (after Gemma's sqrt(n_embd)
    scaling, unscaled themselves), the image tokens read each other both ways, and every
    position's logits are transformers' (the image between <start_of_image> and
    <end_of_image>, as llama.cpp's mtmd lays it out)."""
    from minfer.engine.forward import Batch

    ref = np.load(FIXTURES / "ref_logits.npz")
    ids = ref["ids"].tolist()
    at = ids.index(5)
    engine = _engine()
    batch = Batch.single(ids, 0, n_out=len(ids)).with_rows(at, _image_rows())
    assert batch.kv_end[at:at + 4].tolist() == [at + 4] * 4
    got = engine.forward_batch(batch)
    want = ref["logits"]
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3
    # causal image rows would differ: the image's first token reads its last ones
    causal = Batch.single(ids, 0, n_out=len(ids)).with_rows(at, _image_rows())
    causal = dataclasses.replace(causal, kv_end=np.arange(1, len(ids) + 1, dtype=np.int32))
    assert np.abs(engine.forward_batch(causal) - want).max() > 1e-2


def test_image_rows_are_batch_invariant() -> None:
    """A text row's result does not depend on an image elsewhere in the batch: two sequences
    packed, one with the image, give the text-only sequence's logits bitwise as run alone."""
    from minfer.engine.forward import Batch

    ref = np.load(FIXTURES / "ref_logits.npz")
    ids = ref["ids"].tolist()
    text = [1, 60, 61, 62, 63, 64]
    engine = _engine(batch_invariant=True)
    alone = engine.forward_batch(Batch.single(text, 0, n_out=len(text)))
    one = Batch.single(ids, 0, n_out=len(ids))
    two = Batch.single(text, 0, n_out=len(text))
    off = 32  # the second sequence's cells
    both = Batch(tokens=np.concatenate([one.tokens, two.tokens]),
                 positions=np.concatenate([one.positions, two.positions]),
                 cells=np.concatenate([one.cells, two.cells + off]),
                 kv_start=np.concatenate([one.kv_start, two.kv_start + off]),
                 kv_end=np.concatenate([one.kv_end, two.kv_end + off]),
                 out_rows=np.arange(len(ids) + len(text), dtype=np.int32))
    got = engine.forward_batch(both.with_rows(ids.index(5), _image_rows()))
    np.testing.assert_array_equal(got[len(ids):], alone)


def _image_part(kind: str) -> dict[str, Any]:
    png = (FIXTURES / "image.png").read_bytes()
    if kind == "path":
        return {"type": "image", "path": str(FIXTURES / "image.png")}
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"type": "image_url", "image_url": {"url": url}}


MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "look "}, _image_part("url"),
                                         {"type": "text", "text": " here"}]}]


def test_chat_prompt_lays_the_image_out_as_mtmd() -> None:
    """The image part becomes the text <start_of_image>, one placeholder per image row, the
    text <end_of_image> where the template put the part (tokenized as text, as mtmd does: this
    vocabulary holds the markers as normal tokens, so they split as llama.cpp splits them);
    the placeholders are prompt tokens."""
    from minfer.api import Model

    model = Model(FIXTURES / "model.gguf", n_ctx=128)  # mmproj.gguf beside it: found
    ids, _, embd = model.chat_images(MESSAGES)
    (block,) = embd
    begin, end = (model.tokenizer.encode(t, special=True, add_bos=False)
                  for t in ("<start_of_image>", "<end_of_image>"))
    assert ids[block.at - len(begin):block.at] == begin and ids[block.at:block.at + 4] == [5] * 4
    assert ids[block.at + 4:block.at + 4 + len(end)] == end and block.rows.shape == (4, 64)
    text = model.tokenizer.decode(ids)
    assert "look <start_of_image>" in text and "<end_of_image> here" in text


@pytest.mark.parametrize("batch_size", [512, 3])
def test_chat_with_an_image_decodes_the_image_block_whole(batch_size: int) -> None:
    """Model.chat with an image part: the first token is the argmax of the logits of the
    prompt with the image's rows, computed in one forward; small prompt chunks never split
    the image block (the same reply)."""
    from minfer.api import Model

    model = Model(FIXTURES / "model.gguf", n_ctx=128, batch_size=batch_size)
    ids, _, embd = model.chat_images(MESSAGES)
    logits = _engine().forward(ids, 0, embd=[(e.at, e.rows) for e in embd])
    first = model.tokenizer.decode([int(np.argmax(logits[0]))])
    reply = "".join(model.chat([{"role": "user", "content": [_image_part("path"),
                                                            {"type": "text", "text": "x"}]}],
                               max_tokens=4, temp=0.0))
    again = "".join(model.chat(MESSAGES, max_tokens=4, temp=0.0))
    assert again.startswith(first)
    assert reply  # a path part reads the same file


def test_text_only_model_refuses_an_image(tmp_path: Path) -> None:
    from minfer.api import Model
    from minfer.engine.vision.image import ImageError

    (tmp_path / "model.gguf").write_bytes((FIXTURES / "model.gguf").read_bytes())
    model = Model(tmp_path / "model.gguf", n_ctx=128)
    assert model.vision is None
    with pytest.raises(ImageError, match="takes no images"):
        "".join(model.chat(MESSAGES, max_tokens=2))
    bad = [{"role": "user", "content": [{"type": "image_url",
                                         "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(ImageError, match="cannot be decoded"):
        "".join(Model(FIXTURES / "model.gguf", n_ctx=128).chat(bad, max_tokens=2))


def test_minfer_run_with_an_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`minfer run --image FILE`: the mmproj found beside the model, or named with --mmproj
    (the same reply); the image's placeholders are prompt tokens; a model without one refuses."""
    import json

    from minfer.cli.main import main

    image = str(FIXTURES / "image.png")
    args = ["run", "--json", "hi", "--temp", "0", "-n", "3", "-c", "128", "--image", image]
    assert main([args[0], str(FIXTURES / "model.gguf"), *args[1:]]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["prompt_ids"].count(5) == 4
    text_only = tmp_path / "model.gguf"
    text_only.write_bytes((FIXTURES / "model.gguf").read_bytes())
    assert main([args[0], str(text_only), *args[1:], "-mm",
                 str(FIXTURES / "mmproj.gguf")]) == 0
    named = json.loads(capsys.readouterr().out)
    assert named["ids"] == found["ids"] and named["prompt_ids"] == found["prompt_ids"]
    assert main([args[0], str(text_only), *args[1:]]) != 0
    assert "takes no images" in capsys.readouterr().err
