"""A reply's reasoning (`<think>` … `</think>`) split from its content, as llama.cpp splits it.

Gemma 4 writes its thinking as `<|channel>thought` … `<channel|>` instead (llama.cpp's
common/parsers/gemma4.cpp tags): `reasoning_tags` picks that pair for a template (or, where no
template source is at hand, a rendered prompt) that writes Gemma 4's channel or `<|think|>`
switch; everything below works the same with either pair (`Tags`).

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
(a partial tag, whitespace the thinking may end with), so its pieces concatenate to
`split_reasoning`'s values. Whitespace a reply opens with is content whether or not `<think>`
follows, so it goes out at once (a first token of "\n" is the stream's first delta, as
llama-server's).

`ReasoningOptions` is what a surface asks for (format, thinking budget, template variables such
as Qwen3's `enable_thinking`); once the prompt is rendered, `ReasoningOptions.plan` gives the
reply's `ReplyPlan`: whether it starts inside the thinking, how it is split, and the logit mask
that closes the thinking at the budget (minfer.sampling.reasoning_budget). A harmony template's
(gpt-oss) reply is read by minfer.sampling.harmony instead: its analysis channel is the thinking,
its final channel the content (`ReplyPlan.split` / `stream` give them, `HarmonySplit`).

One rule on every surface (the CLI's `--reasoning on` / `--reasoning-budget N`, a chat request's
`chat_template_kwargs.enable_thinking` / `reasoning_budget`, Anthropic's `thinking`, Ollama's
`think`): thinking asked of a model that cannot think (`template_thinks`: its chat template
neither writes `<think>` nor reads `enable_thinking`) is refused by name
(`ReasoningOptions.check_model`: a CLI error, a 400 in each API's own shape), as Ollama,
OpenAI and Anthropic refuse it, never silently ignored. Asking it not to think is fine.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from minfer.errors import MinferError
from minfer.sampling.harmony import ANALYSIS, END, START, HarmonyFormat, is_harmony
from minfer.sampling.reasoning_budget import ReasoningBudget

OPEN, CLOSE = "<think>", "</think>"
FORCED_CLOSE = CLOSE + "\n\n"  # what a budget forces: the model's own end tag, then a blank line


@dataclass(frozen=True)
class Tags:
    """The text that opens and closes a reply's thinking, and what a budget forces to end it."""

    open: str
    close: str
    forced: str


THINK = Tags(OPEN, CLOSE, FORCED_CLOSE)
GEMMA4 = Tags("<|channel>thought", "<channel|>", "<channel|>")
_GEMMA4_MARKS = ("<|channel>", "<|think|>")  # a Gemma 4 template (or prompt) writes these


def reasoning_tags(text: str) -> Tags:
    """The thinking tags of a chat template's source (or of a prompt it rendered)."""
    return GEMMA4 if any(m in text for m in _GEMMA4_MARKS) else THINK
FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
SWITCHES = ("on", "off", "auto")  # --reasoning: Qwen3's enable_thinking true / false / unset


