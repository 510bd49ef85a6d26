"""ggml's lattice i-quant quantizers: IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S and IQ2_S
(quantize_row_iq2_xxs_impl / iq2_xs_impl / iq3_xxs_impl / iq3_s_impl / iq2_s_impl), ported
operation by operation (f32 in C's order, as `weighted`).

Each 256-value block is cut in sub-blocks (32 values; 16 for IQ2_S) of 8- or 4-value groups.
The XXS types fold the signs into an even count per 8 values (the odd one out flipped on the
value of least weighted square), the S types keep all 8 sign bits. `lattice_search` is the
scale search they share: trial inverse scales, each trial coding the groups on the lattice
(`lattice.group_code`) and scoring sum(w x q)^2 / sum(w q^2); the best scale's codes refined
once; the sub-block scales are then coded to 4 bits against the block's f16 super-scale.
IQ2_XXS and IQ2_XS need importance weights (ggml asserts them); the others without them weight each
value by its square (IQ2_S: plus a quarter of the block's mean square).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .blocks32 import _put_u32, put_f16
from .kquants import GROUP_MAX_EPS, nearest_int
from .lattice import (
    IQ2S_GRID,
    IQ2S_MAP,
    IQ2S_NB,
    IQ2XS_GRID,
    IQ2XS_MAP,
    IQ2XS_NB,
    IQ2XXS_GRID,
    IQ2XXS_MAP,
    IQ2XXS_NB,
    IQ3S_GRID,
    IQ3S_MAP,
    IQ3S_NB,
    IQ3XXS_GRID,
    IQ3XXS_MAP,
    IQ3XXS_NB,
    grid_index,
    group_code,
)
from .weighted import _sum_squares, _weights, make_qp_quants

F = np.float32
GROUP_MAX_EPS_IQ3_XXS = F(1e-8)
GROUP_MAX_EPS_IQ2_S = F(1e-8)


@njit(inline="always", error_model="numpy")
def _fold_signs(x, b, n, weight, xval, signs):
    """xval = |x[b:b+n]| with each 8's count of negatives made even (the value of least
    w x^2 keeps its sign flipped); signs[k]: the 7 stored sign bits of group k."""
    for k in range(n // 8):
        nflip = 0
        s = 0
        for i in range(8):
            v = x[b + 8 * k + i]
            if v >= F(0.0):
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                nflip += 1
                s |= 1 << i
        if nflip % 2:
            imin = 0
            mn = weight[8 * k] * x[b + 8 * k] * x[b + 8 * k]
            for i in range(1, 8):
                ax = weight[8 * k + i] * x[b + 8 * k + i] * x[b + 8 * k + i]
                if ax < mn:
                    mn = ax
                    imin = i
            xval[8 * k + imin] = -xval[8 * k + imin]
            s ^= 1 << imin
        signs[k] = s & 127


@njit(inline="always", error_model="numpy")
def _fit(weight, xval, L, n):
    """(sum w x q, sum w q^2) over the first n values, with q = 2L + 1."""
    sumqx = F(0.0)
    sumq2 = F(0.0)
    for i in range(n):
        w = weight[i]
        q = F(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(inline="always", error_model="numpy")
def _max(v, n):
    m = v[0]
    for i in range(1, n):
        m = m if m > v[i] else v[i]
    return m


@njit(inline="always", error_model="numpy")
def _sub_weights(x, qw, use_qw, b, n, sigma2, floor, weight, waux):
    """weight: qw sqrt(sigma2 + x^2) with importance, else floor + x^2; waux its sqrt."""
    if use_qw:
        _weights(x, qw, b, n, sigma2, weight)
    else:
        for i in range(n):
            weight[i] = floor + x[b + i] * x[b + i]
    for i in range(n):
        waux[i] = np.sqrt(weight[i])


@njit(inline="always", error_model="numpy")
def _plain_signs(x, b, n, xval, signs):
    """xval = |x[b:b+n]|; signs[k]: the 8 sign bits of values 8k .. 8k+7."""
    for k in range(n // 8):
        s = 0
        for i in range(8):
            v = x[b + 8 * k + i]
            if v >= F(0.0):
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                s |= 1 << i
        signs[k] = s


@njit(inline="always", error_model="numpy")
def _scale_codes(scales, d):
    """The 4-bit codes of the sub-block scales against super-scale d."""
    inv = F(1.0) / d
    codes = np.zeros(scales.shape[0], np.uint32)
    for ib in range(scales.shape[0]):
        lv = nearest_int(F(0.5) * (inv * scales[ib] - F(1.0)))
        codes[ib] = np.uint32(max(0, min(15, lv)))
    return codes


@njit(error_model="numpy")
def lattice_search(grid, kmap, nb, xval, weight, waux, n, kmax, trials, step, base, scale,
                   on_init, refine_always, refine_all, L, Laux, on, on_aux):
    """The sub-block's scale (its levels into L[:n]), ggml's search: trial inverse scales
    (2 kmax - 1 + t step) / base for t in -trials..trials, each coding the n / k groups on the
    lattice and kept when sum(w x q)^2 / sum(w q^2) beats the best so far (starting from
    `scale`, L as it is, every group's on-grid flag `on_init`); then, when `refine_always` or a
    kept group was off the grid, and the scale is positive, the groups (all when `refine_all`,
    else those off the grid) coded again at the kept scale and the scale refitted."""
    k = grid.shape[1]
    ng = n // k
    best = F(0.0)
    on[:ng] = on_init
    for trial in range(-trials, trials + 1):
        inv = (F(2 * kmax - 1) + F(trial) * step) / base
        this_scale = F(1.0) / inv
        for g in range(ng):
            on_aux[g] = group_code(grid, kmap, nb, xval, waux, k * g, inv, this_scale, kmax,
                                   Laux)[1]
        sumqx, sumq2 = _fit(weight, xval, Laux, n)
        if sumq2 > F(0.0) and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:n] = Laux[:n]
            on[:ng] = on_aux[:ng]
    if (refine_always or not on[:ng].all()) and scale > F(0.0):
        inv = F(1.0) / scale
        for g in range(ng):
            if refine_all or not on[g]:
                group_code(grid, kmap, nb, xval, waux, k * g, inv, scale, kmax, L)
        sumqx, sumq2 = _fit(weight, xval, L, n)
        if sumq2 > F(0.0):
            scale = sumqx / sumq2
    return scale


@njit(inline="always", error_model="numpy")
def _coded_sub_block(x, qw, use_qw, b, n, sigma2, floor, fold, eps, grid, kmap, nb, kmax,
                     trials, step, on_init, refine_all, weight, waux, xval, signs, L, Laux, on,
                     on_aux):
    """One sub-block x[b:b+n] of the types whose search starts at max / (2 kmax - 1): weights,
    signs (folded or plain) into xval / signs, the lattice search; its levels into L and its
    scale (made positive, the signs flipped with it), or -1 when max |x| < eps (or is 0)."""
    _sub_weights(x, qw, use_qw, b, n, sigma2, floor, weight, waux)
    if fold:
        _fold_signs(x, b, n, weight, xval, signs)
    else:
        _plain_signs(x, b, n, xval, signs)
    mx = _max(xval, n)
    L[:] = 0
    if mx < eps or mx == F(0.0):
        return F(-1.0)
    scale = lattice_search(grid, kmap, nb, xval, weight, waux, n, kmax, trials, step, mx,
                           mx / F(2 * kmax - 1), on_init, False, refine_all, L, Laux, on, on_aux)
    if scale < F(0.0):
        scale = -scale
        mask = 127 if fold else 255
        for k in range(n // 8):
            signs[k] = ~signs[k] & mask
    return scale


@njit(error_model="numpy")
def iq2_xxs_rows(x, qw, out):
    """quantize_row_iq2_xxs_impl: block_iq2_xxs d, then per 32: u32 of 4 grid indices, u32 of
    4 x 7 sign bits and the 4-bit scale."""
    kmax = 3
    scales = np.zeros(8, F)
    weight = np.zeros(32, F)
    waux = np.zeros(32, F)
    xval = np.zeros(32, F)
    L = np.zeros(32, np.int64)
    Laux = np.zeros(32, np.int64)
    signs = np.zeros(4, np.int64)
    on = np.zeros(8, np.bool_)
    on_aux = np.zeros(8, np.bool_)
    q2 = np.zeros(16, np.uint32)
    for ibl in range(x.shape[0] // 256):
        o = 66 * ibl
        q2[:] = 0
        max_scale = F(0.0)
        sigma2 = _sum_squares(x, 256 * ibl, 256) / F(256.0)
        for ib in range(8):
            b = 256 * ibl + 32 * ib
            _sub_weights(x, qw, True, b, 32, sigma2, F(0.0), weight, waux)
            _fold_signs(x, b, 32, weight, xval, signs)
            scales[ib] = F(0.0)
            if _max(xval, 32) < GROUP_MAX_EPS:
                continue
            scale = make_qp_quants(32, kmax + 1, xval, L, weight)
            eff_max = scale * F(kmax)
            if eff_max <= F(0.0):
                continue
            scale = lattice_search(IQ2XXS_GRID, IQ2XXS_MAP, IQ2XXS_NB, xval, weight, waux, 32,
                                   kmax, 6, F(0.1), eff_max, scale, True, True, True, L, Laux,
                                   on, on_aux)
            if scale < F(0.0):
                scale = -scale
                for k in range(4):
                    signs[k] = ~signs[k] & 127
            for k in range(4):
                gi = grid_index(IQ2XXS_MAP, L, 8 * k, 8)
                q2[2 * ib] |= np.uint32(gi << (8 * k))
                q2[2 * ib + 1] |= np.uint32(signs[k] << (7 * k))
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == F(0.0):
            out[o:o + 66] = 0
            continue
        d = max_scale / F(31.0)
        put_f16(out, o, d)
        codes = _scale_codes(scales, d)
        for ib in range(8):
            _put_u32(out, o + 2 + 8 * ib, q2[2 * ib])
            _put_u32(out, o + 6 + 8 * ib, q2[2 * ib + 1] | (codes[ib] << np.uint32(28)))


@njit(error_model="numpy")
def iq3_xxs_rows(x, qw, use_qw, out):
    """quantize_row_iq3_xxs_impl (grid 256): block_iq3_xxs d, 64 grid indices (one a 4-value
    group), per 32 a u32 of 4 x 7 sign bits and the 4-bit scale."""
    kmax = 8
    scales = np.zeros(8, F)
    weight = np.zeros(32, F)
    waux = np.zeros(32, F)
    xval = np.zeros(32, F)
    L = np.zeros(32, np.int64)
    Laux = np.zeros(32, np.int64)
    signs = np.zeros(4, np.int64)
    on = np.zeros(8, np.bool_)
    on_aux = np.zeros(8, np.bool_)
    q3 = np.zeros(64, np.uint8)
    sas = np.zeros(8, np.uint32)
    for ibl in range(x.shape[0] // 256):
        o = 98 * ibl
        q3[:] = 0
        sas[:] = 0
        max_scale = F(0.0)
        sigma2 = F(2.0) * _sum_squares(x, 256 * ibl, 256) / F(256.0)
        for ib in range(8):
            b = 256 * ibl + 32 * ib
            scales[ib] = F(0.0)
            scale = _coded_sub_block(x, qw, use_qw, b, 32, sigma2, F(0.0), True,
                                     GROUP_MAX_EPS_IQ3_XXS, IQ3XXS_GRID, IQ3XXS_MAP, IQ3XXS_NB,
                                     kmax, 15, F(0.2), True, False, weight, waux, xval, signs,
                                     L, Laux, on, on_aux)
            if scale < F(0.0):
                continue
            for k in range(8):
                q3[8 * ib + k] = np.uint8(grid_index(IQ3XXS_MAP, L, 4 * k, 4))
            sas[ib] = np.uint32(signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21))
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == F(0.0):
            out[o:o + 98] = 0
            continue
        d = max_scale / F(31.0)
        put_f16(out, o, d * F(1.0125))
        codes = _scale_codes(scales, d)
        out[o + 2:o + 66] = q3
        for ib in range(8):
            _put_u32(out, o + 66 + 4 * ib, sas[ib] | (codes[ib] << np.uint32(28)))


@njit(error_model="numpy")
def iq3_s_rows(x, qw, use_qw, out):
    """quantize_row_iq3_s_impl (grid 512, sub-blocks of 32): block_iq3_s d, the 64 grid
    indices' low bytes, 8 bytes of their 9th bits, 32 sign bytes, 4 bytes of two 4-bit
    scales. As in ggml, an all-zero sub-block's indices and signs take no room: the next
    coded one's go where it would have (its high bits stay at its own place)."""
    kmax = 8
    scales = np.zeros(8, F)
    weight = np.zeros(32, F)
    waux = np.zeros(32, F)
    xval = np.zeros(32, F)
    L = np.zeros(32, np.int64)
    Laux = np.zeros(32, np.int64)
    signs = np.zeros(4, np.int64)
    on = np.zeros(8, np.bool_)
    on_aux = np.zeros(8, np.bool_)
    for ibl in range(x.shape[0] // 256):
        o = 110 * ibl
        out[o:o + 110] = 0
        nq = 0  # sub-blocks written: ggml advances qs / signs past coded ones only
        max_scale = F(0.0)
        sigma2 = F(2.0) * _sum_squares(x, 256 * ibl, 256) / F(256.0)
        for ib in range(8):
            b = 256 * ibl + 32 * ib
            scales[ib] = F(0.0)
            scale = _coded_sub_block(x, qw, use_qw, b, 32, sigma2, F(0.0), False, F(0.0),
                                     IQ3S_GRID, IQ3S_MAP, IQ3S_NB, kmax, 9, F(0.2), False, True,
                                     weight, waux, xval, signs, L, Laux, on, on_aux)
            if scale < F(0.0):
                continue
            for k in range(8):
                gi = grid_index(IQ3S_MAP, L, 4 * k, 4)
                out[o + 2 + 8 * nq + k] = np.uint8(gi & 255)
                out[o + 66 + ib] |= np.uint8((gi >> 8) << k)
            for k in range(4):
                out[o + 74 + 4 * nq + k] = np.uint8(signs[k])
            nq += 1
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == F(0.0):
            continue
        d = max_scale / F(31.0)
        put_f16(out, o, d * F(1.033))
        codes = _scale_codes(scales, d)
        for j in range(4):
            out[o + 106 + j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << np.uint32(4)))


@njit(error_model="numpy")
def iq2_s_rows(x, qw, use_qw, out):
    """quantize_row_iq2_s_impl (grid 1024, sub-blocks of 16): block_iq2_s d, the 32 grid
    indices' low bytes, 32 sign bytes, 8 bytes of their 2 high bits, 8 bytes of two 4-bit
    scales."""
    kmax = 3
    scales = np.zeros(16, F)
    weight = np.zeros(16, F)
    waux = np.zeros(16, F)
    xval = np.zeros(16, F)
    L = np.zeros(16, np.int64)
    Laux = np.zeros(16, np.int64)
    signs = np.zeros(2, np.int64)
    on = np.zeros(2, np.bool_)
    on_aux = np.zeros(2, np.bool_)
    for ibl in range(x.shape[0] // 256):
        o = 82 * ibl
        out[o:o + 82] = 0
        max_scale = F(0.0)
        sigma2 = F(2.0) * _sum_squares(x, 256 * ibl, 256) / F(256.0)
        for ib in range(16):
            b = 256 * ibl + 16 * ib
            scales[ib] = F(0.0)
            scale = _coded_sub_block(x, qw, use_qw, b, 16, sigma2, F(0.25) * sigma2, False,
                                     GROUP_MAX_EPS_IQ2_S, IQ2S_GRID, IQ2S_MAP, IQ2S_NB, kmax, 9,
                                     F(0.1), True, False, weight, waux, xval, signs, L, Laux, on,
                                     on_aux)
            if scale < F(0.0):
                continue
            for k in range(2):
                i8 = 2 * ib + k
                gi = grid_index(IQ2S_MAP, L, 8 * k, 8)
                out[o + 2 + i8] = np.uint8(gi & 255)
                out[o + 66 + i8 // 4] |= np.uint8((gi >> 8) << (2 * (i8 % 4)))
                out[o + 34 + i8] = np.uint8(signs[k])
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == F(0.0):
            continue
        d = max_scale / F(31.0)
        put_f16(out, o, d * F(0.9875))
        codes = _scale_codes(scales, d)
        for j in range(8):
            out[o + 74 + j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << np.uint32(4)))


@njit(error_model="numpy")
def iq2_xs_rows(x, qw, out):
    """quantize_row_iq2_xs_impl (grid 512, sub-blocks of 16): block_iq2_xs d, 32 u16 of a grid
    index and its 8-value group's 7 sign bits, 8 bytes of two 4-bit scales."""
    kmax = 3
    scales = np.zeros(16, F)
    weight = np.zeros(16, F)
    waux = np.zeros(16, F)
    xval = np.zeros(16, F)
    L = np.zeros(16, np.int64)
    Laux = np.zeros(16, np.int64)
    signs = np.zeros(2, np.int64)
    on = np.zeros(2, np.bool_)
    on_aux = np.zeros(2, np.bool_)
    q2 = np.zeros(32, np.int64)
    for ibl in range(x.shape[0] // 256):
        o = 74 * ibl
        out[o:o + 74] = 0
        q2[:] = 0
        max_scale = F(0.0)
        sigma2 = _sum_squares(x, 256 * ibl, 256) / F(256.0)
        for ib in range(16):
            b = 256 * ibl + 16 * ib
            scales[ib] = F(0.0)
            scale = _coded_sub_block(x, qw, True, b, 16, sigma2, F(0.0), True, GROUP_MAX_EPS,
                                     IQ2XS_GRID, IQ2XS_MAP, IQ2XS_NB, kmax, 9, F(0.1), True,
                                     False, weight, waux, xval, signs, L, Laux, on, on_aux)
            if scale < F(0.0):
                continue
            for k in range(2):
                q2[2 * ib + k] = grid_index(IQ2XS_MAP, L, 8 * k, 8) | (signs[k] << 9)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == F(0.0):
            continue
        d = max_scale / F(31.0)
        put_f16(out, o, d)
        codes = _scale_codes(scales, d)
        for j in range(8):
            out[o + 66 + j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << np.uint32(4)))
        for i in range(32):
            out[o + 2 + 2 * i] = np.uint8(q2[i] & 255)
            out[o + 3 + 2 * i] = np.uint8(q2[i] >> 8)
