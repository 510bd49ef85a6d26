"""The sampler chain: settings, each truncation stage on hand-built logits, greedy, the draw,
seeding, the logit-mask hook — and the fast stages against a slow sort-everything reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.errors import SamplingError
from minfer.sampling import AllowedTokens, Sampler, SamplerParams
from minfer.sampling import stages as st


def cands(logits: list[float] | np.ndarray) -> st.Candidates:
    x = np.asarray(logits, dtype=np.float32)
    return st.Candidates(np.arange(x.size, dtype=np.int64), x)


def from_probs(probs: list[float]) -> st.Candidates:
    return cands(np.log(np.asarray(probs, dtype=np.float64)))


# --- settings ---------------------------------------------------------------------------------


def test_defaults_are_llama_cpp_cli_defaults() -> None:
    p = SamplerParams()
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.typical_p) == (0.8, 40, 0.95, 0.05, 1.0)
    assert (p.repeat_penalty, p.penalty_last_n) == (1.0, 64)
    assert (p.frequency_penalty, p.presence_penalty) == (0.0, 0.0)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (
        0.0,
        1.75,
        2,
        -1,
    )
    assert p.dry_sequence_breakers == ("\n", ":", '"', "*")
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta) == (0, 5.0, 0.1)
    assert not p.penalties_on and not p.dry_on


@pytest.mark.parametrize(
    "bad",
    [
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_k": True},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": -0.5},
        {"min_p": -0.01},
        {"min_p": 1.5},
        {"typical_p": 0.0},
        {"typical_p": 2.0},
        {"temp": math.nan},
        {"temp": math.inf},
        {"repeat_penalty": 0.0},
        {"repeat_penalty": -1.0},
        {"penalty_last_n": -2},
        {"frequency_penalty": math.nan},
        {"dry_multiplier": -1.0},
        {"dry_base": 0.5},
        {"dry_allowed_length": -1},
        {"dry_penalty_last_n": -3},
        {"dry_sequence_breakers": ("\n", "")},
        {"dry_sequence_breakers": "\n"},
        {"mirostat": 3},
        {"mirostat_tau": 0.0},
        {"mirostat_eta": -0.1},
        {"min_keep": -1},
    ],
)
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(SamplingError):
        SamplerParams(**bad)  # type: ignore[arg-type]


def test_with_validates_and_rejects_unknown_names() -> None:
    p = SamplerParams().with_(top_k=5, dry_sequence_breakers=["\n"])
    assert p.top_k == 5 and p.dry_sequence_breakers == ("\n",)
    with pytest.raises(SamplingError, match="top_z"):
        SamplerParams().with_(top_z=3)
    with pytest.raises(SamplingError):
        SamplerParams().with_(top_p=0.0)


# --- stages -----------------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest_sorted() -> None:
    c = st.top_k(cands([1.0, 5.0, 3.0, 4.0, 2.0]), 2)
    assert c.ids.tolist() == [1, 3] and c.sorted
    assert st.top_k(cands([1.0, 2.0]), 0).ids.tolist() == [0, 1]  # 0 = off
    assert st.top_k(cands([1.0, 3.0, 2.0]), 10).ids.tolist() == [1, 2, 0]


@pytest.mark.parametrize("n", [1, 40, 148, 149, 256, 593, 594, 4096])
def test_best_n_over_a_vocabulary_is_the_sorts_head(n: int) -> None:
    """`best_n` over a vocabulary-sized set (the maxima of blocks of 512, 256 or 128 values
    while n is at most half the blocks, argpartition beyond) is the head of a stable sort by
    logit, descending: ties in id order, a value past the last whole block included, masked
    (-inf) logits last."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(151_937) * 3).astype(np.float32)
    x[rng.integers(0, x.size, 500)] = 2.5  # ties, across the n-th place for some n
    x[rng.integers(0, x.size, 20_000)] = -np.inf
    x[-1] = 40.0  # the tail, after the last whole block
    want = np.argsort(-x, kind="stable")[:n]
    got = st.best_n(st.Candidates(np.arange(x.size, dtype=np.int64), x), n)
    assert got.sorted and got.ids.tolist() == want.tolist()
    masked = np.full(151_936, -np.inf, np.float32)
    masked[[7, 3, 90_000]] = [1.0, 2.0, 1.0]  # fewer finite logits than n: the rest are -inf ties
    crowded = np.full(151_936, -np.inf, np.float32)  # a grammar's allowed tokens, in few blocks
    crowded[1000:1000 + 2 * n] = rng.standard_normal(2 * n).astype(np.float32).round(1)
    for y in (masked, crowded):
        got = st.best_n(st.Candidates(np.arange(y.size, dtype=np.int64), y), n)
        assert got.ids.tolist() == np.argsort(-y, kind="stable")[:n].tolist()


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = [0.1, 0.5, 0.15, 0.25]  # sorted: 1 (0.5), 3 (0.25), 2 (0.15), 0 (0.1)
    assert st.top_p(from_probs(probs), 0.4, 1).ids.tolist() == [1]
    assert st.top_p(from_probs(probs), 0.7, 1).ids.tolist() == [1, 3]
    assert st.top_p(from_probs(probs), 0.8, 1).ids.tolist() == [1, 3, 2]
    assert st.top_p(from_probs(probs), 1.0, 1).ids.tolist() == [0, 1, 2, 3]  # off
    assert st.top_p(from_probs(probs), 0.1, 3).ids.tolist() == [1, 3, 2]  # min_keep
    assert st.top_p(from_probs(probs), 0.1, 0).ids.tolist() == [1]  # always >= 1


