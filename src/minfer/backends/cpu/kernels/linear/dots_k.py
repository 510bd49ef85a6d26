"""Integer dot kernels for the K-quants (256-value super-blocks): Q2_K, Q4_K, Q5_K, Q6_K (and
IQ4_XS, TQ2_0, the Q7_K re-encoding).

The activation is Q8_K (`quant.activations.Q8KBlocks`). Per super-block the integer part is exactly
ggml's
(`ggml_vec_dot_q4_K_q8_K` and siblings): sum over sub-blocks of scale * (codes . int8 quants),
accumulated in int32 lanes per super-block by the `simd.kquants.rowdot_*` row intrinsics (which
also unpack the scales and dot the mins (Q4_K/Q5_K/Q2_K), or Q6_K's -32 offset times its scales,
TQ2_0's -1, with the activation's 16-value `bsums`). The float part is
`d_x * d_w * sumi` plus `-d_x * dmin_w * summ` in f32 (order differs from ggml's SIMD lanes:
agreement to f32 rounding). The plain drivers (`mv_q4_k`, ...) are `linear.dots32`'s skeleton,
generated
from one template with theirs (`linear.row_drivers`): MAX_TOKENS (8) activation rows per pass over a
weight row (up to ROWS8_MAX_IN inputs), then 4, 2, 1, batch-invariant, no fastmath. Weights
interleaved 16 rows at a time run `simd.interleaved_k` instead (`mv_q4_kr`, `mv_q6_kr`,
`mv_q7_kr`). Here: the
per-call activation preparation those need.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# -- K-quant weights interleaved 16 rows at a time (`quant.repack.interleave_kquant`;
# `simd.interleaved_k`) --


@njit(cache=True)
def kmins_pairs(bsums):
    """The activation's 32-value sums (int16; |sum| <= 32 * 127) per super-block in the order
    0, 2, 1, 3, 4, 6, 5, 7: the dword pairs the interleaved Q4_K rows' mins words
    ((m0, m2), (m1, m3), ...) are vpdpwssd-ed with."""
    nt, n16 = bsums.shape
    out = np.empty((nt, n16 // 2), np.int16)
    order = (0, 2, 1, 3, 4, 6, 5, 7)
    for t in range(nt):
        for s in range(n16 // 16):
            for k in range(8):
                j = 16 * s + 2 * order[k]
                out[t, 8 * s + k] = np.int16(np.int32(bsums[t, j]) + np.int32(bsums[t, j + 1]))
    return out


@njit(cache=True)
def koffset_corr(bsums, offset):
    """-offset x the activation's 16-value sums (int32): the code offset of Q6_K (32) / Q7_K
    (64), where the interleaved rows start each sub-block's vpdpbusd sums."""
    nt, n16 = bsums.shape
    out = np.empty((nt, n16), np.int32)
    for t in range(nt):
        for j in range(n16):
            out[t, j] = np.int32(-offset) * np.int32(bsums[t, j])
    return out


@njit(cache=True)
def iq4_corr(bsums, offset):
    """-offset x the activation's 32-value sums (int32 [nt, n/32]; 0 columns without an
    offset): where the interleaved IQ4_XS rows start each sub-block's vpdpbusd sums of its
    levels stored as level ^ 0x80 (offset 128; the sign trick's int8 levels need none)."""
    nt, n16 = bsums.shape
    if offset == 0:
        return np.zeros((nt, 0), np.int32)
    out = np.empty((nt, n16 // 2), np.int32)
    for t in range(nt):
        for j in range(n16 // 2):
            out[t, j] = np.int32(-offset) * (np.int32(bsums[t, 2 * j])
                                             + np.int32(bsums[t, 2 * j + 1]))
    return out
