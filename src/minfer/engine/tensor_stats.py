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

import minfer.jit_cache  # noqa: F401  (compiled code cached beside the kernels')

HEAT_ROWS = 8
HEAT_COLS = 32
STAT_KEYS = ("min", "max", "mean", "std", "absmax", "nan", "inf")


@njit(cache=True, error_model="numpy")
def _stats_2d(x: np.ndarray, heat: np.ndarray, rb: int, cb: int,
              out: np.ndarray) -> None:  # pragma: no cover
    """out[:7] = min, max, mean, std, absmax, NaN count, Inf count; heat: pooled signed max."""
    rows, cols = x.shape
    n_hc = heat.shape[1]
    lo = np.inf
    hi = -np.inf
    total = 0.0
    total_sq = 0.0
    n_nan = 0
    n_inf = 0
    n = 0
    for r in range(rows):
        hr = r // rb
        for hc in range(n_hc):
            best = heat[hr, hc]
            for c in range(hc * cb, min(cols, (hc + 1) * cb)):
                v = float(x[r, c])
                if v - v != 0.0:  # NaN or +-Inf
                    if math.isnan(v):
                        n_nan += 1
                    else:
                        n_inf += 1
                    continue
                n += 1
                lo = min(lo, v)
                hi = max(hi, v)
                total += v
                total_sq += v * v
                if abs(v) > abs(best):
                    best = v
            heat[hr, hc] = best
    out[:] = 0.0
    if n > 0:
        mean = total / n
        out[0] = lo
        out[1] = hi
        out[2] = mean
        out[3] = math.sqrt(max(total_sq / n - mean * mean, 0.0))
        out[4] = max(abs(lo), abs(hi))
    out[5] = n_nan
    out[6] = n_inf


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


def summarize_into(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The statistics into out[:7] (STAT_KEYS order); returns the heatmap (float32). The
    traced path: one compiled pass, no Python objects per element or per statistic."""
    x2 = x if x.ndim == 2 else as_rows(x)
    if x2.dtype != np.float32:
        x2 = x2.astype(np.float32)  # int32 inputs: small; one specialization of the kernel
    rows, cols = x2.shape
    rb, cb = heat_blocks(rows, cols)
    heat = np.zeros((-(-rows // rb), -(-cols // cb)), np.float32)
    if x2.size == 0:
        out[:] = 0.0
        return heat
    _stats_2d(x2, heat, rb, cb, out)
    return heat


def stats_dict(values: np.ndarray) -> dict[str, float]:
    stats = {k: float(v) for k, v in zip(STAT_KEYS, values, strict=True)}
    stats["nan"] = int(values[5])
    stats["inf"] = int(values[6])
    return stats


def summarize(x: np.ndarray) -> tuple[dict[str, float], np.ndarray]:
    """({min, max, mean, std, absmax, nan, inf}, heatmap [<= HEAT_ROWS, <= HEAT_COLS] f32)."""
    values = np.zeros(len(STAT_KEYS))
    heat = summarize_into(x, values)
    return stats_dict(values), heat


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
