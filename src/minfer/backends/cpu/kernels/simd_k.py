"""Row dot products for the K-quants (Q4_K, Q5_K, Q6_K) as LLVM vector IR intrinsics.

One `rowdot_*_k(w_row, x, xd, bsums) -> f32` intrinsic per weight row: per 256-value super-block
the 6-bit scales and mins are unpacked with 32-bit word arithmetic (as ggml), the sub-block codes
are dotted with the Q8_K activation in exact int32 lanes (`simd._lane_sums`: vpdpbusd or pmaddwd),
times the sub-block scales; then d_x * d_w * float(lanes) goes into an f32 register accumulator
and -d_x * dmin_w * (mins . bsums) into a scalar one. One horizontal sum per row.
Edits here are not seen by numba's cache: touch dotk.py afterwards.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (
    _F32,
    _I8,
    _I16,
    _I32,
    LANES,
    PREFETCH,
    _f16_at,
    _lane_sums,
    _load,
    _prefetch_ir,
    _ptr,
    _splat,
    _vec,
)


def _reduce_add(builder: Any, v: Any) -> Any:
    name = f"llvm.vector.reduce.add.v{v.type.count}i32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v.type]), name)
    return builder.call(fn, [v])


def _emit_super(context: Any, builder: Any, arrs: tuple[Any, ...], i: Any,
                kind: str) -> tuple[Any, Any]:
    """IR for super-block i of a K-quant row: (<LANES x i32> sum over sub-blocks of scale * lane
    sums of codes . x, i32 sum of min * activation sums (Q4_K/Q5_K; 0 for Q6_K))."""
    (w_t, w_v), (x_t, x_v), _, (bs_t, bs_v) = arrs
    u64 = i.type
    base = builder.mul(i, ir.Constant(u64, _KSIZE[kind]))
    xo = builder.mul(i, ir.Constant(u64, 256))

    def wat(off: int) -> Any:
        return builder.add(base, ir.Constant(u64, off))

    def xat(off: int) -> Any:
        return builder.add(xo, ir.Constant(u64, off))

    def splat_lane(vec: Any, idx: list[int]) -> Any:
        return builder.shuffle_vector(vec, vec, ir.Constant(_vec(_I32, len(idx)), idx))

    acc = ir.Constant(_vec(_I32, LANES), [0] * LANES)
    if kind == "q6":
        sc = builder.sext(_load(context, builder, w_t, w_v, wat(192), _vec(_I8, 16)),
                          _vec(_I32, 16))
        half = LANES // 2
        for n in range(2):
            h = _load(context, builder, w_t, w_v, wat(128 + 32 * n), _vec(_I8, 32))
            for k in range(4):
                q = _load(context, builder, w_t, w_v, wat(64 * n + 32 * (k & 1)), _vec(_I8, 32))
                lo = builder.and_(builder.lshr(q, _splat(builder, 4 * (k >> 1), 32)),
                                  _splat(builder, 15, 32))
                hi = builder.and_(builder.lshr(h, _splat(builder, 2 * k, 32)),
                                  _splat(builder, 3, 32))
                codes = builder.or_(lo, builder.shl(hi, _splat(builder, 4, 32)))
                xv = _load(context, builder, x_t, x_v, xat(128 * n + 32 * k), _vec(_I8, 32))
                lanes = _lane_sums(builder, codes, xv, 32, False)
                s0 = 8 * n + 2 * k
                acc = builder.add(acc, builder.mul(
                    lanes, splat_lane(sc, [s0] * half + [s0 + 1] * half)))
        return acc, ir.Constant(_I32, 0)
    # Q4_K / Q5_K: unpack the 6-bit scales and mins as ggml does with 32-bit words
    u0, u1, u2 = (_load(context, builder, w_t, w_v, wat(off), _I32) for off in (4, 8, 12))

    def c(v: int) -> Any:
        return ir.Constant(_I32, v)

    m3f, m0f, m03 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
    t3 = builder.or_(builder.and_(builder.lshr(u2, c(4)), m0f),
                     builder.shl(builder.and_(builder.lshr(u1, c(6)), m03), c(4)))
    t1 = builder.or_(builder.and_(u2, m0f),
                     builder.shl(builder.and_(builder.lshr(u0, c(6)), m03), c(4)))
    words = ir.Constant(_vec(_I32, 4), None)
    for j, v in enumerate((builder.and_(u0, m3f), t1, builder.and_(u1, m3f), t3)):
        words = builder.insert_element(words, v, c(j))
    sm = builder.zext(builder.bitcast(words, _vec(_I8, 16)), _vec(_I32, 16))  # 8 sc, 8 mins
    # mins . (pair sums of the 16-value activation sums)
    bsv = builder.sext(_load(context, builder, bs_t, bs_v, builder.mul(i, ir.Constant(u64, 16)),
                             _vec(_I16, 16)), _vec(_I32, 16))
    pairs = builder.add(splat_lane(bsv, list(range(0, 16, 2))),
                        splat_lane(bsv, list(range(1, 16, 2))))
    summ = _reduce_add(builder, builder.mul(pairs, splat_lane(sm, list(range(8, 16)))))
    qs = 48 if kind == "q5" else 16
    h = _load(context, builder, w_t, w_v, wat(16), _vec(_I8, 32)) if kind == "q5" else None
    for j in range(4):
        q = _load(context, builder, w_t, w_v, wat(qs + 32 * j), _vec(_I8, 32))
        for half_i, shift in ((0, 0), (1, 4)):
            codes = builder.and_(builder.lshr(q, _splat(builder, shift, 32)),
                                 _splat(builder, 15, 32))
            if h is not None:
                bit = builder.and_(builder.lshr(h, _splat(builder, 2 * j + half_i, 32)),
                                   _splat(builder, 1, 32))
                codes = builder.or_(codes, builder.shl(bit, _splat(builder, 4, 32)))
            xv = _load(context, builder, x_t, x_v, xat(64 * j + 32 * half_i), _vec(_I8, 32))
            lanes = _lane_sums(builder, codes, xv, 0, False)
            acc = builder.add(acc, builder.mul(lanes, splat_lane(sm, [2 * j + half_i] * LANES)))
    return acc, summ


_KSIZE = {"q4": 144, "q5": 176, "q6": 210}
_KD_OFF = {"q4": 0, "q5": 0, "q6": 208}  # byte offset of the f16 d (Q4_K/Q5_K: dmin follows)


def _row_dot_k(kind: str) -> Any:
    """An intrinsic rowdot(w, x, xd, bsums) -> f32 for one K-quant weight row against a Q8_K
    activation row: per super-block, d_x * d_w * float(int lanes) into an f32 register
    accumulator and -d_x * dmin_w * summ into a scalar one; one horizontal sum at the end."""
    size = _KSIZE[kind]

    def typer(typingctx: Any, w: Any, x: Any, xd: Any, bsums: Any) -> Any:
        sig = types.float32(w, x, xd, bsums)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            arrs = tuple(zip(signature.args, args, strict=True))
            (w_t, w_v), _, (xd_t, xd_v), _ = arrs
            u64 = ir.IntType(64)
            nb = context.make_array(xd_t)(context, builder, xd_v).nitems
            nb = builder.zext(nb, u64) if nb.type.width < 64 else nb
            acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, LANES),
                                                                 [0.0] * LANES))
            accm = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
            w_data = context.make_array(w_t)(context, builder, w_v).data
            with cgutils.for_range(builder, nb) as loop:
                i = loop.index
                base = builder.mul(i, ir.Constant(u64, size))
                for off in range(0, size, 64):
                    _prefetch_ir(builder, builder.gep(w_data, [
                        builder.add(base, ir.Constant(u64, PREFETCH + off))]))
                lanes, summ = _emit_super(context, builder, arrs, i, kind)
                dx = builder.load(_ptr(context, builder, xd_t, xd_v, i))
                dw = _f16_at(context, builder, w_t, w_v,
                             builder.add(base, ir.Constant(u64, _KD_OFF[kind])))
                d = _splat(builder, builder.fmul(dx, dw), LANES)
                add = builder.fmul(d, builder.sitofp(lanes, _vec(_F32, LANES)), flags=["fast"])
                builder.store(builder.fadd(builder.load(acc), add, flags=["fast"]), acc)
                if kind != "q6":
                    dmin = _f16_at(context, builder, w_t, w_v,
                                   builder.add(base, ir.Constant(u64, 2)))
                    m = builder.fmul(builder.fmul(builder.fneg(dx), dmin),
                                     builder.sitofp(summ, _F32), flags=["fast"])
                    builder.store(builder.fadd(builder.load(accm), m, flags=["fast"]), accm)
            total = builder.load(acc)
            result = builder.load(accm)
            for j in range(LANES):
                result = builder.fadd(result, builder.extract_element(total, ir.Constant(_I32, j)),
                                      flags=["fast"])
            return result

        return sig, codegen

    return intrinsic(typer)


rowdot_q4_k: Any = _row_dot_k("q4")
rowdot_q5_k: Any = _row_dot_k("q5")
rowdot_q6_k: Any = _row_dot_k("q6")
