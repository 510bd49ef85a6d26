"""Row dots for repacked Q4_K weights (`repack.repack_q4_k`), as LLVM vector IR intrinsics.

The plain K-quant rows (`simd_k`) spend two instructions per 64 codes and token (pmaddubsw, then
vpdpwssd against the scales) plus a per-super-block reduction. A repacked Q4_K row holds its
codes already transposed, one 32-value sub-block per int32 lane (as the 32-value types'
multi-row dots do), so per token and group of 2 super-blocks (16 sub-blocks; an odd last one is
a group of 8) the exact sub-block sums (code . x) come from 8 vpdpbusd against
`block_transpose`'s activation; times the scales (one integer multiply), as floats, times
d_w * d_x (per lane) they go into a 16-lane accumulator, and the mins times the activation's
sub-block sums, as floats, times -dmin_w * d_x into a second one.

All integer steps are exact (|sum * scale| < 2^24, so the float conversions are too); the float
operations for a token do not depend on how many tokens share the pass, so results are
batch-invariant. They differ from the plain rows' by float rounding only (a different order).
Measured on the dev machine kind, 2 threads: 512-token passes ~470 -> ~590 GFLOP/s, small
batches unchanged. The same scheme for Q6_K (16 sub-blocks of 16 per super-block) measured no
faster than its plain rows, so Q6_K is not repacked. AVX512-VNNI only (weights are repacked only
there).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._llvm import half_to_float
from .simd import (
    _F32,
    _I8,
    _I16,
    _I32,
    MAX_TOKENS,
    PREFETCH,
    _fma_fold,
    _hsum,
    _ld,
    _phi_loop,
    _prefetch_ir,
    _row_front,
    _splat,
    _store_totals,
    _token_rows,
    _vec,
    _vpdpbusd,
)
from .simd_k import scales_mins

Q4K_SIZE = 144
WIDE = 16  # accumulator lanes


def _lanes(builder: Any, parts: list[Any], idx: list[int]) -> Any:
    """Lanes `idx` of the concatenation of two equal vectors (or of one)."""
    a = parts[0]
    b = parts[1] if len(parts) > 1 else a
    return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, len(idx)), idx))


def _splat_f(builder: Any, parts: list[Any], count: int) -> Any:
    """<count x f32>: scalar k of `parts` repeated over lanes 8k..8k+7 (one shuffle)."""
    v = ir.Constant(_vec(_F32, len(parts)), None)
    for k, f in enumerate(parts):
        v = builder.insert_element(v, f, ir.Constant(_I32, k))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, count), [i // 8 for i in range(
        count)]))


def _q4k_group(builder: Any, w: Any, base: Any, count: int) -> tuple[Any, ...]:
    """A repacked Q4_K group of count // 8 super-blocks at byte `base`: eight <4 count x i8>
    transposed code vectors, scales and mins <count x i32>, d and -dmin <count x f32>. Group
    bytes: per super-block its 16 header bytes (d, dmin, 12 bytes of scales/mins) | four
    4*count-byte chunks, byte 4i + c of chunk j = code 4j + c (low nibble) and 16 + 4j + c (high
    nibble) of sub-block i."""
    u64 = base.type
    n_sb = count // 8
    n = 4 * count
    wt: list[Any] = [None] * 8
    for j in range(4):
        q = _ld(builder, w, builder.add(base, ir.Constant(u64, 16 * n_sb + n * j)), _vec(_I8, n))
        wt[j] = builder.and_(q, _splat(builder, 15, n))
        wt[j + 4] = builder.lshr(q, _splat(builder, 4, n))
    sms = [scales_mins(builder, w, builder.add(base, ir.Constant(u64, 16 * k + 4)))
           for k in range(n_sb)]
    if n_sb == 2:
        sc = _lanes(builder, sms, list(range(8)) + list(range(16, 24)))
        mn = _lanes(builder, sms, list(range(8, 16)) + list(range(24, 32)))
    else:
        sc = _lanes(builder, sms, list(range(8)))
        mn = _lanes(builder, sms, list(range(8, 16)))
    ds, dms = [], []
    for k in range(n_sb):
        at = builder.add(base, ir.Constant(u64, 16 * k))
        ds.append(half_to_float(builder, _ld(builder, w, at, _I16)))
        dms.append(builder.fneg(half_to_float(builder, _ld(
            builder, w, builder.add(at, ir.Constant(u64, 2)), _I16))))
    return wt, sc, mn, _splat_f(builder, ds, count), _splat_f(builder, dms, count)


def _row_dot_q4kp(ntok: int) -> Any:
    """An intrinsic rowdot(w, xt, xd, xs, t, out, r) -> None: out[t + j, r] for j < ntok, one
    repacked Q4_K weight row against activation rows t.. (2-D arrays): xt from
    `block_transpose`, xd the Q8_K scale per 32 values (f32), xs the activation's sums per 32
    values (int32)."""
    size = Q4K_SIZE

    def typer(typingctx: Any, w: Any, xt: Any, xd: Any, xs: Any, t: Any, out: Any,
              r: Any) -> Any:
        sig = types.void(w, xt, xd, xs, t, out, r)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            w_p, acts, t_v, (out_t, out_v), r_v, nsb = _row_front(
                context, builder, signature, args, 0, 256)
            u64 = ir.IntType(64)
            toks = _token_rows(context, builder, t_v, ntok, acts)
            zero = ir.Constant(_vec(_F32, WIDE), [0.0] * WIDE)

            def prefetch(start: Any, nbytes: int) -> None:
                for off in range(0, nbytes, 64):
                    _prefetch_ir(builder, builder.gep(w_p, [builder.add(
                        start, ir.Constant(u64, PREFETCH + off))]))

            def q4_step(first_sb: Any, count: int) -> Any:
                def body(i: Any, vals: list[Any]) -> list[Any]:
                    sb = builder.add(first_sb, builder.mul(i, ir.Constant(u64, count // 8)))
                    base = builder.mul(sb, ir.Constant(u64, size))
                    prefetch(base, size * count // 8)
                    wt, sc, mn, dw, ndm = _q4k_group(builder, w_p, base, count)
                    b = builder.mul(sb, ir.Constant(u64, 8))  # first 32-value block
                    xo = builder.mul(b, ir.Constant(u64, 32))
                    fo = builder.mul(b, ir.Constant(u64, 4))
                    ivec = _vec(_I32, count)
                    acc, accm = [], []
                    for j, (xt, xd, xs) in enumerate(toks):
                        sums = [ir.Constant(ivec, [0] * count)] * 2
                        for g in range(8):
                            xv = _ld(builder, xt, builder.add(xo, ir.Constant(
                                u64, 4 * count * g)), _vec(_I8, 4 * count))
                            sums[g % 2] = _vpdpbusd(builder, wt[g], xv, sums[g % 2])
                        isum = builder.mul(builder.add(sums[0], sums[1]), sc)
                        dx = _ld(builder, xd, fo, _vec(_F32, count))
                        acc.append(_fma_fold(builder, builder.fmul(dw, dx),
                                             builder.sitofp(isum, _vec(_F32, count)), vals[j]))
                        msum = builder.mul(_ld(builder, xs, fo, ivec), mn)
                        accm.append(_fma_fold(builder, builder.fmul(ndm, dx),
                                              builder.sitofp(msum, _vec(_F32, count)),
                                              vals[ntok + j]))
                    return acc + accm
                return body

            pairs = builder.udiv(nsb, ir.Constant(u64, 2))
            vals = _phi_loop(builder, pairs, [zero] * (2 * ntok),
                             q4_step(ir.Constant(u64, 0), 16))
            last = builder.mul(pairs, ir.Constant(u64, 2))
            vals = _phi_loop(builder, builder.urem(nsb, ir.Constant(u64, 2)), vals,
                             q4_step(last, 8))
            _store_totals(context, builder, out_t, out_v, t_v, r_v, [
                builder.fadd(_hsum(builder, vals[j]), _hsum(builder, vals[ntok + j]))
                for j in range(ntok)])
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


rowdot_q4_kp: Any = _row_dot_q4kp(1)
rowdot2_q4_kp: Any = _row_dot_q4kp(2)
rowdot4_q4_kp: Any = _row_dot_q4kp(4)
rowdot8_q4_kp: Any = _row_dot_q4kp(MAX_TOKENS)