def test_top_p_renormalises_over_current_candidates() -> None:
    # after top-k 2 the survivors are 0.5 / 0.25 -> 2/3, 1/3: p = 0.6 keeps only the first
    c = st.top_k(from_probs([0.1, 0.5, 0.15, 0.25]), 2)
    assert st.top_p(c, 0.6, 1).ids.tolist() == [1]


def test_min_p_is_relative_to_the_max_probability() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    unsorted = st.min_p(from_probs(probs), 0.25, 1)  # keep p >= 0.125
    assert sorted(unsorted.ids.tolist()) == [1, 2, 3]
    sorted_ = st.min_p(st.top_k(from_probs(probs), 4), 0.25, 1)
    assert sorted_.ids.tolist() == [1, 3, 2]
    assert st.min_p(from_probs(probs), 0.9, 3).ids.tolist() == [1, 3, 2]  # min_keep
    assert len(st.min_p(from_probs(probs), 0.0, 1)) == 4  # off


def test_typical_keeps_tokens_whose_surprise_is_near_the_entropy() -> None:
    # H = 1.2799 nats; |surprise - H| = 0.364, 0.076, 0.330, 1.023 -> order 1, 2, 0, 3
    probs = [0.4, 0.3, 0.2, 0.1]
    assert st.typical(from_probs(probs), 0.45, 1).ids.tolist() == [1, 2]  # drops the top token
    assert st.typical(from_probs(probs), 0.6, 1).ids.tolist() == [1, 2, 0]
    assert st.typical(from_probs(probs), 0.1, 3).ids.tolist() == [1, 2, 0]
    assert len(st.typical(from_probs(probs), 1.0, 1)) == 4


def test_temperature_scales_and_zero_keeps_first_argmax() -> None:
    c = st.temperature(cands([1.0, 2.0, 4.0]), 0.5)
    np.testing.assert_allclose(c.logits, [-6.0, -4.0, 0.0])  # (x - max) / temp
    tiny = st.temperature(cands([1.0, 2.0, 4.0]), 5e-324)  # the limit is the argmax, no inf
    assert tiny.logits.tolist() == [-np.inf, -np.inf, 0.0]


def test_extreme_but_valid_settings_still_sample() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(500) * 5).astype(np.float32)
    top = int(logits.argmax())
    for kw in ({"temp": 5e-324}, {"temp": 1e-30}, {"repeat_penalty": 5e-324, "temp": 0.0}):
        s = Sampler(SamplerParams(**kw), 500, seed=1)  # type: ignore[arg-type]
        s.reset([top])
        assert 0 <= s.sample(logits) < 500
    g = st.temperature(cands([1.0, 4.0, 4.0, 0.0]), 0.0)
    assert g.ids.tolist() == [1]


def test_draw_follows_the_softmax() -> None:
    rng = np.random.default_rng(0)
    probs = np.array([0.1, 0.6, 0.3, 0.0])
    c = cands(np.log(np.maximum(probs, 1e-45)).astype(np.float32))
    c = st.Candidates(c.ids, np.where(probs > 0, c.logits, -np.inf).astype(np.float32))
    n = 20000
    counts = np.bincount([c.ids[st.draw(c, rng)[0]] for _ in range(n)], minlength=4)
    np.testing.assert_allclose(counts / n, probs, atol=0.015)
    assert counts[3] == 0


# --- a slow, obviously-correct reference for the truncation stages ---------------------------


