"""Images on every API surface, on the tiny Gemma 3 fixture (tests/fixtures/vision): Anthropic's
image blocks, Ollama's `images`, the Responses API's input_image, http(s) image URLs fetched
from a loopback server with their limits, the encoder's cache of an image's rows, the vision
capability in the listings, and bad images answered with a 400 in each API's own shape."""

from __future__ import annotations

import base64
import contextlib
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from minfer.api import Model
from minfer.engine.vision import fetch
from minfer.server.state import ServerConfig, ServerState
from tests.test_server_anthropic import with_client as anthropic_client
from tests.test_server_app import call
from tests.test_server_ollama import with_client as ollama_client
from tests.test_server_responses import with_client as openai_client
from tests.test_server_vision import FIXTURES, _started

CHAT = "/v1/chat/completions"
PNG = (FIXTURES / "image.png").read_bytes()
B64 = base64.b64encode(PNG).decode()
DATA_URL = "data:image/png;base64," + B64
CORRUPT = base64.b64encode(PNG[:200]).decode()  # a truncated PNG
GIBBERISH = base64.b64encode(b"not an image at all").decode()
LIMIT = 8192  # the download limit in these tests (the fixture's PNG is smaller)


class _Images(BaseHTTPRequestHandler):
    """/image.png, /page.html (not an image), /big.png (over LIMIT, announced),
    /stream.png (over LIMIT, no length), /slow.png (answers late), anything else a 404."""

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(1.5)
        body, kind = {"/image.png": (PNG, "image/png"), "/slow.png": (PNG, "image/png"),
                      "/page.html": (b"<html>hi</html>", "text/html; charset=utf-8"),
                      "/big.png": (b"\0" * (LIMIT + 1), "image/png"),
                      "/stream.png": (b"\0" * (LIMIT * 3), "image/png")}.get(
            self.path, (b"", ""))
        if not kind:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        if self.path != "/stream.png":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client stopped reading (over the limit)
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "MAX_BYTES", LIMIT)
    monkeypatch.setattr(fetch, "TIMEOUT_S", 0.5)


@pytest.fixture(scope="module")
def gemma() -> Iterator[ServerState]:
    st = _started(ServerState(ServerConfig(model_path=FIXTURES / "model.gguf", slots=2)))
    yield st
    st.stop()


@pytest.fixture(scope="module")
def text_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    path = tmp_path_factory.mktemp("text") / "model.gguf"
    path.write_bytes((FIXTURES / "model.gguf").read_bytes())  # no mmproj beside it
    st = _started(ServerState(ServerConfig(model_path=path, slots=1)))
    yield st
    st.stop()


def _openai(st: ServerState, url: str, text: str = "what is it") -> dict[str, Any]:
    r = call(st, "POST", CHAT, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}],
        "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _anthropic_body(source: dict[str, Any], text: str = "what is it") -> dict[str, Any]:
    return {"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source},
                                     {"type": "text", "text": text}]}]}


