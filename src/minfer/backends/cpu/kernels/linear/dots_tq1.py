"""TQ1_0's per-call activation preparation: the Q8_K activation in the form its row dot reads.

The row dot (`simd.ternary`) pairs each weight byte's leading-digit numbers A_n with
y_v = x_v - 3 x_(v + step): the activation of the value holding the byte's digit n, minus 3
times that of its digit n + 1 (step 32 for values 0..127 (qs[0:32]), 16 for 160..223
(qs[32:48]), 4 for 240..251 (qh); none for a byte's last digit), in the values' order but for
qh's 16, which go in the kernel's `QH_SLOTS` order. With the -sum(x) of each
super-block (the -1 of ternary values: ggml's `- bsums`), the integer sums are ggml's
(`ggml_vec_dot_tq1_0_q8_K`) exactly. The driver (`linear.row_drivers`: `mv_tq1_0`) makes them
once per call, before its row loop; a token's y and sum depend on that token alone.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from minfer.backends.cpu.kernels.simd.ternary import QH_SLOTS


@njit(inline="always")
def _run(x, y, first, end, step):
    """y[v] = x[v] - 3 x[v + step] for v in [first, end) (step 0: y[v] = x[v])."""
    if step:
        for v in range(first, end):
            y[v] = np.int16(x[v]) - np.int16(3) * np.int16(x[v + step])
    else:
        for v in range(first, end):
            y[v] = np.int16(x[v])


@njit(cache=True)
def tq1_activation(xq, bsums):
    """(y int16 [nt, n], -sum(x) int32 [nt, n/256]) of Q8_K codes xq int8 [nt, n] and their
    16-value sums bsums int16 [nt, n/16]."""
    nt, n = xq.shape
    # 64-byte aligned (numba's arrays are 32): the kernel's zmm loads of y then split no line
    buf = np.empty(nt * n + 32, np.int16)
    off = (64 - buf.ctypes.data % 64) % 64 // 2
    y = buf[off:off + nt * n].reshape((nt, n))
    neg = np.empty((nt, n // 256), np.int32)
    for t in range(nt):
        for b in range(0, n, 256):
            x, yb = xq[t, b:b + 256], y[t, b:b + 256]
            _run(x, yb, 0, 128, 32)  # qs[0:32]: values m, 32 + m, .., 128 + m
            _run(x, yb, 128, 160, 0)
            _run(x, yb, 160, 224, 16)  # qs[32:48]: 160 + m, 176 + m, .., 224 + m
            _run(x, yb, 224, 240, 0)
            for j in range(16):  # qh byte m's digit k (value 240 + 4 k + m) in QH_SLOTS order
                m, k = QH_SLOTS[j]
                v = 240 + 4 * k + m
                nxt = np.int16(x[v + 4]) if k < 3 else np.int16(0)
                yb[240 + j] = np.int16(x[v]) - np.int16(3) * nxt
            s = np.int32(0)
            for j in range(b // 16, b // 16 + 16):
                s += np.int32(bsums[t, j])
            neg[t, b // 256] = -s
    return y, neg
