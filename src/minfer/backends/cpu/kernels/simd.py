"""Block dot products written as LLVM vector IR (numba intrinsics), inlined into the kernels.

numba's auto-vectorisation of small int8 dots is fragile (it depends on loop shapes, SLP settings
and function size) and, when it works, reduces every block to a scalar (a horizontal sum per 32
values). These intrinsics spell the work out as vector IR, organised like ggml's AVX2 code:

- unpack a block's weight codes to 32 bytes (nibbles, 5th bits from a bit mask, 6-bit Q6_K codes);
- exact int32 lane sums of (code - offset) * x: with VNNI one `vpdpbusd` gives 8 lanes of 4-sums
  (u8 x s8; the code offset is a second vpdpbusd of the constant), else the portable
  mul/add-adjacent-pairs form that x86 lowers to `vpmaddwd` gives 16 lanes;
- `rowdot_<type>(w_row, x, xd, xs) -> f32` for the 32-value types runs a whole row: steps of
  BLOCKS_PER_CALL blocks (then single blocks), lanes times d_w * d_x per block added to f32
  accumulators that stay in registers, a software prefetch PREFETCH bytes ahead, one horizontal
  sum at the end (ggml's AVX2 loop, minus the per-block reduction);
- the K-quant rows (`simd_k`) reuse these helpers.

Arguments are 1-D contiguous arrays; nothing is bounds-checked. numba's cache does not see edits
here: touch dot32.py / dotk.py after changing this file.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import HAS_F16C, half_to_float, target_has

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


def _emit_blocks(context: Any, builder: Any, arrs: tuple[Any, ...], b: Any, count: int,
                 layout: tuple[int, int, int | None, int, bool, int | None]) -> Any:
    """IR for `count` consecutive blocks b.. of a row: <count*LANES x f32> lane contributions
    d_w * d_x * (lane sums of (code - offset) * x) (+ m_w * s_x in each block's first lane)."""
    size, qs_off, qh_off, offset, signed, m_off = layout
    (w_t, w_v), (x_t, x_v), (xd_t, xd_v), (xs_t, xs_v) = arrs
    u64 = b.type
    bases = [builder.mul(builder.add(b, ir.Constant(u64, k)), ir.Constant(u64, size))
             for k in range(count)]
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
        if count == 1:
            f = _f16_at(context, builder, w_t, w_v, builder.add(bases[0], ir.Constant(u64, field)))
            return builder.insert_element(ir.Constant(_vec(_F32, 1), None), f,
                                          ir.Constant(_I32, 0)), act
        # one wide load of the blocks' bytes, then a byte shuffle picks the f16 fields
        span = size * (count - 1) + field + 2
        raw = _load(context, builder, w_t, w_v, bases[0], _vec(_I8, span))
        idx = [size * k + field + i for k in range(count) for i in range(2)]
        pairs = builder.shuffle_vector(raw, raw, ir.Constant(_vec(_I32, 2 * count), idx))
        halves = builder.bitcast(pairs, _vec(_I16, count))
        if HAS_F16C:  # one vcvtph2ps
            return builder.fpext(builder.bitcast(halves, _vec(ir.HalfType(), count)),
                                 _vec(_F32, count)), act
        wv = ir.Constant(_vec(_F32, count), None)
        for k in range(count):
            f = half_to_float(builder, builder.extract_element(halves, ir.Constant(_I32, k)))
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
    return add


def _prefetch_ir(builder: Any, ptr: Any) -> None:
    i32 = ir.IntType(32)
    i8p = ir.IntType(8).as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                      ir.Constant(i32, 1)])


