"""A thinking budget as a logit mask: after N tokens inside `<think>`, the thinking is closed.

`ReasoningBudget` watches the committed tokens (`accept`): once the start sequence (`<think>`'s
ids) has been committed, or from the first token when the prompt already opened the block
(`inside`), it counts the tokens of the thinking. If the end sequence (`</think>`) comes first it
steps aside for good. When the count reaches the budget it forces the closing tokens (an optional
message, then `</think>`), one per step, by masking every other id; then the answer runs
unconstrained. Budget 0 closes the thinking before its first token; -1 never forces anything.
This is llama.cpp's reasoning-budget sampler without its wait for a complete UTF-8 character, so
a budget of N gives exactly N thinking tokens. `minfer.sampling.mask.chain` runs it beside a
grammar mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

IDLE, COUNTING, FORCING, DONE = "idle", "counting", "forcing", "done"


class ReasoningBudget:
    def __init__(self, *, budget: int, start: Sequence[int], end: Sequence[int],
                 forced: Sequence[int], inside: bool = False) -> None:
        if budget < -1:
            raise ValueError(f"reasoning budget must be -1 (unlimited) or more, got {budget}")
        if not forced:
            raise ValueError("a reasoning budget needs the tokens that close the thinking")
        self.budget = budget
        self.start, self.end, self.forced = list(start), list(end), list(forced)
        self.inside = inside
        self.reset()

    def reset(self) -> None:
        self.state = COUNTING if self.inside else IDLE
        self.count = 0  # thinking tokens committed
        self.at = 0  # forced tokens committed
        self.recent: list[int] = []
        self._maybe_force()

    def apply(self, logits: np.ndarray) -> None:
        if self.state == FORCING:
            keep = self.forced[self.at]
            value = logits[keep]
            logits.fill(-np.inf)
            logits[keep] = value if np.isfinite(value) else 0.0

    def accept(self, token_id: int) -> None:
        self.recent = [*self.recent, token_id][-max(len(self.start), len(self.end), 1):]
        if self.state == IDLE and self.start and self._ends_with(self.start):
            self.state = COUNTING
            self._maybe_force()
        elif self.state == COUNTING:
            if self.end and self._ends_with(self.end):
                self.state = DONE
                return
            self.count += 1
            self._maybe_force()
        elif self.state == FORCING:
            self.at += 1
            if self.at == len(self.forced):
                self.state = DONE

    def _maybe_force(self) -> None:
        if self.state == COUNTING and 0 <= self.budget <= self.count:
            self.state, self.at = FORCING, 0

    def _ends_with(self, seq: list[int]) -> bool:
        return self.recent[-len(seq):] == seq

