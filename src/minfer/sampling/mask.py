"""The logit-mask stage: the hook a grammar / JSON-schema constraint plugs into.

A mask runs FIRST, on a private copy of the raw logits, before penalties, DRY and every
truncation stage (llama.cpp's "grammar first" order). It must set the logits of forbidden token
ids to -inf in place and leave the others untouched. The sampler forwards `accept` (each token the
caller commits) and `reset` (a new generation) so the mask can advance its own parser state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class LogitMask(Protocol):
    """What the sampler needs from a constraint (e.g. an llguidance matcher wrapper)."""

    def apply(self, logits: np.ndarray) -> None:
        """Set logits [n_vocab] (float32, writable) of forbidden ids to -inf, in place."""

    def accept(self, token_id: int) -> None:
        """Advance past a committed token."""

    def reset(self) -> None:
        """Start over for a new generation."""


class _Fixed:
    """A mask that never changes: committed tokens and new generations leave it as it is."""

    def accept(self, token_id: int) -> None:
        pass

    def reset(self) -> None:
        pass


class AllowedTokens(_Fixed):
    """A fixed mask: only the given ids may be sampled (for tests, and to force a choice)."""

    def __init__(self, allowed: Iterable[int], n_vocab: int) -> None:
        self.forbidden = np.ones(n_vocab, dtype=bool)
        self.forbidden[list(allowed)] = False

    def apply(self, logits: np.ndarray) -> None:
        logits[self.forbidden] = -np.inf


class BannedTokens(_Fixed):
    """A fixed mask: the given ids are never sampled (llama.cpp's --ignore-eos bans the
    end-of-generation ids this way)."""

    def __init__(self, banned: Iterable[int]) -> None:
        self.banned = np.fromiter(sorted(set(banned)), dtype=np.int64)

    def apply(self, logits: np.ndarray) -> None:
        logits[self.banned] = -np.inf


class MaskChain:
    """Several masks as one: each applies in turn (a grammar, then logit_bias, then a thinking
    budget) and sees every committed token."""

    def __init__(self, masks: Iterable[LogitMask]) -> None:
        self.masks = list(masks)

    def apply(self, logits: np.ndarray) -> None:
        for mask in self.masks:
            mask.apply(logits)

    def accept(self, token_id: int) -> None:
        for mask in self.masks:
            mask.accept(token_id)

    def reset(self) -> None:
        for mask in self.masks:
            mask.reset()


def chain(*masks: LogitMask | None) -> LogitMask | None:
    """The given masks (None skipped) as one mask; None when there are none."""
    present = [m for m in masks if m is not None]
    if len(present) <= 1:
        return present[0] if present else None
    return MaskChain(present)
