"""ggml's reference K-quant quantizers (Q2_K … Q6_K), ported operation by operation.

These are `quantize_row_q{2..6}_K_ref` from ggml-quants.c with their scale searches:
Q2_K `make_qkx2_quants` (16 values, 2 bits, weights |x|, absolute error), Q3_K `make_q3_quants`
(16 values, iterative RMSE refinement), Q4_K / Q5_K `make_qkx2_quants` (32 values, weights
av|x| + |x|, squared error; Q4_K rmin -1 over 20 steps, Q5_K -0.5 over 15), Q6_K
`make_qx_quants` (16 values, rmse_type 1); IQ4_XS `quantize_row_iq4_nl_impl` over 256
values (eight IQ4_NL block searches under a 6-bit scale each). No importance matrix: llama.cpp
uses these exact functions when none is given. All arithmetic is f32 in C's order (see
blocks32's docstring). Each `*_row(x, out)` quantizes one row of a multiple of 256 values
into its bytes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from minfer.backends.cpu.kernels.simd.llvm import bits_of_f32, f16_to_f32

from .blocks32 import (
    IQ4NL_VALUES,
    _best_index_iq4nl,
    absmax_signed,
    i8,
    iq4_block_scale,
    iq4_weights,
    put_f16,
)

F = np.float32
GROUP_MAX_EPS = np.float32(1e-15)
QK_K = 256


@njit(inline="always", error_model="numpy")
def nearest_int(fval):
    """ggml's nearest_int: add 1.5*2^23 in f32 and read the mantissa (ties to even)."""
    val = fval + F(12582912.0)
    return np.int64(bits_of_f32(val) & np.uint32(0x007FFFFF)) - 0x00400000


@njit(inline="always", error_model="numpy")
def _f16_at(out, off):
    """GGML_FP16_TO_FP32 of the half just stored at out[off:off+2]."""
    return f16_to_f32(np.uint16(out[off]) | (np.uint16(out[off + 1]) << np.uint16(8)))


@njit(inline="always", error_model="numpy")
def _weight(x, qw, i, use_qw):
    """make_qx_quants' weight of value i: the importance weight when given, else x^2."""
    return qw[i] if use_qw else x[i] * x[i]


@njit(inline="always", error_model="numpy")
def _first_pass(n, nmax, x, L, shift, qw, use_qw):
    """The start both make_qx_quants and make_q3_quants share: (small, mx, sumlx, suml2). small:
    the group's largest |x| is under GROUP_MAX_EPS (L zeroed, the scale is 0). Otherwise L[i] =
    clamp(nearest_int(-nmax / mx * x[i]), -nmax, nmax - 1) + shift, mx the value of largest
    magnitude, with the weighted sums of l*x and l*l accumulated in ggml's order (weights qw[i]
    when use_qw, else x[i]^2)."""
    amax, mx = absmax_signed(x, 0, n)
    sumlx = F(0.0)
    suml2 = F(0.0)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return True, mx, sumlx, suml2
    iscale = F(-nmax) / mx
    for i in range(n):
        xi = x[i]
        lv = max(-nmax, min(nmax - 1, nearest_int(iscale * xi)))
        L[i] = lv + shift
        w = _weight(x, qw, i, use_qw)
        fl = F(lv)
        sumlx += w * xi * fl
        suml2 += w * fl * fl
    return False, mx, sumlx, suml2


