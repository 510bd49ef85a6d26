"""Block dot products written as LLVM vector IR (numba intrinsics), inlined into the kernels.

numba's auto-vectorisation of small int8 dots is fragile (it depends on loop shapes, SLP settings
and function size) and, when it works, reduces every block to a scalar (a horizontal sum per 32
values). These intrinsics spell the work out as vector IR, organised like ggml's AVX2 code:

- unpack a block's weight codes to 32 bytes (nibbles, 5th bits from a bit mask, 6-bit Q6_K codes);
- exact int32 lane sums of (code - offset) * x: with VNNI one `vpdpbusd` gives 8 lanes of 4-sums
  (u8 x s8; the code offset is a second vpdpbusd of the constant), else the portable
  mul/add-adjacent-pairs form that x86 lowers to `vpmaddwd` gives 16 lanes;
- 32-value types (`acc_*`, 8 blocks a call; `acc4_*`, `acc1_*` for a row's tail): lanes times
  d_w * d_x (per block) are added to an f32 accumulator array that LLVM keeps in registers;
- K-quants (`ksuper_*`, one 256-value super-block a call, scales unpacked in-register): lanes
  times the sub-block scales are added to an int32 accumulator (exact); `kflush` moves it into the
  f32 accumulator scaled by d_w * d_x. Q4_K/Q5_K return their integer min correction.

The scalar total is taken once per row. Arguments are 1-D contiguous arrays plus element offsets;
nothing is bounds-checked. numba's cache does not see edits here: touch dot32.py / dotk.py after
changing this file.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import half_to_float, target_has

_I1 = ir.IntType(1)
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()



# u8 x s8 dot in groups of 4 (vpdpbusd): AVX512-VNNI with VL, or AVX-VNNI
HAS_VNNI = target_has("avxvnni") or target_has("avx512vnni", "avx512vl")
LANES = 8 if HAS_VNNI else 16  # lanes per block sum: 4-sums (vpdpbusd) or pair sums (pmaddwd)


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat(builder: Any, v: Any, n: int) -> Any:
    """Broadcast scalar v (an IR value or a Python int for i8) to n lanes."""
    if isinstance(v, int):
        return ir.Constant(_vec(_I8, n), [v] * n)
    undef = ir.Constant(_vec(v.type, n), None)
    v1 = builder.insert_element(undef, v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v1, undef, ir.Constant(_vec(_I32, n), [0] * n))


def _ptr(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any) -> Any:
    arr = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(
        context, builder, aryty, arr, [idx], wraparound=False, boundscheck=False
    )


def _load(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any, ty: ir.Type) -> Any:
    """Unaligned load of one `ty` (a scalar or a vector) starting at ary[idx]."""
    ptr = _ptr(context, builder, aryty, ary, idx)
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def _f16_at(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any) -> Any:
    return half_to_float(builder, _load(context, builder, aryty, ary, idx, _I16))


def _nibbles(builder: Any, q: Any) -> Any:
    """16 packed bytes -> 32 codes: low nibbles first, then high nibbles."""
    lo = builder.and_(q, _splat(builder, 15, 16))
    hi = builder.lshr(q, _splat(builder, 4, 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))


def _vpdpbusd(builder: Any, u: Any, x: Any) -> Any:
    """<8 x i32>: sums of 4 adjacent u8 x s8 products of two <32 x i8> (one vpdpbusd)."""
    v8 = _vec(_I32, 8)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v8, [v8, v8, v8]), "llvm.x86.avx512.vpdpbusd.256")
    zero = ir.Constant(v8, [0] * 8)
    return builder.call(fn, [zero, builder.bitcast(u, v8), builder.bitcast(x, v8)])


def _lane_sums(builder: Any, codes: Any, x: Any, offset: int, signed: bool) -> Any:
    """Exact int32 lane sums of (code - offset) * x over 32 values: <8 x i32> of 4-sums with
    VNNI, else <16 x i32> of pair sums (the pmaddwd pattern). `signed` codes are int8 (Q8_0)."""
    if HAS_VNNI:
        if signed:  # u8 operand required: code + 128, and subtract 128 * x below
            codes = builder.xor(codes, _splat(builder, 0x80, 32))
            offset = 128
        lanes = _vpdpbusd(builder, codes, x)
        if offset:
            lanes = builder.sub(lanes, _vpdpbusd(builder, _splat(builder, offset, 32), x))
        return lanes
    n = codes.type.count
    a = builder.sext(codes, _vec(_I32, n)) if signed else builder.zext(codes, _vec(_I32, n))
    if offset:
        a = builder.sub(a, ir.Constant(_vec(_I32, n), [offset] * n))
    m = builder.mul(a, builder.sext(x, _vec(_I32, n)))
    even = builder.shuffle_vector(m, m, ir.Constant(_vec(_I32, n // 2), list(range(0, n, 2))))
    odd = builder.shuffle_vector(m, m, ir.Constant(_vec(_I32, n // 2), list(range(1, n, 2))))
    return builder.add(even, odd)


def _acc_ptr(context: Any, builder: Any, aryty: Any, ary: Any, elem: ir.Type,
             lane0: Any = None) -> Any:
    """Pointer to the 16 lanes acc[lane0 : lane0+16] as a vector."""
    ptr = _ptr(context, builder, aryty, ary, lane0 if lane0 is not None else ir.Constant(_I32, 0))
    return builder.bitcast(ptr, _vec(elem, LANES).as_pointer())


def _fma_into(context: Any, builder: Any, aryty: Any, ary: Any, lanes: Any, d: Any,
              lane0: Any = None) -> None:
    """acc[lane0 : lane0+16] += d * float(lanes)."""
    ptr = _acc_ptr(context, builder, aryty, ary, _F32, lane0)
    prod = builder.fmul(_splat(builder, d, LANES), builder.sitofp(lanes, _vec(_F32, LANES)),
                        flags=["fast"])
    builder.store(builder.fadd(builder.load(ptr, align=4), prod, flags=["fast"]), ptr, align=4)


def _codes32(context: Any, builder: Any, w_t: Any, w_v: Any, base: Any, qs_off: int,
             qh_off: int | None, signed: bool) -> Any:
    """The 32 codes of the block at byte `base` as <32 x i8> (raw int8 for Q8_0)."""

    def at(off: int) -> Any:
        return builder.add(base, ir.Constant(base.type, off))

    if signed:  # Q8_0
        return _load(context, builder, w_t, w_v, at(qs_off), _vec(_I8, 32))
    codes = _nibbles(builder, _load(context, builder, w_t, w_v, at(qs_off), _vec(_I8, 16)))
    if qh_off is not None:  # 5th bits: bit j of a u32 -> byte j
        qh = _load(context, builder, w_t, w_v, at(qh_off), _I32)
        bits = builder.zext(builder.bitcast(qh, _vec(_I1, 32)), _vec(_I8, 32))
        codes = builder.or_(codes, builder.shl(bits, _splat(builder, 4, 32)))
    return codes


def _concat(builder: Any, parts: list[Any]) -> Any:
    """Concatenate equal-length vectors (a power-of-two count), pairwise."""
    while len(parts) > 1:
        n = parts[0].type.count
        mask = ir.Constant(_vec(_I32, 2 * n), list(range(2 * n)))
        parts = [builder.shuffle_vector(a, b, mask) for a, b in zip(parts[::2], parts[1::2],
                                                                     strict=True)]
    return parts[0]


def _blocks(size: int, qs_off: int, qh_off: int | None, offset: int, signed: bool = False,
            count: int = 8, m_off: int | None = None) -> Any:
    """An intrinsic acc(acc, lane0, w, x, xd, xs, b) for `count` consecutive 32-value blocks
    b, b+1.. of a row `w` with `size`-byte blocks: for each block, acc lanes += f16(d_w) * xd[b] *
    lane sums of (code - offset) * x[32b : 32b+32]; block k uses lanes lane0 + k*L ... With
    `m_off` (Q4_1/Q5_1) the block's f16 min times the activation's xs[b] is added as well."""

    def typer(typingctx: Any, acc: Any, lane0: Any, w: Any, x: Any, xd: Any, xs: Any,
              b: Any) -> Any:
        sig = types.void(acc, lane0, w, x, xd, xs, b)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            acc_t, _, w_t, x_t, xd_t, xs_t, b_t = signature.args
            acc_v, lane0, w_v, x_v, xd_v, xs_v, b = args
            b = context.cast(builder, b, b_t, types.uint64)
            u64 = b.type
            base = builder.mul(b, ir.Constant(u64, size))
            bases = [builder.add(base, ir.Constant(u64, k * size)) for k in range(count)]
            xo = builder.mul(b, ir.Constant(u64, 32))
            parts = []
            for k in range(count):
                codes = _codes32(context, builder, w_t, w_v, bases[k], qs_off, qh_off, signed)
                xk = _load(context, builder, x_t, x_v, builder.add(xo, ir.Constant(u64, 32 * k)),
                           _vec(_I8, 32))
                parts.append(_lane_sums(builder, codes, xk, offset, signed))
            lanes = _concat(builder, parts)
            def per_block(arr_t: Any, arr_v: Any, field: int) -> tuple[Any, Any]:
                """(f16 field of each block as <count x f32>, arr[b:b+count] as <count x f32>)"""
                act = builder.load(builder.bitcast(_ptr(context, builder, arr_t, arr_v, b),
                                                   _vec(_F32, count).as_pointer()), align=4)
                wv = ir.Constant(_vec(_F32, count), None)
                for k in range(count):
                    f = _f16_at(context, builder, w_t, w_v,
                                builder.add(bases[k], ir.Constant(u64, field)))
                    wv = builder.insert_element(wv, f, ir.Constant(_I32, k))
                return wv, act

            dw, dx = per_block(xd_t, xd_v, 0)
            dk = builder.fmul(dw, dx)  # d_w * d_x per block, broadcast over its lanes
            n = LANES * count
            dv = builder.shuffle_vector(dk, dk, ir.Constant(
                _vec(_I32, n), [k for k in range(count) for _ in range(LANES)]))
            add = builder.fmul(dv, builder.sitofp(lanes, _vec(_F32, n)), flags=["fast"])
            if m_off is not None:  # + m_w * s_x per block, into the block's first lane
                mw, sx = per_block(xs_t, xs_v, m_off)
                ms = builder.fmul(mw, sx)
                ms = builder.shuffle_vector(ms, ir.Constant(_vec(_F32, count), [0.0] * count),
                                            ir.Constant(_vec(_I32, n), [
                                                k if i == 0 else count
                                                for k in range(count) for i in range(LANES)]))
                add = builder.fadd(add, ms, flags=["fast"])
            ptr = _ptr(context, builder, acc_t, acc_v, lane0)
            ptr = builder.bitcast(ptr, _vec(_F32, n).as_pointer())
            builder.store(builder.fadd(builder.load(ptr, align=4), add, flags=["fast"]), ptr,
                          align=4)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


# acc_<type>: BLOCKS_PER_CALL blocks per call; acc4_ / acc1_: 4 and 1 blocks (a row's tail)
BLOCKS_PER_CALL = 8
# name: (block bytes, qs offset, qh offset, code offset, signed codes, m offset)
_LAYOUTS = {
    "q4_0": (18, 2, None, 8, False, None),
    "q4_1": (20, 4, None, 0, False, 2),
    "q5_0": (22, 6, 2, 16, False, None),
    "q5_1": (24, 8, 4, 0, False, 2),
    "q8_0": (34, 2, None, 0, True, None),
}


def _family(name: str, count: int) -> Any:
    size, qs, qh, off, signed, m = _LAYOUTS[name]
    return _blocks(size, qs, qh, off, signed, count=count, m_off=m)


acc_q4_0, acc4_q4_0, acc1_q4_0 = (_family("q4_0", n) for n in (8, 4, 1))
acc_q4_1, acc4_q4_1, acc1_q4_1 = (_family("q4_1", n) for n in (8, 4, 1))
acc_q5_0, acc4_q5_0, acc1_q5_0 = (_family("q5_0", n) for n in (8, 4, 1))
acc_q5_1, acc4_q5_1, acc1_q5_1 = (_family("q5_1", n) for n in (8, 4, 1))
acc_q8_0, acc4_q8_0, acc1_q8_0 = (_family("q8_0", n) for n in (8, 4, 1))


def _reduce_add(builder: Any, v: Any) -> Any:
    name = f"llvm.vector.reduce.add.v{v.type.count}i32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v.type]), name)
    return builder.call(fn, [v])


def _ksuper(kind: str) -> Any:
    """An intrinsic kacc(iacc, w, base, x, xo, bsums, bso) for one 256-value K-quant super-block
    at byte `base` of w, activation quants x[xo:xo+256] and their 16-value sums bsums[bso:bso+16]:
    iacc (int32 lanes) += sum over sub-blocks of scale * lane sums of codes . x. Returns the
    int32 sum over sub-blocks of min * (activation sum) for Q4_K/Q5_K (0 for Q6_K)."""

    def typer(typingctx: Any, iacc: Any, w: Any, base: Any, x: Any, xo: Any, bsums: Any,
              bso: Any) -> Any:
        sig = types.int32(iacc, w, base, x, xo, bsums, bso)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            iacc_t, w_t, base_t, x_t, xo_t, bs_t, _ = signature.args
            iacc_v, w_v, base, x_v, xo, bs_v, bso = args
            base = context.cast(builder, base, base_t, types.uint64)
            xo = context.cast(builder, xo, xo_t, types.uint64)

            def wat(off: int) -> Any:
                return builder.add(base, ir.Constant(base.type, off))

            def xat(off: int) -> Any:
                return builder.add(xo, ir.Constant(xo.type, off))

            def splat_lane(vec: Any, idx: list[int]) -> Any:
                return builder.shuffle_vector(vec, vec, ir.Constant(_vec(_I32, len(idx)), idx))

            ptr = builder.bitcast(_ptr(context, builder, iacc_t, iacc_v, ir.Constant(_I32, 0)),
                                  _vec(_I32, LANES).as_pointer())
            acc = builder.load(ptr, align=4)
            if kind == "q6":
                sc = builder.sext(_load(context, builder, w_t, w_v, wat(192), _vec(_I8, 16)),
                                  _vec(_I32, 16))
                half = LANES // 2
                for n in range(2):
                    h = _load(context, builder, w_t, w_v, wat(128 + 32 * n), _vec(_I8, 32))
                    for k in range(4):
                        q = _load(context, builder, w_t, w_v, wat(64 * n + 32 * (k & 1)),
                                  _vec(_I8, 32))
                        lo = builder.and_(builder.lshr(q, _splat(builder, 4 * (k >> 1), 32)),
                                          _splat(builder, 15, 32))
                        hi = builder.and_(builder.lshr(h, _splat(builder, 2 * k, 32)),
                                          _splat(builder, 3, 32))
                        codes = builder.or_(lo, builder.shl(hi, _splat(builder, 4, 32)))
                        xv = _load(context, builder, x_t, x_v, xat(128 * n + 32 * k),
                                   _vec(_I8, 32))
                        lanes = _lane_sums(builder, codes, xv, 32, False)
                        s0 = 8 * n + 2 * k
                        acc = builder.add(acc, builder.mul(
                            lanes, splat_lane(sc, [s0] * half + [s0 + 1] * half)))
                builder.store(acc, ptr, align=4)
                return ir.Constant(_I32, 0)
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
            for i, v in enumerate((builder.and_(u0, m3f), t1, builder.and_(u1, m3f), t3)):
                words = builder.insert_element(words, v, c(i))
            sm = builder.zext(builder.bitcast(words, _vec(_I8, 16)), _vec(_I32, 16))
            # mins . (pair sums of the 16-value activation sums)
            bsv = _load(context, builder, bs_t, bs_v, bso, _vec(_I16, 16))
            bsv = builder.sext(bsv, _vec(_I32, 16))
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
                    xv = _load(context, builder, x_t, x_v, xat(64 * j + 32 * half_i),
                               _vec(_I8, 32))
                    lanes = _lane_sums(builder, codes, xv, 0, False)
                    acc = builder.add(acc, builder.mul(
                        lanes, splat_lane(sm, [2 * j + half_i] * LANES)))
            builder.store(acc, ptr, align=4)
            return summ

        return sig, codegen

    return intrinsic(typer)


ksuper_q4: Any = _ksuper("q4")
ksuper_q5: Any = _ksuper("q5")
ksuper_q6: Any = _ksuper("q6")


def _kflush(typingctx: Any, acc: Any, iacc: Any, d: Any) -> Any:
    """acc += d * float(iacc); iacc = 0 (end of a K-quant super-block)."""
    sig = types.void(acc, iacc, d)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        t = signature.args
        iptr = _acc_ptr(context, builder, t[1], args[1], _I32)
        d = context.cast(builder, args[2], t[2], types.float32)
        _fma_into(context, builder, t[0], args[0], builder.load(iptr, align=4), d)
        builder.store(ir.Constant(_vec(_I32, LANES), [0] * LANES), iptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


kflush: Any = intrinsic(_kflush)
