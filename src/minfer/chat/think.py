"""Splitting a streamed reply into reasoning (`<think>…</think>`) and answer text.

Qwen3-style models open their reply with a `<think>` block. The REPL shows it dimmed, so it
needs to know, piece by piece, which text lies inside the block. Tags may arrive split over
several pieces (`<thi` + `nk>`), so `ThinkSplitter.push` holds back a tail that could still
become a tag and releases it once it cannot (or at `flush`). The tags themselves are returned as
part of the reasoning segment, so the printed text is exactly the reply.

A harmony reply (gpt-oss) has no such tags: `HarmonySplitter` gives the same segments from its
channels (the analysis is the thinking, the final message the answer), the channel marks never
shown; `splitter_for(template_source)` picks the splitter for a chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from minfer.sampling.harmony import HarmonyFormat, is_harmony

OPEN, CLOSE = "<think>", "</think>"


class Splitter(Protocol):
    def push(self, text: str) -> list[tuple[str, bool]]: ...

    def flush(self) -> list[tuple[str, bool]]: ...


def splitter_for(template_source: str) -> Callable[[], Splitter]:
    """A new splitter per reply for a chat template's replies."""
    return HarmonySplitter if is_harmony(template_source) else ThinkSplitter


def reply_content_for(template_source: str) -> Callable[[str], str] | None:
    """What a conversation keeps of a reply: a harmony reply's final message (the template
    writes it back in its own channel), None for the reply as written."""
    if not is_harmony(template_source):
        return None
    return lambda text: HarmonyFormat().parse(text, new_id=str).content


class ThinkSplitter:
    """Feeds reply text; returns `(text, is_thinking)` segments in order."""

    def __init__(self) -> None:
        self.thinking = False
        self._held = ""

    def push(self, text: str) -> list[tuple[str, bool]]:
        buf = self._held + text
        self._held = ""
        out: list[tuple[str, bool]] = []
        while buf:
            tag = CLOSE if self.thinking else OPEN
            i = buf.find(tag)
            if i >= 0:
                if self.thinking:
                    _append(out, buf[: i + len(tag)], True)
                else:
                    _append(out, buf[:i], False)
                    _append(out, tag, True)
                self.thinking = not self.thinking
                buf = buf[i + len(tag):]
                continue
            keep = _partial_tag_len(buf, tag)
            _append(out, buf[: len(buf) - keep], self.thinking)
            self._held = buf[len(buf) - keep:]
            break
        return out

    def flush(self) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        _append(out, self._held, self.thinking)
        self._held = ""
        return out


def _append(out: list[tuple[str, bool]], text: str, thinking: bool) -> None:
    if not text:
        return
    if out and out[-1][1] == thinking:
        out[-1] = (out[-1][0] + text, thinking)
    else:
        out.append((text, thinking))


def _partial_tag_len(buf: str, tag: str) -> int:
    """Length of the longest tail of buf that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class HarmonySplitter:
    """A harmony reply's `(text, is_thinking)` segments: analysis, then the final message."""

    def __init__(self) -> None:
        self._stream = HarmonyFormat().stream(new_id=str)

    def push(self, text: str) -> list[tuple[str, bool]]:
        return self._segments(self._stream.push(text))

    def flush(self) -> list[tuple[str, bool]]:
        return self._segments(self._stream.finish())

    @staticmethod
    def _segments(deltas: list[dict[str, str]]) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        for d in deltas:
            _append(out, d.get("reasoning_content", ""), True)
            _append(out, d.get("content", ""), False)
        return out
