"""/v1/chat/completions with OpenAI image parts on the tiny Gemma 3 fixture (tests/fixtures/vision:
the text model with its mmproj beside it): the image read into the prompt, counted in usage; a
text-only model, a corrupt image or a URL that is neither data: nor http(s) answered with a 400
(the other surfaces, and http(s) URLs: test_server_vision_apis.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minfer.server.state import ServerConfig, ServerState
from tests.test_server_app import call

FIXTURES = Path(__file__).parent / "fixtures" / "vision"
CHAT = "/v1/chat/completions"


def _started(st: ServerState) -> ServerState:
    st.start()
    assert st.wait_ready(120), st.error
    return st


@pytest.fixture(scope="module")
def gemma() -> Iterator[ServerState]:
    st = _started(ServerState(ServerConfig(model_path=FIXTURES / "model.gguf", slots=2)))
    yield st
    st.stop()


def _body(url: str, text: str = "what is it") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}],
        "max_tokens": 3, "temperature": 0}


def _png_url(*, flipped: bool = False) -> str:
    data = (FIXTURES / "image.png").read_bytes()
    if flipped:  # another image of the same size
        from PIL import Image, ImageOps

        out = io.BytesIO()
        ImageOps.flip(Image.open(io.BytesIO(data)).convert("RGB")).save(out, "PNG")
        data = out.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_an_image_part_is_read_into_the_prompt(gemma: ServerState) -> None:
    from minfer.api import Model

    r = call(gemma, "POST", CHAT, json=_body(_png_url()))
    assert r.status_code == 200, r.text
    out = r.json()
    ids, _, embd = Model(FIXTURES / "model.gguf", n_ctx=64).chat_images(
        _body(_png_url())["messages"])
    assert len(embd) == 1
    assert out["usage"]["prompt_tokens"] == len(ids)  # the image's 4 tokens and its markers
    again = call(gemma, "POST", CHAT, json=_body(_png_url()))  # a cached slot: the same reply
    assert again.json()["choices"][0]["message"] == out["choices"][0]["message"]
    # the image's cells are reused with the text around them: only the last token is fed
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
    other = call(gemma, "POST", CHAT, json=_body(_png_url(flipped=True)))
    assert other.status_code == 200, other.text  # another image: cached up to it, not past
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == embd[0].at


@pytest.mark.parametrize(("url", "words"), [
    ("data:image/png;base64,AAAA", "cannot be decoded"),
    ("data:image/png;base64,@@", "base64"),
    ("ftp://example.com/a.png", "data: URL or http(s)"),
])
def test_a_bad_image_is_a_400(gemma: ServerState, url: str, words: str) -> None:
    r = call(gemma, "POST", CHAT, json=_body(url))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == "messages"


def test_a_text_only_model_refuses_an_image(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes((FIXTURES / "model.gguf").read_bytes())
    st = _started(ServerState(ServerConfig(model_path=tmp_path / "model.gguf", slots=1)))
    try:
        r = call(st, "POST", CHAT, json=_body(_png_url()))
        assert r.status_code == 400
        err = r.json()["error"]
        assert "takes no images" in err["message"] and err["code"] == "unsupported_content"
        assert call(st, "POST", CHAT, json={"messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
    finally:
        st.stop()
