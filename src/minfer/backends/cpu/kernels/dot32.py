"""Integer dot kernels for the 32-value block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each kernel computes `out[t, r] = dot(W[r], x[t])` with the activation already quantized to Q8
blocks (`q8.Q8Blocks`), the way ggml's `ggml_vec_dot_q*_q8_*` do: per block an exact int32 dot
of the weight codes with the activation quants, scaled by `d_w * d_x` (f32) and summed in f32;
Q4_1/Q5_1 add `sum(m_w * s_x)`. Summation order differs from ggml's SIMD lanes, so results agree
to f32 rounding, not bit for bit.

How the code is shaped (decode is memory-bound, so every instruction per block counts):
- each block is one `simd` intrinsic (explicit vector IR): unpack, exact int32 pair sums
  (`vpmaddwd`), scale by d_w*d_x into a 16-lane f32 accumulator -- no per-block horizontal sum;
- indices are unsigned (uint64), which drops numba's negative-index wraparound selects;
- rows are split across threads in contiguous chunks; a software prefetch runs `_PF` bytes ahead.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._llvm import f16_to_f32, prefetch
from .simd import (
    BLOCKS_PER_CALL,
    LANES,
    acc1_q4_0,
    acc1_q4_1,
    acc1_q5_0,
    acc1_q5_1,
    acc1_q8_0,
    acc4_q4_0,
    acc4_q4_1,
    acc4_q5_0,
    acc4_q5_1,
    acc4_q8_0,
    acc_q4_0,
    acc_q4_1,
    acc_q5_0,
    acc_q5_1,
    acc_q8_0,
)

_PF = 1024  # prefetch distance in bytes
_CHUNK = 16  # rows per work item
U = np.uint64
_ACC = BLOCKS_PER_CALL * LANES  # f32 accumulator lanes: one lane group per block of a call


@njit(inline="always")
def load_f16(buf, off):
    """The f16 at byte offset `off` of a uint8 array, as f32."""
    return f16_to_f32(np.uint16(buf[off]) | np.uint16(np.uint16(buf[off + 1]) << np.uint16(8)))


@njit(inline="always")
def _prefetch(row, base, nbytes):
    """Prefetch the cache lines of row[base + _PF : base + _PF + nbytes]."""
    for off in range(U(0), U(nbytes), U(64)):
        prefetch(row, base + off + U(_PF))


@njit(inline="always")
def hsum16(acc):
    """Sum of the lanes of an accumulator (16 or 32 f32)."""
    s = np.float32(0.0)
    for i in range(acc.shape[0]):
        s += acc[i]
    return s


@njit(parallel=True, fastmath=True, cache=True)
def mv_q4_0(w, xq, xd, xs, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        acc = np.empty(_ACC, np.float32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr, xdr, xsr = xq[t], xd[t], xs[t]
                acc[:] = 0.0
                b = U(0)
                while b + U(8) <= U(nb):
                    _prefetch(row, b * U(18), 144)
                    acc_q4_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(8)
                if b + U(4) <= U(nb):
                    acc4_q4_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(4)
                while b < U(nb):
                    acc1_q4_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(1)
                out[t, r] = hsum16(acc)


@njit(parallel=True, fastmath=True, cache=True)
def mv_q4_1(w, xq, xd, xs, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        acc = np.empty(_ACC, np.float32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr, xdr, xsr = xq[t], xd[t], xs[t]
                acc[:] = 0.0
                b = U(0)
                while b + U(8) <= U(nb):
                    _prefetch(row, b * U(20), 160)
                    acc_q4_1(acc, 0, row, xr, xdr, xsr, b)
                    b += U(8)
                if b + U(4) <= U(nb):
                    acc4_q4_1(acc, 0, row, xr, xdr, xsr, b)
                    b += U(4)
                while b < U(nb):
                    acc1_q4_1(acc, 0, row, xr, xdr, xsr, b)
                    b += U(1)
                out[t, r] = hsum16(acc)


@njit(parallel=True, fastmath=True, cache=True)
def mv_q5_0(w, xq, xd, xs, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        acc = np.empty(_ACC, np.float32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr, xdr, xsr = xq[t], xd[t], xs[t]
                acc[:] = 0.0
                b = U(0)
                while b + U(8) <= U(nb):
                    _prefetch(row, b * U(22), 176)
                    acc_q5_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(8)
                if b + U(4) <= U(nb):
                    acc4_q5_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(4)
                while b < U(nb):
                    acc1_q5_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(1)
                out[t, r] = hsum16(acc)


@njit(parallel=True, fastmath=True, cache=True)
def mv_q5_1(w, xq, xd, xs, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        acc = np.empty(_ACC, np.float32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr, xdr, xsr = xq[t], xd[t], xs[t]
                acc[:] = 0.0
                b = U(0)
                while b + U(8) <= U(nb):
                    _prefetch(row, b * U(24), 192)
                    acc_q5_1(acc, 0, row, xr, xdr, xsr, b)
                    b += U(8)
                if b + U(4) <= U(nb):
                    acc4_q5_1(acc, 0, row, xr, xdr, xsr, b)
                    b += U(4)
                while b < U(nb):
                    acc1_q5_1(acc, 0, row, xr, xdr, xsr, b)
                    b += U(1)
                out[t, r] = hsum16(acc)


@njit(parallel=True, fastmath=True, cache=True)
def mv_q8_0(w, xq, xd, xs, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        acc = np.empty(_ACC, np.float32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr, xdr, xsr = xq[t], xd[t], xs[t]
                acc[:] = 0.0
                b = U(0)
                while b + U(8) <= U(nb):
                    _prefetch(row, b * U(34), 272)
                    acc_q8_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(8)
                if b + U(4) <= U(nb):
                    acc4_q8_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(4)
                while b < U(nb):
                    acc1_q8_0(acc, 0, row, xr, xdr, xsr, b)
                    b += U(1)
                out[t, r] = hsum16(acc)
