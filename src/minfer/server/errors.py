"""API errors: one exception type, the body shape of each API, and the handlers that enforce them.

Every failure a client can cause ends as `{"error": {"message", "type", "param", "code"}}` with a
4xx status; on Anthropic's `/v1/messages` routes, and for any request carrying Anthropic's
`anthropic-version` header, as `{"type": "error", "error": {"type", "message"}}`; on Ollama's
`/api/` routes as `{"error": "..."}`. A full queue or a model still loading is a 503 with
`Retry-After`. Validation errors (malformed JSON, wrong types, out-of-range values) are 400 as
OpenAI answers them, not FastAPI's 422. Anything else escaping a handler is a bug: it is logged
and answered with a 500 in the same shape, never a traceback. A client that left before its
reply (`ClientGone`) is answered 499, which nobody reads but the request metrics count.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minfer.errors import ContextOverflowError, MinferError

log = logging.getLogger("minfer.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_unavailable",
}


class ClientGone(Exception):
    """The client left before its reply was whole."""


class APIError(Exception):
    """An error answered to the client as-is (status, message, param, code, extra headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500
                                        else "server_error")
        self.headers = headers or {}

    def body(self, path: str = "", headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The error in the shape of the API that path (and headers) belong to: OpenAI's unless
        it is Anthropic's (`is_anthropic`) or Ollama's `/api/`."""
        if is_anthropic(path, headers):
            return anthropic_error_body(self.status, self.message)
        if path.startswith("/api/"):  # Ollama's: {"error": "..."}
            return {"error": self.message}
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)

    def response(self, path: str = "", headers: Mapping[str, str] | None = None
                 ) -> JSONResponse:
        return JSONResponse(self.body(path, headers), status_code=self.status,
                            headers=self.headers)


def error_body(message: str, *, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# the header Anthropic's clients send with every request (`/v1/models` is both APIs' path)
ANTHROPIC_HEADER = "anthropic-version"


def is_anthropic(path: str, headers: Mapping[str, str] | None = None) -> bool:
    """A request of Anthropic's API: its Messages routes, or any route asked by a client that
    sends `anthropic-version`."""
    return (path == "/v1/messages" or path.startswith("/v1/messages/")
            or (headers is not None and ANTHROPIC_HEADER in headers))


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, *, retry_after: int = 1, code: str | None = None) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after)})


def from_minfer_error(exc: MinferError, *, param: str | None = None) -> APIError:
    """A MinferError raised on the user's input becomes a 400 naming its cause."""
    code = "context_length_exceeded" if isinstance(exc, ContextOverflowError) else None
    return bad_request(str(exc), param=param, code=code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    msg = str(first.get("msg", "invalid value"))
    if param:
        msg = f"{param}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error(s))"
    return msg, param


def install_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI-shaped body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path, request.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return bad_request(message, param=param, code="invalid_value").response(
            request.url.path, request.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        return APIError(exc.status_code, detail, headers=dict(exc.headers or {})).response(
            request.url.path, request.headers)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(MinferError)
    async def _minfer(request: Request, exc: MinferError) -> JSONResponse:
        return from_minfer_error(exc).response(request.url.path, request.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request handler", exc_info=exc)
        return APIError(500, "internal server error", type_="server_error").response(
            request.url.path, request.headers)
