"""Mirostat 1.0 and 2.0: sample while steering the observed surprise towards a target `tau`.

Both keep a running bound `mu` (starting at 2 * tau, reset with the sampler) and, after each draw,
move it by `eta * (tau - surprise)`, where surprise = -log2 p of the drawn token under the
truncated, renormalised distribution — as llama.cpp's `llama_sampler_mirostat{,_v2}`.

- v1 estimates the Zipf exponent s from the best `m` (= 100) probabilities and keeps the top
  k = (eps * 2^mu / (1 - N^-eps)) ^ (1/s) tokens (eps = s - 1, N = vocabulary size).
- v2 keeps every token whose surprise is at most mu (at least the most likely one).

They replace the top-k / typical / top-p / min-p / draw part of the chain; temperature runs just
before them. Neither sorts the vocabulary (llama.cpp does): v1 partitions out the best m tokens
and then the best k, v2 filters the softmax weights by a threshold and draws among them. The
draw walks the survivors in whatever order they come: as valid a sample as a sorted walk.
"""

from __future__ import annotations

import math

import numpy as np

from minfer.errors import SamplingError
from minfer.sampling.stages import Candidates, best_n, draw, inverse_cdf


class Mirostat:
    """Mirostat state (mu) and its selection step; `version` is 1 or 2."""

    def __init__(self, *, version: int, tau: float, eta: float, n_vocab: int, m: int = 100):
        self.version = version
        self.tau = tau
        self.eta = eta
        self.n_vocab = n_vocab
        self.m = m
        self.mu = 2.0 * tau

    def reset(self) -> None:
        self.mu = 2.0 * self.tau

    def sample(self, c: Candidates, rng: np.random.Generator) -> int:
        """Pick a token id from the candidates (logits already divided by the temperature)."""
        if len(c) == 0:
            raise SamplingError("no candidate token left to sample from")
        if self.version == 1:
            if c.logits.min() == -np.inf:  # masked tokens would break the Zipf estimate
                c = c.take(c.logits > -np.inf, sorted=c.sorted)
            kept = self._truncate_v1(c)
            i, p = draw(kept, rng)
            token = int(kept.ids[i])
        else:
            token, p = self._sample_v2(c, rng)
        surprise = -math.log2(p) if p > 0 else float("inf")
        self.mu -= self.eta * (surprise - self.tau)
        return token

    def _truncate_v1(self, c: Candidates) -> Candidates:
        """Top-k with k from the estimated Zipf exponent and mu (any order)."""
        if len(c) <= 1:
            return c
        top = best_n(c, self.m)
        k = self._zipf_k(top.logits)
        if k <= len(top):
            return top.head(k)
        if k >= len(c):
            return c
        return c.take(np.argpartition(c.logits, len(c) - k)[len(c) - k :], sorted=False)

    def _zipf_k(self, top_logits: np.ndarray) -> int:
        """llama.cpp's k from the best logits (descending): log(p_i / p_i+1) = l_i - l_i+1."""
        lg = top_logits.astype(np.float64)
        i = np.arange(lg.size - 1, dtype=np.float64)
        with np.errstate(all="ignore"):
            t = np.log((i + 2) / (i + 1))
            b = lg[:-1] - lg[1:]
            s_hat = float(np.sum(t * b) / np.sum(t * t))
            eps = s_hat - 1.0
            k = np.power(
                eps * np.power(2.0, self.mu) / (1.0 - np.power(float(self.n_vocab), -eps)),
                1.0 / s_hat,
            )
        if math.isnan(k):
            return 1
        return int(max(1.0, min(float(k), float(self.n_vocab))))

    def _sample_v2(self, c: Candidates, rng: np.random.Generator) -> tuple[int, float]:
        """Draw among tokens with surprise <= mu, i.e. p >= 2^-mu (at least the best one)."""
        mx = c.logits.max()
        e = np.exp(c.logits - mx, dtype=np.float32)  # weights; the best token has 1
        z = float(e.sum(dtype=np.float64))
        keep = e >= np.float32(z * 2.0**-self.mu)  # -log2(e / z) <= mu
        ids, w = (c.ids, e) if keep.all() else (c.ids[keep], e[keep])
        if w.size == 0:
            return int(c.ids[int(np.argmax(c.logits))]), 1.0
        i, total = inverse_cdf(w, rng.random())
        return int(ids[i]), float(w[i] / total)
