"""ggml's reference quantizers for the 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
MXFP4) and the F16 / BF16 conversions, ported operation by operation so the bytes equal llama.cpp's.

These are `quantize_row_*_ref` from ggml-quants.c, which `llama_model_quantize` runs when no
importance matrix is given. ggml-base is compiled for plain x86-64 (SSE2, no FMA) and without
fast-math, so every float operation there is one IEEE f32 operation in source order; numba
without fastmath compiles these the same way (every constant and int is cast to f32 first, as C
does, never promoted to f64). Each function quantizes one row `x` (f32) into `out` (its bytes).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from minfer.backends.cpu.kernels.simd.llvm import bits_of_f32, bits_to_f32, f32_to_f16

F = np.float32
FLT_MAX = np.float32(3.4028234663852886e38)


@njit(inline="always", error_model="numpy")
def put_f16(out, off, v):
    """Store f32 `v` as ggml's GGML_FP32_TO_FP16 (round to nearest even) at out[off:off+2]."""
    h = f32_to_f16(v)
    out[off] = np.uint8(h & np.uint16(0xFF))
    out[off + 1] = np.uint8(h >> np.uint16(8))


@njit(inline="always", error_model="numpy")
def roundf(v):
    """C's roundf: to nearest, halves away from zero (exact: v - trunc(v) is exact in f32)."""
    t = np.trunc(v)
    if abs(v - t) >= F(0.5):
        t += F(1.0) if v > F(0.0) else F(-1.0)
    return t


@njit(inline="always", error_model="numpy")
def i8(v):
    """C's (int8_t) of an int: the low byte, signed."""
    return ((v & 0xFF) ^ 0x80) - 0x80


@njit(inline="always", error_model="numpy")
def absmax_signed(x, base, n):
    """(amax, the value with that |value|): the first one wins on ties, as in ggml."""
    amax = F(0.0)
    mx = F(0.0)
    for j in range(n):
        v = x[base + j]
        if amax < abs(v):
            amax = abs(v)
            mx = v
    return amax, mx


@njit(inline="always", error_model="numpy")
def _min_max(x, base, n):
    lo = FLT_MAX
    hi = -FLT_MAX
    for j in range(n):
        v = x[base + j]
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    return lo, hi


@njit(inline="always", error_model="numpy")
def _signed_head(x, b, out, o, div):
    """Q4_0 / Q5_0 block head: d = (the value of largest magnitude) / div stored at out[o];
    returns 1/d (0 for d = 0)."""
    _, mx = absmax_signed(x, b, 32)
    d = mx / div
    put_f16(out, o, d)
    return F(1.0) / d if d != F(0.0) else F(0.0)


@njit(inline="always", error_model="numpy")
def _min_head(x, b, out, o, levels):
    """Q4_1 / Q5_1 block head: d = (max - min) / levels and the min stored at out[o], out[o+2];
    returns (min, 1/d (0 for d = 0))."""
    lo, hi = _min_max(x, b, 32)
    d = (hi - lo) / levels
    put_f16(out, o, d)
    put_f16(out, o + 2, lo)
    return lo, F(1.0) / d if d != F(0.0) else F(0.0)


