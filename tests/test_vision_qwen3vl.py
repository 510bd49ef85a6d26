"""Qwen3-VL mmproj files (`qwen3vl_merger`) against transformers on the same image.

tests/fixtures/qwen3vl/ comes from benchmarks/make_qwen3vl_fixtures.py: a tiny random
Qwen3VLForConditionalGeneration converted by llama.cpp 0.3.36 (f32), a generated 64 x 48 image
(8 x 6 patches of 8, 4 x 3 merged tokens), transformers' pixel_values (each frame twice, patches
in merge-window order) and image features (the merger's and the deepstack merger's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.gguf.clip import ClipParams
from minfer.gguf.reader import GGUFFile
from tests.test_qwen3vl_text import assert_draws_match

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
    assert np.stack(px.chunks).shape == (1, 3, 48, 64) and px.grid == (6, 8)
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


AT = 6  # the image's first row (after `<|im_start|>user\n<|vision_start|>`)
PROMPT = [{"role": "user", "content": [{"type": "image", "path": str(FIXTURES / "image.png")},
                                       {"type": "text", "text": "What is in the image?"}]}]


def test_mrope_positions_equal_transformers_rope_index() -> None:
    """An image of 3 x 4 merged tokens after 6 rows: (6, 6 + y, 6 + x) per token, the
    text after it from 6 + max(3, 4) (transformers' get_rope_index, mtmd's n_pos)."""
    from minfer.engine.core.request import PromptRows, mrope_positions

    ids = REF["ids"].tolist()
    block = PromptRows(AT, np.zeros((12, 128), np.float32), True, (3, 4))
    got = mrope_positions([block], 0, len(ids))
    np.testing.assert_array_equal(got[:3], REF["positions"])
    assert not got[3].any()
    np.testing.assert_array_equal(mrope_positions([block], 30, 5),
                                  got[:, 30:35])  # any window of rows alike


def test_chat_prompt_lays_the_image_out_as_mtmd() -> None:
    from minfer.api import Model

    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    assert ids == REF["ids"].tolist()
    (block,) = embd
    assert (block.at, block.n, block.causal, block.grid) == (AT, 12, True, (3, 4))
    text = model.tokenizer.decode(ids)
    assert "<|vision_start|>" + "<|image_pad|>" * 12 + "<|vision_end|>" in text


def test_logits_after_the_image_match_transformers() -> None:
    from minfer.api import Model
    from minfer.engine.core.request import mrope_positions
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams

    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    f = GGUFFile.open(FIXTURES / "model.gguf")
    engine = Engine(f, HParams.from_gguf(f), n_ctx=128)
    got = engine.forward(ids, 0, n_out=len(ids), embd=[(e.at, e.rows, e.causal) for e in embd],
                         rope_pos=mrope_positions(embd, 0, len(ids)))
    want = REF["logits"]
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3


def test_greedy_answer_matches_transformers_generate() -> None:
    """The Python API's greedy tokens after the image (prefill, then decode steps at rope
    positions past the image's n_pos) are transformers' generate's."""
    from minfer.api import Model
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    want = REF["greedy"].tolist()
    top2 = np.sort(REF["logits"][-1])[-2:]
    assert top2[1] - top2[0] > 1e-3  # the first choice is not a near-tie
    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    *_, done = model.stream(ids, max_tokens=len(want), embd=embd,
                            sampling=SamplerParams(temp=0.0), top_logits=3)
    assert isinstance(done, Finished) and done.ids == want
    assert_draws_match(done.top_logits, REF["decode_logits"])


