"""OpenAI response bodies, field for field: completions, chat completions and their stream chunks.

Chat: `chat.completion` with `choices[{index, message{role, content}, logprobs, finish_reason}]`;
streamed as `chat.completion.chunk`s whose first delta carries the role, then content deltas
(or `tool_calls` deltas), then an empty delta with the finish reason, then (with
`stream_options.include_usage`) one chunk with no choices and the usage. Every other chunk
then carries `"usage": null`, as OpenAI sends.
Completions: `text_completion` with `choices[{index, text, logprobs, finish_reason}]`.
Several choices (`n`, a completion's prompt list): a whole response lists them by index; a
stream interleaves their chunks as they come, each naming its index, and sends the usage (and
`[DONE]`) once every choice has finished.
"""

from __future__ import annotations

import codecs
import secrets
import time
from dataclasses import dataclass
from typing import Any

from minfer.engine.core.request import TokenLogprob
from minfer.server.output import TokenBytes, token_logprobs, token_piece
from minfer.server.worker import Usage


def total_usage(usages: list[Usage], n: int) -> Usage:
    """The usage of a response of several choices, `n` per prompt in order: each prompt's
    tokens (and the cached ones) counted once, from its first choice; every choice's completion
    tokens."""
    firsts = usages[::n]
    return Usage(sum(u.prompt_tokens for u in firsts),
                 sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in firsts))


def usage_body(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def chat_logprobs(lps: list[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    return {"content": token_logprobs(lps, token_bytes), "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], token_bytes: TokenBytes,
                        offset: int = 0, *, first: int | None = None) -> dict[str, Any]:
    """The legacy completions' logprobs object; first: an echoed prompt's first token, which
    nothing scores (its logprob and top logprobs are null, as OpenAI writes them). A token's
    `text_offset` is where it starts in the text the tokens spell (from `offset`), counted over
    their bytes decoded in turn: a token that starts inside a character split over tokens
    starts where that character does."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    at = offset

    def add(token_id: int, value: float | None, top: dict[str, float] | None) -> None:
        nonlocal at
        offsets.append(at)
        at += len(text.decode(token_bytes(token_id)))
        tokens.append(token_piece(token_bytes, token_id)[0])
        values.append(value)
        tops.append(top)

    if first is not None:
        add(first, None, None)
    for lp in lps:
        top: dict[str, float] = {}
        for tid, value in lp.top:
            top.setdefault(token_piece(token_bytes, tid)[0], value)
        add(lp.token_id, lp.logprob, top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


@dataclass
class Envelope:
    """What every body and chunk of one response shares."""

    kind: str  # "chat" | "completion"
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        self.id = self.id or prefix + secrets.token_hex(12)
        self.created = self.created or int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "minfer"}

    # -- whole responses -----------------------------------------------------------------------
    def choice(self, index: int, text_fields: dict[str, Any], finish: str,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """One choice of a whole response."""
        if self.kind == "chat":
            return {"index": index, "message": {"role": "assistant", **text_fields,
                                                "refusal": None},
                    "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text_fields["content"], "logprobs": logprobs,
                "finish_reason": finish}

    def full(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        body["usage"] = usage_body(usage)
        return body

    # -- stream chunks -------------------------------------------------------------------------
    def chunk(self, *, text: str | None = None, role: bool = False, finish: str | None = None,
              logprobs: dict[str, Any] | None = None, with_usage: bool = False,
              fields: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        """One chunk of choice `index`; for chat, `fields` are extra delta fields
        (`tool_calls`, or `content` None next to the role when the reply may be tool calls
        only)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            if text is not None:
                delta["content"] = text
            delta.update(fields or {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body
