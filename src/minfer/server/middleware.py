"""A pure ASGI middleware in front of every route: request metrics, API key, body size cap.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through
untouched. Requests are counted by endpoint (unknown paths collapse to "other", so a scanner
cannot blow up the label set) and final status; a client that leaves before the response starts
counts as 499. With an API key, every path except /health needs `Authorization: Bearer KEY` (or
Anthropic's `x-api-key: KEY`).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
    "/v1/messages": "/v1/messages",
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

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response(scope["path"])(scope, receive, send_status)
            else:
                await self.app(scope, self._capped(receive), send_status)
        except BaseException:
            if status == 499:
                status = 500
            raise
        finally:
            self.state.metrics.requests.inc(1, endpoint, str(status))

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
