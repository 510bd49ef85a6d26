"""`/image PATH` in `minfer chat`: the image goes with the next message on the tiny Gemma 3
fixture (tests/fixtures/vision), its turn the same as a one-shot generation of that prompt; a
follow-up question reuses the image's KV rows; a missing file, a corrupt one and a model
without an mmproj are clear errors."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from minfer.api import Model
from minfer.chat.repl import PipeReader, Repl, ReplOptions, ReplyWriter
from minfer.chat.session import ChatConfig, ChatError, ChatSession
from minfer.engine.generate import Finished
from minfer.sampling.sampler import SamplerParams
from tests.test_chat_repl import run_piped

FIXTURES = Path(__file__).parent / "fixtures" / "vision"
PNG = FIXTURES / "image.png"


@pytest.fixture(scope="module")
def gemma() -> Model:
    return Model(FIXTURES / "model.gguf", n_ctx=256)


def _session(model: Model) -> ChatSession:
    engine = model.engine()
    sampler = model.sampler(SamplerParams(temp=0.0), 0, engine.n_ctx)
    return ChatSession(engine, model.tokenizer, model.chat_template, sampler,
                       config=ChatConfig(max_tokens=4), images=model.image_prompt)


def _repl(session: ChatSession, text: str) -> tuple[Repl, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(session, ReplOptions(interactive=False),
                reader=PipeReader(io.StringIO(text), multiline=False),
                writer=ReplyWriter(color=False, interactive=False, out=out, err=err))
    return repl, out, err


def test_an_attached_image_goes_with_the_next_message(gemma: Model) -> None:
    session = _session(gemma)
    encoder = gemma.vision
    assert encoder is not None
    repl, _out, err = _repl(session, f"/image {PNG}\nwhat is it\nand its colour?\n")
    before = encoder.n_encoded
    assert repl.run() == 0, err.getvalue()
    assert "image attached" in err.getvalue()
    user = session.messages[0]
    assert user["images"] == [PNG.read_bytes()] and user["content"] == "what is it"
    assert "images" not in session.messages[2]  # the image went with one message only
    # the first reply is the one-shot generation of the same conversation
    ids, _, embd = gemma.chat_images([{"role": "user", "content": [
        {"type": "image", "path": str(PNG)}, {"type": "text", "text": "what is it"}]}])
    (done,) = [e for e in gemma.stream(ids, max_tokens=4, sampling=SamplerParams(temp=0.0),
                                       embd=embd) if isinstance(e, Finished)]
    assert session.reports[0].ids == done.ids
    assert session.kv.tokens[:len(ids)] == ids
    # the follow-up reuses the image's KV rows: it prefills only what follows the first turn
    assert encoder.n_encoded <= before + 1
    assert 0 < session.reports[1].n_prefilled <= len(session.kv.tokens) - len(ids)
    assert "images" not in session.transcript()[0]  # a saved session keeps the text


def test_two_different_images_are_never_confused(gemma: Model, tmp_path: Path) -> None:
    from PIL import Image

    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    Image.new("RGB", (16, 16), (255, 0, 0)).save(red)
    Image.new("RGB", (16, 16), (0, 0, 255)).save(blue)
    session = _session(gemma)
    repl, _, err = _repl(session, f"/image {red}\nwhat is it\n/clear\n/image {blue}\nwhat is it\n")
    assert repl.run() == 0, err.getvalue()
    fresh = _session(gemma)
    repl, _, _ = _repl(fresh, f"/image {blue}\nwhat is it\n")
    repl.run()
    assert session.reports[-1].ids == fresh.reports[-1].ids  # the blue image's reply
    assert session.reports[-1].n_prefilled == fresh.reports[-1].n_prefilled


def test_image_errors_are_clear(gemma: Model, tmp_path: Path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(PNG.read_bytes()[:100])
    session = _session(gemma)
    repl, out, err = _repl(session, f"/image {tmp_path}/nope.png\n/image {bad}\n/image\nhi\n")
    assert repl.run() == 2
    text = err.getvalue()
    assert "cannot read the image" in text and "nope.png" in text
    assert "bad.png" in text and "corrupt" in text
    assert "/image needs a file" in text
    assert out.getvalue().strip()  # "hi" was answered, with no image
    assert "images" not in session.messages[0]


def test_a_text_only_model_says_it_takes_no_images() -> None:
    rc, out, err, repl = run_piped(f"/image {PNG}\nhi\n")
    assert rc == 2 and "takes no images" in err and out == "<hi>\n"
    with pytest.raises(ChatError, match="takes no images"):
        repl.session.say("x", [PNG.read_bytes()])


@pytest.mark.slow
def test_minfer_chat_attaches_an_image(gemma: Model) -> None:
    """The CLI wires the model's encoder into the session (an mmproj beside the model)."""
    from tests.test_chat_repl import _minfer

    common = ["-n", "4", "--temp", "0", "-c", "256", "-t", "1"]
    rc, out, err = _minfer(["chat", str(FIXTURES / "model.gguf"), *common],
                           f"/image {PNG}\nwhat is it\n")
    assert rc == 0, err
    assert "image attached" in err
    ids, _, embd = gemma.chat_images([{"role": "user", "content": [
        {"type": "image", "path": str(PNG)}, {"type": "text", "text": "what is it"}]}])
    (done,) = [e for e in gemma.stream(ids, max_tokens=4, sampling=SamplerParams(temp=0.0),
                                       embd=embd) if isinstance(e, Finished)]
    assert out.rstrip("\n") == done.text.strip() or done.text in out
