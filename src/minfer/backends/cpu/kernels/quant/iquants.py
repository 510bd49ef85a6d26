"""The i-quants, the ternary types and MXFP4: their blocks as integers, and their f32 values.

Every 256-value type here is, per block, exactly `value[v] = d * sc[v // 16] * q[v]` with an
f32 d and small integers sc, q (`iq_form`, the one decoder of these layouts); dequantization
(`iq_values`) and the exact re-encodings into types with fast dots (`quant.reencode`) both read
that form. The products are exact in f32 (at most 24 significant bits), so the values are the
same bits as ggml's `dequantize_row_*` (and gguf.quants') whatever the order of the factors.

Byte layouts (ggml-common.h; little-endian, f16 = IEEE half; grids and ksigns: `iq_grids`):

  IQ2_XXS (66 B): d f16 | 8 x (u8 grid[4], u32 w: 4 x 7-bit ksigns indices | 4-bit ls << 28);
          v = d * (2 ls + 1) / 8 * iq2xxs_grid * sign              d/8, sc 2ls+1, |q| <= 43
  IQ2_XS  (74 B): d | u16 qs[32] (9-bit grid index | 7-bit ksigns << 9) | scales[8] (nibble per
          16 values)                                               d/8, sc 2ls+1, |q| <= 43
  IQ2_S   (82 B): d | qs[32] (grid low 8 bits) | signs[32] | qh[8] (2 high bits per 8 values) |
          scales[8]                                                d/8, sc 2ls+1, |q| <= 43
  IQ3_XXS (98 B): d | qs[64] (grid index per 4 values) | 8 x u32 (ksigns indices | ls << 28);
          v = d * (2 ls + 1) / 4 * iq3xxs_grid (all even) * sign  d/2, sc 2ls+1, |q| <= 31
  IQ3_S  (110 B): d | qs[64] | qh[8] (9th index bit) | signs[32] | scales[4] (nibble per 32)
          v = d * (2 ls + 1) * iq3s_grid * sign                    d, sc 2ls+1, |q| <= 15
  IQ1_S   (50 B): d | qs[32] | u16 qh[8] (3 index bits per 8 values, 3-bit ls, delta sign);
          v = d * (2 ls + 1) * (grid +- 1/8)                       d/8, sc 2ls+1, |q| <= 9
  IQ1_M   (56 B): qs[32] | qh[16] (3 index bits + delta sign per 8 values) | u16 scales[4]
          (3-bit ls per 16 values; d f16 from their top nibbles)   d/8, sc 2ls+1, |q| <= 9
  IQ4_XS (136 B): d | u16 scales_h | scales_l[4] (6-bit ls per 32) | qs[128] (nibbles as
          IQ4_NL); v = d * (ls - 32) * kvalues_iq4nl[code]         d, sc ls-32, |q| <= 127
  TQ1_0   (54 B): qs[48] | qh[4] (5 / 4 base-3 digits a byte) | d;  v = d * (digit - 1)
  TQ2_0   (66 B): qs[64] (2-bit codes) | d;                          v = d * (code - 1)
  MXFP4 (32 values, 17 B): e8m0 e | qs[16] (nibbles as IQ4_NL); v = 2^(e - 128) * e2m1x2[code]
"""

from __future__ import annotations

import numpy as np
from numba import njit

from minfer.backends.cpu.kernels.linear.dots32 import U, load_f16
from minfer.backends.cpu.kernels.quant.iq_grids import (
    IQ1S_GRID,
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    IQ4_LEVELS,
    KSIGNS,
    MXFP4_LEVELS,
)
from minfer.backends.cpu.kernels.simd.llvm import bits_to_f32, f16_to_f32

# GGML ids and block bytes of the 256-value types `iq_form` decodes
IQ_SIZES = {16: 66, 17: 74, 22: 82, 18: 98, 21: 110, 19: 50, 29: 56, 23: 136, 34: 54, 35: 66}
IQ_SIZE_PAIRS = tuple(IQ_SIZES.items())
_T = np.uint32


@njit(inline="always")
def _u16(w, at):
    return np.int32(w[at]) | (np.int32(w[at + U(1)]) << 8)


@njit(inline="always")
def _u32(w, at):
    return (_T(w[at]) | (_T(w[at + U(1)]) << _T(8)) | (_T(w[at + U(2)]) << _T(16))
            | (_T(w[at + U(3)]) << _T(24)))