@njit(inline="always", error_model="numpy")
def make_qx_quants(n, nmax, x, L, qw, use_qw):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw) on n-long views (qw is NULL unless
    use_qw); L gets codes + nmax."""
    small, mx, sumlx, suml2 = _first_pass(n, nmax, x, L, nmax, qw, use_qw)
    if small:
        return F(0.0)
    scale = sumlx / suml2 if suml2 != F(0.0) else F(0.0)
    best = scale * sumlx
    for ist in range(-9, 10):
        if ist == 0:
            continue
        iscale = -(F(nmax) + F(0.1) * F(ist)) / mx
        sumlx = F(0.0)
        suml2 = F(0.0)
        for i in range(n):
            xi = x[i]
            fl = F(max(-nmax, min(nmax - 1, nearest_int(iscale * xi))))
            w = _weight(x, qw, i, use_qw)
            sumlx += w * xi * fl
            suml2 += w * fl * fl
        if suml2 > F(0.0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(inline="always", error_model="numpy")
def make_q3_quants(n, nmax, x, L):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) on n-long views; L gets codes + nmax."""
    small, _, sumlx, suml2 = _first_pass(n, nmax, x, L, 0, x, False)
    if small:
        return F(0.0)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            xi = x[i]
            w = xi * xi
            li = F(L[i])
            slx = sumlx - w * xi * li
            if slx > F(0.0):
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, nearest_int(xi * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * xi * F(new_l)
                    sl2 += w * F(new_l) * F(new_l)
                    if sl2 > F(0.0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > F(0.0) else F(0.0)


@njit(inline="always", error_model="numpy")
def make_qkx2_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, …) → (scale, the_min)."""
    mn = x[0]
    mx = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        xi = x[i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        w = weights[i]
        sum_w += w
        sum_x += w * xi
    if mn > F(0.0):
        mn = F(0.0)
    if mx == mn:
        for i in range(n):
            L[i] = 0
        return F(0.0), -mn
    iscale = F(nmax) / (mx - mn)
    scale = F(1.0) / iscale
    best_error = F(0.0)
    for i in range(n):
        lv = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
        L[i] = lv
        diff = scale * F(lv) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    if nstep < 1:
        return scale, -mn
    for ist in range(nstep + 1):
        iscale = (rmin + rdelta * F(ist) + F(nmax)) / (mx - mn)
        sum_l = F(0.0)
        sum_l2 = F(0.0)
        sum_xl = F(0.0)
        for i in range(n):
            lv = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
            Laux[i] = lv
            w = weights[i]
            fl = F(lv)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if F(0.0) < D:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > F(0.0):
                this_min = F(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = F(0.0)
            for i in range(n):
                diff = this_scale * F(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(inline="always", error_model="numpy")
def _pack_2bit(L, out, qs):
    """qs[j/4 + l] = L[j+l] | L[j+l+32] << 2 | L[j+l+64] << 4 | L[j+l+96] << 6, j in (0, 128)."""
    for j in range(0, 256, 128):
        for m in range(32):
            out[qs + j // 4 + m] = np.uint8(L[j + m] | (L[j + m + 32] << 2)
                                            | (L[j + m + 64] << 4) | (L[j + m + 96] << 6))


@njit(inline="always", error_model="numpy")
def _q2_k_codes(x, b, L, out, o):
    """A Q2_K block's 2-bit codes against its stored scales and mins (each 4-bit value times
    the block's f16 d / dmin, as ggml re-derives them), packed into qs; shared by the plain
    and the importance-weighted quantizer."""
    d_all = _f16_at(out, o + 80)
    m_all = _f16_at(out, o + 82)
    for j in range(16):
        d = d_all * F(out[o + j] & np.uint8(0xF))
        if d == F(0.0):
            continue
        dm = m_all * F(out[o + j] >> np.uint8(4))
        for m in range(16):
            L[16 * j + m] = max(0, min(3, nearest_int((x[b + 16 * j + m] + dm) / d)))
    _pack_2bit(L, out, o + 16)


@njit(error_model="numpy")
def q2_k_row(x, out):
    """block_q2_K: scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin (84 bytes)."""
    L = np.zeros(256, dtype=np.int64)
    Laux = np.zeros(16, dtype=np.int64)
    weights = np.zeros(16, dtype=np.float32)
    mins = np.zeros(16, dtype=np.float32)
    scales = np.zeros(16, dtype=np.float32)
    q4scale = F(15.0)
    for i in range(x.shape[0] // 256):
        b = i * 256
        o = i * 84
        max_scale = F(0.0)
        max_min = F(0.0)
        for j in range(16):
            for m in range(16):
                weights[m] = abs(x[b + 16 * j + m])
            sc, mn = make_qkx2_quants(16, 3, x[b + 16 * j:b + 16 * j + 16], weights,
                                      L[16 * j:16 * j + 16], Laux, F(-0.5), F(0.1), 15, True)
            scales[j] = sc
            mins[j] = mn
            if sc > max_scale:
                max_scale = sc
            if mn > max_min:
                max_min = mn
        if max_scale > F(0.0):
            iscale = q4scale / max_scale
            for j in range(16):
                out[o + j] = np.uint8(nearest_int(iscale * scales[j]) & 0xFF)
            put_f16(out, o + 80, max_scale / q4scale)
        else:
            for j in range(16):
                out[o + j] = 0
            put_f16(out, o + 80, F(0.0))
        if max_min > F(0.0):
            iscale = q4scale / max_min
            for j in range(16):
                out[o + j] |= np.uint8((nearest_int(iscale * mins[j]) << 4) & 0xFF)
            put_f16(out, o + 82, max_min / q4scale)
        else:
            put_f16(out, o + 82, F(0.0))
        _q2_k_codes(x, b, L, out, o)


@njit(error_model="numpy")
def q3_k_row(x, out):
    """block_q3_K: hmask[32], qs[64], scales[12] (6-bit signed, packed), d (110 bytes)."""
    L = np.zeros(256, dtype=np.int64)
    scales = np.zeros(16, dtype=np.float32)
    for i in range(x.shape[0] // 256):
        b = i * 256
        o = i * 110
        sc_off = o + 96
        max_scale = F(0.0)
        amax = F(0.0)
        for j in range(16):
            scales[j] = make_q3_quants(16, 4, x[b + 16 * j:b + 16 * j + 16], L[16 * j:16 * j + 16])
            scale = abs(scales[j])
            if scale > amax:
                amax = scale
                max_scale = scales[j]
        for k in range(12):
            out[sc_off + k] = 0
        if max_scale != F(0.0):
            iscale = F(-32.0) / max_scale
            for j in range(16):
                lv = i8(nearest_int(iscale * scales[j]))
                lv = max(-32, min(31, lv)) + 32
                if j < 8:
                    out[sc_off + j] = np.uint8(lv & 0xF)
                else:
                    out[sc_off + j - 8] |= np.uint8((lv & 0xF) << 4)
                lv >>= 4
                out[sc_off + j % 4 + 8] |= np.uint8((lv << (2 * (j // 4))) & 0xFF)
            put_f16(out, o + 108, F(1.0) / iscale)
        else:
            put_f16(out, o + 108, F(0.0))
        _q3_k_codes(x, b, out, o, L)


@njit(inline="always", error_model="numpy")
def _q3_k_codes(x, b, out, o, L):
    """A Q3_K block's codes from its stored d and scales: hmask and the 2-bit qs."""
    sc_off = o + 96
    d_all = _f16_at(out, o + 108)
    for j in range(16):
        if j < 8:
            sc = np.int64(out[sc_off + j] & np.uint8(0xF))
        else:
            sc = np.int64(out[sc_off + j - 8] >> np.uint8(4))
        sc = i8((sc | (((np.int64(out[sc_off + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32)
        d = d_all * F(sc)
        if d == F(0.0):
            continue
        for m in range(16):
            L[16 * j + m] = max(-4, min(3, nearest_int(x[b + 16 * j + m] / d))) + 4
    for k in range(32):
        out[o + k] = 0
    m = 0
    hm = 1
    for j in range(256):
        if L[j] > 3:
            out[o + m] |= np.uint8(hm)
            L[j] -= 4
        m += 1
        if m == 32:
            m = 0
            hm <<= 1
    _pack_2bit(L, out, o + 32)


@njit(error_model="numpy")
def _q45_k_scales(x, b, nmax, rmin, nstep, L, Laux, weights, scales, mins):
    """Q4_K/Q5_K's first pass over the 8 sub-blocks: (max_scale, max_min)."""
    max_scale = F(0.0)
    max_min = F(0.0)
    for j in range(8):
        xs = x[b + 32 * j:b + 32 * j + 32]
        sum_x2 = F(0.0)
        for m in range(32):
            sum_x2 += xs[m] * xs[m]
        av_x = np.sqrt(sum_x2 / F(32.0))
        for m in range(32):
            weights[m] = av_x + abs(xs[m])
        sc, mn = make_qkx2_quants(32, nmax, xs, weights, L[32 * j:32 * j + 32], Laux, rmin,
                                  F(0.1), nstep, False)
        scales[j] = sc
        mins[j] = mn
        if sc > max_scale:
            max_scale = sc
        if mn > max_min:
            max_min = mn
    return max_scale, max_min


@njit(inline="always", error_model="numpy")
def _q45_k_scratch():
    """`_q45_k_block`'s work arrays, made once per row: codes L, trial codes, weights, scales
    and mins of the 8 sub-blocks."""
    return (np.zeros(256, dtype=np.int64), np.zeros(32, dtype=np.int64),
            np.zeros(32, dtype=np.float32), np.zeros(8, dtype=np.float32),
            np.zeros(8, dtype=np.float32))


@njit(error_model="numpy")
def _q45_k_block(x, b, out, o, nmax, rmin, nstep, scratch):
    """Header (d, dmin, 12 packed 6-bit scales/mins) and the codes L = scratch[0] (0..nmax) of
    one block."""
    L, Laux, weights, scales, mins = scratch
    max_scale, max_min = _q45_k_scales(x, b, nmax, rmin, nstep, L, Laux, weights, scales, mins)
    inv_scale = F(63.0) / max_scale if max_scale > F(0.0) else F(0.0)
    inv_min = F(63.0) / max_min if max_min > F(0.0) else F(0.0)
    for j in range(8):
        _q45_k_scale_min(out, o, j, min(63, nearest_int(inv_scale * scales[j]) & 0xFF),
                         min(63, nearest_int(inv_min * mins[j]) & 0xFF))
    put_f16(out, o, max_scale / F(63.0))
    put_f16(out, o + 2, max_min / F(63.0))
    _q45_k_requantize(x, b, out, o, nmax, L)


@njit(inline="always", error_model="numpy")
def _q45_k_scale_min(out, o, j, ls, lm):
    """Sub-block j's 6-bit scale and min into the block's 12 packed bytes."""
    s = o + 4
    if j < 4:
        out[s + j] = np.uint8(ls)
        out[s + j + 4] = np.uint8(lm)
    else:
        out[s + j + 4] = np.uint8((ls & 0xF) | ((lm & 0xF) << 4))
        out[s + j - 4] |= np.uint8((ls >> 4) << 6)
        out[s + j] |= np.uint8((lm >> 4) << 6)


@njit(inline="always", error_model="numpy")
def _q45_k_requantize(x, b, out, o, nmax, L):
    """The codes L (0..nmax) of a Q4_K / Q5_K block from its stored d, dmin, scales, mins."""
    s = o + 4
    d_all = _f16_at(out, o)
    m_all = _f16_at(out, o + 2)
    for j in range(8):
        if j < 4:
            sc = out[s + j] & np.uint8(63)
            mq = out[s + j + 4] & np.uint8(63)
        else:
            sc = (out[s + j + 4] & np.uint8(0xF)) | ((out[s + j - 4] >> np.uint8(6)) << np.uint8(4))
            mq = (out[s + j + 4] >> np.uint8(4)) | ((out[s + j] >> np.uint8(6)) << np.uint8(4))
        d = d_all * F(sc)
        if d == F(0.0):
            continue
        dm = m_all * F(mq)
        for m in range(32):
            L[32 * j + m] = max(0, min(nmax, nearest_int((x[b + 32 * j + m] + dm) / d)))


@njit(error_model="numpy")
def q4_k_row(x, out):
    """block_q4_K: d, dmin, scales[12], qs[128] (144 bytes)."""
    scratch = _q45_k_scratch()
    L = scratch[0]
    for i in range(x.shape[0] // 256):
        o = i * 144
        _q45_k_block(x, i * 256, out, o, 15, F(-1.0), 20, scratch)
        _q4_k_codes(L, out, o)


@njit(inline="always", error_model="numpy")
def _q4_k_codes(L, out, o):
    for j in range(4):
        for m in range(32):
            out[o + 16 + 32 * j + m] = np.uint8(L[64 * j + m] | (L[64 * j + m + 32] << 4))


@njit(error_model="numpy")
def q5_k_row(x, out):
    """block_q5_K: d, dmin, scales[12], qh[32], qs[128] (176 bytes)."""
    scratch = _q45_k_scratch()
    L = scratch[0]
    for i in range(x.shape[0] // 256):
        o = i * 176
        _q45_k_block(x, i * 256, out, o, 31, F(-0.5), 15, scratch)
        _q5_k_codes(L, out, o)


@njit(inline="always", error_model="numpy")
def _q5_k_codes(L, out, o):
    for m in range(32):
        out[o + 16 + m] = 0
    m1 = 1
    m2 = 2
    for n in range(4):
        for j in range(32):
            l1 = L[64 * n + j]
            if l1 > 15:
                l1 -= 16
                out[o + 16 + j] |= np.uint8(m1)
            l2 = L[64 * n + j + 32]
            if l2 > 15:
                l2 -= 16
                out[o + 16 + j] |= np.uint8(m2)
            out[o + 48 + 32 * n + j] = np.uint8(l1 | (l2 << 4))
        m1 <<= 2
        m2 <<= 2


@njit(error_model="numpy")
def q6_k_row(x, out):
    """block_q6_K: ql[128], qh[64], scales[16] (int8), d (210 bytes)."""
    q6_k_rows(x, x, False, out)


@njit(inline="always", error_model="numpy")
def q6_k_rows(x, qw, use_qw, out):
    """quantize_row_q6_K_impl: the sub-block scales by make_qx_quants weighted by qw (the
    row's importance, used as is) when use_qw, else by x^2 (the reference)."""
    L = np.zeros(256, dtype=np.int64)
    scales = np.zeros(16, dtype=np.float32)
    for i in range(x.shape[0] // 256):
        b = i * 256
        o = i * 210
        max_scale = F(0.0)
        max_abs_scale = F(0.0)
        for ib in range(16):
            lo = b + 16 * ib
            scale = make_qx_quants(16, 32, x[lo:lo + 16], L[16 * ib:16 * ib + 16],
                                   qw[lo:lo + 16], use_qw)
            scales[ib] = scale
            if abs(scale) > max_abs_scale:
                max_abs_scale = abs(scale)
                max_scale = scale
        if max_abs_scale < GROUP_MAX_EPS:
            for k in range(210):
                out[o + k] = 0
            continue
        iscale = F(-128.0) / max_scale
        put_f16(out, o + 208, F(1.0) / iscale)
        for ib in range(16):
            out[o + 192 + ib] = np.uint8(min(127, nearest_int(iscale * scales[ib])) & 0xFF)
        d_all = _f16_at(out, o + 208)
        for j in range(16):
            d = d_all * F(i8(np.int64(out[o + 192 + j])))
            if d == F(0.0):
                continue
            for m in range(16):
                L[16 * j + m] = max(-32, min(31, nearest_int(x[b + 16 * j + m] / d))) + 32
        for half in range(2):
            ql = o + 64 * half
            qh = o + 128 + 32 * half
            j = 128 * half
            for m in range(32):
                q1 = L[j + m] & 0xF
                q2 = L[j + m + 32] & 0xF
                q3 = L[j + m + 64] & 0xF
                q4 = L[j + m + 96] & 0xF
                out[ql + m] = np.uint8(q1 | (q3 << 4))
                out[ql + m + 32] = np.uint8(q2 | (q4 << 4))
                out[qh + m] = np.uint8((L[j + m] >> 4) | ((L[j + m + 32] >> 4) << 2)
                                       | ((L[j + m + 64] >> 4) << 4) | ((L[j + m + 96] >> 4) << 6))


@njit(error_model="numpy")
def iq4_xs_row(x, out):
    """quantize_iq4_xs without an importance matrix (`iq4_xs_rows`)."""
    iq4_xs_rows(x, x, False, out)


@njit(inline="always", error_model="numpy")
def iq4_xs_rows(x, qw, use_qw, out):
    """quantize_row_iq4_nl_impl(QK_K, 32, …, ntry=7) per 256-block: each 32-block's scale
    searched as IQ4_NL's (its weights' sigma2 over the whole 256), the super-block scale
    d = -max_scale / 32, each block's 6-bit l = nearest_int(scale / d) clamped to [-32, 31]
    and its levels re-chosen at d * l. block_iq4_xs: d f16 | scales_h u16 (2 high bits per
    block) | scales_l[4] (low nibbles) | qs[128] (136 bytes)."""
    values = IQ4NL_VALUES
    L = np.zeros(QK_K, dtype=np.int64)
    weight = np.zeros(32, dtype=np.float32)
    scales = np.zeros(8, dtype=np.float32)
    for i in range(x.shape[0] // QK_K):
        b = i * QK_K
        o = i * 136
        max_scale = F(0.0)
        amax_scale = F(0.0)
        for ib in range(8):
            iq4_weights(x, b + 32 * ib, QK_K, qw, use_qw, b, weight)
            d = iq4_block_scale(x, b + 32 * ib, weight)
            scales[ib] = d
            if abs(d) > amax_scale:
                amax_scale = abs(d)
                max_scale = d
        d = -max_scale / F(32.0)
        put_f16(out, o, d)
        idv = F(1.0) / d if d != F(0.0) else F(0.0)
        scales_h = 0
        for j in range(4):
            out[o + 4 + j] = 0
        for ib in range(8):
            lv = min(31, max(-32, nearest_int(idv * scales[ib])))
            dl = d * F(lv)
            idl = F(1.0) / dl if dl != F(0.0) else F(0.0)
            for j in range(32):
                L[32 * ib + j] = _best_index_iq4nl(values, idl * x[b + 32 * ib + j])
            lv += 32
            out[o + 4 + ib // 2] |= np.uint8((lv & 0xF) << (4 * (ib % 2)))
            scales_h |= (lv >> 4) << (2 * ib)
        out[o + 2] = np.uint8(scales_h & 0xFF)
        out[o + 3] = np.uint8((scales_h >> 8) & 0xFF)
        for ib in range(8):
            for j in range(16):
                out[o + 8 + 16 * ib + j] = np.uint8(L[32 * ib + j] | (L[32 * ib + 16 + j] << 4))
