"""Integer dot kernels for the K-quants (256-value super-blocks): Q4_K, Q5_K, Q6_K.

The activation is Q8_K (`q8.Q8KBlocks`). Per super-block the integer part is exactly ggml's
(`ggml_vec_dot_q4_K_q8_K` and siblings): sum over sub-blocks of scale * (u8 codes . s8 quants);
the mins (Q4_K/Q5_K) come from the activation's 16-value `bsums`, and Q6_K's -32 offset likewise.
The float part is `d_x * d_w * sumi` plus `-d_x * dmin_w * summ`, summed in f32 (order differs
from ggml's SIMD lanes: agreement to f32 rounding). Same code shape as `dot32`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._llvm import prefetch
from .dot32 import _CHUNK, _PF, U, load_f16
from .simd import dot_nib32, dot_nib32h, dot_q6

_M4 = np.uint8(15)
_M6 = np.uint8(63)
_S4 = np.uint8(4)
_S6 = np.uint8(6)


@njit(inline="always")
def unpack_scales(w, s, sc, mn):
    """The eight 6-bit scales and mins packed in w[s:s+12] (ggml get_scale_min_k4)."""
    for j in range(U(4)):
        sc[j] = np.int32(w[s + j] & _M6)
        mn[j] = np.int32(w[s + U(4) + j] & _M6)
        hi = w[s + U(8) + j]
        sc[j + U(4)] = np.int32((hi & _M4) | ((w[s + j] >> _S6) << _S4))
        mn[j + U(4)] = np.int32((hi >> _S4) | ((w[s + U(4) + j] >> _S6) << _S4))


@njit(inline="always")
def _mins(mn, bsums, t, bs):
    """sum_k min_k * (sum of the activation quants of 32-value sub-block k)."""
    summ = np.int32(0)
    for k in range(U(8)):
        pair = np.int32(bsums[t, bs + U(2) * k]) + np.int32(bsums[t, bs + U(2) * k + U(1)])
        summ += mn[k] * pair
    return summ


@njit(parallel=True, fastmath=True, cache=True)
def mv_q4_k(w, xq, xd, bsums, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 256
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        isums = np.empty(nb, np.int32)
        msums = np.empty(nb, np.int32)
        sc = np.empty(8, np.int32)
        mn = np.empty(8, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = xq[t]
                for i in range(U(nb)):
                    base = i * U(144)
                    prefetch(row, base + U(_PF))
                    prefetch(row, base + U(_PF + 64))
                    prefetch(row, base + U(_PF + 128))
                    unpack_scales(row, base + U(4), sc, mn)
                    sumi = np.int32(0)
                    for j in range(U(4)):
                        q = base + U(16) + U(32) * j
                        xo = i * U(256) + U(64) * j
                        sumi += sc[U(2) * j] * dot_nib32(row, q, np.uint8(0), xr, xo)
                        sumi += sc[U(2) * j + U(1)] * dot_nib32(row, q, _S4, xr, xo + U(32))
                    isums[i] = sumi
                    msums[i] = _mins(mn, bsums, t, i * U(16))
                acc = np.float32(0.0)
                accm = np.float32(0.0)
                for i in range(nb):
                    acc += (xd[t, i] * load_f16(row, i * 144)) * np.float32(isums[i])
                    accm += (-xd[t, i] * load_f16(row, i * 144 + 2)) * np.float32(msums[i])
                out[t, r] = acc + accm


@njit(parallel=True, fastmath=True, cache=True)
def mv_q5_k(w, xq, xd, bsums, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 256
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        isums = np.empty(nb, np.int32)
        msums = np.empty(nb, np.int32)
        sc = np.empty(8, np.int32)
        mn = np.empty(8, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = xq[t]
                for i in range(U(nb)):
                    base = i * U(176)
                    prefetch(row, base + U(_PF))
                    prefetch(row, base + U(_PF + 64))
                    prefetch(row, base + U(_PF + 128))
                    unpack_scales(row, base + U(4), sc, mn)
                    qh = base + U(16)
                    sumi = np.int32(0)
                    for j in range(U(4)):
                        q = base + U(48) + U(32) * j
                        xo = i * U(256) + U(64) * j
                        b = np.uint8(2 * j)
                        sumi += sc[U(2) * j] * dot_nib32h(row, q, np.uint8(0), qh, b, xr, xo)
                        sumi += sc[U(2) * j + U(1)] * dot_nib32h(
                            row, q, _S4, qh, b + np.uint8(1), xr, xo + U(32))
                    isums[i] = sumi
                    msums[i] = _mins(mn, bsums, t, i * U(16))
                acc = np.float32(0.0)
                accm = np.float32(0.0)
                for i in range(nb):
                    acc += (xd[t, i] * load_f16(row, i * 176)) * np.float32(isums[i])
                    accm += (-xd[t, i] * load_f16(row, i * 176 + 2)) * np.float32(msums[i])
                out[t, r] = acc + accm


@njit(parallel=True, fastmath=True, cache=True)
def mv_q6_k(w, xq, xd, bsums, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 256
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        isums = np.empty(nb, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = xq[t]
                for i in range(U(nb)):
                    base = i * U(210)
                    prefetch(row, base + U(_PF))
                    prefetch(row, base + U(_PF + 64))
                    prefetch(row, base + U(_PF + 128))
                    prefetch(row, base + U(_PF + 192))
                    sumi = np.int32(0)
                    # half n, code k (0..3), 16-run g: x[256i + 128n + 32k + 16g : +16]
                    for n in range(U(2)):
                        for k in range(U(4)):
                            for g in range(U(2)):
                                lo = base + U(64) * n + U(32) * (k & U(1)) + U(16) * g
                                ho = base + U(128) + U(32) * n + U(16) * g
                                xo = i * U(256) + U(128) * n + U(32) * k + U(16) * g
                                s = dot_q6(row, lo, np.uint8(4 * (k >> U(1))), ho,
                                           np.uint8(2 * k), xr, xo)
                                sub = U(8) * n + U(2) * k + g
                                bsum = np.int32(bsums[t, i * U(16) + sub])
                                scale = np.int32(np.int8(row[base + U(192) + sub]))
                                sumi += scale * (s - np.int32(32) * bsum)
                    isums[i] = sumi
                acc = np.float32(0.0)
                for i in range(nb):
                    acc += (xd[t, i] * load_f16(row, i * 210 + 208)) * np.float32(isums[i])
                out[t, r] = acc
