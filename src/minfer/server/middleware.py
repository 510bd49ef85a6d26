"""A pure ASGI middleware in front of every route: request metrics, API key, body size cap.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through
untouched. Requests are counted by endpoint (unknown paths collapse to "other", so a scanner
cannot blow up the label set) and final status; a client that leaves before the response starts
counts as 499. With an API key, every path except /health needs `Authorization: Bearer KEY` (or
Anthropic's `x-api-key: KEY`). A POST body sent without a JSON content type (`curl -d`, which
says `application/x-www-form-urlencoded`, or none) is read as JSON, as llama-server reads it;
one that is not JSON is then the usual 400. What the server changed in the request instead of
refusing it (`server.notices`: a capped `max_tokens`) goes back as `Warning` headers.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minfer.server import notices
from minfer.server.errors import APIError

if TYPE_CHECKING:
    from minfer.server.state import ServerState

ENDPOINTS = {
    "/v1/chat/completions": "/v1/chat/completions",
    "/chat/completions": "/v1/chat/completions",
    "/v1/completions": "/v1/completions",
    "/completions": "/v1/completions",
    "/v1/models": "/v1/models",
    "/models": "/v1/models",
    "/health": "/health",
    "/metrics": "/metrics",
    "/tokenize": "/tokenize",
    "/detokenize": "/detokenize",
    "/infill": "/infill",
    "/completion": "/completion",
    "/v1/messages": "/v1/messages",
    "/v1/responses": "/v1/responses",
    "/responses": "/v1/responses",
    "/v1/messages/count_tokens": "/v1/messages/count_tokens",
    **{f"/api/{name}": f"/api/{name}" for name in ("chat", "generate", "tags", "show", "ps",
                                                   "version", "embed")},
}
OPEN_PATHS = frozenset({"/health"})


class RequestGuard:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = ENDPOINTS.get(scope["path"], "other")
        status = 499
        changed = notices.collect()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if changed:  # what the server changed in the request (server.notices)
                    message = {**message, "headers": [
                        *message.get("headers", []),
                        *((b"warning", notices.header(m)) for m in changed)]}
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response(scope["path"], Headers(scope=scope))(
                    scope, receive, send_status)
            else:
                await self.app(_as_json(scope), self._capped(receive), send_status)
        except BaseException:
            if status == 499:
                status = 500
            raise
        finally:
            self.state.metrics.requests.labels(endpoint, str(status)).inc()

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if self._expected is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if b"x-api-key" in headers:  # Anthropic's clients send the key this way
                given = b"Bearer " + headers[b"x-api-key"]
            if not secrets.compare_digest(given, self._expected):
                return APIError(401, "invalid or missing API key (send Authorization: Bearer "
                                "<key> or x-api-key: <key>)", code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit()
                                   or int(length) > self.state.config.max_body_bytes):
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.state.config.max_body_bytes} bytes",
                        code="request_too_large")

    def _capped(self, receive: Receive) -> Receive:
        limit = self.state.config.max_body_bytes
        seen = 0

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise self._too_large()
            return message

        return capped


_FORM = b"application/x-www-form-urlencoded"


def _as_json(scope: Scope) -> Scope:
    """A POST's scope with its content type made JSON when the client named none or a form's
    (every body these APIs take is JSON)."""
    if scope.get("method") != "POST":
        return scope
    headers = list(scope.get("headers") or [])
    kinds = [v for k, v in headers if k == b"content-type"]
    if kinds and not kinds[0].startswith(_FORM):
        return scope
    kept = [(k, v) for k, v in headers if k != b"content-type"]
    return {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
