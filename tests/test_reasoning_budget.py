"""The thinking budget (minfer.sampling.reasoning_budget) through the real sampler chain."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.sampling.mask import AllowedTokens, MaskChain
from minfer.sampling.params import SamplerParams
from minfer.sampling.reasoning_budget import ReasoningBudget
from minfer.sampling.sampler import Sampler

N_VOCAB = 32
THINK, END_THINK, MSG = 30, 31, 29
FAVOURITE = 5  # the token the scripted model always prefers


def _run(mask: object, n: int, *, temp: float = 0.0, prefer: int = FAVOURITE) -> list[int]:
    sampler = Sampler(SamplerParams(temp=temp), N_VOCAB, seed=7, logit_mask=mask)  # type: ignore[arg-type]
    out = []
    for _ in range(n):
        logits = np.zeros(N_VOCAB, np.float32)
        logits[prefer] = 10.0
        tok = sampler.sample(logits)
        sampler.accept(tok)
        out.append(tok)
    return out


@pytest.mark.parametrize("budget", [0, 1, 8])
def test_exactly_n_thinking_tokens_then_the_end_tokens(budget: int) -> None:
    mask = ReasoningBudget(budget=budget, start=[THINK], end=[END_THINK],
                           forced=[MSG, END_THINK], inside=True)
    got = _run(mask, budget + 5)
    assert got == [FAVOURITE] * budget + [MSG, END_THINK] + [FAVOURITE] * 3


def test_counting_starts_at_the_opening_tag() -> None:
    mask = ReasoningBudget(budget=2, start=[THINK], end=[END_THINK], forced=[END_THINK])
    sampler = Sampler(SamplerParams(temp=0.0), N_VOCAB, logit_mask=mask)
    out = []
    for prefer in (1, THINK, 2, 3, 4, 6):
        logits = np.zeros(N_VOCAB, np.float32)
        logits[prefer] = 10.0
        tok = sampler.sample(logits)
        sampler.accept(tok)
        out.append(tok)
    assert out == [1, THINK, 2, 3, END_THINK, 6]


def test_a_thinking_that_ends_by_itself_is_left_alone() -> None:
    mask = ReasoningBudget(budget=3, start=[THINK], end=[END_THINK], forced=[END_THINK],
                           inside=True)
    sampler = Sampler(SamplerParams(temp=0.0), N_VOCAB, logit_mask=mask)
    for prefer in (1, END_THINK, 2, 3, 4, 5):
        logits = np.zeros(N_VOCAB, np.float32)
        logits[prefer] = 10.0
        assert sampler.sample(logits) == prefer
        sampler.accept(prefer)


def test_unlimited_never_forces_and_sampling_is_forced_too() -> None:
    free = ReasoningBudget(budget=-1, start=[THINK], end=[END_THINK], forced=[END_THINK],
                           inside=True)
    assert _run(free, 12) == [FAVOURITE] * 12
    hot = ReasoningBudget(budget=2, start=[THINK], end=[END_THINK], forced=[END_THINK],
                          inside=True)
    assert _run(hot, 3, temp=1.5)[2] == END_THINK


def test_chained_with_a_grammar_mask() -> None:
    budget = ReasoningBudget(budget=1, start=[THINK], end=[END_THINK], forced=[END_THINK],
                             inside=True)
    grammar = AllowedTokens([FAVOURITE, 7, END_THINK], N_VOCAB)
    assert _run(MaskChain([budget, grammar]), 3, prefer=7) == [7, END_THINK, 7]


def test_bad_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="-1"):
        ReasoningBudget(budget=-2, start=[], end=[], forced=[1])
