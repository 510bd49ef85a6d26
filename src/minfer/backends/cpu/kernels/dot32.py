"""Integer dot kernels for the 32-value block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each kernel computes `out[t, r] = dot(W[r], x[t])` with the activation already quantized to Q8
blocks (`q8.Q8Blocks`), the way ggml's `ggml_vec_dot_q*_q8_*` do: per block an exact int32 dot
of the weight codes with the activation quants, scaled by `d_w * d_x` (f32) and summed in f32;
Q4_1/Q5_1 add `sum(m_w * s_x)`. Summation order differs from ggml's SIMD lanes, so results agree
to f32 rounding, not bit for bit.

How the code is shaped for LLVM (decode is memory-bound, so every instruction per block counts):
- weight codes stay unsigned (Q8_0's int8 flipped by ^0x80) so each block dot is u8 x s8, which
  LLVM lowers to `vpdpbusd`; the offset returns exactly as `-offset * sum(x_q)` from the
  activation's block sums;
- the block dots are `simd` intrinsics (explicit vector IR), not auto-vectorised loops;
- indices are unsigned (uint64), which drops numba's negative-index wraparound selects;
- pass 1 writes per-block int sums to a small array, pass 2 folds the scales in f32;
- rows are split across threads in contiguous chunks; a software prefetch runs `_PF` bytes ahead.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._llvm import f16_to_f32, prefetch
from .simd import dot_q4, dot_q5, dot_q8

_PF = 1024  # prefetch distance in bytes
_CHUNK = 16  # rows per work item
U = np.uint64


@njit(inline="always")
def load_f16(buf, off):
    """The f16 at byte offset `off` of a uint8 array, as f32."""
    return f16_to_f32(np.uint16(buf[off]) | np.uint16(np.uint16(buf[off + 1]) << np.uint16(8)))


@njit(parallel=True, fastmath=True, cache=True)
def mv_q4_0(w, xq, xd, xsum, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        isums = np.empty(nb, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = xq[t]
                for b in range(U(nb)):
                    prefetch(row, b * U(18) + U(_PF))
                    s = dot_q4(row, b * U(18) + U(2), xr, b * U(32))
                    isums[b] = s - np.int32(8) * xsum[t, b]
                acc = np.float32(0.0)
                for b in range(nb):
                    acc += (load_f16(row, b * 18) * xd[t, b]) * np.float32(isums[b])
                out[t, r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def mv_q4_1(w, xq, xd, xs, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        isums = np.empty(nb, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = xq[t]
                for b in range(U(nb)):
                    prefetch(row, b * U(20) + U(_PF))
                    isums[b] = dot_q4(row, b * U(20) + U(4), xr, b * U(32))
                acc = np.float32(0.0)
                summs = np.float32(0.0)
                for b in range(nb):
                    acc += (load_f16(row, b * 20) * xd[t, b]) * np.float32(isums[b])
                    summs += load_f16(row, b * 20 + 2) * xs[t, b]
                out[t, r] = acc + summs


@njit(parallel=True, fastmath=True, cache=True)
def mv_q5_0(w, xq, xd, xsum, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        isums = np.empty(nb, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = xq[t]
                for b in range(U(nb)):
                    base = b * U(22)
                    prefetch(row, base + U(_PF))
                    s = dot_q5(row, base + U(6), base + U(2), xr, b * U(32))
                    isums[b] = s - np.int32(16) * xsum[t, b]
                acc = np.float32(0.0)
                for b in range(nb):
                    acc += (load_f16(row, b * 22) * xd[t, b]) * np.float32(isums[b])
                out[t, r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def mv_q5_1(w, xq, xd, xs, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        isums = np.empty(nb, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = xq[t]
                for b in range(U(nb)):
                    base = b * U(24)
                    prefetch(row, base + U(_PF))
                    isums[b] = dot_q5(row, base + U(8), base + U(4), xr, b * U(32))
                acc = np.float32(0.0)
                summs = np.float32(0.0)
                for b in range(nb):
                    acc += (load_f16(row, b * 24) * xd[t, b]) * np.float32(isums[b])
                    summs += load_f16(row, b * 24 + 2) * xs[t, b]
                out[t, r] = acc + summs


@njit(parallel=True, fastmath=True, cache=True)
def mv_q8_0(w, xq, xd, xsum, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 32
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        isums = np.empty(nb, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = xq[t]
                for b in range(U(nb)):
                    prefetch(row, b * U(34) + U(_PF))
                    s = dot_q8(row, b * U(34) + U(2), xr, b * U(32))
                    isums[b] = s - np.int32(128) * xsum[t, b]
                acc = np.float32(0.0)
                for b in range(nb):
                    acc += (load_f16(row, b * 34) * xd[t, b]) * np.float32(isums[b])
                out[t, r] = acc
