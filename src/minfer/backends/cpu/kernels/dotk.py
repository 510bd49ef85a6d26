"""Integer dot kernels for the K-quants (256-value super-blocks): Q4_K, Q5_K, Q6_K.

The activation is Q8_K (`q8.Q8KBlocks`). Per super-block the integer part is exactly ggml's
(`ggml_vec_dot_q4_K_q8_K` and siblings): sum over sub-blocks of scale * (codes . int8 quants),
accumulated in int32 lanes per super-block by the `simd_k.rowdot_*_k` row intrinsics (which also
unpack the 6-bit scales and dot the mins (Q4_K/Q5_K), or Q6_K's -32 offset times its scales,
with the activation's 16-value `bsums`). The float part is
`d_x * d_w * sumi` plus `-d_x * dmin_w * summ` in f32 (order differs from ggml's SIMD lanes:
agreement to f32 rounding). The drivers (`mv_q4_k`, ..., `mv_q4_kp` on repacked Q4_K) are
`dot32`'s skeleton, generated from one template with theirs (`row_drivers`): MAX_TOKENS (8)
activation rows per pass over a weight row (up to ROWS8_MAX_IN inputs), then 4, 2, 1,
batch-invariant, no fastmath. Here: the per-call activation preparation they need.
"""

from __future__ import annotations

import numpy as np
from numba import njit

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
