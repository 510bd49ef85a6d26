"""The truncation stages of the sampler chain and the final draw, on a small candidate set.

Each stage takes `Candidates` (token ids with their logits, and whether they are sorted by logit,
descending) and returns a new, usually smaller, set — the same contract as llama.cpp's
`llama_token_data_array` stages (src/llama-sampling.cpp), with the same semantics:

- top-k keeps the k largest logits (k <= 0: off; ties: the lower id first) and leaves them
  sorted;
- typical-p keeps the tokens whose surprise is closest to the entropy until their mass exceeds p;
- top-p keeps the smallest sorted prefix whose probability mass reaches p;
- min-p keeps the tokens with p >= min_p * p_max;
- temperature divides logits (temp <= 0 keeps only the first argmax);
- `draw` picks one candidate from the softmax with a numpy Generator.

Probabilities are always the softmax of the *current* candidate set, as in llama.cpp (so top-p
after top-k renormalises over the k survivors). Nothing here sorts the full vocabulary unless a
stage truly needs it: with top-k off, top-p tries the best 256, then 4096, then 65536 tokens
before a full sort, and typical-p (off by default) sorts every candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minfer.errors import SamplingError

_TOP_P_FIRST_TRY = 256  # top-p over a large unsorted set: try the best 256, 4096, ... first
_DRAW_BLOCK = 1024  # the draw's two-level inverse CDF over large sets
_STABLE_SORT_MAX = 4096  # stable sorts (ties keep id order) up to here; quicksort beyond
# `best_n`'s block sizes, the largest with twice n blocks taken (numpy's max over rows of 512
# runs at ~27 us per 151,936 values, of 256 ~45 us; rows of 64 cost as much as argpartition)
_BLOCKS = (512, 256, 128)


@dataclass(frozen=True)
class Candidates:
    """Token ids [n] (int64) with their logits [n] (float32); `sorted`: logits descending."""

    ids: np.ndarray
    logits: np.ndarray
    sorted: bool = False

    def __len__(self) -> int:
        return int(self.logits.shape[0])

    def take(self, order: np.ndarray, *, sorted: bool) -> Candidates:
        """The candidates at positions `order` (an index or boolean array), in that order."""
        return Candidates(self.ids[order], self.logits[order], sorted)

    def head(self, n: int) -> Candidates:
        """The first n candidates (keeps `sorted`)."""
        return Candidates(self.ids[:n], self.logits[:n], self.sorted)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities [n] float64 of a float32 logit vector (stable; -inf logits get 0)."""
    e = np.exp(logits - logits.max(), dtype=np.float32)
    return e / e.sum(dtype=np.float64)


def sort_desc(c: Candidates) -> Candidates:
    """All candidates sorted by logit, descending."""
    if c.sorted:
        return c
    return c.take(_order_desc(c.logits), sorted=True)


def _order_desc(logits: np.ndarray) -> np.ndarray:
    """Indices that sort logits descending."""
    return _argsort(-logits)


def _argsort(x: np.ndarray) -> np.ndarray:
    """Stable for small sets (ties keep id order); quicksort beyond (a stable sort of the whole
    vocabulary costs ~10 ms, a quicksort ~1.5 ms)."""
    if x.size <= _STABLE_SORT_MAX:
        return np.argsort(x, kind="stable")
    return np.argsort(x, kind="quicksort")


def best_n(c: Candidates, n: int) -> Candidates:
    """The n largest logits, sorted descending (ties: the earlier candidate first), without
    sorting the rest."""
    size = len(c)
    n = min(n, size)
    if c.sorted:
        return c.head(n)
    if n >= size:
        return sort_desc(c)
    return c.take(_largest(c.logits, n), sorted=True)


