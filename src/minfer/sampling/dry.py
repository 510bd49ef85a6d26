"""DRY ("don't repeat yourself"): penalise the token that would extend a repeated sequence.

Semantics of llama.cpp's `llama_sampler_dry` (after koboldcpp, by pi6am). Over the last
`penalty_last_n` tokens:

1. Sequence breakers (text such as "\\n" or ":") end a repeat: the most recent breaker occurrence
   limits how far back a repeat may reach (`rep_limit`).
2. For every earlier position j, measure how long the suffix ending at j matches the suffix of the
   whole window (capped at rep_limit).
3. A match of length L >= allowed_length means emitting the token that followed j would repeat
   L + 1 tokens; that token's logit is lowered by `multiplier * base ** (L - allowed_length)`
   (the largest L per token wins; the exponent is clamped so the penalty stays finite).
4. Tokens whose text contains a whole breaker are never penalised.

Breakers are text, so the stage needs each token's text: `token_text` (a callable or a list)
is read once, lazily, on the first penalised step. Multi-character breakers can straddle a token
boundary ("abc\\n" + "\\n"); completing them needs `encode` (text -> ids), as in llama.cpp.

Step 2 is vectorised: candidates are all positions, and each round keeps those whose match
extends one more token — rounds are bounded by the clamp, so the cost stays small.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from minfer.errors import SamplingError

TokenText = Callable[[int], str] | Sequence[str]
Encode = Callable[[str], Sequence[int]]

_MAX_BREAKER_CHARS = 40  # llama.cpp truncates longer breakers
_MAX_TAIL_TOKENS = 20  # and the token tail that completes one
_FLOAT_MAX_LOG = 88.7228391  # log(float32 max): the exponent clamp


class TokenWindow:
    """The last `cap` token ids (None: all), appended one by one, viewed as an int64 array."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._buf = np.empty(256, dtype=np.int64)
        self._n = 0

    def clear(self) -> None:
        self._n = 0

    def push(self, token: int) -> None:
        if self._n == self._buf.size:
            keep = self._n if self.cap is None else min(self._n, self.cap)
            grow = keep * 2 > self._buf.size  # compacting would free too little: grow
            dst = np.empty(2 * self._buf.size, np.int64) if grow else self._buf
            dst[:keep] = self._buf[self._n - keep : self._n]
            self._buf, self._n = dst, keep
        self._buf[self._n] = token
        self._n += 1

    def view(self) -> np.ndarray:
        """The window, oldest first (a view: do not keep it across pushes)."""
        start = 0 if self.cap is None else max(0, self._n - self.cap)
        return self._buf[start : self._n]


class Breakers:
    """Sequence breakers resolved to token ids: head id -> tails (ids that must follow it)."""

    def __init__(self, tails: dict[int, list[tuple[int, ...]]], n_vocab: int) -> None:
        self.tails = tails
        self.is_head = np.zeros(n_vocab, dtype=bool)
        self.is_head[list(tails)] = True
        singles = [t for t, ts in tails.items() if () in ts]
        self.single = np.zeros(n_vocab, dtype=bool)  # tokens containing a whole breaker
        self.single[singles] = True

    @classmethod
    def build(
        cls,
        breakers: Sequence[str],
        *,
        n_vocab: int,
        token_text: TokenText,
        encode: Encode | None,
    ) -> Breakers:
        """Scan the vocabulary once (as llama.cpp's get_overlapping_token_sequences)."""
        text_of = token_text.__getitem__ if isinstance(token_text, Sequence) else token_text
        texts = [text_of(i) for i in range(n_vocab)]
        tails: dict[int, list[tuple[int, ...]]] = {}

        def add(tok: int, tail: tuple[int, ...]) -> None:
            seqs = tails.setdefault(tok, [])
            if tail not in seqs:
                seqs.append(tail)

        for brk in breakers:
            brk = brk[:_MAX_BREAKER_CHARS]
            for tok in (i for i, w in enumerate(texts) if brk[0] in w):
                word = texts[tok]
                if brk in word:
                    add(tok, ())
                    continue
                pos = word.find(brk[0])
                while pos != -1:  # the token ends with a proper prefix of the breaker
                    if brk.startswith(word[pos:]):
                        if encode is None:
                            raise SamplingError("multi-character DRY breakers need `encode`")
                        rest = brk[len(word) - pos :]
                        add(tok, tuple(int(t) for t in encode(rest))[:_MAX_TAIL_TOKENS])
                    pos = word.find(brk[0], pos + 1)
        return cls(tails, n_vocab)


