"""Repetition, frequency and presence penalties over the last `penalty_last_n` tokens.

Same rule as llama.cpp's `llama_sampler_penalties`: for every token id seen `count > 0` times in
the window, its logit is divided by `repeat_penalty` when positive (multiplied when <= 0, so a
penalty always makes the token less likely), then `count * frequency_penalty + presence_penalty`
is subtracted. Only the (at most `penalty_last_n`) ids in the window are touched, so the stage
costs microseconds whatever the vocabulary size.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

import numpy as np


class RepetitionPenalty:
    """The penalty stage and its token window (a ring of the last `last_n` accepted ids)."""

    def __init__(
        self,
        *,
        last_n: int,
        repeat: float,
        frequency: float,
        presence: float,
    ) -> None:
        """`last_n`: window length (0 = off, < 0 = unbounded); the rest as in SamplerParams."""
        self.last_n = last_n
        self.repeat = float(repeat)
        self.frequency = np.float32(frequency)
        self.presence = np.float32(presence)
        self.enabled = last_n != 0 and not (repeat == 1.0 and frequency == 0.0 and presence == 0.0)
        self._window: deque[int] = deque(maxlen=last_n if last_n > 0 else None)
        self._counts: Counter[int] = Counter()

    def reset(self, tokens: Iterable[int] = ()) -> None:
        """Forget the window, then fill it from `tokens` (oldest first)."""
        self._window.clear()
        self._counts.clear()
        for t in tokens:
            self.accept(t)

    def accept(self, token: int) -> None:
        """Push one generated (or prompt) token into the window."""
        if not self.enabled:
            return
        if self._window.maxlen is not None and len(self._window) == self._window.maxlen:
            old = self._window[0]
            self._counts[old] -= 1
            if self._counts[old] == 0:
                del self._counts[old]
        self._window.append(token)
        self._counts[token] += 1

    def counts(self) -> dict[int, int]:
        """Token id -> occurrences in the window (a copy, for tests and debugging)."""
        return dict(self._counts)

    def apply(self, logits: np.ndarray) -> None:
        """Penalise the full-vocabulary logits [n_vocab] in place."""
        if not self.enabled or not self._counts:
            return
        n = len(self._counts)
        ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=n)
        cnt = np.fromiter(self._counts.values(), dtype=np.float32, count=n)
        vals = logits[ids].astype(np.float64)
        with np.errstate(over="ignore"):
            vals = np.where(vals <= 0, vals * self.repeat, vals / self.repeat)
        vals -= cnt * self.frequency + self.presence
        # a tiny penalty can push a logit past float32's range: clamp, never store an inf
        logits[ids] = np.clip(vals, -3e38, 3e38)
