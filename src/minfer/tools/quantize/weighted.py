"""ggml's quantizers with an importance matrix (`quantize_row_*_impl` with quant_weights).

What llama.cpp runs when `llama-quantize --imatrix` gives a tensor its importance vector qw
(one weight per column: the mean squared activation of that input, see `imatrix`), ported
operation by operation from ggml-quants.c as `blocks32` and `kquants` port the reference ones
(f32 in C's order, C's integer truncations). Each `*_row_w(x, qw, out)` quantizes one row
with the row's importance vector qw (as long as the row):

- Q4_0 / Q5_0: make_qx_quants per 32-block with weights qw * sqrt(sigma2 + x^2), sigma2 the
  row's mean square; Q4_1 / Q5_1: make_qkx3_quants (a min and a scale) with those weights.
- Q2_K: make_qkx3_quants per 16 values, then the 16 scales and mins themselves quantized by
  make_qp_quants weighted by each sub-block's total weight; Q4_K / Q5_K alike per 32 values
  (sigma2 twice the block's mean square); Q3_K: make_qx_quants per 16 values and over the
  scales; Q6_K: the reference with qw as make_qx_quants' weights; IQ4_NL: its impl with
  qw * sqrt(sigma2 + x^2) (`blocks32.iq4_nl_rows`); IQ4_XS likewise, sigma2 over its 256
  values (`kquants.iq4_xs_rows`).

make_qkx3_quants with weights is make_qkx2_quants (`kquants`): the same operations.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .blocks32 import _put_u32, iq4_nl_rows, put_f16
from .kquants import (
    GROUP_MAX_EPS,
    _q2_k_codes,
    _q3_k_codes,
    _q4_k_codes,
    _q5_k_codes,
    _q45_k_requantize,
    _q45_k_scale_min,
    iq4_xs_rows,
    make_qkx2_quants,
    make_qx_quants,
    nearest_int,
    q6_k_rows,
)

F = np.float32


@njit(inline="always", error_model="numpy")
def make_qp_quants(n, nmax, x, L, qw):
    """make_qp_quants(n, nmax, x, L, quant_weights): non-negative x on 0..nmax codes (L is
    uint8 in C: stores keep the low byte)."""
    mx = F(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F(0.0)
    iscale = F(nmax) / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = F(1.0) / iscale
    best_mse = F(0.0)
    for i in range(n):
        diff = x[i] - scale * F(L[i])
        best_mse += qw[i] * diff * diff
    for ist in range(-4, 5):
        if ist == 0:
            continue
        iscale_is = (F(0.1) * F(ist) + F(nmax)) / mx
        scale_is = F(1.0) / iscale_is
        mse = F(0.0)
        for i in range(n):
            lv = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F(lv)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(n):
        lv = min(nmax, nearest_int(iscale * x[i]))
        L[i] = lv & 0xFF
        w = qw[i]
        sumlx += w * x[i] * F(lv)
        suml2 += w * F(lv) * F(lv)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            li = F(L[i])
            slx = sumlx - w * x[i] * li
            sl2 = suml2 - w * li * li
            if slx > F(0.0) and sl2 > F(0.0):
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w * x[i] * F(new_l)
                    sl2 += w * F(new_l) * F(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > F(0.0) else F(0.0)


@njit(inline="always", error_model="numpy")
def _sum_squares(x, b, n):
    total = F(0.0)
    for j in range(n):
        total += x[b + j] * x[b + j]
    return total


@njit(inline="always", error_model="numpy")
def _weights(x, qw, b, n, sigma2, weight):
    """weight[j] = qw[b+j] * sqrt(sigma2 + x[b+j]^2); returns their sum."""
    total = F(0.0)
    for j in range(n):
        weight[j] = qw[b + j] * np.sqrt(sigma2 + x[b + j] * x[b + j])
        total += weight[j]
    return total


# -- 32-value blocks -----------------------------------------------------------------------------

@njit(error_model="numpy")
def q4_0_row_w(x, qw, out):
    _signed_rows(x, qw, out, 8, 18)


@njit(error_model="numpy")
def q5_0_row_w(x, qw, out):
    _signed_rows(x, qw, out, 16, 22)


@njit(inline="always", error_model="numpy")
def _signed_rows(x, qw, out, nmax, size):
    """quantize_row_q4_0_impl (nmax 8) / q5_0_impl (nmax 16)."""
    weight = np.zeros(32, dtype=np.float32)
    L = np.zeros(32, dtype=np.int64)
    sigma2 = _sum_squares(x, 0, x.shape[0]) / F(x.shape[0])
    for ib in range(x.shape[0] // 32):
        b = 32 * ib
        o = size * ib
        _weights(x, qw, b, 32, sigma2, weight)
        put_f16(out, o, make_qx_quants(32, nmax, x[b:b + 32], L, weight, True))
        _put_codes(L, out, o, nmax == 16)


@njit(error_model="numpy")
def q4_1_row_w(x, qw, out):
    _min_rows(x, qw, out, 15, 20)


@njit(error_model="numpy")
def q5_1_row_w(x, qw, out):
    _min_rows(x, qw, out, 31, 24)


@njit(inline="always", error_model="numpy")
def _min_rows(x, qw, out, nmax, size):
    """quantize_row_q4_1_impl (nmax 15) / q5_1_impl (nmax 31): d, m = -min, codes."""
    weight = np.zeros(32, dtype=np.float32)
    L = np.zeros(32, dtype=np.int64)
    Laux = np.zeros(32, dtype=np.int64)
    sigma2 = _sum_squares(x, 0, x.shape[0]) / F(x.shape[0])
    for ib in range(x.shape[0] // 32):
        b = 32 * ib
        o = size * ib
        _weights(x, qw, b, 32, sigma2, weight)
        d, the_min = make_qkx2_quants(32, nmax, x[b:b + 32], weight, L, Laux, F(-0.9),
                                      F(0.05), 36, False)
        put_f16(out, o, d)
        put_f16(out, o + 2, -the_min)
        _put_codes(L, out, o + 2, nmax == 31)


@njit(inline="always", error_model="numpy")
def _put_codes(L, out, o, five_bits):
    """qs (low nibbles; 32-block codes j and j+16 share a byte) after the 2-byte d at o, and
    for 5-bit codes the u32 of fifth bits before them."""
    qs = o + 6 if five_bits else o + 2
    qh = np.uint32(0)
    for j in range(16):
        xi0 = L[j]
        xi1 = L[j + 16]
        out[qs + j] = np.uint8((xi0 & 0x0F) | ((xi1 & 0x0F) << 4))
        qh |= np.uint32((xi0 & 0x10) >> 4) << np.uint32(j)
        qh |= np.uint32((xi1 & 0x10) >> 4) << np.uint32(j + 16)
    if five_bits:
        _put_u32(out, o + 2, qh)


# -- K-quants ------------------------------------------------------------------------------------

@njit(error_model="numpy")
def q2_k_row_w(x, qw, out):
    """quantize_row_q2_K_impl: block_q2_K scales[16], qs[64], d, dmin."""
    L = np.zeros(256, dtype=np.int64)
    Laux = np.zeros(16, dtype=np.int64)
    Ls = np.zeros(16, dtype=np.int64)
    Lm = np.zeros(16, dtype=np.int64)
    weight = np.zeros(16, dtype=np.float32)
    sw = np.zeros(16, dtype=np.float32)
    scales = np.zeros(16, dtype=np.float32)
    mins = np.zeros(16, dtype=np.float32)
    for i in range(x.shape[0] // 256):
        b = 256 * i
        o = 84 * i
        sigma2 = _sum_squares(x, b, 256) / F(256.0)
        for j in range(16):
            lo = b + 16 * j
            sw[j] = _weights(x, qw, lo, 16, sigma2, weight)
            scales[j], mins[j] = make_qkx2_quants(16, 3, x[lo:lo + 16], weight,
                                                  L[16 * j:16 * j + 16], Laux, F(-0.9),
                                                  F(0.05), 36, False)
        dm = make_qp_quants(16, 15, scales, Ls, sw)
        mm = make_qp_quants(16, 15, mins, Lm, sw)
        put_f16(out, o + 80, dm)
        put_f16(out, o + 82, mm)
        for j in range(16):
            out[o + j] = np.uint8((Ls[j] | (Lm[j] << 4)) & 0xFF)
        _q2_k_codes(x, b, L, out, o)


@njit(error_model="numpy")
def q3_k_row_w(x, qw, out):
    """quantize_row_q3_K_impl: block_q3_K hmask[32], qs[64], scales[12], d."""
    L = np.zeros(256, dtype=np.int64)
    Ls = np.zeros(16, dtype=np.int64)
    weight = np.zeros(16, dtype=np.float32)
    sw = np.zeros(16, dtype=np.float32)
    scales = np.zeros(16, dtype=np.float32)
    for i in range(x.shape[0] // 256):
        b = 256 * i
        o = 110 * i
        sc_off = o + 96
        sigma2 = F(2.0) * _sum_squares(x, b, 256) / F(256.0)
        for j in range(16):
            lo = b + 16 * j
            sw[j] = _weights(x, qw, lo, 16, sigma2, weight)
            scales[j] = make_qx_quants(16, 4, x[lo:lo + 16], L[16 * j:16 * j + 16], weight,
                                       True)
        for k in range(12):
            out[sc_off + k] = 0
        d_block = make_qx_quants(16, 32, scales, Ls, sw, True)
        for j in range(16):
            lv = Ls[j]
            if j < 8:
                out[sc_off + j] = np.uint8(lv & 0xF)
            else:
                out[sc_off + j - 8] |= np.uint8((lv & 0xF) << 4)
            lv >>= 4
            out[sc_off + j % 4 + 8] |= np.uint8((lv << (2 * (j // 4))) & 0xFF)
        put_f16(out, o + 108, d_block)
        _q3_k_codes(x, b, out, o, L)


@njit(inline="always", error_model="numpy")
def _q45_k_rows(x, qw, out, nmax, size, clamp):
    """quantize_row_q4_K_impl (nmax 15) / q5_K_impl (nmax 31, scales clamped to 63): the
    header, L left in the returned array for the caller's code packing."""
    L = np.zeros(256, dtype=np.int64)
    Laux = np.zeros(32, dtype=np.int64)
    Ls = np.zeros(8, dtype=np.int64)
    Lm = np.zeros(8, dtype=np.int64)
    weight = np.zeros(32, dtype=np.float32)
    sw = np.zeros(8, dtype=np.float32)
    scales = np.zeros(8, dtype=np.float32)
    mins = np.zeros(8, dtype=np.float32)
    for i in range(x.shape[0] // 256):
        b = 256 * i
        o = size * i
        sigma2 = F(2.0) * _sum_squares(x, b, 256) / F(256.0)
        for j in range(8):
            lo = b + 32 * j
            sw[j] = _weights(x, qw, lo, 32, sigma2, weight)
            scales[j], mins[j] = make_qkx2_quants(32, nmax, x[lo:lo + 32], weight,
                                                  L[32 * j:32 * j + 32], Laux, F(-0.9),
                                                  F(0.05), 36, False)
        d_block = make_qp_quants(8, 63, scales, Ls, sw)
        m_block = make_qp_quants(8, 63, mins, Lm, sw)
        for k in range(12):
            out[o + 4 + k] = 0
        for j in range(8):
            ls = min(63, Ls[j]) if clamp else Ls[j]
            lm = min(63, Lm[j]) if clamp else Lm[j]
            _q45_k_scale_min(out, o, j, ls, lm)
        put_f16(out, o, d_block)
        put_f16(out, o + 2, m_block)
        _q45_k_requantize(x, b, out, o, nmax, L)
        if clamp:
            _q5_k_codes(L, out, o)
        else:
            _q4_k_codes(L, out, o)


@njit(error_model="numpy")
def q4_k_row_w(x, qw, out):
    _q45_k_rows(x, qw, out, 15, 144, False)


@njit(error_model="numpy")
def q5_k_row_w(x, qw, out):
    _q45_k_rows(x, qw, out, 31, 176, True)


@njit(error_model="numpy")
def q6_k_row_w(x, qw, out):
    q6_k_rows(x, qw, True, out)


@njit(error_model="numpy")
def iq4_nl_row_w(x, qw, out):
    iq4_nl_rows(x, qw, True, out)


@njit(error_model="numpy")
def iq4_xs_row_w(x, qw, out):
    iq4_xs_rows(x, qw, True, out)