@njit(error_model="numpy")
def q4_0_row(x, out):
    for i in range(x.shape[0] // 32):
        b = i * 32
        o = i * 18
        idv = _signed_head(x, b, out, o, F(-8.0))
        for j in range(16):
            xi0 = min(15, i8(np.int32(x[b + j] * idv + F(8.5)))) & 0xFF
            xi1 = min(15, i8(np.int32(x[b + 16 + j] * idv + F(8.5)))) & 0xFF
            out[o + 2 + j] = np.uint8(xi0 | (xi1 << 4))


@njit(error_model="numpy")
def q4_1_row(x, out):
    for i in range(x.shape[0] // 32):
        b = i * 32
        o = i * 20
        lo, idv = _min_head(x, b, out, o, F(15.0))
        for j in range(16):
            xi0 = min(15, i8(np.int32((x[b + j] - lo) * idv + F(0.5)))) & 0xFF
            xi1 = min(15, i8(np.int32((x[b + 16 + j] - lo) * idv + F(0.5)))) & 0xFF
            out[o + 4 + j] = np.uint8(xi0 | (xi1 << 4))


@njit(error_model="numpy")
def _q5_store(out, o, qs_off, j, xi0, xi1, qh):
    out[o + qs_off + j] = np.uint8((xi0 & 0x0F) | ((xi1 & 0x0F) << 4))
    qh |= np.uint32((xi0 & 0x10) >> 4) << np.uint32(j)
    qh |= np.uint32((xi1 & 0x10) >> 4) << np.uint32(j + 16)
    return qh


@njit(inline="always", error_model="numpy")
def _put_u32(out, off, v):
    for k in range(4):
        out[off + k] = np.uint8((v >> np.uint32(8 * k)) & np.uint32(0xFF))


@njit(error_model="numpy")
def q5_0_row(x, out):
    for i in range(x.shape[0] // 32):
        b = i * 32
        o = i * 22
        idv = _signed_head(x, b, out, o, F(-16.0))
        qh = np.uint32(0)
        for j in range(16):
            xi0 = min(31, i8(np.int32(x[b + j] * idv + F(16.5)))) & 0xFF
            xi1 = min(31, i8(np.int32(x[b + 16 + j] * idv + F(16.5)))) & 0xFF
            qh = _q5_store(out, o, 6, j, xi0, xi1, qh)
        _put_u32(out, o + 2, qh)


@njit(error_model="numpy")
def q5_1_row(x, out):
    for i in range(x.shape[0] // 32):
        b = i * 32
        o = i * 24
        lo, idv = _min_head(x, b, out, o, F(31.0))
        qh = np.uint32(0)
        for j in range(16):
            xi0 = np.int32((x[b + j] - lo) * idv + F(0.5)) & 0xFF
            xi1 = np.int32((x[b + 16 + j] - lo) * idv + F(0.5)) & 0xFF
            qh = _q5_store(out, o, 8, j, xi0, xi1, qh)
        _put_u32(out, o + 4, qh)


@njit(error_model="numpy")
def q8_0_row(x, out):
    for i in range(x.shape[0] // 32):
        b = i * 32
        o = i * 34
        amax = F(0.0)
        for j in range(32):
            amax = max(amax, abs(x[b + j]))
        d = amax / F(127.0)
        idv = F(1.0) / d if d != F(0.0) else F(0.0)
        put_f16(out, o, d)
        for j in range(32):
            out[o + 2 + j] = np.uint8(np.int32(roundf(x[b + j] * idv)) & 0xFF)


@njit(error_model="numpy")
def f16_row(x, out):
    for j in range(x.shape[0]):
        put_f16(out, 2 * j, x[j])


@njit(error_model="numpy")
def bf16_row(x, out):
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN forced quiet."""
    for j in range(x.shape[0]):
        u = bits_of_f32(x[j])
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            h = (u >> np.uint32(16)) | np.uint32(64)
        else:
            h = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
        out[2 * j] = np.uint8(h & np.uint32(0xFF))
        out[2 * j + 1] = np.uint8((h >> np.uint32(8)) & np.uint32(0xFF))


# ggml's kvalues_iq4nl: the 16 non-linear levels of IQ4_NL.
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        dtype=np.int8)


@njit(inline="always", error_model="numpy")
def _best_index_iq4nl(values, x):
    """ggml's best_index_int8(16, values, x): the nearest level (bisection, ties upward)."""
    if x <= F(values[0]):
        return 0
    if x >= F(values[15]):
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < F(values[mav]):
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - F(values[mu - 1]) < F(values[mu]) - x else mu


@njit(error_model="numpy")
def iq4_nl_row(x, out):
    """quantize_iq4_nl without an importance matrix: quantize_row_iq4_nl_impl(32, 32, …,
    ntry=7) per block; block_iq4_nl is d f16 | qs[16] (18 bytes)."""
    iq4_nl_rows(x, x, False, out)


@njit(inline="always", error_model="numpy")
def _iq4_fit(values, idv, x, b, weight):
    """The weighted sums (q . x, q . q) of the 32 values at b snapped to the nearest levels
    at inverse scale idv (one trial of `iq4_block_scale`)."""
    sumqx = F(0.0)
    sumq2 = F(0.0)
    for j in range(32):
        xj = x[b + j]
        q = F(values[_best_index_iq4nl(values, idv * xj)])
        w = weight[j]
        sumqx += w * q * xj
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(inline="always", error_model="numpy")
def iq4_block_scale(x, b, weight):
    """quantize_row_iq4_nl_impl's search for one 32-block's scale (ntry=7): the weighted
    least-squares scale of the levels at -max/values[0], then of 15 trial scales around it
    (0 where the block's largest |x| is under 1e-15)."""
    values = IQ4NL_VALUES
    amax, mx = absmax_signed(x, b, 32)
    if amax < F(1e-15):
        return F(0.0)
    d = -mx / F(values[0])
    sumqx, sumq2 = _iq4_fit(values, F(1.0) / d, x, b, weight)
    d = sumqx / sumq2 if sumq2 > F(0.0) else F(0.0)
    best = d * sumqx
    for itry in range(-7, 8):
        sumqx, sumq2 = _iq4_fit(values, F(itry + np.int64(values[0])) / mx, x, b, weight)
        if sumq2 > F(0.0) and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(inline="always", error_model="numpy")
def iq4_weights(x, b, n, qw, use_qw, sigma_base, weight):
    """quantize_row_iq4_nl_impl's weights of the 32 values at b: qw[j] * sqrt(sigma2 + x[j]^2)
    (sigma2: twice the mean square of the n values at sigma_base) when use_qw, else x[j]^2."""
    if use_qw:
        sigma2 = F(0.0)
        for j in range(n):
            sigma2 += x[sigma_base + j] * x[sigma_base + j]
        sigma2 *= F(2.0) / F(n)
        for j in range(32):
            weight[j] = qw[b + j] * np.sqrt(sigma2 + x[b + j] * x[b + j])
    else:
        for j in range(32):
            weight[j] = x[b + j] * x[b + j]


@njit(inline="always", error_model="numpy")
def iq4_nl_rows(x, qw, use_qw, out):
    """quantize_row_iq4_nl_impl per 32-block (`iq4_weights`, `iq4_block_scale`)."""
    values = IQ4NL_VALUES
    L = np.zeros(32, dtype=np.int64)
    weight = np.zeros(32, dtype=np.float32)
    for i in range(x.shape[0] // 32):
        b = i * 32
        o = i * 18
        iq4_weights(x, b, 32, qw, use_qw, b, weight)
        scale = iq4_block_scale(x, b, weight)
        put_f16(out, o, scale)
        idv = F(1.0) / scale if scale != F(0.0) else F(0.0)
        for j in range(32):
            L[j] = _best_index_iq4nl(values, idv * x[b + j])
        for j in range(16):
            out[o + 2 + j] = np.uint8(L[j] | (L[16 + j] << 4))


# ggml's kvalues_mxfp4: the E2M1 values, doubled (the scale is halved to match).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


@njit(inline="always", error_model="numpy")
def _best_index_mxfp4(x, d):
    """ggml's best_index_mxfp4: the level nearest x at scale d (the first one on ties)."""
    best = 0
    best_err = abs(F(MXFP4_VALUES[0]) * d - x)
    for i in range(1, 16):
        err = abs(F(MXFP4_VALUES[i]) * d - x)
        if err < best_err:
            best = i
            best_err = err
    return best


@njit(error_model="numpy")
def mxfp4_row(x, out):
    """quantize_row_mxfp4_ref: per 32-block an E8M0 exponent e = floor(log2f(amax)) - 2 + 127
    (0 for an all-zero block) and 16 bytes of nibbles, value j low and j + 16 high. log2f is
    taken as the f64 log2 rounded to f32 (glibc's log2f is correctly rounded, so the floor
    agrees even for amax just below a power of two)."""
    for i in range(x.shape[0] // 32):
        b = i * 32
        o = i * 17
        amax = F(0.0)
        for j in range(32):
            if amax < abs(x[b + j]):
                amax = abs(x[b + j])
        e = np.int32(0)
        if amax > F(0.0):
            lg = F(np.log2(np.float64(amax)))
            e = np.int32(np.floor(lg) - F(2.0) + F(127.0)) & 0xFF  # C's (uint8_t) of the float
        # ggml_e8m0_to_fp32_half: 2^(e - 128), the two smallest as denormals
        bits = np.uint32(0x00200000) << np.uint32(e) if e < 2 else np.uint32(e - 1) << np.uint32(23)
        d = bits_to_f32(bits)
        out[o] = np.uint8(e)
        for j in range(16):
            lo = _best_index_mxfp4(x[b + j], d)
            hi = _best_index_mxfp4(x[b + 16 + j], d)
            out[o + 1 + j] = np.uint8(lo | (hi << 4))
