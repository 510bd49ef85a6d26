"""A text's perplexity, measured as llama.cpp's `llama-perplexity` measures it.

The text's tokens (a BOS first where the vocabulary adds one) are cut into chunks of `n_ctx`
(whole chunks only; at least two); each chunk is evaluated from position 0, its first token
replaced by BOS where the vocabulary adds one, and only its second half is scored: the tokens
at positions n_ctx/2 + 1 .. n_ctx - 1, each given everything before it in the chunk, so every
scored token has at least half a context behind it. PPL = exp(mean negative log-likelihood),
with llama.cpp's error estimate (the standard error of the mean NLL, times PPL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from minfer.errors import MinferError

# a chunk's ids -> the logprobs of its last tokens, each given those before it: ids[1:] or any
# tail of them that holds the scored second half
Scorer = Callable[[list[int]], Sequence[float]]
Forward = Callable[[Sequence[int], int, int], np.ndarray]  # (ids, start pos, n_out) -> logits


@dataclass
class Perplexity:
    n_ctx: int
    n_chunks: int = 0
    n_scored: int = 0
    nll: float = 0.0  # sums over the scored tokens
    nll2: float = 0.0
    running: list[float] = field(default_factory=list)  # PPL after each chunk

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.n_scored)

    @property
    def error(self) -> float:
        """llama.cpp's +/-: the standard error of the mean NLL, times PPL (0 when undefined)."""
        if self.n_scored < 2:
            return 0.0
        mean = self.nll / self.n_scored
        var = self.nll2 / self.n_scored - mean * mean
        return math.sqrt(var / (self.n_scored - 1)) * self.ppl if var > 0 else 0.0

    def add(self, logprobs: Sequence[float]) -> None:
        for lp in logprobs:
            self.nll -= lp
            self.nll2 += lp * lp
        self.n_scored += len(logprobs)
        self.n_chunks += 1
        self.running.append(self.ppl)


def chunks(ids: Sequence[int], n_ctx: int, bos: int | None,
           max_chunks: int | None = None) -> list[list[int]]:
    """The text's whole chunks of n_ctx tokens, each starting with BOS where one is given."""
    if n_ctx < 4:
        raise MinferError(f"the perplexity context must be at least 4 tokens, got {n_ctx}")
    if len(ids) < 2 * n_ctx:
        raise MinferError(f"the text has {len(ids)} tokens: perplexity at a context of {n_ctx} "
                          f"needs at least {2 * n_ctx} (use a longer text or a smaller -c)")
    n = len(ids) // n_ctx if max_chunks is None else min(max_chunks, len(ids) // n_ctx)
    out = []
    for i in range(n):
        chunk = list(ids[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def perplexity(scorer: Scorer, ids: Sequence[int], n_ctx: int, bos: int | None, *,
               max_chunks: int | None = None,
               progress: Callable[[Perplexity], None] | None = None) -> Perplexity:
    """The text's perplexity with chunks of n_ctx (see the module docstring); `progress` is
    called after each chunk."""
    result = Perplexity(n_ctx)
    n_scored = n_ctx - 1 - n_ctx // 2
    for chunk in chunks(ids, n_ctx, bos, max_chunks):
        logprobs = scorer(chunk)
        assert n_scored <= len(logprobs) <= n_ctx - 1
        result.add(logprobs[len(logprobs) - n_scored:])
        if progress is not None:
            progress(result)
    return result


def scored_logits(forward: Forward, chunk: Sequence[int], batch_size: int) -> np.ndarray:
    """The logits of a chunk's scored rows (positions n_ctx/2 .. n_ctx - 2, each predicting the
    token after it), the chunk run from position 0 in batches of batch_size tokens: rows
    before the second half are not asked for, the last token is not run."""
    n = len(chunk)
    first = n // 2
    out = []
    for start in range(0, n - 1, batch_size):
        end = min(n - 1, start + batch_size)
        n_out = end - max(start, first)
        logits = forward(chunk[start:end], start, max(n_out, 1))
        if n_out > 0:
            out.append(logits[-n_out:])
    return np.concatenate(out)
