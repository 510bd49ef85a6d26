"""Integer dot kernels for the K-quants (256-value super-blocks): Q4_K, Q5_K, Q6_K.

The activation is Q8_K (`q8.Q8KBlocks`). Per super-block the integer part is exactly ggml's
(`ggml_vec_dot_q4_K_q8_K` and siblings): sum over sub-blocks of scale * (codes . int8 quants),
accumulated in int32 lanes by one `simd.ksuper_*` intrinsic per super-block (which also unpacks
the 6-bit scales and dots the mins (Q4_K/Q5_K) with the activation's 16-value `bsums`); Q6_K's
-32 offset is applied to the codes. The float part is
`d_x * d_w * sumi` plus `-d_x * dmin_w * summ` in f32 (order differs from ggml's SIMD lanes:
agreement to f32 rounding). Same code shape as `dot32`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._llvm import prefetch
from .dot32 import _CHUNK, _PF, U, hsum16, load_f16
from .simd import LANES, kflush, ksuper_q4, ksuper_q5, ksuper_q6


@njit(inline="always")
def _prefetch_block(row, base, size):
    for off in range(U(0), U(size), U(64)):
        prefetch(row, base + off + U(_PF))


@njit(parallel=True, fastmath=True, cache=True)
def mv_q4_k(w, xq, xd, bsums, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 256
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        acc = np.empty(LANES, np.float32)
        iacc = np.zeros(LANES, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr, xdr, bs = xq[t], xd[t], bsums[t]
                acc[:] = 0.0
                accm = np.float32(0.0)
                for i in range(U(nb)):
                    base = i * U(144)
                    _prefetch_block(row, base, 144)
                    summ = ksuper_q4(iacc, row, base, xr, i * U(256), bs, i * U(16))
                    kflush(acc, iacc, xdr[i] * load_f16(row, base))
                    accm += (-xdr[i] * load_f16(row, base + U(2))) * np.float32(summ)
                out[t, r] = hsum16(acc) + accm


@njit(parallel=True, fastmath=True, cache=True)
def mv_q5_k(w, xq, xd, bsums, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 256
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        acc = np.empty(LANES, np.float32)
        iacc = np.zeros(LANES, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr, xdr, bs = xq[t], xd[t], bsums[t]
                acc[:] = 0.0
                accm = np.float32(0.0)
                for i in range(U(nb)):
                    base = i * U(176)
                    _prefetch_block(row, base, 176)
                    summ = ksuper_q5(iacc, row, base, xr, i * U(256), bs, i * U(16))
                    kflush(acc, iacc, xdr[i] * load_f16(row, base))
                    accm += (-xdr[i] * load_f16(row, base + U(2))) * np.float32(summ)
                out[t, r] = hsum16(acc) + accm


@njit(parallel=True, fastmath=True, cache=True)
def mv_q6_k(w, xq, xd, bsums, out):
    n_out, nt, nb = w.shape[0], xq.shape[0], xq.shape[1] // 256
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        acc = np.empty(LANES, np.float32)
        iacc = np.zeros(LANES, np.int32)
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr, xdr, bs = xq[t], xd[t], bsums[t]
                acc[:] = 0.0
                for i in range(U(nb)):
                    base = i * U(210)
                    _prefetch_block(row, base, 210)
                    ksuper_q6(iacc, row, base, xr, i * U(256), bs, i * U(16))
                    kflush(acc, iacc, xdr[i] * load_f16(row, base + U(208)))
                out[t, r] = hsum16(acc)
