"""The machine's read bandwidth, measured the way a decode step reads weights.

A decode step streams every weight matrix once from memory, so its ceiling is how fast the cores
can read a buffer far larger than the caches. `read_bandwidth` times a compiled, parallel sum
over a 1 GiB buffer (the same threads the engine uses; the sum keeps the loads from being
optimised away) and reports the best of a few passes in GB/s. `minfer bench --roofline` prints
it as its own row and each tg row's GB/s as a fraction of it.
"""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from minfer import jit_cache  # noqa: F401  (points numba's cache at minfer's folder)

BUFFER_BYTES = 1 << 30


@njit(cache=True, inline="always")
def _chunk_sum(x: np.ndarray) -> np.uint64:  # pragma: no cover - compiled
    acc = np.uint64(0)
    for i in range(x.shape[0]):
        acc += x[i]
    return acc


@njit(cache=True, parallel=True)
def _parallel_sum(buf: np.ndarray, n_chunks: int) -> np.uint64:  # pragma: no cover - compiled
    # Each chunk's sum is its own loop writing its own slot. A prange reduction variable
    # (`total += acc`) kept the inner loop scalar: 4 GB/s per thread on an AMD EPYC (Zen 4)
    # whose cores read 26-29 GB/s each.
    n = buf.shape[0]
    step = (n + n_chunks - 1) // n_chunks
    parts = np.zeros(n_chunks, np.uint64)
    for c in prange(n_chunks):
        lo = min(n, c * step)
        parts[c] = _chunk_sum(buf[lo:min(n, lo + step)])
    return parts.sum()


def read_bandwidth(n_threads: int, *, nbytes: int = BUFFER_BYTES, passes: int = 5) -> float:
    """Best-of-`passes` GB/s of a parallel read of `nbytes` on `n_threads` threads."""
    buf = np.ones(nbytes // 8, np.uint64)  # written once: every page is resident
    previous = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
    try:
        _parallel_sum(buf[:1024], 64)  # compile / load from cache outside the timing
        best = float("inf")
        for _ in range(passes):
            t0 = time.perf_counter()
            total = _parallel_sum(buf, 64 * max(1, n_threads))
            best = min(best, time.perf_counter() - t0)
            if int(total) != buf.shape[0]:
                raise AssertionError("bandwidth probe read the wrong number of words")
    finally:
        numba.set_num_threads(previous)
    return buf.nbytes / best / 1e9
