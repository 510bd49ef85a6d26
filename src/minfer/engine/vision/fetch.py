"""An image URL's bytes: a base64 `data:` URL decoded, an http(s) URL downloaded with limits.

Every surface that takes an image by URL (OpenAI's `image_url`, Anthropic's `url` source, the
Responses API's `input_image`, the Python API's parts) reads it here. A download is bounded as
llama-server bounds it: at most `MAX_BYTES` (10 MiB) and `TIMEOUT_S` (10 s) for the whole
transfer (connecting and each read wait at most the time left); only http and https, redirects
followed among them, no proxy. Each failure is an `ImageError` naming the URL and the problem
(unreachable, an HTTP error status, too large, not an image, timed out).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import socket
import time
import urllib.error
import urllib.request

from minfer.engine.vision.image import ImageError

MAX_BYTES = 10 * 1024 * 1024
TIMEOUT_S = 10.0
CHUNK = 64 * 1024
# a type a server gives any file (the bytes then decide): an image's own, or these
GENERIC_TYPES = ("application/octet-stream", "binary/octet-stream")


def url_bytes(url: str, *, max_bytes: int | None = None, timeout_s: float | None = None
              ) -> bytes:
    """The image file's bytes behind a data: URL (base64) or an http(s) URL (limits: None is
    MAX_BYTES, TIMEOUT_S)."""
    if url.startswith("data:"):
        head, _, body = url.partition(",")
        if not head.endswith(";base64"):
            raise ImageError("a data: URL of an image must be base64 "
                             "(data:image/png;base64,...)")
        return base64_bytes(body)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https"):
        raise ImageError(f"an image URL must be a data: URL or http(s), got {_short(url)!r}")
    return download(url, max_bytes=max_bytes, timeout_s=timeout_s)


def base64_bytes(text: str) -> bytes:
    """Base64 text's bytes (ImageError: not base64)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's base64 data is corrupt") from None


def _opener() -> urllib.request.OpenerDirector:
    """http and https only (a redirect elsewhere is refused), no proxy."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                    urllib.request.HTTPRedirectHandler(), urllib.request.HTTPErrorProcessor(),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.UnknownHandler()):
        opener.add_handler(handler)
    return opener


def download(url: str, *, max_bytes: int | None = None, timeout_s: float | None = None
             ) -> bytes:
    """An http(s) URL's body, at most max_bytes, within timeout_s (see the module docstring;
    None: MAX_BYTES, TIMEOUT_S)."""
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    where = f"the image at {_short(url)}"
    deadline = time.monotonic() + timeout_s
    try:
        request = urllib.request.Request(url, headers={"Accept": "image/*",
                                                       "User-Agent": "minfer"})
        with _opener().open(request, timeout=timeout_s) as resp:
            kind = resp.headers.get_content_type() if resp.headers.get("Content-Type") else ""
            if kind and not kind.startswith("image/") and kind not in GENERIC_TYPES:
                raise ImageError(f"{where} is not an image (Content-Type {kind})")
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise ImageError(f"{where} is {int(length)} bytes, more than the "
                                 f"{_mib(max_bytes)} limit")
            chunks: list[bytes] = []
            n = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
                if isinstance(sock, socket.socket):
                    sock.settimeout(left)
                chunk = resp.read(min(CHUNK, max_bytes + 1 - n))
                if not chunk:
                    break
                chunks.append(chunk)
                n += len(chunk)
                if n > max_bytes:
                    raise ImageError(f"{where} is more than the {_mib(max_bytes)} limit")
            return b"".join(chunks)
    except urllib.error.HTTPError as exc:
        raise ImageError(f"{where} cannot be fetched: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise ImageError(f"{where} timed out after {timeout_s:g} s") from None
        raise ImageError(f"{where} is unreachable ({exc.reason})") from None
    except TimeoutError:
        raise ImageError(f"{where} timed out after {timeout_s:g} s") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ImageError(f"{where} cannot be fetched ({exc})") from None


def _mib(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n % (1024 * 1024) == 0 else f"{n} bytes"


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
