"""A reply's reasoning (`<think>` … `</think>`) split from its content, as llama.cpp splits it.

Reasoning models (Qwen3, DeepSeek-R1 distills) think before they answer. With a reasoning format
other than `none` the thinking leaves `content` for `reasoning_content`:

- a reply opens with `<think>` (whitespace before the tag is allowed and stays in content), or
  starts inside the thinking because the rendered prompt ended with `<think>` (plus whitespace:
  `prompt_opens_reasoning`);
- the reasoning is the text up to `</think>`, stripped of whitespace at both ends; whitespace
  right after `</think>` is dropped; with no `</think>` the whole rest is reasoning;
- a reply that does not open with `<think>` is all content.

Formats (llama.cpp's `--reasoning-format`): `none` leaves the text alone; `deepseek` (and `auto`,
the default, which behaves as it) moves the thinking out of content; `deepseek-legacy` keeps the
tags and thinking in content and fills `reasoning_content` too. `split_reasoning` splits a whole
reply; `ReasoningStream` splits it piece by piece, holding back only what may still change
(whitespace, a partial tag), so its pieces concatenate to `split_reasoning`'s values.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


@dataclass(frozen=True)
class Split:
    content: str
    reasoning: str | None  # None: the reply had no reasoning (or the format keeps it in)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown reasoning_format {fmt!r} (use one of {', '.join(FORMATS)})")
    return fmt


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt ends inside a thinking block (the template opened `<think>`)."""
    return prompt.rstrip().endswith(OPEN)


def split_reasoning(text: str, *, fmt: str = "auto", in_reasoning: bool = False) -> Split:
    """The whole reply's content and reasoning."""
    content, reasoning, _ = _split(text, fmt=check_format(fmt), in_reasoning=in_reasoning,
                                   final=True)
    return Split(content, reasoning or None)


class ReasoningStream:
    """Split a reply as it streams: `push(text)` and `finish()` return (content, reasoning)
    pieces; every piece is final, so they concatenate to `split_reasoning`'s values."""

    def __init__(self, *, fmt: str = "auto", in_reasoning: bool = False) -> None:
        self.fmt = check_format(fmt)
        self.in_reasoning = in_reasoning
        self.text = ""
        self._content = 0  # characters of each value already given out
        self._reasoning = 0

    def push(self, text: str) -> tuple[str, str]:
        self.text += text
        return self._emit(final=False)

    def finish(self) -> tuple[str, str]:
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> tuple[str, str]:
        content, reasoning, _ = _split(self.text, fmt=self.fmt, in_reasoning=self.in_reasoning,
                                       final=final)
        out = content[self._content:], reasoning[self._reasoning:]
        self._content, self._reasoning = len(content), len(reasoning)
        return out


def _split(text: str, *, fmt: str, in_reasoning: bool, final: bool) -> tuple[str, str, bool]:
    """(content, reasoning, decided): the values for `text` (final), or the parts of them that
    no further text can change (not final)."""
    if fmt == "none":
        return text, "", True
    lead, body = "", text
    if not in_reasoning:
        stripped = text.lstrip()
        if not final and (not stripped or (OPEN.startswith(stripped) and stripped != OPEN)):
            return "", "", False  # may still open with <think>
        if not stripped.startswith(OPEN):
            return text, "", True
        lead, body = text[:len(text) - len(stripped)], stripped[len(OPEN):]
    legacy = fmt == "deepseek-legacy"
    end = body.find(CLOSE)
    if end < 0:
        reasoning = body.strip() if final else _stable(body.lstrip())
        content = text if legacy else lead
        return content, reasoning, True
    after = body[end + len(CLOSE):]
    content = text if legacy else lead + after.lstrip()
    return content, body[:end].strip(), True


def _stable(reasoning: str) -> str:
    """The part of unfinished reasoning that stays: without a tail that may become `</think>`,
    and without trailing whitespace (dropped if the thinking ends there)."""
    for n in range(min(len(CLOSE) - 1, len(reasoning)), 0, -1):
        if reasoning.endswith(CLOSE[:n]):
            reasoning = reasoning[:-n]
            break
    return reasoning.rstrip()