@njit(inline="always")
def _put8(q, at, grid, idx, signs, n):
    """q[at + j] = grid[idx, j], negated where bit j of `signs` is set, for j < n."""
    for j in range(n):
        g = np.int32(grid[idx, j])
        q[at + j] = -g if (signs >> j) & 1 else g


@njit(inline="always")
def _iq2_xxs(w, b, sc, q, grid, half):
    """IQ2_XXS (grid 8 wide, aux32 words) and IQ3_XXS (`half`: grid 4 wide, values halved)."""
    n = 4 if half else 8
    wpos = b + U(66) if half else b + U(6)
    for g in range(8):
        aux = _u32(w, wpos + U(4 if half else 8) * g)
        for s in range(2):
            sc[2 * g + s] = np.int32(2 * (aux >> _T(28)) + 1)
        for k in range(4):
            signs = np.int32(KSIGNS[(aux >> _T(7 * k)) & _T(127)])
            for p in range(8 // n):
                idx = w[b + U(2) + U(8) * g + U(k * (8 // n) + p)] if half else (
                    w[b + U(2) + U(8) * g + U(k)])
                at = 32 * g + 8 * k + n * p
                _put8(q, at, grid, idx, signs >> (n * p), n)
        if half:
            for j in range(32):
                q[32 * g + j] //= 2  # the IQ3_XXS grid is all even: d/4 * g = d/2 * (g/2)


@njit(inline="always")
def iq_form(w, b, qtype, sc, q):
    """The block of GGML type `qtype` at byte `b` of row `w` as value = d * sc[v//16] * q[v]:
    fills sc (int32[16]) and q (int32[256]), returns d (f32; exactly ggml's scale over the
    power of two noted in the module docstring)."""
    if qtype == 16:  # IQ2_XXS
        _iq2_xxs(w, b, sc, q, IQ2XXS_GRID, False)
        return load_f16(w, b) * np.float32(0.125)
    if qtype == 18:  # IQ3_XXS
        _iq2_xxs(w, b, sc, q, IQ3XXS_GRID, True)
        return load_f16(w, b) * np.float32(0.5)
    if qtype == 17 or qtype == 22:  # IQ2_XS / IQ2_S: per-16 nibble scales
        s_at = b + U(66) if qtype == 17 else b + U(74)
        for j in range(16):
            ls = (w[s_at + U(j // 2)] >> np.uint8(4 * (j % 2))) & np.uint8(15)
            sc[j] = 2 * np.int32(ls) + 1
        for k in range(32):
            if qtype == 17:
                v = _u16(w, b + U(2) + U(2 * k))
                idx, signs = v & 511, np.int32(KSIGNS[v >> 9])
                _put8(q, 8 * k, IQ2XS_GRID, idx, signs, 8)
            else:
                hi = (np.int32(w[b + U(66) + U(k // 4)]) >> (2 * (k % 4))) & 3
                idx = np.int32(w[b + U(2) + U(k)]) | (hi << 8)
                _put8(q, 8 * k, IQ2S_GRID, idx, np.int32(w[b + U(34) + U(k)]), 8)
        return load_f16(w, b) * np.float32(0.125)
    if qtype == 21:  # IQ3_S
        for g in range(8):
            ls = (w[b + U(106) + U(g // 2)] >> np.uint8(4 * (g % 2))) & np.uint8(15)
            sc[2 * g] = sc[2 * g + 1] = 2 * np.int32(ls) + 1
            qh = np.int32(w[b + U(66) + U(g)])
            for k in range(8):
                idx = np.int32(w[b + U(2) + U(8 * g + k)]) | (((qh >> k) & 1) << 8)
                signs = np.int32(w[b + U(74) + U(4 * g + k // 2)]) >> (4 * (k % 2))
                _put8(q, 32 * g + 4 * k, IQ3S_GRID, idx, signs, 4)
        return load_f16(w, b)
    if qtype == 19 or qtype == 29:  # IQ1_S / IQ1_M: q = 8 * grid +- 1
        if qtype == 19:
            d = load_f16(w, b)
        else:
            bits = ((_u16(w, b + U(48)) >> 12) | ((_u16(w, b + U(50)) >> 8) & 0xF0)
                    | ((_u16(w, b + U(52)) >> 4) & 0xF00) | (_u16(w, b + U(54)) & 0xF000))
            d = f16_to_f32(np.uint16(bits))
        for k in range(32):  # groups of 8 values
            if qtype == 19:
                qh = _u16(w, b + U(34) + U(2 * (k // 4)))
                idx = np.int32(w[b + U(2) + U(k)]) | (((qh >> (3 * (k % 4))) & 7) << 8)
                neg = qh & 0x8000
                if k % 2 == 0:
                    sc[k // 2] = 2 * ((qh >> 12) & 7) + 1
            else:
                h = np.int32(w[b + U(32) + U(k // 2)]) >> (4 * (k % 2))
                idx = np.int32(w[b + U(k)]) | ((h & 7) << 8)
                neg = h & 8
                if k % 2 == 0:
                    s = _u16(w, b + U(48) + U(2 * (k // 8)))
                    sc[k // 2] = 2 * ((s >> (3 * ((k // 2) % 4))) & 7) + 1
            delta = -1 if neg else 1
            for j in range(8):
                q[8 * k + j] = 8 * np.int32(IQ1S_GRID[idx, j]) + delta
        return d * np.float32(0.125)
    if qtype == 23:  # IQ4_XS
        sh = _u16(w, b + U(2))
        for g in range(8):
            lo = (np.int32(w[b + U(4) + U(g // 2)]) >> (4 * (g % 2))) & 15
            sc[2 * g] = sc[2 * g + 1] = (lo | (((sh >> (2 * g)) & 3) << 4)) - 32
            for j in range(16):
                c = w[b + U(8) + U(16 * g + j)]
                q[32 * g + j] = np.int32(IQ4_LEVELS[c & np.uint8(15)])
                q[32 * g + 16 + j] = np.int32(IQ4_LEVELS[c >> np.uint8(4)])
        return load_f16(w, b)
    for j in range(16):  # TQ1_0 / TQ2_0: one scale
        sc[j] = 1
    if qtype == 35:
        for hf in range(2):
            for s in range(4):
                for m in range(32):
                    c = (np.int32(w[b + U(32 * hf + m)]) >> (2 * s)) & 3
                    q[128 * hf + 32 * s + m] = c - 1
        return load_f16(w, b + U(64))
    v = np.int32(0)  # TQ1_0: base-3 digits, most significant first, as ggml's (q * 3) >> 8 per byte
    for first, count, width in ((0, 32, 5), (32, 16, 5), (48, 4, 4)):
        for n in range(width):
            p3 = np.int32(3 ** n)
            for m in range(count):
                t = (np.int32(w[b + U(first + m)]) * p3) & 255
                q[v] = ((t * 3) >> 8) - 1
                v += np.int32(1)
    return load_f16(w, b + U(52))


@njit(inline="always")
def iq_values(w, y, qtype):
    """y[:] = the f32 values of a row `w` of 256-value blocks of GGML type `qtype`."""
    size = U(66)
    for t, s in IQ_SIZE_PAIRS:
        if t == qtype:
            size = U(s)
    sc = np.empty(16, np.int32)
    q = np.empty(256, np.int32)
    for i in range(U(y.shape[0] // 256)):
        d = iq_form(w, i * size, qtype, sc, q)
        for j in range(U(256)):
            y[i * U(256) + j] = (d * np.float32(sc[j // U(16)])) * np.float32(q[j])



@njit(inline="always")
def e8m0_half(e):
    """ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) as f32 (subnormal below e = 2)."""
    if e < 2:
        return bits_to_f32(np.uint32(0x00200000) << np.uint32(e))
    return bits_to_f32(np.uint32(e - 1) << np.uint32(23))


@njit(inline="always")
def mxfp4_values(w, y):
    """MXFP4: v = 2^(e - 128) * e2m1x2[code], low nibbles values 0..15, high 16..31."""
    for b in range(U(y.shape[0] // 32)):
        d = e8m0_half(np.int32(w[b * U(17)]))
        for j in range(U(16)):
            c = w[b * U(17) + U(1) + j]
            y[b * U(32) + j] = d * np.float32(MXFP4_LEVELS[c & np.uint8(15)])
            y[b * U(32) + U(16) + j] = d * np.float32(MXFP4_LEVELS[c >> np.uint8(4)])