# -- the surfaces read images ------------------------------------------------------------------
def test_an_http_image_url_is_the_same_image_as_its_data_url(gemma: ServerState,
                                                             web: str) -> None:
    ref = _openai(gemma, DATA_URL)
    got = _openai(gemma, f"{web}/image.png")
    assert got["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert got["choices"][0]["message"] == ref["choices"][0]["message"]


def test_anthropic_image_blocks(gemma: ServerState, web: str) -> None:
    ref = _openai(gemma, DATA_URL)
    for source in ({"type": "base64", "media_type": "image/png", "data": B64},
                   {"type": "url", "url": f"{web}/image.png"}):
        msg = anthropic_client(gemma, lambda c, s=source: c.messages.create(  # type: ignore[misc]
            **_anthropic_body(s), extra_body={"temperature": 0}))
        assert msg.usage.input_tokens == ref["usage"]["prompt_tokens"]
        assert msg.content[0].text == ref["choices"][0]["message"]["content"]
    counted = anthropic_client(gemma, lambda c: c.messages.count_tokens(
        model="m", messages=_anthropic_body({"type": "base64", "media_type": "image/png",
                                             "data": B64})["messages"]))
    assert counted.input_tokens == ref["usage"]["prompt_tokens"]


def test_ollama_images_on_chat_and_generate(gemma: ServerState) -> None:
    ref = _openai(gemma, DATA_URL)
    opts = {"temperature": 0, "num_predict": 3}
    got = ollama_client(gemma, lambda c: c.chat("model", options=opts, messages=[
        {"role": "user", "content": "what is it", "images": [PNG]}]))
    assert got.prompt_eval_count == ref["usage"]["prompt_tokens"]
    assert got.message.content == ref["choices"][0]["message"]["content"]
    gen = ollama_client(gemma, lambda c: c.generate("model", "what is it", options=opts,
                                                    images=[FIXTURES / "image.png"]))
    assert gen.prompt_eval_count == ref["usage"]["prompt_tokens"]
    assert gen.response == ref["choices"][0]["message"]["content"]
    r = call(gemma, "POST", "/api/generate", json={"model": "model", "prompt": "x", "raw": True,
                                                   "images": [B64], "stream": False})
    assert r.status_code == 400 and "raw" in r.json()["error"]


def test_responses_input_image(gemma: ServerState, web: str) -> None:
    ref = _openai(gemma, DATA_URL)
    for url in (DATA_URL, f"{web}/image.png"):
        got = openai_client(gemma, lambda c, u=url: c.responses.create(  # type: ignore[misc]
            model="m", max_output_tokens=3, temperature=0, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": u, "detail": "auto"},
                {"type": "input_text", "text": "what is it"}]}]))
        assert got.usage is not None and got.usage.input_tokens == ref["usage"]["prompt_tokens"]
        assert got.output_text == ref["choices"][0]["message"]["content"]


def test_listings_name_the_vision_capability(gemma: ServerState,
                                             text_only: ServerState) -> None:
    for st, vision in ((gemma, True), (text_only, False)):
        (m,) = call(st, "GET", "/v1/models").json()["data"]
        assert m["capabilities"] == (["completion", "vision"] if vision else ["completion"])
        assert call(st, "GET", "/props").json()["modalities"]["vision"] is vision
        shown = call(st, "POST", "/api/show", json={"model": "model"}).json()
        assert ("vision" in shown["capabilities"]) is vision


# -- the encoder's cache ---------------------------------------------------------------------
def test_a_follow_up_about_the_same_image_does_not_encode_it_again(gemma: ServerState) -> None:
    from PIL import Image

    encoder = gemma.model().vision
    assert encoder is not None
    fresh = Image.new("RGB", (30, 20), (12, 200, 99))  # an image no other test sent
    buf = io.BytesIO()
    fresh.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    before = encoder.n_encoded
    first = _openai(gemma, url)
    assert encoder.n_encoded == before + 1
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is it"}]},
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "and its colour?"}]
    r = call(gemma, "POST", CHAT, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    # the image's cells are reused: the follow-up prefills only what comes after them
    _, _, blocks = Model(FIXTURES / "model.gguf", n_ctx=64).chat_images(messages)
    image_end = blocks[-1].at + blocks[-1].n
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_end
    assert _gauge(gemma, "minfer_image_chunks_encoded_total") == encoder.n_encoded == before + 1
    again = base64.b64encode(buf.getvalue()).decode()
    ollama = call(gemma, "POST", "/api/chat", json={
        "model": "model", "stream": False, "options": {"num_predict": 2},
        "messages": [{"role": "user", "content": "again", "images": [again]}]})
    assert ollama.status_code == 200, ollama.text
    assert encoder.n_encoded == before + 1  # read from the cache both times


def _gauge(st: ServerState, name: str) -> float:
    """A /metrics gauge's value."""
    (line,) = (x for x in call(st, "GET", "/metrics").text.splitlines()
               if x.startswith(name + " "))
    return float(line.split()[1])


# -- bad input: a 400 in each API's shape --------------------------------------------------------
@pytest.mark.parametrize(("path", "words"), [
    ("/missing.png", "HTTP 404"),
    ("/page.html", "not an image (Content-Type text/html)"),
    ("/big.png", "more than the 8192 bytes limit"),
    ("/stream.png", "more than the 8192 bytes limit"),
    ("/slow.png", "timed out after 0.5 s"),
])
def test_a_url_that_cannot_be_fetched_is_a_400_naming_the_problem(
        gemma: ServerState, web: str, path: str, words: str) -> None:
    url = web + path
    r = call(gemma, "POST", CHAT, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and url in err["message"]
    assert err["code"] == "invalid_image"
    a = call(gemma, "POST", "/v1/messages", json=_anthropic_body({"type": "url", "url": url}))
    assert a.status_code == 400 and a.json()["type"] == "error"
    assert words in a.json()["error"]["message"]


def test_unreachable_and_other_schemes(gemma: ServerState) -> None:
    for url, words in (("http://127.0.0.1:1/a.png", "unreachable"),
                       ("file:///etc/hostname", "data: URL or http(s)"),
                       ("http://[::1", "cannot be fetched")):
        with pytest.raises(Exception, match=words.replace("(", r"\(").replace(")", r"\)")):
            fetch.url_bytes(url)
    r = call(gemma, "POST", "/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://127.0.0.1:1/a.png"}]}]})
    assert r.status_code == 400 and "unreachable" in r.json()["error"]["message"]


