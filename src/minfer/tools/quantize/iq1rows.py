"""ggml's IQ1_S and IQ1_M quantizers (quantize_row_iq1_s_impl / iq1_m_impl), ported operation
by operation (f32 in C's order, as `weighted`).

Each sub-block (IQ1_S 32 values, IQ1_M 16) takes values {-1, 0, 1} + delta (delta = +-1/8,
the shift: one per IQ1_S sub-block, one per 8-value half in IQ1_M) times a scale: the values
sorted, every split of them into the three levels scored from prefix sums of w x and w
(sum(w x q)^2 / sum(w q^2), every shift choice), the best split's 8-value groups looked up on
the 2048-point lattice (`_code_groups`: off-grid ones replaced by their nearest listed
neighbour, `lattice.best_neighbour`, and the scale refitted), the 3-bit scales coded against
the block's f16 super-scale (IQ1_M's refitted over the whole block). IQ1_S needs importance
weights (ggml asserts them); IQ1_M without them weights each value by its square. The sort is glibc
2.36's qsort, a stable merge sort for arrays this small: ties keep their order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .blocks32 import FLT_MAX, put_f16
from .kquants import nearest_int
from .lattice import IQ1S_GRID, IQ1S_MAP, IQ1S_NB, best_neighbour
from .weighted import _sum_squares, _weights

F = np.float32
GROUP_MAX_EPS_IQ1_S = F(1e-12)
GROUP_MAX_EPS_IQ1_M = F(1e-7)
IQ1S_DELTA = F(0.125)
# the three values of each shift (x_p: +delta, x_m: -delta), and the lattice as those values
X_P = np.array([F(-1.0) + IQ1S_DELTA, IQ1S_DELTA, F(1.0) + IQ1S_DELTA], F)
X_M = np.array([F(-1.0) - IQ1S_DELTA, -IQ1S_DELTA, F(1.0) - IQ1S_DELTA], F)
IQ1S_QP = X_P[(IQ1S_GRID.astype(np.int64) - 1) // 2]
IQ1S_QM = X_M[(IQ1S_GRID.astype(np.int64) - 1) // 2]


@njit(inline="always", error_model="numpy")
def _sub_block(x, qw, use_qw, b, n, sigma2, weight, xb):
    """weight (qw sqrt(sigma2 + x^2), else x^2) and xb = x[b:b+n]; returns max |x|."""
    if use_qw:
        _weights(x, qw, b, n, sigma2, weight)
    else:
        for i in range(n):
            weight[i] = x[b + i] * x[b + i]
    mx = F(0.0)
    for i in range(n):
        xb[i] = x[b + i]
        a = abs(xb[i])
        mx = mx if i > 0 and mx > a else a
    return mx


@njit(inline="always", error_model="numpy")
def _split_levels(idx, i1, i2, n, L):
    """Levels 0 / 1 / 2 to the sorted values before i1, before i2, and from i2 on."""
    for j in range(n):
        L[idx[j]] = 0 if j < i1 else 1 if j < i2 else 2


@njit(inline="always", error_model="numpy")
def _code_groups(L, xb, weight, n, scale, gshift, index):
    """Each 8-value group's grid index (an off-grid one: its nearest listed neighbour with the
    values of its shift gshift[k]) into index; the scale refitted when one was off the grid."""
    all_on_grid = True
    for k in range(n // 8):
        qgrid = IQ1S_QP if gshift[k] == 1 else IQ1S_QM
        u = 0
        for j in range(8):
            u |= L[8 * k + j] << (2 * j)
        gi = np.int64(IQ1S_MAP[u])
        if gi < 0:
            all_on_grid = False
            gi = best_neighbour(qgrid, IQ1S_GRID, IQ1S_MAP, IQ1S_NB, u, xb, weight, 8 * k,
                                scale, L)
        index[k] = gi
    if not all_on_grid:
        sumqx = F(0.0)
        sumq2 = F(0.0)
        for k in range(n // 8):
            qgrid = IQ1S_QP if gshift[k] == 1 else IQ1S_QM
            for j in range(8):
                w = weight[8 * k + j]
                q = qgrid[index[k], j]
                sumqx += w * q * xb[8 * k + j]
                sumq2 += w * q * q
        if sumqx > F(0.0) and sumq2 > F(0.0):
            scale = sumqx / sumq2
    return scale


@njit(error_model="numpy")
def iq1_s_rows(x, qw, out):
    """block_iq1_s: d, 32 low bytes of the grid indices, per 32 values a u16 of their 3 high
    bits each, the 3-bit scale at bit 12 and the shift's sign at bit 15."""
    bs = 32
    scales = np.zeros(8, F)
    shifts = np.zeros(8, np.int64)
    weight = np.zeros(bs, F)
    xb = np.zeros(bs, F)
    sumx = np.zeros(bs + 1, F)
    sumw = np.zeros(bs + 1, F)
    L = np.zeros(bs, np.int64)
    index = np.zeros(4, np.int64)
    gshift = np.zeros(4, np.int64)
    qh = np.zeros(8, np.int64)
    for ibl in range(x.shape[0] // 256):
        o = 50 * ibl
        out[o:o + 50] = 0
        qh[:] = 0
        max_scale = F(0.0)
        sigma2 = F(2.0) * _sum_squares(x, 256 * ibl, 256) / F(256.0)
        for ib in range(8):
            mx = _sub_block(x, qw, True, 256 * ibl + bs * ib, bs, sigma2, weight, xb)
            scales[ib] = F(0.0)
            shifts[ib] = 1
            if mx < GROUP_MAX_EPS_IQ1_S:
                continue
            idx = np.argsort(xb, kind="mergesort")
            for j in range(bs):
                i = idx[j]
                sumx[j + 1] = sumx[j] + weight[i] * xb[i]
                sumw[j + 1] = sumw[j] + weight[i]
            best_score = -FLT_MAX
            scale = mx
            besti1 = -1
            besti2 = -1
            best_shift = 0
            for i1 in range(bs + 1):
                for i2 in range(i1, bs + 1):
                    for shift in (1, -1):
                        xx = X_P if shift == 1 else X_M
                        sumqx = ((sumx[i1] - sumx[0]) * xx[0] + (sumx[i2] - sumx[i1]) * xx[1]
                                 + (sumx[bs] - sumx[i2]) * xx[2])
                        sumq2 = ((sumw[i1] - sumw[0]) * xx[0] * xx[0]
                                 + (sumw[i2] - sumw[i1]) * xx[1] * xx[1]
                                 + (sumw[bs] - sumw[i2]) * xx[2] * xx[2])
                        if sumq2 > F(0.0) and sumqx * sumqx > best_score * sumq2:
                            scale = sumqx / sumq2
                            best_score = scale * sumqx
                            besti1 = i1
                            besti2 = i2
                            best_shift = shift
            if besti1 < 0 or besti2 < 0 or best_shift == 0:
                continue
            _split_levels(idx, besti1, besti2, bs, L)
            if scale < F(0.0):
                for j in range(bs):
                    L[j] = 2 - L[j]
                scale = -scale
                best_shift = -best_shift
            gshift[:] = best_shift
            scale = _code_groups(L, xb, weight, bs, scale, gshift, index)
            h = 0
            for k in range(4):
                out[o + 2 + 4 * ib + k] = np.uint8(index[k] & 255)
                h |= (index[k] >> 8) << (3 * k)
            qh[ib] = h
            scales[ib] = scale
            shifts[ib] = best_shift
            max_scale = max_scale if max_scale > scale else scale
        if max_scale != F(0.0):
            d = max_scale / F(15.0)
            put_f16(out, o, d * F(1.125))
            inv = F(1.0) / d
            for ib in range(8):
                lv = max(0, min(7, nearest_int(F(0.5) * (inv * scales[ib] - F(1.0)))))
                if shifts[ib] == -1:
                    lv |= 8
                qh[ib] |= lv << 12
        for ib in range(8):
            out[o + 34 + 2 * ib] = np.uint8(qh[ib] & 255)
            out[o + 35 + 2 * ib] = np.uint8(qh[ib] >> 8)


@njit(error_model="numpy")
def iq1_m_rows(x, qw, use_qw, out):
    """quantize_row_iq1_m_impl (sub-blocks of 16, each 8-value half with its own shift):
    block_iq1_m 32 low bytes of the grid indices, 16 bytes of two 3-bit high parts and
    shift flags, 8 bytes of 3-bit scales with the f16 super-scale spread over their top
    nibbles."""
    bs = 16
    masks = (0x00, 0x80, 0x08, 0x88)
    scales = np.zeros(16, F)
    shifts = np.zeros(16, np.int64)
    weight = np.zeros(bs, F)
    xb = np.zeros(bs, F)
    px = np.zeros((2, bs + 1), F)
    pw = np.zeros((2, bs + 1), F)
    sumqx = np.zeros(4, F)
    sumq2 = np.zeros(4, F)
    L = np.zeros(bs, np.int64)
    index = np.zeros(2, np.int64)
    gshift = np.zeros(2, np.int64)
    sc = np.zeros(4, np.int64)
    p2 = X_P[2]
    m2 = X_M[2]
    cp1 = X_P[0] * X_P[0] - X_P[1] * X_P[1]
    cp2 = X_P[1] * X_P[1] - X_P[2] * X_P[2]
    cm1 = X_M[0] * X_M[0] - X_M[1] * X_M[1]
    cm2 = X_M[1] * X_M[1] - X_M[2] * X_M[2]
    for ibl in range(x.shape[0] // 256):
        o = 56 * ibl
        out[o:o + 56] = 0
        max_scale = F(0.0)
        sigma2 = F(2.0) * _sum_squares(x, 256 * ibl, 256) / F(256.0)
        for ib in range(16):
            mx = _sub_block(x, qw, use_qw, 256 * ibl + bs * ib, bs, sigma2, weight, xb)
            scales[ib] = F(0.0)
            shifts[ib] = 0
            if mx < GROUP_MAX_EPS_IQ1_M:
                continue
            idx = np.argsort(xb, kind="mergesort")
            for j in range(bs):
                i = idx[j]
                h = 0 if i < bs // 2 else 1
                px[h, j + 1] = px[h, j] + weight[i] * xb[i]
                px[1 - h, j + 1] = px[1 - h, j]
                pw[h, j + 1] = pw[h, j] + weight[i]
                pw[1 - h, j + 1] = pw[1 - h, j]
            best_score = -FLT_MAX
            scale = mx
            besti1 = -1
            besti2 = -1
            best_k = -1
            for i1 in range(bs + 1):
                for i2 in range(i1, bs + 1):
                    sx0 = px[0, i1] + px[0, i2]
                    sx1 = px[1, i1] + px[1, i2]
                    qxp0 = px[0, bs] * p2 - sx0
                    qxm0 = px[0, bs] * m2 - sx0
                    qxp1 = px[1, bs] * p2 - sx1
                    qxm1 = px[1, bs] * m2 - sx1
                    q2p0 = pw[0, bs] * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
                    q2m0 = pw[0, bs] * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
                    q2p1 = pw[1, bs] * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
                    q2m1 = pw[1, bs] * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
                    sumqx[0] = qxp0 + qxp1
                    sumqx[1] = qxp0 + qxm1
                    sumqx[2] = qxm0 + qxp1
                    sumqx[3] = qxm0 + qxm1
                    sumq2[0] = q2p0 + q2p1
                    sumq2[1] = q2p0 + q2m1
                    sumq2[2] = q2m0 + q2p1
                    sumq2[3] = q2m0 + q2m1
                    for k in range(4):
                        if sumq2[k] > F(0.0) and sumqx[k] * sumqx[k] > best_score * sumq2[k]:
                            scale = sumqx[k] / sumq2[k]
                            best_score = scale * sumqx[k]
                            besti1 = i1
                            besti2 = i2
                            best_k = k
            if besti1 < 0 or besti2 < 0 or best_k < 0:
                continue
            _split_levels(idx, besti1, besti2, bs, L)
            if scale < F(0.0):
                for j in range(bs):
                    L[j] = 2 - L[j]
                scale = -scale
                best_k = 3 - best_k
            gshift[0] = 1 if best_k < 2 else -1
            gshift[1] = 1 if best_k % 2 == 0 else -1
            scale = _code_groups(L, xb, weight, bs, scale, gshift, index)
            out[o + 2 * ib] = np.uint8(index[0] & 255)
            out[o + 2 * ib + 1] = np.uint8(index[1] & 255)
            out[o + 32 + ib] = np.uint8((index[0] >> 8) | ((index[1] >> 8) << 4))
            scales[ib] = scale
            shifts[ib] = best_k
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == F(0.0):
            continue
        sc[:] = 0
        d = max_scale / F(15.0)
        inv = F(1.0) / d
        sumqx_f = F(0.0)
        sumq2_f = F(0.0)
        for ib in range(16):
            lv = max(0, min(7, nearest_int(F(0.5) * (inv * scales[ib] - F(1.0)))))
            sc[ib // 4] |= lv << (3 * (ib % 4))
            out[o + 32 + ib] |= np.uint8(masks[shifts[ib]])
            _sub_block(x, qw, use_qw, 256 * ibl + bs * ib, bs, sigma2, weight, xb)
            qh = np.int64(out[o + 32 + ib])
            for k in range(2):
                xx = (X_P if shifts[ib] < 2 else X_M) if k == 0 else (
                    X_P if shifts[ib] % 2 == 0 else X_M)
                gi = np.int64(out[o + 2 * ib + k]) + ((qh << (8 - 4 * k)) & 0x700)
                for j in range(8):
                    w = weight[8 * k + j]
                    q = xx[(np.int64(IQ1S_GRID[gi, j]) - 1) // 2] * F(2 * lv + 1)
                    sumqx_f += w * q * xb[8 * k + j]
                    sumq2_f += w * q * q
        if sumq2_f > F(0.0):
            d = sumqx_f / sumq2_f
        put_f16(out, o + 48, d * F(1.1125))
        s = np.int64(out[o + 48]) | (np.int64(out[o + 49]) << 8)
        sc[0] |= (s & 0x000F) << 12
        sc[1] |= (s & 0x00F0) << 8
        sc[2] |= (s & 0x0F00) << 4
        sc[3] |= s & 0xF000
        for j in range(4):
            out[o + 48 + 2 * j] = np.uint8(sc[j] & 255)
            out[o + 49 + 2 * j] = np.uint8(sc[j] >> 8)
