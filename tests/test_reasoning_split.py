"""The reasoning split (minfer.chat.reasoning): llama.cpp's rules, whole and streamed."""

from __future__ import annotations

import random

import pytest

from minfer.chat.reasoning import (
    ReasoningStream,
    Split,
    prompt_opens_reasoning,
    split_reasoning,
)

CASES = [
    # (reply, in_reasoning, deepseek split)
    ("<think>\nplan it\n</think>\n\nThe answer.", False, Split("The answer.", "plan it")),
    ("  <think>x</think>y", False, Split("  y", "x")),  # whitespace before <think> stays
    ("<think>still thinking", False, Split("", "still thinking")),  # no </think>
    ("no tags here", False, Split("no tags here", None)),
    ("answer <think>late</think>", False, Split("answer <think>late</think>", None)),
    ("opened by the template\n</think>\n\nok", True, Split("ok", "opened by the template")),
    ("all reasoning, never closed", True, Split("", "all reasoning, never closed")),
    ("<think></think>\n\nplain", False, Split("plain", None)),  # empty thinking: none
    ("<think>a</think>   \n", False, Split("", "a")),
    ("<think>a</think>b</think>c", False, Split("b</think>c", "a")),
    ('<think>t</think>\n<tool_call>\n{"name": "f"}\n</tool_call>', False,
     Split('<tool_call>\n{"name": "f"}\n</tool_call>', "t")),
    ("", False, Split("", None)),
    ("<thi", False, Split("<thi", None)),
    ("<think>ends in a partial </thi", False, Split("", "ends in a partial </thi")),
]


@pytest.mark.parametrize(("text", "inside", "want"), CASES)
def test_deepseek_and_auto_split(text: str, inside: bool, want: Split) -> None:
    assert split_reasoning(text, fmt="deepseek", in_reasoning=inside) == want
    assert split_reasoning(text, fmt="auto", in_reasoning=inside) == want


@pytest.mark.parametrize(("text", "inside", "want"), CASES)
def test_none_leaves_the_text_alone(text: str, inside: bool, want: Split) -> None:
    assert split_reasoning(text, fmt="none", in_reasoning=inside) == Split(text, None)


@pytest.mark.parametrize(("text", "inside", "want"), CASES)
def test_legacy_keeps_the_tags_in_content(text: str, inside: bool, want: Split) -> None:
    assert split_reasoning(text, fmt="deepseek-legacy", in_reasoning=inside) == \
        Split(text, want.reasoning)


@pytest.mark.parametrize("fmt", ["auto", "deepseek", "deepseek-legacy", "none"])
@pytest.mark.parametrize(("text", "inside", "want"), CASES)
def test_stream_concatenates_to_the_whole_split(fmt: str, text: str, inside: bool,
                                                want: Split) -> None:
    rng = random.Random(hash((fmt, text)) & 0xFFFF)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ReasoningStream(fmt=fmt, in_reasoning=inside)
        outs = [stream.push(p) for p in pieces] + [stream.finish()]
        content = "".join(c for c, _ in outs)
        reasoning = "".join(r for _, r in outs)
        whole = split_reasoning(text, fmt=fmt, in_reasoning=inside)
        assert (content, reasoning or None) == (whole.content, whole.reasoning)


def test_stream_gives_reasoning_out_before_the_reply_ends() -> None:
    stream = ReasoningStream()
    assert stream.push("<think>\nfirst ") == ("", "first")
    assert stream.push("idea  ") == ("", " idea")
    assert stream.push("</think>\n\nAns") == ("Ans", "")
    assert stream.finish() == ("", "")


def test_prompt_ending_inside_a_thinking_block() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_unknown_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="reasoning_format 'qwen'"):
        split_reasoning("x", fmt="qwen")


def test_stream_gives_leading_whitespace_out_at_once() -> None:
    """Whitespace a reply opens with is content before <think> and without it, so it is not
    held while the tag may still come (a first token of "\\n" streams as it is drawn)."""
    stream = ReasoningStream()
    assert stream.push("\n") == ("\n", "")
    assert stream.push("\n<th") == ("\n", "")
    assert stream.push("ink>a</think>b") == ("b", "a")
    assert split_reasoning("\n\n<think>a</think>b") == Split("\n\nb", "a")
    plain = ReasoningStream()
    assert plain.push(" ") == (" ", "")
    assert plain.push("x") == ("x", "")