BAD = [(CORRUPT, "corrupt"), (GIBBERISH, "cannot be decoded"), ("@@", "base64")]


@pytest.mark.parametrize(("data", "words"), BAD)
def test_a_bad_image_is_a_400_on_every_surface(gemma: ServerState, data: str,
                                               words: str) -> None:
    url = "data:image/png;base64," + data
    r = call(gemma, "POST", CHAT, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 2})
    assert r.status_code == 400 and words in r.json()["error"]["message"]
    a = call(gemma, "POST", "/v1/messages", json=_anthropic_body(
        {"type": "base64", "media_type": "image/png", "data": data}))
    assert a.status_code == 400 and words in a.json()["error"]["message"]
    o = call(gemma, "POST", "/api/chat", json={"model": "model", "stream": False, "messages": [
        {"role": "user", "content": "x", "images": [data]}]})
    assert o.status_code == 400 and words in o.json()["error"]
    g = call(gemma, "POST", "/api/generate", json={"model": "model", "prompt": "x",
                                                   "images": [data], "stream": False})
    assert g.status_code == 400 and words in g.json()["error"]
    resp = call(gemma, "POST", "/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url}]}]})
    assert resp.status_code == 400 and words in resp.json()["error"]["message"]
    assert call(gemma, "POST", CHAT, json={"messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 2}).status_code == 200


def test_anthropic_image_sources_checked(gemma: ServerState) -> None:
    for source, words in (({"type": "file", "file_id": "f"}, "base64 or url source"),
                          ({"type": "base64", "data": B64}, "media_type and data")):
        r = call(gemma, "POST", "/v1/messages", json=_anthropic_body(source))
        assert r.status_code == 400 and words in r.json()["error"]["message"]
    r = call(gemma, "POST", "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]})
    assert r.status_code == 400 and "user turns" in r.json()["error"]["message"]


def test_a_text_only_model_refuses_images_on_every_surface(text_only: ServerState) -> None:
    words = "takes no images"
    a = call(text_only, "POST", "/v1/messages", json=_anthropic_body(
        {"type": "base64", "media_type": "image/png", "data": B64}))
    assert a.status_code == 400 and words in a.json()["error"]["message"]
    o = call(text_only, "POST", "/api/chat", json={"model": "model", "stream": False,
                                                   "messages": [{"role": "user", "content": "x",
                                                                 "images": [B64]}]})
    assert o.status_code == 400 and words in o.json()["error"]
    g = call(text_only, "POST", "/api/generate", json={"model": "model", "prompt": "x",
                                                       "images": [B64], "stream": False})
    assert g.status_code == 400 and words in g.json()["error"]
    r = call(text_only, "POST", "/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": DATA_URL}]}]})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_the_cache_holds_a_few_images() -> None:
    """The LRU drops the least recently used image past CACHE_IMAGES."""
    from PIL import Image

    from minfer.engine.vision import encoder as enc_mod

    enc = enc_mod.VisionEncoder(FIXTURES / "mmproj.gguf")
    files = []
    for i in range(enc_mod.CACHE_IMAGES + 1):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (i, 0, 0)).save(buf, "PNG")
        files.append(buf.getvalue())
    rows = enc.encode(files[0])
    assert not rows.rows.flags.writeable
    assert enc.encode(files[0]) is rows and enc.n_encoded == 1
    for f in files[1:]:
        enc.encode(f)
    assert enc.n_encoded == len(files)
    enc.encode(files[1])  # still held
    assert enc.n_encoded == len(files)
    enc.encode(files[0])  # dropped: encoded again, the same rows
    assert enc.n_encoded == len(files) + 1