def _largest(x: np.ndarray, n: int) -> np.ndarray:
    """Positions of the n largest values of x (0 < n < x.size), sorted descending, ties in
    position order. Few enough of them (top-k's usual k, top-p's first try): through the
    maxima of blocks (`_BLOCKS`). The n-th largest block maximum is a floor at least n values
    reach, so only the blocks whose maximum reaches it are searched; over the whole vocabulary
    ~80 us against ~350 us for numpy's argpartition (151,936 logits, k = 40). Masked (-inf)
    values are never searched: a floor of -inf (a grammar's few allowed tokens) takes the
    finite values, and masked positions in id order fill what they leave short (argpartition
    over 151,936 mostly equal values took ~6 ms)."""
    block = next((b for b in _BLOCKS if n <= x.size // b // 2), 0)
    if block:
        nb = x.size // block
        blocks = x[: nb * block].reshape(nb, block)
        tops = blocks.max(axis=1)
        floor = np.partition(tops, nb - n)[nb - n]
        rows = np.flatnonzero(_reaching(tops, floor))
        flat = np.flatnonzero(_reaching(blocks[rows], floor))
        cand = rows[flat // block] * block + flat % block
        tail = np.flatnonzero(_reaching(x[nb * block :], floor))
        if tail.size:
            cand = np.concatenate([cand, tail + nb * block])
    else:  # the n-th largest trims the set first: trimming all 151,936 below is 5-10x slower
        finite = x > -np.inf
        if finite.all():
            cand = np.flatnonzero(x >= np.partition(x, x.size - n)[x.size - n])  # ties too
        else:
            cand = np.flatnonzero(finite)
            if cand.size > n:
                v = x[cand]
                cand = cand[v >= np.partition(v, v.size - n)[v.size - n]]
    v = x[cand]
    if cand.size > n:  # every value above the n-th largest, then as many of its ties as fit
        kth = np.partition(v, cand.size - n)[cand.size - n]
        above = v > kth
        tie = v == kth
        keep = above | (tie & (np.cumsum(tie) <= n - np.count_nonzero(above)))
        cand, v = cand[keep], v[keep]
    order = cand[np.argsort(-v, kind="stable")]
    if order.size < n:  # fewer finite values than n: masked ones follow, in position order
        head = np.arange(min(x.size, n + order.size))
        order = np.concatenate([order, head[x[head] == -np.inf][: n - order.size]])
    return order


def _reaching(a: np.ndarray, floor: np.float32) -> np.ndarray:
    """a >= floor; the finite values where the floor is -inf (so masked values stay out)."""
    return a >= floor if floor > -np.inf else a > floor


def top_k(c: Candidates, k: int) -> Candidates:
    """Keep the k most likely tokens, sorted (llama_sampler_top_k); k <= 0 is off."""
    if k <= 0:
        return c
    return best_n(c, k)


def top_p(c: Candidates, p: float, min_keep: int) -> Candidates:
    """Smallest sorted prefix with cumulative probability >= p, at least min_keep long."""
    if p >= 1.0 or len(c) <= 1:
        return c
    n = _TOP_P_FIRST_TRY
    while not c.sorted and n < len(c) // 2:
        # adaptive, as llama.cpp: the best few usually reach p, so skip the full sort
        head = best_n(c, n)
        cut = _top_p_cut(_probs_within(head.logits, c.logits), p, min_keep)
        if cut is not None:
            return head.head(cut)
        n *= 16
    s = sort_desc(c)
    cut = _top_p_cut(softmax(s.logits), p, min_keep)
    return s if cut is None else s.head(cut)


def _probs_within(sub: np.ndarray, full: np.ndarray) -> np.ndarray:
    """Probabilities of the logits `sub` under the softmax of the whole set `full`."""
    mx = full.max()
    total = np.exp(full - mx, dtype=np.float32).sum(dtype=np.float64)
    return np.exp(sub - mx, dtype=np.float32) / total


def _top_p_cut(sorted_probs: np.ndarray, p: float, min_keep: int) -> int | None:
    """First length whose cumulative sum reaches p (and >= min_keep); None if none does."""
    cum = np.cumsum(sorted_probs, dtype=np.float64)
    ok = np.flatnonzero((cum >= p) & (np.arange(1, cum.size + 1) >= min_keep))
    return int(ok[0]) + 1 if ok.size else None


def min_p(c: Candidates, p: float, min_keep: int) -> Candidates:
    """Keep tokens with probability >= p * max probability (llama_sampler_min_p)."""
    if p <= 0.0 or len(c) == 0:
        return c
    mx = c.logits[0] if c.sorted else c.logits.max()
    keep = c.logits >= mx + np.float32(math.log(p))
    n_keep = int(np.count_nonzero(keep))
    if c.sorted:
        return c.head(min(len(c), max(n_keep, min_keep, 1)))
    if n_keep >= max(min_keep, 1):
        return c.take(keep, sorted=False)
    return min_p(sort_desc(c), p, min_keep)


def typical(c: Candidates, p: float, min_keep: int) -> Candidates:
    """Locally typical sampling (llama_sampler_typical): closest surprise to the entropy first."""
    if p >= 1.0 or len(c) <= 1:
        return c
    probs = softmax(c.logits)
    pos = probs > 0
    logp = np.full_like(probs, -np.inf)
    logp[pos] = np.log(probs[pos])
    entropy = -float(np.sum(probs[pos] * logp[pos]))
    shifted = np.abs(-logp - entropy)
    order = _argsort(shifted)
    cum = np.cumsum(probs[order])
    ok = np.flatnonzero((cum > p) & (np.arange(cum.size) >= min_keep - 1))
    n = int(ok[0]) + 1 if ok.size else len(c)
    return c.take(order[:n], sorted=False)


def temperature(c: Candidates, temp: float) -> Candidates:
    """Divide logits by temp; temp <= 0 keeps only the first token with the largest logit."""
    if temp <= 0.0:
        i = int(np.argmax(c.logits))
        return Candidates(c.ids[i : i + 1], c.logits[i : i + 1], True)
    if temp == 1.0:
        return c
    # Shift by the maximum first so a tiny temperature sends the rest to -inf, never the top to
    # +inf: the limit of temp -> 0+ is the argmax, and the draw stays well defined.
    with np.errstate(over="ignore"):
        scaled = (c.logits - np.max(c.logits)).astype(np.float64) / float(temp)
    return Candidates(c.ids, scaled.astype(np.float32, copy=False), c.sorted)


def draw(c: Candidates, rng: np.random.Generator) -> tuple[int, float]:
    """Pick one candidate from softmax(logits): (position in `c`, its probability)."""
    if len(c) == 0:
        raise SamplingError("no candidate token left to sample from")
    if len(c) == 1:
        return 0, 1.0
    mx = c.logits.max()
    if not np.isfinite(mx):
        raise SamplingError(f"cannot sample: the largest candidate logit is {mx}")
    e = np.exp(c.logits - mx, dtype=np.float32)  # unnormalised weights
    i, total = inverse_cdf(e, rng.random())
    if not math.isfinite(total):
        raise SamplingError("cannot sample: logits hold NaN")
    return i, float(e[i] / total)


def inverse_cdf(e: np.ndarray, u: float) -> tuple[int, float]:
    """(first i whose running sum of e passes u * total, total); zero weights never win.

    Large sets go in two levels — block sums, then one block — since a float64 cumsum over
    the whole vocabulary costs more than the rest of the chain.
    """
    n = e.size
    if n <= _DRAW_BLOCK * 4:
        cdf = np.cumsum(e, dtype=np.float64)
        total = float(cdf[-1])
        i = min(int(np.searchsorted(cdf, u * total, side="right")), n - 1)
        return _nonzero_at_or_before(e, i), total
    starts = np.arange(0, n, _DRAW_BLOCK)
    block_cdf = np.cumsum(np.add.reduceat(e, starts).astype(np.float64))
    total = float(block_cdf[-1])
    target = u * total
    b = min(int(np.searchsorted(block_cdf, target, side="right")), starts.size - 1)
    before = float(block_cdf[b - 1]) if b else 0.0
    inner = np.cumsum(e[starts[b] : starts[b] + _DRAW_BLOCK], dtype=np.float64) + before
    j = min(int(np.searchsorted(inner, target, side="right")), inner.size - 1)
    return _nonzero_at_or_before(e, int(starts[b]) + j), total


def _nonzero_at_or_before(e: np.ndarray, i: int) -> int:
    """i, or the last positive weight before it (float rounding at the very top of the CDF)."""
    if e[i] > 0:
        return i
    nz = np.flatnonzero(e[: i + 1])
    return int(nz[-1]) if nz.size else int(np.argmax(e))
