"""A Hugging Face Hub stand-in on 127.0.0.1 for the endpoints huggingface_hub's downloads use.

`GET /api/models/ORG/REPO[/revision/REV]` (model info with LFS sizes and sha256s) and
`HEAD|GET /ORG/REPO/resolve/REV/PATH` (ETag, X-Repo-Commit, Content-Length, Range → 206).
Knobs: `corrupt` (paths served with one byte flipped), `cut_once` (paths whose first GET stops
half-way, to exercise resume), `requests` (what was asked, for assertions).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_INFO = re.compile(r"^/api/models/([^/?]+/[^/?]+)(?:/revision/([^/?]+))?(?:\?.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    auth: str | None


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]]
    corrupt: set[str] = field(default_factory=set)
    cut_once: set[str] = field(default_factory=set)
    requests: list[Request] = field(default_factory=list)
    url: str = ""

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                hub.handle(self, body=True)

            def do_HEAD(self) -> None:
                hub.handle(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _send(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str],
              body: bytes, send_body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if send_body:
            h.wfile.write(body)

    def _error(self, h: BaseHTTPRequestHandler, code: str, send_body: bool) -> None:
        self._send(h, 404, {"X-Error-Code": code, "Content-Type": "application/json"},
                   json.dumps({"error": code}).encode(), send_body)

    def handle(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        self.requests.append(Request(h.command, h.path, h.headers.get("Range"),
                                     h.headers.get("Authorization")))
        if m := _INFO.match(h.path):
            return self._info(h, m[1], body)
        if m := _RESOLVE.match(h.path):
            return self._resolve(h, m[1], m[3], body)
        return self._error(h, "RepoNotFound", body)

    def _info(self, h: BaseHTTPRequestHandler, repo: str, body: bool) -> None:
        if repo not in self.repos:
            return self._error(h, "RepoNotFound", body)
        siblings = []
        for path, data in self.repos[repo].items():
            s: dict[str, Any] = {"rfilename": path, "size": len(data),
                                 "blobId": hashlib.sha1(data).hexdigest()}
            if path.endswith(".gguf"):
                s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
            siblings.append(s)
        info = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                "siblings": siblings}
        self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(info).encode(), body)

    def _resolve(self, h: BaseHTTPRequestHandler, repo: str, path: str, body: bool) -> None:
        data = self.repos.get(repo, {}).get(path)
        if data is None:
            return self._error(h, "EntryNotFound" if repo in self.repos else "RepoNotFound", body)
        lfs = path.endswith(".gguf")
        etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(data).hexdigest()
        if path in self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start = 0
        if (r := h.headers.get("Range")) and (m := re.match(r"bytes=(\d+)-$", r)):
            start = int(m[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        status = 206 if start else 200
        if body and h.command == "GET" and path in self.cut_once:
            self.cut_once.discard(path)
            h.send_response(status)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(data) - start))
            h.end_headers()
            h.wfile.write(data[start : start + (len(data) - start) // 2])
            h.wfile.flush()
            h.close_connection = True
            return None
        return self._send(h, status, headers, data[start:], body)


def use_fake_hub(monkeypatch: Any, url: str, home: Any) -> None:
    """Point huggingface_hub and minfer at a FakeHub's url, their caches under home (a
    pytest MonkeyPatch and a tmp_path)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("MINFER_HOME", str(home / "minfer"))
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
