"""ggml's lattice i-quant quantizers: IQ2_XXS and IQ3_XXS (quantize_row_iq2_xxs_impl /
quantize_row_iq3_xxs_impl), ported operation by operation (f32 in C's order, as `weighted`).

Each 256-value block is 8 groups of 32: the signs folded into an even count per 8 values (the
odd one out flipped on the value of least weighted square), then a scale search over trial
inverse scales, each trial coding the groups on the lattice (`lattice.group_code`) and scoring
sum(w x q)^2 / sum(w q^2); the best scale's codes are refined once, and the 8 scales coded to
4 bits against the block's f16 super-scale. IQ2_XXS needs importance weights (ggml asserts
them); IQ3_XXS without them weights each value by its square.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .blocks32 import _put_u32, put_f16
from .kquants import GROUP_MAX_EPS, nearest_int
from .lattice import (
    IQ2XXS_GRID,
    IQ2XXS_MAP,
    IQ2XXS_NB,
    IQ3XXS_GRID,
    IQ3XXS_MAP,
    IQ3XXS_NB,
    grid_index,
    group_code,
)
from .weighted import _sum_squares, _weights, make_qp_quants

F = np.float32
GROUP_MAX_EPS_IQ3_XXS = F(1e-8)


@njit(inline="always", error_model="numpy")
def _fold_signs(x, b, weight, xval, signs):
    """xval = |x[b:b+32]| with each 8's count of negatives made even (the value of least
    w x^2 keeps its sign flipped); signs[k]: the 7 stored sign bits of group k."""
    for k in range(4):
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
def _fit(weight, xval, L):
    """(sum w x q, sum w q^2) with q = 2L + 1."""
    sumqx = F(0.0)
    sumq2 = F(0.0)
    for i in range(32):
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
def _sub_weights(x, qw, use_qw, b, sigma2, weight, waux):
    if use_qw:
        _weights(x, qw, b, 32, sigma2, weight)
    else:
        for i in range(32):
            weight[i] = x[b + i] * x[b + i]
    for i in range(32):
        waux[i] = np.sqrt(weight[i])


@njit(inline="always", error_model="numpy")
def _scale_codes(scales, d):
    """The 4-bit codes of the 8 group scales against super-scale d."""
    inv = F(1.0) / d
    codes = np.zeros(8, np.uint32)
    for ib in range(8):
        lv = nearest_int(F(0.5) * (inv * scales[ib] - F(1.0)))
        codes[ib] = np.uint32(max(0, min(15, lv)))
    return codes


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
    q2 = np.zeros(16, np.uint32)
    for ibl in range(x.shape[0] // 256):
        o = 66 * ibl
        q2[:] = 0
        max_scale = F(0.0)
        sigma2 = _sum_squares(x, 256 * ibl, 256) / F(256.0)
        for ib in range(8):
            b = 256 * ibl + 32 * ib
            _sub_weights(x, qw, True, b, sigma2, weight, waux)
            _fold_signs(x, b, weight, xval, signs)
            scales[ib] = F(0.0)
            if _max(xval, 32) < GROUP_MAX_EPS:
                continue
            scale = make_qp_quants(32, kmax + 1, xval, L, weight)
            eff_max = scale * F(kmax)
            if eff_max <= F(0.0):
                continue
            best = F(0.0)
            for trial in range(-6, 7):
                inv = (F(2 * kmax - 1) + F(trial) * F(0.1)) / eff_max
                this_scale = F(1.0) / inv
                for k in range(4):
                    group_code(IQ2XXS_GRID, IQ2XXS_MAP, IQ2XXS_NB, xval, waux, 8 * k, inv,
                               this_scale, kmax, Laux)
                sumqx, sumq2 = _fit(weight, xval, Laux)
                if sumq2 > F(0.0) and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    L[:] = Laux
            if scale > F(0.0):
                inv = F(1.0) / scale
                for k in range(4):
                    group_code(IQ2XXS_GRID, IQ2XXS_MAP, IQ2XXS_NB, xval, waux, 8 * k, inv,
                               scale, kmax, L)
                sumqx, sumq2 = _fit(weight, xval, L)
                if sumq2 > F(0.0):
                    scale = sumqx / sumq2
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
    on_grid = np.zeros(8, np.bool_)
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
            _sub_weights(x, qw, use_qw, b, sigma2, weight, waux)
            _fold_signs(x, b, weight, xval, signs)
            mx = _max(xval, 32)
            L[:] = 0
            scales[ib] = F(0.0)
            if mx < GROUP_MAX_EPS_IQ3_XXS:
                continue
            best = F(0.0)
            scale = mx / F(2 * kmax - 1)
            on_grid[:] = True
            for trial in range(-15, 16):
                inv = (F(2 * kmax - 1) + F(trial) * F(0.2)) / mx
                this_scale = F(1.0) / inv
                for k in range(8):
                    on_aux[k] = group_code(IQ3XXS_GRID, IQ3XXS_MAP, IQ3XXS_NB, xval, waux,
                                           4 * k, inv, this_scale, kmax, Laux)[1]
                sumqx, sumq2 = _fit(weight, xval, Laux)
                if sumq2 > F(0.0) and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    L[:] = Laux
                    on_grid[:] = on_aux
            if not on_grid.all() and scale > F(0.0):
                inv = F(1.0) / scale
                for k in range(8):
                    if not on_grid[k]:
                        group_code(IQ3XXS_GRID, IQ3XXS_MAP, IQ3XXS_NB, xval, waux, 4 * k, inv,
                                   scale, kmax, L)
                sumqx, sumq2 = _fit(weight, xval, L)
                if sumq2 > F(0.0):
                    scale = sumqx / sumq2
            if scale < F(0.0):
                scale = -scale
                for k in range(4):
                    signs[k] = ~signs[k] & 127
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
def iq2_xxs_row_w(x, qw, out):
    iq2_xxs_rows(x, qw, out)


@njit(error_model="numpy")
def iq3_xxs_row(x, out):
    iq3_xxs_rows(x, x, False, out)


@njit(error_model="numpy")
def iq3_xxs_row_w(x, qw, out):
    iq3_xxs_rows(x, qw, True, out)
