"""What the server changed in a request instead of refusing it, said back on every API.

One rule per mistake, the same on every surface (OpenAI, Anthropic, Ollama, llama-server's
native routes): a value past what the server can give is capped, never silently and never as a
400 that breaks a client asking for the usual large limit (Anthropic's and Claude Code's
`max_tokens`, lm-evaluation-harness' `max_gen_toks`). `warn` logs the change on the
`minfer.server` logger and adds it to the request's notices; `RequestGuard` (middleware) sends
them back as HTTP `Warning: 299 minfer "..."` headers, which every one of those APIs' clients
carries through (none of their bodies has a warning field to put it in).

`capped_max_tokens` is that rule for the reply's length: the one place every route's
`max_tokens` (`max_completion_tokens`, `max_output_tokens`, `num_predict`, `n_predict`) passes.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

log = logging.getLogger("minfer.server")
_notices: ContextVar[list[str] | None] = ContextVar("minfer_notices", default=None)


def collect() -> list[str]:
    """Start collecting the current request's notices (the middleware, before the route)."""
    notices: list[str] = []
    _notices.set(notices)
    return notices


def warn(message: str) -> None:
    """A change the server made to the request: logged, and sent back with the response."""
    log.warning("%s", message)
    notices = _notices.get()
    if notices is not None and message not in notices:
        notices.append(message)


def header(message: str) -> bytes:
    """RFC 9111's `Warning` value (code 299: a persistent warning), ASCII only."""
    text = message.replace("\\", "\\\\").replace('"', '\\"')
    return f'299 minfer "{text}"'.encode("ascii", errors="replace")


def capped_max_tokens(requested: int, n_ctx_slot: int, param: str) -> int:
    """The reply's length limit: `requested`, or the slot's context where it asks for more
    (the reply can never be longer), with a warning saying so."""
    if requested <= n_ctx_slot:
        return requested
    warn(f"{param} = {requested} exceeds the context length ({n_ctx_slot} tokens per "
         f"request); capped to {n_ctx_slot}")
    return n_ctx_slot
