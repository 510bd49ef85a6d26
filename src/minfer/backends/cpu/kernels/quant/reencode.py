"""Re-encodings of weight types into wider ones that have fast integer kernels (`widen`).

- IQ4_NL → Q8_0: a block's 4-bit codes index 16 int8 levels, so the block is exactly a Q8_0
  block with the same d and the levels as its quants (34 bytes instead of 18). The Q8_0 dot
  then computes ggml's IQ4_NL dot: d_w * d_x * sum(level * q_x).
- Q3_K → Q6_K: value = d * (sc - 32) * q3 with q3 in -4..3 per 16 values is exactly Q6_K's
  d * sc8 * (q6 - 32) with sc8 = sc - 32 and q6 = q3 + 32 (210 bytes instead of 110).
- TQ1_0, TQ2_0, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M → Q6_K: their integer form d * sc * q
  (`quant.iquants.iq_form`; |q| <= 31, sc <= 31) is a Q6_K block with d as its f16 scale. The
  Q6_K dot with a Q8_K activation forms the same integer sums as ggml's dots of these types
  (which read Q8_K too; IQ1's delta is the q = 8 * grid +- 1 of d/8), so results agree to f32
  summation order. d is ggml's f16 scale over 1, 2 or 8, exact in f16 unless it falls below
  f16's normal range (ggml d < 2^-11); a weight with such a block goes to Q7_K instead.
- IQ2_XXS, IQ2_XS, IQ2_S → Q7_K (minfer's layout, `quant.types`): lattice values up to 43 need
  7-bit codes; d/8 kept as f32. Exact, as above (276 bytes for 66..82).
- MXFP4 → Q8_0: 2^(e - 128) is an f16 for 104 <= e <= 143 and the doubled E2M1 values are
  int8, so the block is Q8_0's with the same Q8_0 activation ggml's MXFP4 dot takes: exact.
  Scales below 2^-24 round to f16 (|error| <= 12 * 2^-25 per weight; all-zero blocks, e = 0,
  stay exact); a scale over 2^15 is refused.
- IQ4_XS → Q8_0, NOT exact: per 32 values d_w' = f16(d * (ls - 32)) (|d_w' - d*(ls-32)| <=
  2^-11 |d * (ls-32)|, or 2^-25 below f16's normal range), quants the int8 levels, and a Q8_0
  activation (per-32 scales) where ggml's IQ4_XS dot takes Q8_K (per-256). Against the exact
  product of the weight with that Q8_0 activation the result is off by at most
  2^-11 * sum |w| |x_q8_0| + 2^-25 * sum |q_w| |x_q8_0| plus f32 rounding
  (`tests/test_kernels_iquants.py` checks this bound); against ggml's dot it differs further
  by the two activation roundings (Q8_0's is the finer one). An exact form needs 8-bit codes
  with per-32 integer scales, which no fast kernel here reads.

The CPU backend binds these weights once (`linear.dispatch.bind_prequant`) and runs the copy
through the hand-vectorized Q8_0 / Q6_K / Q7_K kernels: 1.5-4x the weight memory, an order of
magnitude faster than dotting the narrow types in plain loops.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.quant.iquants import IQ_SIZES, MXFP4_LEVELS, e8m0_half, iq_form
from minfer.backends.cpu.kernels.quant.types import QType
from minfer.backends.cpu.kernels.simd.llvm import bits_of_f32, f16_to_f32, f32_to_f16
from minfer.errors import ModelError

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


@njit(inline="always")
def _q6_codes(L, dst, o):
    """The ql / qh bytes of the Q6_K block at byte `o` from its 256 codes L (0..63)."""
    for half in range(2):
        j0 = 128 * half
        for m in range(32):
            dst[o + 64 * half + m] = np.uint8((L[j0 + m] & 15) | ((L[j0 + m + 64] & 15) << 4))
            dst[o + 64 * half + 32 + m] = np.uint8((L[j0 + m + 32] & 15)
                                                   | ((L[j0 + m + 96] & 15) << 4))
            dst[o + 128 + 32 * half + m] = np.uint8(
                (L[j0 + m] >> 4) | ((L[j0 + m + 32] >> 4) << 2)
                | ((L[j0 + m + 64] >> 4) << 4) | ((L[j0 + m + 96] >> 4) << 6))


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
            _q6_codes(L, dst, o)


def q3_k_to_q6_k(w: np.ndarray) -> np.ndarray:
    """uint8 [n_out, nb*110] Q3_K rows → uint8 [n_out, nb*210] Q6_K rows, exactly."""
    out = np.empty((w.shape[0], w.shape[1] // 110 * 210), np.uint8)
    _q3_k_to_q6_k(w, out)
    return out


@njit(parallel=True, cache=True)
def _iq_to_k(w, qtype, size, out, seven, exact):
    """Rows of 256-value blocks of `qtype` → Q6_K (exact[r] = 0 where a block's d is no f16)
    or (`seven`) Q7_K rows, from `iq_form`."""
    osize = 276 if seven else 210
    for r in prange(w.shape[0]):
        sc = np.empty(16, np.int32)
        q = np.empty(256, np.int32)
        row = w[r]
        dst = out[r]
        exact[r] = 1
        for b in range(w.shape[1] // size):
            d = iq_form(row, b * size, qtype, sc, q)
            o = b * osize
            if seven:
                for j in range(256):
                    dst[o + j] = np.uint8(q[j] + 64)
                for j in range(16):
                    dst[o + 256 + j] = np.uint8(sc[j] & 255)
                bits = bits_of_f32(d)
                for k in range(4):
                    dst[o + 272 + k] = np.uint8((bits >> np.uint32(8 * k)) & np.uint32(255))
                continue
            for j in range(256):
                q[j] += 32
            _q6_codes(q, dst, o)
            for j in range(16):
                dst[o + 192 + j] = np.uint8(sc[j] & 255)
            h = f32_to_f16(d)
            if f16_to_f32(h) != d:
                exact[r] = 0
            dst[o + 208] = np.uint8(h & np.uint16(255))
            dst[o + 209] = np.uint8(h >> np.uint16(8))


@njit(parallel=True, cache=True)
def _iq_to_q8_0(w, qtype, size, out):
    """Rows of 256-value blocks whose scales are per 32 values → Q8_0, d rounded to f16."""
    for r in prange(w.shape[0]):
        sc = np.empty(16, np.int32)
        q = np.empty(256, np.int32)
        for b in range(w.shape[1] // size):
            d = iq_form(w[r], b * size, qtype, sc, q)
            for g in range(8):
                o = (8 * b + g) * 34
                h = f32_to_f16(d * np.float32(sc[2 * g]))
                out[r, o] = np.uint8(h & np.uint16(255))
                out[r, o + 1] = np.uint8(h >> np.uint16(8))
                for j in range(32):
                    out[r, o + 2 + j] = np.uint8(q[32 * g + j] & 255)


@njit(parallel=True, cache=True)
def _mxfp4_to_q8_0(w, out, levels):
    for r in prange(w.shape[0]):
        for b in range(w.shape[1] // 17):
            h = f32_to_f16(e8m0_half(np.int32(w[r, 17 * b])))
            out[r, 34 * b] = np.uint8(h & np.uint16(255))
            out[r, 34 * b + 1] = np.uint8(h >> np.uint16(8))
            for j in range(16):
                c = w[r, 17 * b + 1 + j]
                out[r, 34 * b + 2 + j] = levels[c & np.uint8(15)]
                out[r, 34 * b + 18 + j] = levels[c >> np.uint8(4)]


_MXFP4_Q8 = MXFP4_LEVELS.view(np.uint8)
_Q6_K_TARGETS = frozenset({QType.TQ1_0, QType.TQ2_0, QType.IQ3_XXS, QType.IQ3_S, QType.IQ1_S,
                           QType.IQ1_M})


def widen(w: np.ndarray, qt: QType) -> tuple[np.ndarray, QType]:
    """The weight (uint8 rows of type qt) as the fast kernels read it: the re-encoded copy and
    its type for the types above, else w and qt themselves."""
    if qt is QType.IQ4_NL:
        return iq4_nl_to_q8_0(w), QType.Q8_0
    if qt is QType.Q3_K:
        return q3_k_to_q6_k(w), QType.Q6_K
    if qt is QType.MXFP4:
        if w.size and int(w.reshape(-1, 17)[:, 0].max()) > 143:
            raise ModelError("MXFP4 weight has a block scale over 2^15, beyond f16")
        out = np.empty((w.shape[0], w.shape[1] // 17 * 34), np.uint8)
        _mxfp4_to_q8_0(w, out, _MXFP4_Q8)
        return out, QType.Q8_0
    if qt not in IQ_SIZES:
        return w, qt
    size = IQ_SIZES[qt]
    nb = w.shape[1] // size
    if qt is QType.IQ4_XS:
        out = np.empty((w.shape[0], nb * 8 * 34), np.uint8)
        _iq_to_q8_0(w, int(qt), size, out)
        return out, QType.Q8_0
    exact = np.empty(w.shape[0], np.uint8)
    if qt in _Q6_K_TARGETS:
        out = np.empty((w.shape[0], nb * 210), np.uint8)
        _iq_to_k(w, int(qt), size, out, False, exact)
        if exact.all():
            return out, QType.Q6_K
    out = np.empty((w.shape[0], nb * 276), np.uint8)
    _iq_to_k(w, int(qt), size, out, True, exact)
    return out, QType.Q7_K
