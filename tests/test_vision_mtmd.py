"""minfer's images against llama.cpp's mtmd on the same files: embeddings, prompt layout,
logits, greedy answer.

tests/fixtures/{vision,idefics3}/mtmd.{json,npz} come from benchmarks/make_mtmd_reference.py
(llama-cpp-python 0.3.36's `mtmd_cpp`, run by tests/mtmd_ref.py): for the chat prompt
`PROMPT` with the fixture's image, mtmd_tokenize's chunks, the image chunks' embeddings (the
encoder's attention without flash attention), the logits after the prompt and after each of
6 greedy tokens, and the top-1 minus top-2 margins before each greedy token. The live test
re-runs llama.cpp when a reference interpreter is there ($MINFER_REF_PYTHON, else
/tmp/refvenv/bin/python) and skips otherwise.

Gemma 3's projection (`mm.input_projection`) is f16 in every converted file, so llama.cpp
runs it on its input rounded to f16, as minfer does (`RoundF16`); where the encoder's f32
values before it sit within float noise of an f16 rounding midpoint, the two round one value
a step apart (2^-11 of it), which moves that row by up to ~5e-4 of the largest value: Gemma 3's
rows are held to 1e-3, and the rows without such a step to 1e-5.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).parent / "fixtures"
FIXTURES = ("vision", "idefics3")
EMBD_TOL = {"vision": 1e-3, "idefics3": 1e-4}
LOGITS_TOL = 1e-3  # relative to the largest logit
NEAR_TIE = 0.01  # a top-1 minus top-2 margin below which a greedy step may go either way


def _ref(name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    d = ROOT / name
    return json.loads((d / "mtmd.json").read_text()), dict(np.load(d / "mtmd.npz"))


def _messages(name: str) -> list[dict[str, Any]]:
    image = ROOT / name / "image.png"
    return [{"role": "user", "content": [{"type": "image", "path": str(image)},
                                         {"type": "text", "text": "What is in the image?"}]}]


def _model(name: str) -> Any:
    from minfer.api import Model

    return Model(ROOT / name / "model.gguf", n_ctx=256)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _check_embeddings(name: str, want: np.ndarray) -> None:
    from minfer.engine.vision.encoder import VisionEncoder

    enc = VisionEncoder(ROOT / name / "mmproj.gguf")
    got = enc.encode((ROOT / name / "image.png").read_bytes()).rows
    assert got.shape == want.shape
    assert _rel(got, want) < EMBD_TOL[name]
    row_err = np.abs(got - want).max(axis=1) / np.abs(want).max()
    assert int((row_err < 1e-5).sum()) >= len(row_err) // 2  # the f32 path itself agrees


def _check_layout(name: str, chunks: list[dict[str, Any]]) -> None:
    """minfer's ids: each text chunk's tokens in place, each image chunk a block of as many
    rows (causal unless mtmd decodes it non-causally) at the position mtmd puts it."""
    ids, _, embd = _model(name).chat_images(_messages(name))
    blocks = iter(embd)
    at = 0
    for chunk in chunks:
        if chunk["type"] == "text":
            n = len(chunk["tokens"])
            assert ids[at:at + n] == chunk["tokens"], f"text chunk at {at}"
        else:
            block = next(blocks)
            n = chunk["n_tokens"]
            assert (block.at, block.n, block.causal) == (at, n, not chunk["non_causal"])
        at += n
    assert at == len(ids) and next(blocks, None) is None


@pytest.mark.parametrize("name", FIXTURES)
def test_image_embeddings_match_mtmd(name: str) -> None:
    _check_embeddings(name, _ref(name)[1]["embd"])


@pytest.mark.parametrize("name", FIXTURES)
def test_prompt_layout_matches_mtmd(name: str) -> None:
    ref, _ = _ref(name)
    _check_layout(name, ref["chunks"])
    assert ref["n_pos"] == ref["n_tokens"]  # no M-RoPE: one position per token


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_after_the_image_match_mtmd(name: str) -> None:
    """The logits after the prompt and after each of llama.cpp's greedy tokens (fed back as
    llama.cpp fed them)."""
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile

    ref, arrays = _ref(name)
    ids, _, embd = _model(name).chat_images(_messages(name))
    f = GGUFFile.open(ROOT / name / "model.gguf")
    engine = Engine(f, HParams.from_gguf(f), n_ctx=256)
    n = len(ref["greedy"])
    got = engine.forward([*ids, *ref["greedy"]], 0, n_out=n + 1,
                         embd=[(e.at, e.rows, e.causal) for e in embd])
    want = arrays["logits"]
    assert got.shape == want.shape
    assert _rel(got, want) < LOGITS_TOL


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_answer_matches_mtmd(name: str) -> None:
    """minfer's greedy tokens are llama.cpp's up to the first step where llama.cpp's own top
    two were within NEAR_TIE (after which the texts may part)."""
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    ref, _ = _ref(name)
    want, margins = ref["greedy"], ref["margins"]
    model = _model(name)
    ids, _, embd = model.chat_images(_messages(name))
    *_, done = model.stream(ids, max_tokens=len(want), embd=embd,
                            sampling=SamplerParams(temp=0.0))
    assert isinstance(done, Finished)
    got = done.ids
    ties = [i for i, m in enumerate(margins) if m < NEAR_TIE]
    upto = ties[0] if ties else len(want)
    assert got[:upto] == want[:upto]
    if got != want:  # they part only at a near-tie
        first = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
        assert margins[first] < NEAR_TIE


def _ref_python() -> str:
    ref = os.environ.get("MINFER_REF_PYTHON") or "/tmp/refvenv/bin/python"
    if not Path(ref).exists():
        pytest.skip(f"no llama.cpp reference interpreter ({ref})")
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_live_mtmd_agrees_with_the_fixture_and_minfer(name: str, tmp_path: Path) -> None:
    """llama.cpp re-run now: the committed reference is what it gives, and minfer agrees with
    what it gives (with flash attention too: mtmd's default, its K and V in f16)."""
    from tests import mtmd_ref

    python = _ref_python()
    ref, arrays = _ref(name)
    d = ROOT / name
    live = mtmd_ref.run(python, d / "model.gguf", d / "mmproj.gguf", d / "image.png",
                        ref["prompt"], tmp_path / "live.npz")
    now = dict(np.load(tmp_path / "live.npz"))
    assert live["chunks"] == ref["chunks"] and live["greedy"] == ref["greedy"]
    np.testing.assert_allclose(now["embd"], arrays["embd"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(now["logits"], arrays["logits"], rtol=0, atol=1e-4)
    _check_layout(name, live["chunks"])
    _check_embeddings(name, now["embd"])
    mtmd_ref.run(python, d / "model.gguf", d / "mmproj.gguf", d / "image.png", ref["prompt"],
                 tmp_path / "fa.npz", n_greedy=0, flash_attn=True)
    from minfer.engine.vision.encoder import VisionEncoder

    got = VisionEncoder(d / "mmproj.gguf").encode((d / "image.png").read_bytes()).rows
    assert _rel(got, np.load(tmp_path / "fa.npz")["embd"]) < 1e-3