def _row_dot(layout: tuple[int, int, int | None, int, bool, int | None]) -> Any:
    """An intrinsic rowdot(w, x, xd, xs) -> f32: the dot of one weight row (uint8 block bytes)
    with a quantized activation row (x int8, xd per-block scales, xs per-block Q8_1 sums).
    Steps of BLOCKS_PER_CALL blocks, then single blocks; the accumulators stay in registers and
    a software prefetch runs PREFETCH bytes ahead."""
    size = layout[0]

    def typer(typingctx: Any, w: Any, x: Any, xd: Any, xs: Any) -> Any:
        sig = types.float32(w, x, xd, xs)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            arrs = tuple(zip(signature.args, args, strict=True))
            nb = builder.udiv(context.make_array(signature.args[1])(
                context, builder, args[1]).nitems, ir.Constant(cgutils.intp_t, 32))
            u64 = ir.IntType(64)
            nb = builder.zext(nb, u64) if nb.type.width < 64 else nb
            n_main = builder.udiv(nb, ir.Constant(u64, BLOCKS_PER_CALL))
            wide = _vec(_F32, LANES * BLOCKS_PER_CALL)
            acc = cgutils.alloca_once_value(builder, ir.Constant(wide, [0.0] * wide.count))
            acc1 = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, LANES),
                                                                  [0.0] * LANES))
            w_data = context.make_array(signature.args[0])(context, builder, args[0]).data
            with cgutils.for_range(builder, n_main) as loop:
                b = builder.mul(loop.index, ir.Constant(u64, BLOCKS_PER_CALL))
                start = builder.add(builder.mul(b, ir.Constant(u64, size)),
                                    ir.Constant(u64, PREFETCH))
                for off in range(0, size * BLOCKS_PER_CALL, 64):
                    _prefetch_ir(builder, builder.gep(w_data, [
                        builder.add(start, ir.Constant(u64, off))]))
                add = _emit_blocks(context, builder, arrs, b, BLOCKS_PER_CALL, layout)
                builder.store(builder.fadd(builder.load(acc), add, flags=["fast"]), acc)
            tail0 = builder.mul(n_main, ir.Constant(u64, BLOCKS_PER_CALL))
            with cgutils.for_range(builder, builder.sub(nb, tail0)) as loop:
                add = _emit_blocks(context, builder, arrs, builder.add(tail0, loop.index), 1,
                                   layout)
                builder.store(builder.fadd(builder.load(acc1), add, flags=["fast"]), acc1)
            total = builder.load(acc)
            n = wide.count
            while n > LANES:  # fold halves down to LANES, then add the tail accumulator
                n //= 2
                lo = builder.shuffle_vector(total, total, ir.Constant(_vec(_I32, n),
                                                                      list(range(n))))
                hi = builder.shuffle_vector(total, total, ir.Constant(_vec(_I32, n),
                                                                      list(range(n, 2 * n))))
                total = builder.fadd(lo, hi, flags=["fast"])
            total = builder.fadd(total, builder.load(acc1), flags=["fast"])
            result = builder.extract_element(total, ir.Constant(_I32, 0))
            for i in range(1, LANES):
                result = builder.fadd(result, builder.extract_element(total, ir.Constant(_I32, i)),
                                      flags=["fast"])
            return result

        return sig, codegen

    return intrinsic(typer)


BLOCKS_PER_CALL = 8  # blocks per step of the row loop
PREFETCH = 1024  # software prefetch distance, bytes
# name: (block bytes, qs offset, qh offset, code offset, signed codes, m offset)
_LAYOUTS = {
    "q4_0": (18, 2, None, 8, False, None),
    "q4_1": (20, 4, None, 0, False, 2),
    "q5_0": (22, 6, 2, 16, False, None),
    "q5_1": (24, 8, 4, 0, False, 2),
    "q8_0": (34, 2, None, 0, True, None),
}
rowdot_q4_0: Any = _row_dot(_LAYOUTS["q4_0"])
rowdot_q4_1: Any = _row_dot(_LAYOUTS["q4_1"])
rowdot_q5_0: Any = _row_dot(_LAYOUTS["q5_0"])
rowdot_q5_1: Any = _row_dot(_LAYOUTS["q5_1"])
rowdot_q8_0: Any = _row_dot(_LAYOUTS["q8_0"])