def reference_chain(logits: np.ndarray, p: SamplerParams) -> dict[int, float]:
    """top-k -> typical -> top-p -> min-p -> temp with full sorts; returns id -> probability."""
    ids = list(np.argsort(-logits.astype(np.float64), kind="stable"))
    lg = {i: float(logits[i]) for i in ids}

    def probs(cur: list[int]) -> dict[int, float]:
        m = max(lg[i] for i in cur)
        e = {i: math.exp(lg[i] - m) for i in cur}
        s = sum(e.values())
        return {i: v / s for i, v in e.items()}

    if p.top_k > 0:
        ids = ids[: p.top_k]
    if p.top_p < 1.0:
        pr, cum = probs(ids), 0.0
        for n, i in enumerate(ids, 1):
            cum += pr[i]
            if cum >= p.top_p and n >= p.min_keep:
                ids = ids[:n]
                break
    if p.min_p > 0.0:
        pr = probs(ids)
        top = max(pr.values())
        kept = [i for i in ids if pr[i] >= p.min_p * top]
        ids = kept if len(kept) >= max(p.min_keep, 1) else ids[: max(p.min_keep, 1)]
    final = {i: lg[i] / p.temp for i in ids}
    m = max(final.values())
    e = {i: math.exp(v - m) for i, v in final.items()}
    s = sum(e.values())
    return {i: v / s for i, v in e.items()}


def fast_chain(logits: np.ndarray, p: SamplerParams) -> dict[int, float]:
    c = st.Candidates(np.arange(logits.size, dtype=np.int64), logits.astype(np.float32))
    c = st.top_k(c, p.top_k)
    c = st.top_p(c, p.top_p, p.min_keep)
    c = st.min_p(c, p.min_p, p.min_keep)
    c = st.temperature(c, p.temp)
    pr = st.softmax(c.logits)
    return dict(zip(c.ids.tolist(), pr.tolist(), strict=True))


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"top_k": 0},
        {"top_k": 0, "top_p": 0.5, "min_p": 0.0},
        {"top_k": 0, "top_p": 0.99, "min_p": 0.0},  # forces the full-sort fallback
        {"top_k": 3000, "top_p": 0.9, "min_p": 0.01, "temp": 1.3},
        {"top_k": 1},
    ],
)
@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_fast_stages_match_the_reference(settings: dict[str, float], scale: float) -> None:
    rng = np.random.default_rng(int(scale * 10))
    logits = (rng.standard_normal(20000) * scale).astype(np.float32)
    p = SamplerParams(**settings)  # type: ignore[arg-type]
    want, got = reference_chain(logits, p), fast_chain(logits, p)
    assert set(got) == set(want)
    for i, v in want.items():
        assert got[i] == pytest.approx(v, rel=1e-3, abs=1e-6)


# --- the Sampler ------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ignores_truncation() -> None:
    logits = np.array([0.5, 3.0, 2.9, -1.0], dtype=np.float32)
    s = Sampler(SamplerParams(temp=0.0, top_k=1, typical_p=0.2), 4, seed=0)
    assert [s.sample(logits) for _ in range(5)] == [1] * 5
    assert Sampler(SamplerParams(temp=-1.0), 4, seed=0).sample(logits) == 1


def test_greedy_sees_the_penalties() -> None:
    logits = np.array([0.5, 3.0, 2.9, -1.0], dtype=np.float32)
    s = Sampler(SamplerParams(temp=0.0, repeat_penalty=1.5), 4, seed=0)
    s.reset([1])
    assert s.sample(logits) == 2


def test_same_seed_same_tokens_and_reset_reseeds() -> None:
    rng = np.random.default_rng(7)
    steps = [(rng.standard_normal(500) * 2).astype(np.float32) for _ in range(30)]

    def run(s: Sampler) -> list[int]:
        out = []
        for x in steps:
            out.append(s.sample(x))
            s.accept(out[-1])
        return out

    params = SamplerParams(repeat_penalty=1.1, top_k=0, min_p=0.0)
    a, b = Sampler(params, 500, seed=42), Sampler(params, 500, seed=42)
    first = run(a)
    assert first == run(b)
    assert run(Sampler(params, 500, seed=43)) != first
    a.reset()
    assert run(a) == first
    a.reset(seed=44)
    assert a.seed == 44 and run(a) != first


def test_seed_none_draws_one_and_reports_it() -> None:
    s = Sampler(SamplerParams(), 10)
    assert isinstance(s.seed, int) and s.seed >= 0
    with pytest.raises(SamplingError):
        Sampler(SamplerParams(), 10, seed=-1)


