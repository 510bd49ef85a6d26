"""Repetition / frequency / presence penalties and DRY, against hand-computed values and a slow
transcription of llama.cpp's DRY."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.errors import SamplingError
from minfer.sampling import Sampler, SamplerParams
from minfer.sampling.dry import Breakers, DryPenalty, TokenWindow, suffix_match_lengths
from minfer.sampling.penalties import RepetitionPenalty

# --- repetition / frequency / presence --------------------------------------------------------


def test_repeat_penalty_divides_positive_and_multiplies_negative() -> None:
    pen = RepetitionPenalty(last_n=64, repeat=2.0, frequency=0.0, presence=0.0)
    pen.reset([1, 2])
    x = np.array([4.0, 4.0, -4.0, 4.0], dtype=np.float32)
    pen.apply(x)
    assert x.tolist() == [4.0, 2.0, -8.0, 4.0]


def test_frequency_counts_and_presence_once() -> None:
    pen = RepetitionPenalty(last_n=64, repeat=1.0, frequency=0.5, presence=0.25)
    pen.reset([3, 1, 3, 3])
    assert pen.counts() == {3: 3, 1: 1}
    x = np.zeros(4, dtype=np.float32)
    pen.apply(x)
    assert x.tolist() == [0.0, -0.75, 0.0, -1.75]


def test_window_keeps_only_the_last_n_tokens() -> None:
    pen = RepetitionPenalty(last_n=3, repeat=1.0, frequency=1.0, presence=0.0)
    pen.reset([0, 1, 1])
    pen.accept(2)
    pen.accept(2)  # window: 1 2 2
    assert pen.counts() == {1: 1, 2: 2}
    x = np.zeros(3, dtype=np.float32)
    pen.apply(x)
    assert x.tolist() == [0.0, -1.0, -2.0]


def test_penalties_off_when_neutral_or_last_n_zero() -> None:
    for pen in (
        RepetitionPenalty(last_n=64, repeat=1.0, frequency=0.0, presence=0.0),
        RepetitionPenalty(last_n=0, repeat=1.5, frequency=1.0, presence=1.0),
    ):
        pen.reset([0, 1])
        x = np.ones(2, dtype=np.float32)
        pen.apply(x)
        assert x.tolist() == [1.0, 1.0]


def test_sampler_seeds_penalties_from_the_prompt_tail_and_accepts() -> None:
    s = Sampler(SamplerParams(temp=0.0, presence_penalty=10.0, penalty_last_n=2), 4, seed=0)
    logits = np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    s.reset([0, 0, 0, 1])  # only the last two count: 0 and 1
    assert s.sample(logits) == 2
    s.accept(2)  # window: 1 2
    assert s.sample(logits) == 0


def test_penalty_last_n_minus_one_means_the_context() -> None:
    params = SamplerParams(temp=0.0, presence_penalty=10.0, penalty_last_n=-1)
    s = Sampler(params, 4, seed=0, n_ctx=100)
    s.reset([0] + [3] * 80)
    assert s.sample(np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)) == 1


# --- DRY --------------------------------------------------------------------------------------

A, B, C, D, NL, X = range(6)
TEXTS = ["a", "b", "c", "d", "\n", "x", "b:", "y"]


def make_dry(**kw: object) -> DryPenalty:
    args: dict[str, object] = {
        "multiplier": 1.0,
        "base": 2.0,
        "allowed_length": 2,
        "last_n": -1,
        "breakers": ("\n",),
        "n_vocab": len(TEXTS),
        "token_text": TEXTS,
    }
    args.update(kw)
    return DryPenalty(**args)  # type: ignore[arg-type]


def dry_delta(dry: DryPenalty, history: list[int]) -> np.ndarray:
    dry.reset(history)
    x = np.zeros(dry.breakers().is_head.size, dtype=np.float32)
    dry.apply(x)
    return x


def test_dry_penalises_the_token_that_extends_a_repeat() -> None:
    # "a b c d a b c": emitting d would repeat 4 tokens; match length 3 -> 2 ** (3 - 2)
    x = dry_delta(make_dry(), [A, B, C, D, A, B, C])
    assert x[D] == -2.0
    assert np.count_nonzero(x) == 1


def test_dry_allows_short_repeats() -> None:
    x = dry_delta(make_dry(allowed_length=3), [A, B, C, D, A, B])
    assert not x.any()


def test_dry_repeat_stops_at_a_breaker() -> None:
    hist = [A, NL, B, C, D, A, NL, B, C]  # true match "a \n b c" (4), but "\n" breaks it
    assert dry_delta(make_dry(), hist)[D] == -1.0  # 2 ** (2 - 2)
    assert dry_delta(make_dry(breakers=("z",)), hist)[D] == -4.0  # 2 ** (4 - 2)


def test_dry_never_penalises_a_breaker_token() -> None:
    hist = [A, NL, B, NL, A, NL, B]
    with_breaker = dry_delta(make_dry(allowed_length=1), hist)
    assert not with_breaker.any()
    without = dry_delta(make_dry(allowed_length=1, breakers=("q",)), hist)
    assert without[NL] < 0


def test_dry_tokens_containing_a_breaker_are_breakers() -> None:
    brk = make_dry(breakers=(":",)).breakers()
    assert brk.single.tolist() == [t.find(":") >= 0 for t in TEXTS]


def test_dry_multi_character_breaker_completes_across_tokens() -> None:
    texts = ["a", "b", "xa", "ab", "q"]
    brk = Breakers.build(["ab"], n_vocab=5, token_text=texts, encode=lambda s: [1] if s else [])
    assert brk.tails == {0: [(1,)], 2: [(1,)], 3: [()]}
    with pytest.raises(SamplingError, match="encode"):
        make_dry(breakers=("ab",), encode=None)


def test_dry_needs_token_text_when_on() -> None:
    with pytest.raises(SamplingError, match="token_text"):
        make_dry(token_text=None)
    off = make_dry(multiplier=0.0, token_text=None)
    assert not dry_delta(off, [A, B, A, B, A]).any()


def test_dry_exponent_is_clamped() -> None:
    dry = make_dry(base=1.75, allowed_length=2)
    x = dry_delta(dry, [A] * 2000)
    assert np.isfinite(x).all() and x[A] == pytest.approx(-(1.75**dry.max_exp), rel=1e-5)


def test_dry_last_n_limits_the_scan() -> None:
    hist = [A, B, C, D] + [X] * 10 + [A, B, C]
    assert dry_delta(make_dry(last_n=8), hist)[D] == 0.0
    assert dry_delta(make_dry(last_n=20), hist)[D] == -2.0


def test_token_window_compacts_and_grows() -> None:
    w = TokenWindow(5)
    for t in range(1000):
        w.push(t)
    assert w.view().tolist() == [995, 996, 997, 998, 999]
    u = TokenWindow(None)
    for t in range(600):
        u.push(t)
    assert u.view().tolist() == list(range(600))


def reference_dry(
    hist: list[int],
    tails: dict[int, list[tuple[int, ...]]],
    *,
    n_vocab: int,
    mult: float,
    base: float,
    allowed: int,
) -> np.ndarray:
    """llama.cpp's DRY, transcribed plainly (brute-force suffix matching)."""
    out = np.zeros(n_vocab, dtype=np.float64)
    w, n = hist, len(hist)
    if n <= allowed:
        return out
    rep_limit = n
    for i in range(n):
        longest = -1
        for tail in tails.get(w[n - 1 - i], []):
            if longest < len(tail) <= i and all(
                tail[o] == w[n - 1 - (i - o - 1)] for o in range(len(tail))
            ):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return out
    best: dict[int, int] = {}
    for j in range(n - 1):
        length = 0
        while length <= j and w[j - length] == w[n - 1 - length]:
            length += 1
        length = min(length, rep_limit)
        if length >= allowed:
            best[w[j + 1]] = max(best.get(w[j + 1], 0), length)
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for tok, length in best.items():
        if () in tails.get(tok, []):
            continue
        e = length - allowed
        out[tok] -= mult * base ** (min(e, max_exp) if max_exp > 0 else e)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_dry_matches_the_plain_transcription(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_vocab = 6
    tails = {4: [()], 5: [(2,), (2, 3)]}  # 4 is a breaker; 5 starts breakers "5 2", "5 2 3"
    hist = rng.integers(0, n_vocab if seed % 2 else 3, size=int(rng.integers(1, 120))).tolist()
    if seed % 5 == 0:
        hist = (hist[:10] * 12)[:110]  # long periodic repeats
    allowed = int(rng.integers(0, 4))
    dry = DryPenalty(
        multiplier=0.8,
        base=1.75,
        allowed_length=allowed,
        last_n=-1,
        breakers=(),
        n_vocab=n_vocab,
        resolved=Breakers(tails, n_vocab),
    )
    dry.reset(hist)
    x = np.zeros(n_vocab, dtype=np.float32)
    dry.apply(x)
    want = reference_dry(hist, tails, n_vocab=n_vocab, mult=0.8, base=1.75, allowed=allowed)
    np.testing.assert_allclose(x, want, rtol=1e-5)


def test_suffix_match_lengths_small_cases() -> None:
    w = np.array([A, B, C, C, B, C, X, A, B, C])  # llama.cpp's own example
    assert suffix_match_lengths(w, 100).tolist() == [0, 0, 3, 1, 0, 2, 0, 0, 0]
    assert suffix_match_lengths(w, 2).tolist() == [0, 0, 2, 1, 0, 2, 0, 0, 0]


def test_sampler_wires_dry_with_token_text() -> None:
    params = SamplerParams(temp=0.0, dry_multiplier=5.0, dry_base=2.0)
    s = Sampler(params, len(TEXTS), seed=0, token_text=lambda i: TEXTS[i])
    s.reset([A, B, C, D, A, B])
    logits = np.zeros(len(TEXTS), dtype=np.float32)
    logits[C] = 1.0
    assert s.sample(logits) != C  # "a b" repeated: c would extend it, penalised by 5 * 2 ** 0
    with pytest.raises(SamplingError):
        Sampler(params, len(TEXTS), seed=0)
