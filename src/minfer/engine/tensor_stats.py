"""One-pass statistics of a node's output, for the per-step trace (`minfer.engine.trace`).

`summarize(x)` returns min, max, mean, std, abs-max and the NaN / Inf counts of an array, plus a
small heatmap: the array seen as `[rows, cols]` (first axis, the rest flattened), pooled into at
most `HEAT_ROWS x HEAT_COLS` cells, each cell the signed value of largest magnitude in its block
(outliers are what a debugger looks for; a mean would wash them out). One compiled pass over the
data: a traced decode step summarizes every node of the graph. Statistics skip NaN and Inf
values (they are counted instead); `summarize_reference` is the plain numpy oracle.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

HEAT_ROWS = 8
HEAT_COLS = 32
STAT_KEYS = ("min", "max", "mean", "std", "absmax", "nan", "inf")


@njit(cache=True, error_model="numpy")
def _stats_2d(x: np.ndarray, heat: np.ndarray, rb: int, cb: int) -> np.ndarray:  # pragma: no cover
    rows, cols = x.shape
    lo = np.inf
    hi = -np.inf
    total = 0.0
    total_sq = 0.0
    n_nan = 0
    n_inf = 0
    n = 0
    for r in range(rows):
        hr = r // rb
        for c in range(cols):
            v = float(x[r, c])
            if math.isnan(v):
                n_nan += 1
                continue
            if math.isinf(v):
                n_inf += 1
                continue
            n += 1
            lo = min(lo, v)
            hi = max(hi, v)
            total += v
            total_sq += v * v
            hc = c // cb
            if abs(v) > abs(heat[hr, hc]):
                heat[hr, hc] = v
    out = np.zeros(7)
    if n > 0:
        mean = total / n
        out[0] = lo
        out[1] = hi
        out[2] = mean
        out[3] = math.sqrt(max(total_sq / n - mean * mean, 0.0))
        out[4] = max(abs(lo), abs(hi))
    out[5] = n_nan
    out[6] = n_inf
    return out


def as_rows(x: np.ndarray) -> np.ndarray:
    """The array as [rows, cols]: first axis kept, the rest flattened (a vector is one row)."""
    if x.ndim == 0:
        return x.reshape(1, 1)
    if x.ndim == 1:
        return x.reshape(1, -1)
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def heat_blocks(rows: int, cols: int) -> tuple[int, int]:
    """Rows and columns of data per heatmap cell."""
    return max(1, -(-rows // HEAT_ROWS)), max(1, -(-cols // HEAT_COLS))


def summarize(x: np.ndarray) -> tuple[dict[str, float], np.ndarray]:
    """({min, max, mean, std, absmax, nan, inf}, heatmap [<= HEAT_ROWS, <= HEAT_COLS] f32)."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    rb, cb = heat_blocks(rows, cols)
    heat = np.zeros((-(-rows // rb), -(-cols // cb)), np.float64)
    if x2.size == 0:
        return dict.fromkeys(STAT_KEYS, 0.0), heat.astype(np.float32)
    if x2.dtype != np.float32:
        x2 = x2.astype(np.float32)  # int32 inputs: small; one specialization of the kernel
    values = _stats_2d(x2, heat, rb, cb)
    stats = {k: float(v) for k, v in zip(STAT_KEYS, values, strict=True)}
    stats["nan"] = int(values[5])
    stats["inf"] = int(values[6])
    return stats, heat.astype(np.float32)


def summarize_reference(x: np.ndarray) -> dict[str, float]:
    """The statistics by plain numpy (the oracle for `summarize`)."""
    flat = np.asarray(x, np.float64).reshape(-1)
    finite = flat[np.isfinite(flat)]
    stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0.0)
    if finite.size:
        stats.update(min=float(finite.min()), max=float(finite.max()),
                     mean=float(finite.mean()), std=float(finite.std()),
                     absmax=float(np.abs(finite).max()))
    stats["nan"] = int(np.isnan(flat).sum())
    stats["inf"] = int(np.isinf(flat).sum())
    return stats