@dataclass(frozen=True)
class ReasoningOptions:
    """How a request's thinking is rendered, held and returned."""

    fmt: str = "auto"
    budget: int = -1  # thinking tokens; -1 unlimited, 0 none (enable_thinking false)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_format(self.fmt)
        check_budget(self.budget)

    @classmethod
    def build(cls, *, fmt: str = "auto", budget: int = -1, switch: str = "auto",
              template_kwargs: Mapping[str, Any] | None = None) -> ReasoningOptions:
        """From the CLI / server flags: `switch` on|off sets `enable_thinking` unless the
        template variables already do."""
        if switch not in SWITCHES:
            raise ValueError(f"unknown reasoning switch {switch!r} (use on, off or auto)")
        kwargs = dict(template_kwargs or {})
        if switch != "auto":
            kwargs.setdefault("enable_thinking", switch == "on")
        return cls(fmt=fmt, budget=budget, template_kwargs=kwargs)

    def override(self, *, fmt: str | None = None, budget: int | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> ReasoningOptions:
        """A request's own values over these (its template variables added to them)."""
        kwargs = {**self.template_kwargs, **(template_kwargs or {})}
        return replace(self, fmt=self.fmt if fmt is None else fmt,
                       budget=self.budget if budget is None else budget, template_kwargs=kwargs)

    def asks_to_think(self) -> str | None:
        """The setting that asks for thinking (None: none does)."""
        if self.template_kwargs.get("enable_thinking") is True:
            return "enable_thinking"
        return "reasoning budget" if self.budget > 0 else None

    def check_model(self, template_source: str, template_variables: Collection[str]) -> None:
        """ThinkingUnsupported when these options ask a model that cannot think to think."""
        asked = self.asks_to_think()
        if asked is not None and not template_thinks(template_source, template_variables):
            raise ThinkingUnsupported(f"this model does not think (its chat template writes no "
                                      f"{OPEN} and has no enable_thinking switch): the "
                                      f"{asked} asked for cannot apply")

    def template_vars(self) -> dict[str, Any]:
        """The variables the chat template renders with; a zero budget asks the template not
        to think (where it can), as llama.cpp does."""
        out = dict(self.template_kwargs)
        if self.budget == 0:
            out.setdefault("enable_thinking", False)
        return out

    def plan(self, prompt: str, encode: Callable[[str], list[int]], *,
             template_source: str = "") -> ReplyPlan:
        """The plan for a reply to the rendered `prompt` of a template (its source: a harmony
        template's replies are harmony messages). encode: text to ids with special tokens
        parsed (for the budget's tags)."""
        if is_harmony(template_source):
            harmony = HarmonyFormat(reasoning=self.fmt != "none",
                                    opens_header=prompt.endswith(START))
            return ReplyPlan(self.fmt, False, self.budget_mask(encode, in_reasoning=False,
                                                               harmony=True), harmony)
        tags = reasoning_tags(template_source or prompt)
        inside = prompt_opens_reasoning(prompt, tags)
        return ReplyPlan(self.fmt, inside, self.budget_mask(encode, in_reasoning=inside,
                                                            tags=tags), tags=tags)

    def budget_mask(self, encode: Callable[[str], list[int]], *, in_reasoning: bool,
                    harmony: bool = False, tags: Tags = THINK) -> ReasoningBudget | None:
        """The mask that closes the thinking after `budget` tokens (None when unlimited): a
        `<think>` block, or harmony's analysis message (closed by `<|end|>`, as llama.cpp's
        gpt-oss tags say). encode: text to ids with special tokens parsed."""
        if self.budget < 0:
            return None
        if harmony:
            return ReasoningBudget(budget=self.budget, start=encode(ANALYSIS), end=encode(END),
                                   forced=encode(END))
        return ReasoningBudget(budget=self.budget, start=encode(tags.open), end=encode(tags.close),
                               forced=encode(tags.forced), inside=in_reasoning)


@dataclass(frozen=True)
class ReplyPlan:
    """How one reply's thinking is split (whole or streamed) and held to its budget."""

    fmt: str
    in_reasoning: bool  # the rendered prompt opened <think>
    budget: ReasoningBudget | None = None  # the logit mask that closes the thinking
    harmony: HarmonyFormat | None = None  # a harmony reply: parsed whole (tools added later)
    tags: Tags = THINK  # the reply's thinking tags (Gemma 4's channel, or <think>)

    def split(self, text: str) -> Split:
        """The whole reply's content and reasoning (a harmony reply's final and analysis
        channels)."""
        if self.harmony is not None:
            got = self.harmony.parse(text, new_id=str)
            return Split(got.content, got.reasoning)
        return split_reasoning(text, fmt=self.fmt, in_reasoning=self.in_reasoning,
                               tags=self.tags)

    def stream(self) -> ReasoningStream | HarmonySplit:
        """`split` piece by piece: `push(text)` / `finish()` give (content, reasoning)."""
        if self.harmony is not None:
            return HarmonySplit(self.harmony)
        return ReasoningStream(fmt=self.fmt, in_reasoning=self.in_reasoning, tags=self.tags)


class HarmonySplit:
    """A harmony reply as (content, reasoning) pieces, as `ReasoningStream` gives them: its
    final channel, its analysis channel; the channel marks never show (no tools are offered,
    so a call is dropped)."""

    def __init__(self, fmt: HarmonyFormat) -> None:
        self._stream = fmt.stream(new_id=str)

    def push(self, text: str) -> tuple[str, str]:
        return self._pieces(self._stream.push(text))

    def finish(self) -> tuple[str, str]:
        return self._pieces(self._stream.finish())

    @staticmethod
    def _pieces(deltas: list[dict[str, Any]]) -> tuple[str, str]:
        return ("".join(d.get("content", "") for d in deltas),
                "".join(d.get("reasoning_content", "") for d in deltas))


class ThinkingUnsupported(MinferError):
    """Thinking asked of a model whose chat template cannot think."""


def template_thinks(template_source: str, template_variables: Collection[str]) -> bool:
    """Whether a chat template can think: it writes `<think>`, Gemma 4's thought channel or
    harmony's channels, or reads `enable_thinking`."""
    return OPEN in template_source or GEMMA4.open in template_source or \
        is_harmony(template_source) or "enable_thinking" in template_variables


def check_budget(budget: int) -> int:
    if budget < -1:
        raise ValueError(f"reasoning budget must be -1 (unlimited) or more, got {budget}")
    return budget


@dataclass(frozen=True)
class Split:
    content: str
    reasoning: str | None  # None: the reply had no reasoning (or the format keeps it in)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown reasoning_format {fmt!r} (use one of {', '.join(FORMATS)})")
    return fmt


def prompt_opens_reasoning(prompt: str, tags: Tags = THINK) -> bool:
    """The rendered prompt ends inside a thinking block (the template opened `<think>`)."""
    return prompt.rstrip().endswith(tags.open)


def split_reasoning(text: str, *, fmt: str = "auto", in_reasoning: bool = False,
                    tags: Tags = THINK) -> Split:
    """The whole reply's content and reasoning."""
    content, reasoning, _ = _split(text, fmt=check_format(fmt), in_reasoning=in_reasoning,
                                   final=True, tags=tags)
    return Split(content, reasoning or None)


class ReasoningStream:
    """Split a reply as it streams: `push(text)` and `finish()` return (content, reasoning)
    pieces; every piece is final, so they concatenate to `split_reasoning`'s values."""

    def __init__(self, *, fmt: str = "auto", in_reasoning: bool = False,
                 tags: Tags = THINK) -> None:
        self.fmt = check_format(fmt)
        self.in_reasoning = in_reasoning
        self.tags = tags
        self.text = ""
        self._content = 0  # characters of each value already given out
        self._reasoning = 0
        self._verbatim = False  # all further text is content as it comes

    def push(self, text: str) -> tuple[str, str]:
        if self._verbatim:
            return text, ""
        self.text += text
        return self._emit(final=False)

    def finish(self) -> tuple[str, str]:
        return ("", "") if self._verbatim else self._emit(final=True)

    def _emit(self, *, final: bool) -> tuple[str, str]:
        content, reasoning, self._verbatim = _split(self.text, fmt=self.fmt,
                                                    in_reasoning=self.in_reasoning, final=final,
                                                    tags=self.tags)
        out = content[self._content:], reasoning[self._reasoning:]
        self._content, self._reasoning = len(content), len(reasoning)
        return out


def _split(text: str, *, fmt: str, in_reasoning: bool, final: bool,
           tags: Tags = THINK) -> tuple[str, str, bool]:
    """(content, reasoning, verbatim): the values for `text` (final), or the parts of them that
    no further text can change (not final); verbatim: any text that follows is content as is."""
    if fmt == "none":
        return text, "", True
    lead, body = "", text
    opening, closing = tags.open, tags.close
    if not in_reasoning:
        stripped = text.lstrip()
        lead = text[:len(text) - len(stripped)]  # content however the reply goes on
        if not final and (not stripped or (opening.startswith(stripped) and stripped != opening)):
            return lead, "", False  # may still open with <think>
        if not stripped.startswith(opening):
            return text, "", True
        body = stripped[len(opening):]
    legacy = fmt == "deepseek-legacy"
    end = body.find(closing)
    if end < 0:
        reasoning = body.strip() if final else _stable(body.lstrip(), closing)
        content = text if legacy else lead
        return content, reasoning, False
    after = body[end + len(closing):].lstrip()
    content = text if legacy else lead + after
    return content, body[:end].strip(), legacy or bool(after)


def _stable(reasoning: str, closing: str = CLOSE) -> str:
    """The part of unfinished reasoning that stays: without a tail that may become `</think>`,
    and without trailing whitespace (dropped if the thinking ends there)."""
    for n in range(min(len(closing) - 1, len(reasoning)), 0, -1):
        if reasoning.endswith(closing[:n]):
            reasoning = reasoning[:-n]
            break
    return reasoning.rstrip()
