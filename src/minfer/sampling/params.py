"""Sampler settings: one frozen dataclass with llama.cpp's CLI defaults, validated on creation.

Names follow llama.cpp's `common_params_sampling` (and its CLI flags) so settings read the same in
both: `temp`, `top_k`, `top_p`, `min_p`, `typical_p`, `repeat_penalty`, `penalty_last_n`,
`frequency_penalty`, `presence_penalty`, `dry_*`, `mirostat*`. A stage whose setting is at its
neutral value (top-k 0, top-p 1, min-p 0, typical-p 1, repeat-penalty 1, DRY multiplier 0) is off.

Anything a user could get wrong (a negative top-k, top-p outside (0, 1], an unknown mirostat
version, a NaN) raises `SamplingError` naming the field, instead of being clamped silently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from minfer.errors import SamplingError

DEFAULT_DRY_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")


@dataclass(frozen=True)
class SamplerParams:
    """Every knob of the sampler chain; defaults are llama.cpp's CLI defaults."""

    temp: float = 0.8
    """Temperature; `<= 0` means greedy (argmax after the penalty stages)."""
    top_k: int = 40
    """Keep the k most likely tokens; 0 = off."""
    top_p: float = 0.95
    """Keep the smallest set whose probabilities sum to at least p; 1.0 = off."""
    min_p: float = 0.05
    """Drop tokens less likely than min_p times the most likely one; 0.0 = off."""
    typical_p: float = 1.0
    """Locally typical sampling (llama_sampler_typical); 1.0 = off."""
    min_keep: int = 1
    """Every truncating stage keeps at least this many tokens (0 behaves as 1)."""

    repeat_penalty: float = 1.0
    """Divide positive / multiply negative logits of recent tokens; 1.0 = off."""
    penalty_last_n: int = 64
    """How many recent tokens the penalties look at; 0 = off, -1 = the context size."""
    frequency_penalty: float = 0.0
    """Subtract count * frequency_penalty from each recent token's logit; 0.0 = off."""
    presence_penalty: float = 0.0
    """Subtract presence_penalty from each token seen at least once; 0.0 = off."""

    dry_multiplier: float = 0.0
    """DRY ("don't repeat yourself") strength; 0.0 = off."""
    dry_base: float = 1.75
    """DRY penalty = multiplier * base ** (repeat length - allowed length)."""
    dry_allowed_length: int = 2
    """Repeats up to this many tokens are not penalised."""
    dry_penalty_last_n: int = -1
    """How many recent tokens DRY scans; 0 = off, -1 = the context size."""
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    """Text that ends a repeat (a repeat never extends across one)."""

    mirostat: int = 0
    """0 = the plain chain, 1 = Mirostat, 2 = Mirostat 2.0 (replaces top-k/p, min-p, typical)."""
    mirostat_tau: float = 5.0
    """Target surprise (cross-entropy, bits)."""
    mirostat_eta: float = 0.1
    """Learning rate of mu."""

    def __post_init__(self) -> None:
        breakers = self.dry_sequence_breakers
        if isinstance(breakers, str) or not isinstance(breakers, Sequence):
            raise SamplingError("dry_sequence_breakers must be a list of strings")
        object.__setattr__(self, "dry_sequence_breakers", tuple(breakers))
        _validate(self)

    @classmethod
    def greedy(cls, **overrides: Any) -> SamplerParams:
        """Settings that always pick the most likely token (temp 0)."""
        return cls(**{"temp": 0.0, **overrides})

    def with_(self, **changes: Any) -> SamplerParams:
        """A copy with some fields changed (validated again)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise SamplingError(f"unknown sampler setting(s): {', '.join(unknown)}")
        return replace(self, **changes)

    @property
    def penalties_on(self) -> bool:
        """Whether the repetition / frequency / presence stage changes anything."""
        neutral = (
            self.repeat_penalty == 1.0
            and self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0
        )
        return self.penalty_last_n != 0 and not neutral

    @property
    def dry_on(self) -> bool:
        """Whether the DRY stage runs."""
        return self.dry_multiplier != 0.0 and self.dry_penalty_last_n != 0


def _validate(p: SamplerParams) -> None:
    """Raise SamplingError on the first setting outside its documented range."""
    _check_int(p, "top_k", lo=0)
    _check_int(p, "min_keep", lo=0)
    _check_int(p, "penalty_last_n", lo=-1)
    _check_int(p, "dry_allowed_length", lo=0)
    _check_int(p, "dry_penalty_last_n", lo=-1)
    _check_int(p, "mirostat", lo=0)
    if p.mirostat not in (0, 1, 2):
        raise SamplingError(f"mirostat must be 0, 1 or 2, got {p.mirostat}")

    _check_float(p, "temp")
    _check_float(p, "top_p", lo=0.0, lo_open=True, hi=1.0)
    _check_float(p, "min_p", lo=0.0, hi=1.0)
    _check_float(p, "typical_p", lo=0.0, lo_open=True, hi=1.0)
    _check_float(p, "repeat_penalty", lo=0.0, lo_open=True)
    _check_float(p, "frequency_penalty")
    _check_float(p, "presence_penalty")
    _check_float(p, "dry_multiplier", lo=0.0)
    _check_float(p, "dry_base", lo=1.0)
    _check_float(p, "mirostat_tau", lo=0.0, lo_open=True)
    _check_float(p, "mirostat_eta", lo=0.0)

    for b in p.dry_sequence_breakers:
        if not isinstance(b, str) or not b:
            raise SamplingError(f"dry_sequence_breakers holds {b!r}: need non-empty strings")


def _check_int(p: SamplerParams, name: str, *, lo: int) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplingError(f"{name} must be an integer, got {v!r}")
    if v < lo:
        raise SamplingError(f"{name} must be >= {lo}, got {v}")


def _check_float(
    p: SamplerParams,
    name: str,
    *,
    lo: float | None = None,
    lo_open: bool = False,
    hi: float | None = None,
) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SamplingError(f"{name} must be a number, got {v!r}")
    if not math.isfinite(v):
        raise SamplingError(f"{name} must be finite, got {v}")
    below = lo is not None and (v <= lo if lo_open else v < lo)
    above = hi is not None and v > hi
    if below or above:
        left = "(" if lo_open or lo is None else "["
        lo_s = "-inf" if lo is None else f"{lo:g}"
        right = ")" if hi is None else "]"
        hi_s = "inf" if hi is None else f"{hi:g}"
        raise SamplingError(f"{name} must be in {left}{lo_s}, {hi_s}{right}, got {v}")
