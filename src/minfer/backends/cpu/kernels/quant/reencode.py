"""Exact re-encodings of weight types into wider ones that have fast integer kernels.

- IQ4_NL → Q8_0: a block's 4-bit codes index 16 int8 levels, so the block is exactly a Q8_0
  block with the same d and the levels as its quants (34 bytes instead of 18). The Q8_0 dot
  then computes ggml's IQ4_NL dot: d_w * d_x * sum(level * q_x).
- Q3_K → Q6_K: value = d * (sc - 32) * q3 with q3 in -4..3 per 16 values is exactly Q6_K's
  d * sc8 * (q6 - 32) with sc8 = sc - 32 and q6 = q3 + 32 (210 bytes instead of 110).

The CPU backend binds these weights once (`linear.dispatch.bind_prequant`) and runs the copy
through the
hand-vectorized Q8_0 / Q6_K kernels: ~1.9x the weight memory, an order of magnitude faster than
dotting the narrow types in plain loops.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   dtype=np.int8).view(np.uint8)


@njit(parallel=True, cache=True)
def _iq4_nl_to_q8_0(w, out, levels):
    for r in prange(w.shape[0]):
        for b in range(w.shape[1] // 18):
            src = b * 18
            dst = b * 34
            out[r, dst] = w[r, src]
            out[r, dst + 1] = w[r, src + 1]
            for j in range(16):
                q = w[r, src + 2 + j]
                out[r, dst + 2 + j] = levels[q & np.uint8(15)]
                out[r, dst + 18 + j] = levels[q >> np.uint8(4)]


def iq4_nl_to_q8_0(w: np.ndarray) -> np.ndarray:
    """uint8 [n_out, nb*18] IQ4_NL rows → uint8 [n_out, nb*34] Q8_0 rows, exactly."""
    out = np.empty((w.shape[0], w.shape[1] // 18 * 34), np.uint8)
    _iq4_nl_to_q8_0(w, out, _LEVELS)
    return out


@njit(inline="always")
def _q3_codes(w, base, L):
    """L[v] = q3 + 32 for the 256 values of the Q3_K block at `base`."""
    for c in range(2):
        for s in range(4):
            bit = np.uint8(1 << (4 * c + s))
            for h in range(2):
                for m in range(16):
                    q = np.int32((w[base + 32 + 32 * c + 16 * h + m] >> np.uint8(2 * s))
                                 & np.uint8(3))
                    if not (w[base + 16 * h + m] & bit):
                        q -= 4
                    L[128 * c + 32 * s + 16 * h + m] = q + 32


@njit(parallel=True, cache=True)
def _q3_k_to_q6_k(w, out):
    for r in prange(w.shape[0]):
        L = np.empty(256, np.int32)
        row = w[r]
        dst = out[r]
        for b in range(w.shape[1] // 110):
            base = b * 110
            o = b * 210
            _q3_codes(row, base, L)
            for j in range(16):
                low = (row[base + 96 + j] & np.uint8(15)) if j < 8 else (
                    row[base + 96 + j - 8] >> np.uint8(4))
                high = (row[base + 104 + j % 4] >> np.uint8(2 * (j // 4))) & np.uint8(3)
                dst[o + 192 + j] = np.uint8((np.int32(low | (high << np.uint8(4))) - 32) & 0xFF)
            dst[o + 208] = row[base + 108]
            dst[o + 209] = row[base + 109]
            for half in range(2):
                j0 = 128 * half
                for m in range(32):
                    dst[o + 64 * half + m] = np.uint8((L[j0 + m] & 15)
                                                      | ((L[j0 + m + 64] & 15) << 4))
                    dst[o + 64 * half + 32 + m] = np.uint8((L[j0 + m + 32] & 15)
                                                           | ((L[j0 + m + 96] & 15) << 4))
                    dst[o + 128 + 32 * half + m] = np.uint8(
                        (L[j0 + m] >> 4) | ((L[j0 + m + 32] >> 4) << 2)
                        | ((L[j0 + m + 64] >> 4) << 4) | ((L[j0 + m + 96] >> 4) << 6))


def q3_k_to_q6_k(w: np.ndarray) -> np.ndarray:
    """uint8 [n_out, nb*110] Q3_K rows → uint8 [n_out, nb*210] Q6_K rows, exactly."""
    out = np.empty((w.shape[0], w.shape[1] // 110 * 210), np.uint8)
    _q3_k_to_q6_k(w, out)
    return out
