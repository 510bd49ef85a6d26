"""Integer dot kernels for the K-quants (256-value super-blocks): Q4_K, Q5_K, Q6_K.

The activation is Q8_K (`q8.Q8KBlocks`). Per super-block the integer part is exactly ggml's
(`ggml_vec_dot_q4_K_q8_K` and siblings): sum over sub-blocks of scale * (codes . int8 quants),
accumulated in int32 lanes per super-block by the `simd_k.rowdot_*_k` row intrinsics (which also
unpack the 6-bit scales and dot the mins (Q4_K/Q5_K) with the activation's 16-value `bsums`);
Q6_K's -32 offset is applied to the codes. The float part is
`d_x * d_w * sumi` plus `-d_x * dmin_w * summ` in f32 (order differs from ggml's SIMD lanes:
agreement to f32 rounding). Same code shape as `dot32`.
"""

from __future__ import annotations

from numba import njit, prange

from .dot32 import _CHUNK
from .simd_k import rowdot_q4_k, rowdot_q5_k, rowdot_q6_k


@njit(parallel=True, fastmath=True, cache=True)
def mv_q4_k(w, xq, xd, bsums, out):
    n_out, nt = w.shape[0], xq.shape[0]
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        for t in range(nt):  # the chunk's rows stay in cache across the tokens
            xr, xdr, bs = xq[t], xd[t], bsums[t]
            for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
                out[t, r] = rowdot_q4_k(w[r], xr, xdr, bs)


@njit(parallel=True, fastmath=True, cache=True)
def mv_q5_k(w, xq, xd, bsums, out):
    n_out, nt = w.shape[0], xq.shape[0]
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        for t in range(nt):  # the chunk's rows stay in cache across the tokens
            xr, xdr, bs = xq[t], xd[t], bsums[t]
            for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
                out[t, r] = rowdot_q5_k(w[r], xr, xdr, bs)


@njit(parallel=True, fastmath=True, cache=True)
def mv_q6_k(w, xq, xd, bsums, out):
    n_out, nt = w.shape[0], xq.shape[0]
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        for t in range(nt):  # the chunk's rows stay in cache across the tokens
            xr, xdr, bs = xq[t], xd[t], bsums[t]
            for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
                out[t, r] = rowdot_q6_k(w[r], xr, xdr, bs)
