"""Pooling a batch's rows into one row per sequence: mean, first ([CLS]) or last token.

Output row i pools rows [start[i], end[i]) of x: their mean (summed in f64 in row order, then
divided and rounded to f32), the first row, or the last one. A sequence's pooled row depends on
its own rows alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange

POOL_KINDS = {"mean": 0, "cls": 1, "last": 2}


@njit(cache=True, error_model="numpy", parallel=True)
def _pool(x, start, end, kind, out):
    n = x.shape[1]
    for i in prange(out.shape[0]):
        s, e = start[i], end[i]
        if kind == 1:
            out[i, :] = x[s]
        elif kind == 2:
            out[i, :] = x[e - 1]
        else:
            acc = np.zeros(n, np.float64)
            for t in range(s, e):
                for j in range(n):
                    acc[j] += x[t, j]
            for j in range(n):
                out[i, j] = np.float32(acc[j] / (e - s))


def bind_pool(x: np.ndarray, start: np.ndarray, end: np.ndarray, kind: str,
              out: np.ndarray) -> Callable[[], None]:
    """out[i] = pool(x[start[i]:end[i]]) for kind mean / cls / last; bounds checked per call."""
    if kind not in POOL_KINDS:
        raise ValueError(f"unknown pooling {kind!r} (one of {', '.join(POOL_KINDS)})")
    if x.ndim != 2 or out.shape != (start.shape[0], x.shape[1]) or end.shape != start.shape:
        raise ValueError(f"pool of x {x.shape} into {out.shape} with {start.shape} bounds")
    run = partial(_pool, x, start, end, POOL_KINDS[kind], out)

    def call() -> None:
        if np.any(start < 0) or np.any(end > x.shape[0]) or np.any(end <= start):
            raise ValueError("each pooled row's bounds must be a non-empty range of the batch")
        run()

    return call
