"""Re-encodings of weight types into wider ones that have fast integer kernels (`widen`).

(IQ4_NL, IQ4_XS and MXFP4, 4-bit codes of int8 levels, are not widened: their own kernels look
the levels up, `simd.blocks._lookup`, and read the file's blocks. Nor are TQ2_0, whose 2-bit codes
are Q2_K's layout, dotted by Q2_K's vector kernel with unit scales (`simd.kquants`), and TQ1_0,
whose base-3 bytes its kernel `simd.ternary` dots as they are. Nor, by default, are the
READ_DIRECT types (IQ2_XXS, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S; `reads_direct`): their kernels
(`simd.iquants`) fetch the grid rows from the file's blocks, and for long calls expand one group
of 16 rows at a time into a Q7_K_PACKED scratch: the file's bytes held (1/4.2 of IQ2_XXS's
copy, 1/2.8 of IQ3_XXS's, 1/1.9 of IQ3_S's, 1/3.7 of IQ2_XS's; the 1.5B imatrix files' RSS
1,056 / 1,383 MiB against 2,143 / 2,335 widened for IQ2_XXS / IQ3_XXS), at 2-3.7x the copy's
time per decode matmul (their grid and sign fetches are compute), 1.05-1.3x at 512 tokens. A
user picks these types to fit memory, so the file's blocks are the default; MINFER_IQ_WIDEN=1
widens them as below, speed over memory.)

- Q3_K → Q6_K: value = d * (sc - 32) * q3 with q3 in -4..3 per 16 values is exactly Q6_K's
  d * sc8 * (q6 - 32) with sc8 = sc - 32 and q6 = q3 + 32 (210 bytes instead of 110).
- IQ3_XXS, IQ3_S, IQ1_S, IQ1_M → Q6_K: their integer form d * sc * q
  (`quant.iquants.iq_form`; |q| <= 31, sc <= 31) is a Q6_K block with d as its f16 scale. The
  Q6_K dot with a Q8_K activation forms the same integer sums as ggml's dots of these types
  (which read Q8_K too; IQ1's delta is the q = 8 * grid +- 1 of d/8), so results agree to f32
  summation order. d is ggml's f16 scale over 1, 2 or 8, exact in f16 unless it falls below
  f16's normal range (ggml d < 2^-11); a weight with such a block goes to Q7_K instead. Small
  weights do: in llama-quantize's imatrix IQ3_XXS of Qwen2.5-Coder-1.5B most FFN blocks have
  d < 2^-13 (d/2 a subnormal f16, its last bit lost), so all 84 IQ3_XXS tensors run as Q7_K
  (its IQ3_S ones as Q6_K).
- IQ2_XXS, IQ2_XS, IQ2_S → Q7_K (minfer's layout, `quant.types`): lattice values up to 43 need
  7-bit codes; d/8 kept as f32. Exact, as above (276 bytes for 66..82).

The CPU backend binds these weights once (`linear.dispatch.bind_prequant`) and runs the copy
through the hand-vectorized Q6_K / Q7_K kernels: 1.5-4x the weight memory, an order of
magnitude faster than dotting the narrow types in plain loops. Where the rows are a multiple
of 16 it interleaves the copy (`linear.dispatch.repack_weight`: Q6_K_PACKED / Q7_K_PACKED,
`simd.interleaved_k`), which then replaces it: 2-3x faster at 512 tokens, as fast at one.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from minfer import env
from minfer.backends.cpu.kernels.quant.iquants import IQ_SIZES, iq_form
from minfer.backends.cpu.kernels.quant.types import QType
from minfer.backends.cpu.kernels.simd.llvm import bits_of_f32, f16_to_f32, f32_to_f16


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


# the types with kernels on the file's blocks (`simd.iquants`), run so unless MINFER_IQ_WIDEN
READ_DIRECT = frozenset({QType.IQ2_XXS, QType.IQ3_XXS, QType.IQ3_S, QType.IQ2_XS, QType.IQ2_S})


def reads_direct(qt: QType) -> bool:
    """Whether weights of this type are kept as the file's blocks, not widened: a READ_DIRECT
    type, unless MINFER_IQ_WIDEN is set (read at each call)."""
    return qt in READ_DIRECT and not env.flag("MINFER_IQ_WIDEN")


_Q6_K_TARGETS = frozenset({QType.IQ3_XXS, QType.IQ3_S, QType.IQ1_S, QType.IQ1_M})
# read in the file's blocks by their own kernels
_OWN_BLOCKS = frozenset({QType.IQ4_XS, QType.TQ1_0, QType.TQ2_0})


def widen(w: np.ndarray, qt: QType) -> tuple[np.ndarray, QType]:
    """The weight (uint8 rows of type qt) as the fast kernels read it: the re-encoded copy and
    its type for the types above, else w and qt themselves."""
    if qt is QType.Q3_K:
        return q3_k_to_q6_k(w), QType.Q6_K
    if qt not in IQ_SIZES or qt in _OWN_BLOCKS or reads_direct(qt):
        return w, qt
    size = IQ_SIZES[qt]
    nb = w.shape[1] // size
    exact = np.empty(w.shape[0], np.uint8)
    if qt in _Q6_K_TARGETS:
        out = np.empty((w.shape[0], nb * 210), np.uint8)
        _iq_to_k(w, int(qt), size, out, False, exact)
        if exact.all():
            return out, QType.Q6_K
    out = np.empty((w.shape[0], nb * 276), np.uint8)
    _iq_to_k(w, int(qt), size, out, True, exact)
    return out, QType.Q7_K
