"""The fill-in-the-middle layout (minfer.tokenizer.infill) chunk by chunk and cut by cut.

A character-level fake tokenizer keeps each piece's ids readable (one id per character, FIM
tokens above 1000); the development model's own ids are checked in test_infill_real.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from minfer.tokenizer.infill import (
    Budget,
    ExtraFile,
    FimUnsupported,
    infill_prompt,
    repo_context,
    tokenize_mixed,
)
from minfer.tokenizer.vocab import FimTokens

PRE, SUF, MID, PAD, REP, SEP, BOS = 1001, 1002, 1003, 1004, 1005, 1006, 1000
QWEN_LIKE = FimTokens(pre=PRE, suf=SUF, mid=MID, pad=PAD, rep=REP, sep=SEP)


@dataclass
class CharTokenizer:
    fim: FimTokens = field(default_factory=lambda: QWEN_LIKE)
    add_bos: bool = False
    bos_id: int | None = BOS
    calls: list[tuple[str, bool, bool | None]] = field(default_factory=list)

    def encode(self, text: str, *, special: bool = True,
               add_bos: bool | None = None) -> list[int]:
        self.calls.append((text, special, add_bos))
        return [ord(c) for c in text]


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_repo_level_layout_with_every_chunk_kind() -> None:
    tok = CharTokenizer()
    got = infill_prompt(tok, "ab", "yz", extra=[ExtraFile("one", "a.py"), ExtraFile("two")],
                        prompt=ids("p"))
    assert got == [REP, *ids("myproject\n"), SEP, *ids("a.py\n"), *ids("one"),
                   SEP, *ids("tmp\n"), *ids("two"), SEP, *ids("filename\n"),
                   PRE, *ids("ab"), *ids("p"), SUF, *ids("yz"), MID]
    assert all(not special and add_bos is False for _, special, add_bos in tok.calls)


def test_no_repo_or_separator_tokens_uses_the_snippet_marker() -> None:
    tok = CharTokenizer(fim=FimTokens(pre=PRE, suf=SUF, mid=MID))
    got = infill_prompt(tok, "a", "b", extra=[ExtraFile("x", "f.py")])
    assert got == [*ids("\n\n--- snippet ---\n\n"), *ids("x"), PRE, *ids("a"), SUF, *ids("b"),
                   MID]


def test_bos_goes_after_the_extra_context_when_the_vocab_adds_one() -> None:
    tok = CharTokenizer(add_bos=True)
    got = infill_prompt(tok, "a", "b")
    assert got == [REP, *ids("myproject\n"), SEP, *ids("filename\n"), BOS, PRE, *ids("a"), SUF,
                   *ids("b"), MID]


def test_budget_cuts_prefix_left_suffix_right_extra_oldest_first() -> None:
    tok = CharTokenizer()
    prefix, suffix = "P" * 50 + "0123456789", "9876543210" + "S" * 50
    budget = Budget(n_batch=16, n_predict=4, n_ctx=40)  # prefix 12, suffix 4 - 2 - 1, extra 16
    got = infill_prompt(tok, prefix, suffix, extra=[ExtraFile("old" * 10, "o.py")],
                        prompt=ids("q"), budget=budget)
    block = repo_context(tok, [ExtraFile("old" * 10, "o.py")])
    assert got == [*block[-16:], PRE, *ids("PP0123456789"), *ids("q"), SUF, *ids("9"), MID]


def test_far_past_the_context_is_cut_never_refused() -> None:
    tok = CharTokenizer()
    got = infill_prompt(tok, "x" * 100_000, "y" * 100_000, extra=[ExtraFile("z" * 100_000)],
                        budget=Budget(n_batch=512, n_predict=-1, n_ctx=1024))
    assert len(got) <= 1024
    assert got[-1] == MID and PRE in got and SUF in got


def test_token_ids_mixed_with_text_are_kept() -> None:
    tok = CharTokenizer()
    assert tokenize_mixed(tok, ["ab", 7, "c"]) == [*ids("ab"), 7, *ids("c")]


def test_a_model_without_fim_tokens_is_refused_by_name() -> None:
    tok = CharTokenizer(fim=FimTokens(pre=PRE, suf=None, mid=None))
    with pytest.raises(FimUnsupported, match=r"fill-in-the-middle.*suffix, middle"):
        infill_prompt(tok, "a", "b")
