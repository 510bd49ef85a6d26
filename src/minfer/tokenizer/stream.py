"""Streaming detokenization: token ids in, complete UTF-8 text out.

A byte-level BPE token may end in the middle of a multi-byte character (an emoji is often split
over two or three tokens). `IncrementalDecoder.push` returns only text whose characters are
complete and keeps the unfinished tail for the next token; `flush` ends the stream, turning a
tail that never completed into U+FFFD. Bytes that can never start or continue a character are
replaced at once, so nothing is held back longer than one character and nothing is lost:
the concatenation of every `push` and the final `flush` equals `tokenizer.decode(ids)`, except
that `decode` also drops the space an SPM vocabulary's `add_space_prefix` put before the text
(pushes give each token's piece as is, as llama.cpp streams them).
"""

from __future__ import annotations

import codecs
from typing import Protocol


class _TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    def is_control(self, token_id: int) -> bool: ...


class IncrementalDecoder:
    """Turns a stream of token ids into text, one push per token."""

    def __init__(self, tokenizer: _TokenBytes, *, special: bool = True) -> None:
        """`special=False` drops control tokens (such as `<|im_end|>`) from the text."""
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        if not self._special and self._tokenizer.is_control(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def push_many(self, ids: list[int]) -> str:
        """`push` for each id, joined."""
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """End of stream: whatever is still held, an unfinished character as U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bool:
        """True while an incomplete character is held back."""
        buffered, _ = self._utf8.getstate()
        return bool(buffered)
