"""Integer dot kernels for the K-quants (256-value super-blocks): Q4_K, Q5_K, Q6_K.

The activation is Q8_K (`q8.Q8KBlocks`). Per super-block the integer part is exactly ggml's
(`ggml_vec_dot_q4_K_q8_K` and siblings): sum over sub-blocks of scale * (codes . int8 quants),
accumulated in int32 lanes per super-block by the `simd_k.rowdot_*_k` row intrinsics (which also
unpack the 6-bit scales and dot the mins (Q4_K/Q5_K), or Q6_K's -32 offset times its scales,
with the activation's 16-value `bsums`). The float part is
`d_x * d_w * sumi` plus `-d_x * dmin_w * summ` in f32 (order differs from ggml's SIMD lanes:
agreement to f32 rounding). Same code shape as `dot32`: MAX_TOKENS (8) activation rows per
pass over a weight row (up to ROWS8_MAX_IN inputs), then 4, 2, 1, batch-invariant, no fastmath.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .dot32 import _CHUNK, block_transpose
from .simd import MAX_TOKENS, ROWS8_MAX_IN
from .simd_k import (
    rowdot2_q4_k,
    rowdot2_q5_k,
    rowdot2_q6_k,
    rowdot4_q4_k,
    rowdot4_q5_k,
    rowdot4_q6_k,
    rowdot8_q4_k,
    rowdot8_q5_k,
    rowdot8_q6_k,
    rowdot_q4_k,
    rowdot_q5_k,
    rowdot_q6_k,
)
from .simd_kp import (
    rowdot2_q4_kp,
    rowdot4_q4_kp,
    rowdot8_q4_kp,
    rowdot_q4_kp,
)


@njit(parallel=True, cache=True)
def mv_q4_k(w, xq, xd, bsums, out):
    n_out, nt = w.shape[0], xq.shape[0]
    n8 = nt - nt % MAX_TOKENS if xq.shape[1] <= ROWS8_MAX_IN else 0
    n4 = n8 + (nt - n8) // 4 * 4
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        r1 = min(n_out, c * _CHUNK + _CHUNK)
        for t in range(0, n8, MAX_TOKENS):  # the chunk's rows stay in cache across tokens
            for r in range(c * _CHUNK, r1):
                rowdot8_q4_k(w[r], xq, xd, bsums, t, out, r)
        for t in range(n8, n4, 4):
            for r in range(c * _CHUNK, r1):
                rowdot4_q4_k(w[r], xq, xd, bsums, t, out, r)
        if nt - n4 >= 2:
            for r in range(c * _CHUNK, r1):
                rowdot2_q4_k(w[r], xq, xd, bsums, n4, out, r)
        if (nt - n4) % 2:
            for r in range(c * _CHUNK, r1):
                rowdot_q4_k(w[r], xq, xd, bsums, nt - 1, out, r)


@njit(parallel=True, cache=True)
def mv_q5_k(w, xq, xd, bsums, out):
    n_out, nt = w.shape[0], xq.shape[0]
    n8 = nt - nt % MAX_TOKENS if xq.shape[1] <= ROWS8_MAX_IN else 0
    n4 = n8 + (nt - n8) // 4 * 4
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        r1 = min(n_out, c * _CHUNK + _CHUNK)
        for t in range(0, n8, MAX_TOKENS):  # the chunk's rows stay in cache across tokens
            for r in range(c * _CHUNK, r1):
                rowdot8_q5_k(w[r], xq, xd, bsums, t, out, r)
        for t in range(n8, n4, 4):
            for r in range(c * _CHUNK, r1):
                rowdot4_q5_k(w[r], xq, xd, bsums, t, out, r)
        if nt - n4 >= 2:
            for r in range(c * _CHUNK, r1):
                rowdot2_q5_k(w[r], xq, xd, bsums, n4, out, r)
        if (nt - n4) % 2:
            for r in range(c * _CHUNK, r1):
                rowdot_q5_k(w[r], xq, xd, bsums, nt - 1, out, r)


@njit(parallel=True, cache=True)
def mv_q6_k(w, xq, xd, bsums, out):
    n_out, nt = w.shape[0], xq.shape[0]
    n8 = nt - nt % MAX_TOKENS if xq.shape[1] <= ROWS8_MAX_IN else 0
    n4 = n8 + (nt - n8) // 4 * 4
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        r1 = min(n_out, c * _CHUNK + _CHUNK)
        for t in range(0, n8, MAX_TOKENS):  # the chunk's rows stay in cache across tokens
            for r in range(c * _CHUNK, r1):
                rowdot8_q6_k(w[r], xq, xd, bsums, t, out, r)
        for t in range(n8, n4, 4):
            for r in range(c * _CHUNK, r1):
                rowdot4_q6_k(w[r], xq, xd, bsums, t, out, r)
        if nt - n4 >= 2:
            for r in range(c * _CHUNK, r1):
                rowdot2_q6_k(w[r], xq, xd, bsums, n4, out, r)
        if (nt - n4) % 2:
            for r in range(c * _CHUNK, r1):
                rowdot_q6_k(w[r], xq, xd, bsums, nt - 1, out, r)


# -- repacked Q4_K weights (`repack.repack_q4_k`; `simd_kp`) --------------------------------------


@njit(cache=True)
def block_scales_sums(xd, bsums):
    """Per 32 activation values: the Q8_K scale (f32) and the quants' sum (int32), what the
    repacked Q4_K rows read per sub-block lane."""
    nt, nsb = xd.shape
    xdb = np.empty((nt, 8 * nsb), np.float32)
    xsb = np.empty((nt, 8 * nsb), np.int32)
    for t in range(nt):
        for b in range(8 * nsb):
            xdb[t, b] = xd[t, b // 8]
            xsb[t, b] = np.int32(bsums[t, 2 * b]) + np.int32(bsums[t, 2 * b + 1])
    return xdb, xsb


@njit(parallel=True, cache=True)
def mv_q4_kp(w, xq, xd, bsums, out):
    """mv_q4_k on a repacked weight (same arithmetic up to float rounding order)."""
    n_out, nt = w.shape[0], xq.shape[0]
    xt = block_transpose(xq, True)
    xdb, xsb = block_scales_sums(xd, bsums)
    n8 = nt - nt % MAX_TOKENS if xq.shape[1] <= ROWS8_MAX_IN else 0
    n4 = n8 + (nt - n8) // 4 * 4
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        r1 = min(n_out, c * _CHUNK + _CHUNK)
        for t in range(0, n8, MAX_TOKENS):
            for r in range(c * _CHUNK, r1):
                rowdot8_q4_kp(w[r], xt, xdb, xsb, t, out, r)
        for t in range(n8, n4, 4):
            for r in range(c * _CHUNK, r1):
                rowdot4_q4_kp(w[r], xt, xdb, xsb, t, out, r)
        if nt - n4 >= 2:
            for r in range(c * _CHUNK, r1):
                rowdot2_q4_kp(w[r], xt, xdb, xsb, n4, out, r)
        if (nt - n4) % 2:
            for r in range(c * _CHUNK, r1):
                rowdot_q4_kp(w[r], xt, xdb, xsb, nt - 1, out, r)
