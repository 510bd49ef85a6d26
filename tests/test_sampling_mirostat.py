"""Mirostat v1 / v2: truncation rules, the mu feedback loop, reset, greedy temperature."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.sampling import Sampler, SamplerParams
from minfer.sampling.mirostat import Mirostat
from minfer.sampling.stages import Candidates

N_VOCAB = 5000


def zipf_logits(s: float = 1.1, n: int = N_VOCAB) -> np.ndarray:
    """log p_i = -s log(i + 1): a Zipf distribution, the model mirostat assumes."""
    return (-s * np.log(np.arange(1, n + 1))).astype(np.float32)


def cands(x: np.ndarray) -> Candidates:
    return Candidates(np.arange(x.size, dtype=np.int64), x)


def test_v1_estimates_zipf_exponent_and_k() -> None:
    m = Mirostat(version=1, tau=5.0, eta=0.1, n_vocab=N_VOCAB)
    s = 1.1
    k = m._zipf_k(zipf_logits(s)[:100])
    eps = s - 1
    want = (eps * 2**m.mu / (1 - N_VOCAB ** (-eps))) ** (1 / s)
    assert k == int(want)


def test_v2_keeps_only_tokens_with_surprise_below_mu() -> None:
    x = zipf_logits()
    p = np.exp(x.astype(np.float64))
    p /= p.sum()
    m = Mirostat(version=2, tau=3.0, eta=0.0, n_vocab=N_VOCAB)  # eta 0: mu stays at 6
    rng = np.random.default_rng(0)
    picked = {m.sample(cands(x), rng) for _ in range(300)}
    assert all(-math.log2(p[t]) <= 6.0 for t in picked)
    assert len(picked) > 3


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("tau", [2.0, 4.0])
def test_feedback_holds_the_average_surprise_near_tau(version: int, tau: float) -> None:
    m = Mirostat(version=version, tau=tau, eta=0.1, n_vocab=N_VOCAB)
    rng = np.random.default_rng(1)
    x = cands(zipf_logits())
    steps = 1500
    mu0 = m.mu
    for _ in range(steps):
        m.sample(x, rng)
    # mu_T = mu_0 - eta * sum(surprise - tau)  =>  mean surprise = tau - (mu_T - mu_0) / (eta T)
    mean_surprise = tau - (m.mu - mu0) / (0.1 * steps)
    assert abs(mean_surprise - tau) < 0.1
    assert 0.0 < m.mu < 4 * tau


@pytest.mark.parametrize("version", [1, 2])
def test_lower_tau_means_fewer_distinct_tokens(version: int) -> None:
    logits = zipf_logits()

    def distinct(tau: float) -> int:
        s = Sampler(SamplerParams(mirostat=version, mirostat_tau=tau, temp=1.0), N_VOCAB, seed=3)
        return len({s.sample(logits) for _ in range(400)})

    assert distinct(1.0) < distinct(6.0)


@pytest.mark.parametrize("version", [1, 2])
def test_reset_restores_mu_and_reproduces(version: int) -> None:
    s = Sampler(SamplerParams(mirostat=version), N_VOCAB, seed=9)
    logits = zipf_logits()
    first = [s.sample(logits) for _ in range(50)]
    assert s.mirostat is not None and s.mirostat.mu != 10.0
    s.reset()
    assert s.mirostat.mu == 10.0
    assert [s.sample(logits) for _ in range(50)] == first


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_with_zero_temperature_is_greedy(version: int) -> None:
    rng = np.random.default_rng(4)
    logits = rng.standard_normal(300).astype(np.float32)
    s = Sampler(SamplerParams(mirostat=version, temp=0.0), 300, seed=0)
    assert {s.sample(logits) for _ in range(20)} == {int(np.argmax(logits))}


def test_mirostat_ignores_masked_tokens() -> None:
    x = zipf_logits()
    x[:10] = -np.inf
    for version in (1, 2):
        m = Mirostat(version=version, tau=5.0, eta=0.1, n_vocab=N_VOCAB)
        rng = np.random.default_rng(0)
        assert all(m.sample(cands(x), rng) >= 10 for _ in range(100))