def test_default_chain_samples_only_surviving_tokens() -> None:
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(2000) * 3).astype(np.float32)
    allowed = set(reference_chain(logits, SamplerParams()))
    s = Sampler(SamplerParams(), 2000, seed=1)
    seen = {s.sample(logits) for _ in range(400)}
    assert seen <= allowed and len(seen) > 1


def test_sample_does_not_modify_logits_and_checks_shape() -> None:
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    s = Sampler(SamplerParams(repeat_penalty=2.0, presence_penalty=1.0), 3, seed=0)
    s.reset([2])
    s.sample(logits)
    assert logits.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(SamplingError):
        s.sample(np.zeros(4, dtype=np.float32))
    with pytest.raises(SamplingError):
        s.accept(3)
    with pytest.raises(SamplingError):
        Sampler(SamplerParams(), 0)


def test_float64_logits_are_accepted() -> None:
    s = Sampler(SamplerParams(temp=0.0), 3, seed=0)
    assert s.sample(np.array([0.0, 5.0, 1.0])) == 1


class RecordingMask(AllowedTokens):
    def __init__(self, allowed: list[int], n_vocab: int) -> None:
        super().__init__(allowed, n_vocab)
        self.accepted: list[int] = []
        self.resets = 0

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def reset(self) -> None:
        self.resets += 1


def test_logit_mask_runs_first_and_follows_accept_and_reset() -> None:
    logits = np.array([9.0, 1.0, 2.0, 8.0], dtype=np.float32)
    mask = RecordingMask([1, 2], 4)
    s = Sampler(SamplerParams(temp=0.0), 4, seed=0, logit_mask=mask)
    assert s.sample(logits) == 2
    s.accept(2)
    s.reset([0, 1])
    assert mask.accepted == [2] and mask.resets == 1  # prompt tokens do not reach the mask
    sampled = {
        Sampler(SamplerParams(), 4, seed=i, logit_mask=mask).sample(logits) for i in range(50)
    }
    assert sampled <= {1, 2}


def test_mask_that_forbids_everything_is_an_error() -> None:
    logits = np.zeros(4, dtype=np.float32)
    for params in (SamplerParams(temp=0.0), SamplerParams(), SamplerParams(mirostat=2)):
        s = Sampler(params, 4, seed=0, logit_mask=AllowedTokens([], 4))
        with pytest.raises(SamplingError):
            s.sample(logits)


def test_nan_logits_are_refused() -> None:
    logits = np.array([1.0, np.nan, 0.0], dtype=np.float32)
    for params in (SamplerParams(temp=0.0), SamplerParams(), SamplerParams(mirostat=1)):
        with pytest.raises(SamplingError):
            Sampler(params, 3, seed=0).sample(logits)


def test_typical_in_the_chain_changes_the_candidates() -> None:
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    s = Sampler(SamplerParams(typical_p=0.45, top_k=0, top_p=1.0, min_p=0.0), 4, seed=0)
    assert {s.sample(logits) for _ in range(200)} == {1, 2}


def test_draw_two_level_cdf_matches_the_flat_one() -> None:
    rng = np.random.default_rng(5)
    e = rng.random(10_000).astype(np.float32)
    e[rng.random(10_000) < 0.3] = 0.0
    cdf = np.cumsum(e, dtype=np.float64)
    for u in [0.0, 1e-9, 0.25, 0.5, 0.77777, 0.999999]:
        i, total = st.inverse_cdf(e, u)
        assert total == pytest.approx(cdf[-1], rel=1e-5)
        assert e[i] > 0
        assert i == int(np.searchsorted(cdf, u * cdf[-1], side="right")) or (
            abs(cdf[i] - u * cdf[-1]) < 1e-3 * cdf[-1]  # a float tie at a boundary
        )


def test_draw_over_a_large_set_follows_the_softmax() -> None:
    rng = np.random.default_rng(6)
    logits = np.full(50_000, -np.inf, dtype=np.float32)
    logits[[7, 20_000, 49_999]] = np.log([0.2, 0.5, 0.3])
    c = cands(logits)
    counts: dict[int, int] = {}
    for _ in range(6000):
        tok = int(c.ids[st.draw(c, rng)[0]])
        counts[tok] = counts.get(tok, 0) + 1
    assert set(counts) == {7, 20_000, 49_999}
    assert counts[20_000] / 6000 == pytest.approx(0.5, abs=0.03)