def test_minfer_run_with_an_image(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from minfer.cli.main import main

    args = ["run", str(FIXTURES / "model.gguf"), "--json", "What is in the image?", "--temp",
            "0", "-n", "8", "-c", "128", "--image", str(FIXTURES / "image.png")]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == REF["ids"].tolist()
    n = len(out["ids"])
    assert n >= 1 and out["ids"] == REF["greedy"].tolist()[:n]


def test_batched_core_runs_the_image_beside_text() -> None:
    """The server's core (two slots, prompts chunked 8 rows a step, the image's block whole):
    the image request beside a text-only one draws transformers' greedy tokens for each."""
    from minfer.api import Model
    from minfer.engine.core.core import EngineCore
    from minfer.engine.core.request import GenRequest
    from minfer.engine.core.runner import Runner
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.sampling.params import SamplerParams
    from minfer.sampling.sampler import Sampler
    from minfer.tokenizer import Tokenizer

    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    f = GGUFFile.open(FIXTURES / "model.gguf")
    engine = Engine(f, HParams.from_gguf(f), n_ctx=256, batch_invariant=True)
    core = EngineCore(Runner(engine, 128), Tokenizer.from_gguf(f), n_slots=2, n_ctx_slot=128,
                      chunk=8)
    text = REF["text_ids"].tolist()
    states = []
    for seq_id, (prompt, rows) in enumerate(((ids, tuple(embd)), (text, ()))):
        s = Sampler(SamplerParams(temp=0.0), 320, seed=1)
        s.reset(prompt)
        states.append(core.add(seq_id, GenRequest(prompt, 8, s, embd=rows, top_logits=3)))
    while core.busy:
        assert all(o.error is None for o in core.step())
    assert states[0].ids == REF["greedy"].tolist()
    scale = float(np.abs(REF["decode_logits"]).max())
    for top, row in zip(states[0].tops, REF["decode_logits"], strict=True):
        ids = [i for i, _ in top]
        np.testing.assert_allclose([v for _, v in top], row[ids], atol=1e-3 * scale)
    assert states[1].ids == REF["text_greedy"].tolist()


def test_mrope_positions_of_two_images() -> None:
    """The second image starts where the first one's n_pos left the text, and so on."""
    from minfer.engine.core.request import PromptRows, mrope_positions

    a = PromptRows(2, np.zeros((6, 4), np.float32), True, (2, 3))
    b = PromptRows(10, np.zeros((2, 4), np.float32), True, (1, 2))
    got = mrope_positions([b, a], 0, 13)
    want_t = [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 7, 9]
    want_h = [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7, 7, 9]
    want_w = [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8, 9]
    np.testing.assert_array_equal(got, [want_t, want_h, want_w, [0] * 13])


def test_a_chats_second_turn_is_the_one_shot_answer() -> None:
    """`minfer chat` with /image on the tiny Qwen3-VL: the second turn (its KV reused up to the
    image, the rest prefilled at M-RoPE positions) answers as a one-shot generation of the
    whole conversation does."""
    import io

    from minfer.api import Model
    from minfer.chat.repl import PipeReader, Repl, ReplOptions, ReplyWriter
    from minfer.chat.session import ChatConfig, ChatSession
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    model = Model(FIXTURES / "model.gguf", n_ctx=256)
    engine = model.engine()
    session = ChatSession(engine, model.tokenizer, model.chat_template,
                          model.sampler(SamplerParams(temp=0.0), 0, engine.n_ctx),
                          config=ChatConfig(max_tokens=4), images=model.image_prompt)
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(session, ReplOptions(interactive=False),
                reader=PipeReader(io.StringIO(f"/image {FIXTURES / 'image.png'}\nwhat is it\n"
                                              "and then?\n"), multiline=False),
                writer=ReplyWriter(color=False, interactive=False, out=out, err=err))
    assert repl.run() == 0, err.getvalue()
    first = model.tokenizer.decode(session.reports[0].ids)
    ids, _, embd = model.chat_images([
        {"role": "user", "content": [{"type": "image", "path": str(FIXTURES / "image.png")},
                                     {"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and then?"}])
    (done,) = [e for e in model.stream(ids, max_tokens=4, sampling=SamplerParams(temp=0.0),
                                       embd=embd) if isinstance(e, Finished)]
    assert session.reports[1].ids == done.ids


LLAMA = np.load(FIXTURES / "llamacpp.npz")


def test_prompt_and_positions_are_llama_cpps() -> None:
    """llama.cpp's mtmd (llamacpp.npz) lays the prompt out as minfer does (its image tokens
    -1) and leaves n_past at the rows minus the image's 12 plus its max(3, 4) positions."""
    from minfer.api import Model
    from minfer.engine.core.request import mrope_positions

    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    want = LLAMA["ids"].tolist()
    assert len(ids) == len(want)
    assert all(w == -1 if AT <= i < AT + 12 else w == t
               for i, (t, w) in enumerate(zip(ids, want, strict=True)))
    assert int(mrope_positions(embd, len(ids), 1)[0, 0]) == int(LLAMA["n_past"]) == 33


def test_greedy_draws_are_llama_cpps() -> None:
    """The greedy tokens and the logits they are drawn from are llama.cpp's (its merger's GELU
    is the tanh form, its KV f16: within 1e-3 of the largest logit)."""
    from minfer.api import Model
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    model = Model(FIXTURES / "model.gguf", n_ctx=128)
    ids, _, embd = model.chat_images(PROMPT)
    want = LLAMA["greedy"].tolist()
    *_, done = model.stream(ids, max_tokens=len(want), embd=embd,
                            sampling=SamplerParams(temp=0.0), top_logits=3)
    assert isinstance(done, Finished) and done.ids == want
    assert_draws_match(done.top_logits, LLAMA["decode_logits"])


@pytest.mark.slow
def test_llama_cpp_live_gives_the_committed_results() -> None:
    """Rerun llama.cpp's mtmd (skipped without llama-cpp-python here or in
    $MINFER_REF_PYTHON): the same ids, n_past and greedy tokens as llamacpp.npz."""
    from tests.mtmd_ref import mtmd_greedy
    from tests.refpython import llama_python

    prompt = "<|im_start|>user\n<image>What is in the image?<|im_end|>\n<|im_start|>assistant\n"
    live = mtmd_greedy(llama_python(), str(FIXTURES / "model.gguf"),
                       str(FIXTURES / "mmproj.gguf"), str(FIXTURES / "image.png"), prompt, 8)
    for key in ("ids", "n_past", "greedy"):
        np.testing.assert_array_equal(live[key], LLAMA[key])
    np.testing.assert_allclose(live["decode_logits"], LLAMA["decode_logits"], atol=1e-4)