class DryPenalty:
    """The DRY stage: its token window, its breakers and `apply(logits)`."""

    def __init__(
        self,
        *,
        multiplier: float,
        base: float,
        allowed_length: int,
        last_n: int,
        breakers: Sequence[str],
        n_vocab: int,
        n_ctx: int | None = None,
        token_text: TokenText | None = None,
        encode: Encode | None = None,
        resolved: Breakers | None = None,
    ) -> None:
        """`last_n` 0 = off, -1 = n_ctx (unbounded when n_ctx is None).

        `resolved`: breakers already as token ids (tests; skips the vocabulary scan).
        """
        self.enabled = multiplier != 0.0 and base >= 1.0 and last_n != 0
        if resolved is not None:
            breakers = ()
        if self.enabled and token_text is None and breakers:
            raise SamplingError("DRY with sequence breakers needs the tokens' text (token_text)")
        if self.enabled and encode is None and any(len(b) > 1 for b in breakers):
            raise SamplingError("multi-character DRY breakers need `encode` (text -> ids)")
        self.multiplier = multiplier
        self.base = base
        self.allowed = allowed_length
        cap = last_n if last_n > 0 else n_ctx
        if n_ctx is not None and cap is not None:
            cap = min(cap, n_ctx)
        self.window = TokenWindow(cap)
        self.max_exp = int(_FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
        self._spec = (tuple(breakers), n_vocab, token_text, encode)
        self._breakers: Breakers | None = resolved

    def breakers(self) -> Breakers:
        """The resolved breakers (built on first use: it reads every token's text)."""
        if self._breakers is None:
            names, n_vocab, token_text, encode = self._spec
            if token_text is None:
                self._breakers = Breakers({}, n_vocab)
            else:
                self._breakers = Breakers.build(
                    names, n_vocab=n_vocab, token_text=token_text, encode=encode
                )
        return self._breakers

    def reset(self, tokens: Sequence[int] = ()) -> None:
        self.window.clear()
        for t in tokens:
            self.accept(t)

    def accept(self, token: int) -> None:
        if self.enabled:
            self.window.push(token)

    def apply(self, logits: np.ndarray) -> None:
        """Lower, in place, the logits [n_vocab] of tokens that would extend a repeat."""
        if not self.enabled:
            return
        w = self.window.view()
        if w.size <= self.allowed:
            return
        brk = self.breakers()
        rep_limit = _repeat_limit(w, brk)
        if rep_limit < self.allowed:
            return
        cap = rep_limit if self.max_exp == 0 else min(rep_limit, self.allowed + self.max_exp)
        lengths = suffix_match_lengths(w, cap)  # [n - 1]
        hit = np.flatnonzero(lengths >= self.allowed)
        if hit.size == 0:
            return
        toks, inv = np.unique(w[hit + 1], return_inverse=True)
        longest = np.zeros(toks.size, dtype=np.int64)
        np.maximum.at(longest, inv, lengths[hit])
        keep = ~brk.single[toks]
        toks, longest = toks[keep], longest[keep]
        exp = longest - self.allowed
        if self.max_exp > 0:
            exp = np.minimum(exp, self.max_exp)
        penalty = self.multiplier * np.power(self.base, exp.astype(np.float64))
        logits[toks] -= penalty.astype(np.float32)


def _repeat_limit(w: np.ndarray, brk: Breakers) -> int:
    """How far back (in tokens) a repeat may reach before the most recent breaker."""
    n = int(w.size)
    for q in np.flatnonzero(brk.is_head[w])[::-1]:  # most recent head first
        back = n - 1 - int(q)  # tokens after the head
        longest = -1
        for tail in brk.tails[int(w[q])]:
            if longest < len(tail) <= back and tuple(w[q + 1 : q + 1 + len(tail)].tolist()) == tail:
                longest = len(tail)
        if longest >= 0:
            return back - longest
    return n


def suffix_match_lengths(w: np.ndarray, cap: int) -> np.ndarray:
    """For each j < n-1: length (<= cap) of the longest common suffix of w[:j+1] and w."""
    n = int(w.size)
    lengths = np.zeros(max(n - 1, 0), dtype=np.int64)
    alive = np.arange(n - 1)
    k = 0
    while alive.size and k < cap:
        alive = alive[alive >= k]
        alive = alive[w[alive - k] == w[n - 1 - k]]
        k += 1
        lengths[alive] = k
    return lengths
