"""The Q2_K integer dot against Q8_K activations, in plain numba loops.

(Q3_K, another type `minfer quantize` adds, is re-encoded exactly into Q6_K and runs through
its vectorized kernel, see `quant.reencode`; IQ4_NL has its own, `simd.blocks`. Q2_K's per-16
mins have no such exact wider form.)

The integer part is ggml's (`ggml_vec_dot_q2_K_q8_K`): per 16-value sub-block, scale *
(codes . int8 quants), summed exactly in integers per super-block; the mins are dotted with the
activation's 16-value `bsums`. The float part per super-block is `d_x * d_w * isum - d_x *
dmin_w * summs` accumulated in f32 (order differs from ggml's SIMD lanes: agreement to f32
rounding). Not the hand-written row intrinsics of `simd.kquants`: about 10x slower than Q4_K per
byte.

Value v of a super-block (v = 128c + 32s + 16h + l) has code `(qs[32c + 16h + l] >> 2s) & 3`
and scale index 8c + 2s + h = v // 16 (Q3_K alike; its third bit is bit 4c + s of
hmask[16h + l], clear meaning minus 4).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.linear.dots32 import _CHUNK, even_groups, load_f16


@njit(inline="always")
def _dot_q2_k(w, xq, xd, bsums, t):
    acc = np.float32(0.0)
    for i in range(w.shape[0] // 84):
        base = i * 84
        summs = np.int32(0)
        for j in range(16):
            summs += np.int32(bsums[t, 16 * i + j]) * np.int32(w[base + j] >> np.uint8(4))
        isum = np.int32(0)
        for c in range(2):
            for s in range(4):
                for h in range(2):
                    q = base + 16 + 32 * c + 16 * h
                    x0 = 256 * i + 128 * c + 32 * s + 16 * h
                    part = np.int32(0)
                    for m in range(16):
                        code = (w[q + m] >> np.uint8(2 * s)) & np.uint8(3)
                        part += np.int32(xq[t, x0 + m]) * np.int32(code)
                    isum += np.int32(w[base + 8 * c + 2 * s + h] & np.uint8(15)) * part
        dall = xd[t, i] * load_f16(w, base + 80)
        dmin = xd[t, i] * load_f16(w, base + 82)
        acc += dall * np.float32(isum) - dmin * np.float32(summs)
    return acc


@njit(parallel=True, cache=True)
def mv_q2_k(w, xq, xd, bsums, out):
    n_out, nt = w.shape[0], xq.shape[0]
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        r1 = min(n_out, c * _CHUNK + _CHUNK)
        for t in range(nt):  # the chunk's rows stay in cache across tokens
            for r in range(c * _CHUNK, r1):
                out[t, r] = _dot_q2_k(w[r], xq, xd, bsums, t)


@njit(parallel=True, cache=True)
def mv_q2_k_x(w3, groups, n_groups, xq, xd, bsums, out):
    """mv_q2_k over stacked experts (the row drivers' `_x` form)."""
    n_out, ng = w3.shape[1], n_groups[0]
    n_chunk = (n_out + _CHUNK - 1) // _CHUNK
    even = even_groups(groups, ng)
    for job in prange(n_chunk * ng):
        g, c = (job // n_chunk, job % n_chunk) if even else (job % ng, job // ng)
        w = w3[groups[g, 0]]
        r1 = min(n_out, c * _CHUNK + _CHUNK)
        for t in range(groups[g, 1], groups[g, 2]):
            for r in range(c * _CHUNK, r1):
                out[t, r] = _dot_q2_k(w[r], xq, xd, bsums, t)
