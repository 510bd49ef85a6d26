"""Integer dot kernels in plain numba loops: Q2_K and Q3_K (against Q8_K activations) and
IQ4_NL (against Q8_0 activations), the types `minfer quantize` adds.

IQ4_NL (32 values, 18 B: d f16 | qs[16], nibbles index ggml's 16 non-linear levels): per block
`d_x * d_w * sum(level[code] * q_x)`, as `ggml_vec_dot_iq4_nl_q8_0`.

The integer part is ggml's (`ggml_vec_dot_q2_K_q8_K` / `_q3_K_q8_K`): per 16-value sub-block,
scale * (codes . int8 quants), summed exactly in integers per super-block; Q2_K's mins are
dotted with the activation's 16-value `bsums`. The float part per super-block is
`d_x * d_w * isum` (minus `d_x * dmin_w * summs` for Q2_K) accumulated in f32 (order differs
from ggml's SIMD lanes: agreement to f32 rounding). Plain numba loops (LLVM vectorizes the
16-wide inner products), not the hand-written row intrinsics of `simd_k`: these types come from
`minfer quantize`'s low-bit mixes, where correctness matters more than the last 2x.

Value v of a super-block (v = 128c + 32s + 16h + l) has code `(qs[32c + 16h + l] >> 2s) & 3`
and scale index 8c + 2s + h = v // 16; Q3_K's third bit is bit 4c + s of hmask[16h + l]
(clear means minus 4).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .dot32 import _CHUNK, load_f16


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


@njit(inline="always")
def _q3_scale(w, s, j):
    """The j-th 6-bit scale of a Q3_K block (scales at byte s), minus 32."""
    low = (w[s + j] & np.uint8(15)) if j < 8 else (w[s + j - 8] >> np.uint8(4))
    high = (w[s + 8 + j % 4] >> np.uint8(2 * (j // 4))) & np.uint8(3)
    return np.int32(low | (high << np.uint8(4))) - 32


@njit(inline="always")
def _dot_q3_k(w, xq, xd, t):
    acc = np.float32(0.0)
    for i in range(w.shape[0] // 110):
        base = i * 110
        isum = np.int32(0)
        for c in range(2):
            for s in range(4):
                bit = np.uint8(1 << (4 * c + s))
                for h in range(2):
                    q = base + 32 + 32 * c + 16 * h
                    x0 = 256 * i + 128 * c + 32 * s + 16 * h
                    part = np.int32(0)
                    for m in range(16):
                        code = np.int32((w[q + m] >> np.uint8(2 * s)) & np.uint8(3))
                        if not (w[base + 16 * h + m] & bit):
                            code -= 4
                        part += np.int32(xq[t, x0 + m]) * code
                    isum += _q3_scale(w, base + 96, 8 * c + 2 * s + h) * part
        acc += xd[t, i] * load_f16(w, base + 108) * np.float32(isum)
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
def mv_q3_k(w, xq, xd, bsums, out):
    n_out, nt = w.shape[0], xq.shape[0]
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        r1 = min(n_out, c * _CHUNK + _CHUNK)
        for t in range(nt):
            for r in range(c * _CHUNK, r1):
                out[t, r] = _dot_q3_k(w[r], xq, xd, t)


IQ4NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        dtype=np.int32)


@njit(inline="always")
def _dot_iq4_nl(w, xq, xd, t, levels):
    acc = np.float32(0.0)
    for b in range(w.shape[0] // 18):
        base = b * 18
        isum = np.int32(0)
        for m in range(16):
            q = w[base + 2 + m]
            isum += levels[q & np.uint8(15)] * np.int32(xq[t, 32 * b + m])
            isum += levels[q >> np.uint8(4)] * np.int32(xq[t, 32 * b + 16 + m])
        acc += (load_f16(w, base) * xd[t, b]) * np.float32(isum)
    return acc


@njit(parallel=True, cache=True)
def mv_iq4_nl(w, xq, xd, xs, out):
    """xs (the Q8_0 activation's block sums) is unused: IQ4_NL has no offset to cancel."""
    n_out, nt = w.shape[0], xq.shape[0]
    levels = IQ4NL_LEVELS
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        r1 = min(n_out, c * _CHUNK + _CHUNK)
        for t in range(nt):
            for r in range(c * _CHUNK, r1):
                out[t, r] = _dot_iq4_nl(w[r], xq, xd, t, levels)
