"""The machine's read bandwidth, measured the way a decode step reads weights.

A decode step streams every weight matrix once from memory, so its ceiling is how fast the cores
can read a buffer far larger than the caches. `read_bandwidth` times a compiled, parallel sum
over a 1 GiB buffer (the same threads the engine uses; the sum keeps the loads from being
optimised away) and reports the best of a few passes in GB/s. `minfer bench --roofline` prints
it as its own row and each tg row's GB/s as a fraction of it.

`weights_read_bandwidth` reads a model's own weight arrays instead (`ModelWeights.read_set`):
the pages, sizes and order a decode step reads, each array split over the threads, one call per
array, with no arithmetic. Calls of 0.1-3 MB do not reach the 1 GiB probe's rate (an earlier
sum over buffers of the decode step's sizes read 81-85% of it), and pages that sat idle for
hours read slower than the probe's fresh ones on shared hosts (the 0.5B's step 29.8 -> 23.3 ms
once its weight files were evicted and read again); against this figure a tg row's fraction is
the kernels' own share of what the memory gives those arrays.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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


def _best_seconds(n_threads: int, passes: int, warm: np.ndarray,
                  read: Callable[[int], None]) -> float:
    """The fastest of `passes` calls of read(threads), on `n_threads` threads (at most numba's
    pool), after one sum over `warm` loads the kernel outside the timing."""
    previous = numba.get_num_threads()
    threads = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    numba.set_num_threads(threads)
    try:
        _parallel_sum(warm[:1024], threads)
        best = float("inf")
        for _ in range(passes):
            t0 = time.perf_counter()
            read(threads)
            best = min(best, time.perf_counter() - t0)
    finally:
        numba.set_num_threads(previous)
    return best


def read_bandwidth(n_threads: int, *, nbytes: int = BUFFER_BYTES, passes: int = 5) -> float:
    """Best-of-`passes` GB/s of a parallel read of `nbytes` on `n_threads` threads."""
    buf = np.ones(nbytes // 8, np.uint64)  # written once: every page is resident

    def read(threads: int) -> None:  # 64 chunks a thread asked for
        if int(_parallel_sum(buf, 64 * max(1, n_threads))) != buf.shape[0]:
            raise AssertionError("bandwidth probe read the wrong number of words")

    return buf.nbytes / _best_seconds(n_threads, passes, buf, read) / 1e9


def _words(a: np.ndarray) -> np.ndarray:
    """The aligned 8-byte words of a contiguous array's bytes, as uint64 (in place)."""
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    flat = flat[-flat.ctypes.data % 8:]  # from the first aligned byte (the arrays sit aligned)
    return flat[:flat.shape[0] // 8 * 8].view(np.uint64)


def weights_read_bandwidth(arrays: Sequence[np.ndarray], n_threads: int, *,
                           passes: int = 3) -> float:
    """Best-of-`passes` GB/s of reading `arrays` one after another, each split over `n_threads`
    threads: a decode step's weight reads without its arithmetic."""
    words = [_words(a) for a in arrays if a.nbytes >= 8]
    nbytes = sum(w.nbytes for w in words)
    if not nbytes:
        raise ValueError("no weight bytes to read")

    def read(threads: int) -> None:
        for w in words:
            _parallel_sum(w, threads)

    return nbytes / _best_seconds(n_threads, passes, words[0], read) / 1e9
