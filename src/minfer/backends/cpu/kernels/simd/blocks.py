"""Block dot products written as LLVM vector IR (numba intrinsics), inlined into the kernels.

numba's auto-vectorisation of small int8 dots is fragile (it depends on loop shapes, SLP settings
and function size) and, when it works, reduces every block to a scalar (a horizontal sum per 32
values). These intrinsics spell the work out as vector IR, organised like ggml's AVX2 code:

- unpack a block's weight codes to 32 bytes (nibbles, 5th bits from a bit mask, 6-bit Q6_K codes;
  IQ4_NL / MXFP4 / IQ4_XS: the nibbles through their 16 int8 levels by one vpshufb, `_lookup`,
  then dotted as Q8_0's signed codes; MXFP4's E8M0 scale read as ggml's, `_e8m0s`);
- exact int32 lane sums of (code - offset) * x: with VNNI one `vpdpbusd` gives 8 lanes of 4-sums
  (u8 x s8), started from the activation's -offset * 4-sums (`xc`, computed once per call by
  `linear.dots32.lane_corr`: the offset correction depends on the activation only, so it costs
  nothing
  per weight row; Q8_0's signed codes go in as code ^ 0x80 with offset 128); with AVX512-VNNI
  two blocks share one zmm `vpdpbusd` (the lanes are the same as two ymm ones). Without VNNI
  the portable mul/add-adjacent-pairs form that x86 lowers to `vpmaddwd` gives 16 lanes;
- `rowdot_<type>(w_row, x, xt, xd, xs, xc, cb, t, out, r)` for Q4_0/Q4_1/Q5_0/Q5_1 runs a
  whole row against activation row t (`rowdot4_<type>` / `rowdot2_<type>`: rows t..t+3 / t+1,
  each block unpacked once for all): steps of BLOCKS_PER_CALL = 16 blocks (then one of 12 on
  AVX512-VNNI, or of 8 and of 4, then pairs, one),
  whose exact per-block int sums, as floats, times d_w * d_x are fused (one FMA per step) into
  a 16-lane f32 accumulator per token that stays in registers (loop-carried phis), a software
  prefetch PREFETCH bytes ahead, one fixed-order horizontal sum per token at the end. The block
  sums come from the lane sums added down (one row), or, for several rows, from the codes
  transposed once per step (dword j of block i -> lane i of vector j) against the activation
  transposed the same way once per call (`xt`): 8 vpdpbusd per row per 16 blocks, no per-row
  shuffles. Q8_0 (`_row_dot_lanes`, rowdot(w_row, x, xd, xs, xc, t, out, r)) keeps per-lane
  float steps (its codes need no unpacking, so the reductions would slow its one-row dot);
- integer sums are exact whichever way they are formed, so a block's float inputs are the same
  in the one-row and the multi-row code;
- batch invariance: the float operations for one (token, row) are emitted identically whatever
  the number of tokens per pass, and carry no fastmath flags (the kernels are compiled without
  fastmath), so LLVM cannot reassociate them differently: a token's result is bitwise the same
  alone or batched (tests/test_kernels_batch_invariance.py);
- the K-quant rows (`simd.kquants`) reuse these helpers.

Arguments are 1-D contiguous arrays; nothing is bounds-checked. The compiled-code cache is keyed
on every kernel source (`minfer.jit_cache`), so edits here are picked up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.quant.iq_grids import IQ4_LEVELS, MXFP4_LEVELS
from minfer.backends.cpu.kernels.simd.llvm import HAS_F16C, half_to_float, target_has

_I1 = ir.IntType(1)
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()

# u8 x s8 dot in groups of 4 (vpdpbusd): AVX512-VNNI with VL, or AVX-VNNI
HAS_VNNI = target_has("avxvnni") or target_has("avx512vnni", "avx512vl")
HAS_VNNI512 = target_has("avx512vnni", "avx512bw")  # vpdpbusd on zmm: two blocks per op
HAS_FMA = target_has("fma")
_HAS_AVX2 = target_has("avx2")
_HAS_AVX512BW = target_has("avx512bw")
# Block sums as 8 lanes of 4-sums: one vpdpbusd with VNNI; on AVX2 without it the same exact
# integers from pmaddubsw then pmaddwd against ones (as llama.cpp's AVX2 dots: 2 instructions,
# where widening multiplies took ~10), valid because its i16 pair sums cannot saturate: the
# unsigned codes are < 128 and Q8_0's signed ones go in by the sign trick. Only a target
# without AVX2 takes the generic pair sums (16 lanes).
DOT4 = HAS_VNNI or target_has("avx2")
LANES = 8 if DOT4 else 16  # lanes per block sum: 4-sums or pair sums


# a 32-value block type's layout: see `_LAYOUTS`
Layout = tuple[int, int, int | None, int, bool, int | None, tuple[int, ...] | None, bool]


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat(builder: Any, v: Any, n: int) -> Any:
    """Broadcast scalar v (an IR value or a Python int for i8) to n lanes."""
    if isinstance(v, int):
        return ir.Constant(_vec(_I8, n), [v] * n)
    undef = ir.Constant(_vec(v.type, n), None)
    v1 = builder.insert_element(undef, v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v1, undef, ir.Constant(_vec(_I32, n), [0] * n))


def _nibbles(builder: Any, q: Any) -> Any:
    """16 packed bytes -> 32 codes: low nibbles first, then high nibbles."""
    lo = builder.and_(q, _splat(builder, 15, 16))
    hi = builder.lshr(q, _splat(builder, 4, 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))


def _x86(builder: Any, name: str, ret: ir.Type, args: list[Any]) -> Any:
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _pmaddubsw(builder: Any, u: Any, x: Any) -> Any:
    """<n/2 x i16> sums of adjacent u8 x s8 products of <n x i8> (n = 32 or 64; saturating,
    exact while |u1 x1 + u2 x2| < 2^15, e.g. codes <= 127 against x >= -128)."""
    n = u.type.count
    name = "llvm.x86.avx512.pmaddubs.w.512" if n == 64 else "llvm.x86.avx2.pmadd.ub.sw"
    return _x86(builder, name, _vec(_I16, n // 2), [u, x])


def _pmaddwd(builder: Any, a: Any, b: Any) -> Any:
    """<8 x i32> sums of adjacent i16 x i16 products."""
    return _x86(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [a, b])


def _half(builder: Any, v: Any, k: int) -> Any:
    """Half k (0: the low lanes) of vector v."""
    n = v.type.count // 2
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n),
                                                    list(range(k * n, k * n + n))))


def _vpdpbusd(builder: Any, u: Any, x: Any, acc: Any = None) -> Any:
    """acc + sums of 4 adjacent u8 x s8 products of u and x (<32 x i8> -> <8 x i32>, or
    <64 x i8> -> <16 x i32> on zmm): one vpdpbusd. `acc` defaults to zero. Without VNNI
    pmaddubsw, pmaddwd against ones and an add: exact for u <= 127. Without zmm VNNI the
    <64 x i8> form runs as two ymm halves (AVX-VNNI, or AVX2's pmaddubsw)."""
    n = u.type.count // 4
    vn = _vec(_I32, n)
    if n == 16 and not HAS_VNNI512:  # the 16-row interleaved dots on ymm: two halves
        return _concat(builder, [_vpdpbusd(builder, _half(builder, u, k), _half(builder, x, k),
                                           None if acc is None else _half(builder, acc, k))
                                 for k in (0, 1)])
    if not HAS_VNNI:
        quads = _pmaddwd(builder, _pmaddubsw(builder, u, x),
                         ir.Constant(_vec(_I16, 16), [1] * 16))
        return quads if acc is None else builder.add(acc, quads)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vn, [vn, vn, vn]), f"llvm.x86.avx512.vpdpbusd.{32 * n}")
    if acc is None:
        acc = ir.Constant(vn, [0] * n)
    return builder.call(fn, [acc, builder.bitcast(u, vn), builder.bitcast(x, vn)])


# Without VNNI a dot of u8 codes and s8 activations is pmaddubsw (adjacent pairs -> int16),
# then pmaddwd against ones (-> int32). Activation codes are at most 127 in magnitude, so the
# int16 pairs of codes below `code_max` stay within 2 * code_max * 127, and that many of them
# add up in int16 before one pmaddwd without overflow: Q4_0 / Q4_K codes (15) eight, Q5_0 (31)
# four, Q6_K (63) two. The same exact sums with fewer multiplies (the AVX2 limit: two a cycle).
def pairs16_group(code_max: int) -> int:
    """How many pmaddubsw results of codes <= code_max may be summed in int16."""
    return max(1, 32767 // (2 * code_max * 127))


def _dots_pairs16(builder: Any, codes: list[Any], xs: list[Any], acc: Any, code_max: int) -> Any:
    """acc + the exact int32 lane sums of vpdpbusd(codes[k], xs[k]) over k (<64 x i8> vectors
    -> <16 x i32>, on ymm halves; or <32 x i8> -> <8 x i32>, one ymm), without VNNI: int16
    pairs summed in groups of `pairs16_group(code_max)` before each pmaddwd. u8 codes <=
    code_max, s8 |xs| <= 127."""
    group = pairs16_group(code_max)
    ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    split = codes[0].type.count == 64

    def part(v: Any, h: int) -> Any:
        return _half(builder, v, h) if split else v

    out = []
    for h in (0, 1) if split else (0,):
        total = part(acc, h)
        for g0 in range(0, len(codes), group):
            pairs = None
            for k in range(g0, min(len(codes), g0 + group)):
                p = _pmaddubsw(builder, part(codes[k], h), part(xs[k], h))
                pairs = p if pairs is None else builder.add(pairs, p)
            total = builder.add(total, _pmaddwd(builder, pairs, ones))
        out.append(total)
    return _concat(builder, out)


def _lane_sums(builder: Any, codes: Any, x: Any, offset: int, signed: bool,
               corr: Any = None) -> Any:
    """Exact int32 lane sums of (code - offset) * x over 32 values: <8 x i32> of 4-sums with
    VNNI, else <16 x i32> of pair sums (the pmaddwd pattern). `signed` codes are int8 (Q8_0).
    With VNNI, `corr` (when given) is the activation's -offset * 4-sums (`-128` for signed
    codes, whose u8 form is code ^ 0x80), the accumulator the one vpdpbusd starts from; codes
    and x may then also be two blocks (<64 x i8>, 16 lanes, a zmm vpdpbusd)."""
    if DOT4 and signed and not HAS_VNNI:  # |x| . sign(code, x): pair sums <= 2 * 127 * 128
        ax = _x86(builder, "llvm.x86.avx2.psign.b", codes.type, [x, x])
        sc = _x86(builder, "llvm.x86.avx2.psign.b", codes.type, [codes, x])
        return _vpdpbusd(builder, ax, sc)  # (corr unused: these sums need no correction)
    if DOT4:
        if signed:  # u8 operand required: code + 128, and subtract 128 * x below
            codes = builder.xor(codes, _splat(builder, 0x80, codes.type.count))
            offset = 128
        if corr is not None:
            return _vpdpbusd(builder, codes, x, corr)
        lanes = _vpdpbusd(builder, codes, x)
        if offset:
            lanes = builder.sub(lanes, _vpdpbusd(builder, _splat(builder, offset, x.type.count),
                                                 x))
        return lanes
    n = codes.type.count
    a = builder.sext(codes, _vec(_I32, n)) if signed else builder.zext(codes, _vec(_I32, n))
    if offset:
        a = builder.sub(a, ir.Constant(_vec(_I32, n), [offset] * n))
    m = builder.mul(a, builder.sext(x, _vec(_I32, n)))
    even = builder.shuffle_vector(m, m, ir.Constant(_vec(_I32, n // 2), list(range(0, n, 2))))
    odd = builder.shuffle_vector(m, m, ir.Constant(_vec(_I32, n // 2), list(range(1, n, 2))))
    return builder.add(even, odd)


def _concat(builder: Any, parts: list[Any]) -> Any:
    """Concatenate equal-length vectors (a power-of-two count), pairwise."""
    while len(parts) > 1:
        n = parts[0].type.count
        mask = ir.Constant(_vec(_I32, 2 * n), list(range(2 * n)))
        parts = [builder.shuffle_vector(a, b, mask) for a, b in zip(parts[::2], parts[1::2],
                                                                     strict=True)]
    return parts[0]


def _ld(builder: Any, ptr: Any, off: Any, ty: ir.Type) -> Any:
    """Unaligned load of one `ty` at byte offset `off` (an i64 value or int) from an i8*."""
    if isinstance(off, int):
        off = ir.Constant(ir.IntType(64), off)
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer()), align=1)


def _ld_low(builder: Any, ptr: Any, off: Any, n: int, ty: ir.VectorType) -> Any:
    """A `ty` vector whose first n lanes are loaded from byte offset `off` (an i64 value) and
    whose other lanes are zero: one masked load, nothing past the n lanes read (a group of 12
    blocks on a 16-block vector)."""
    if n == ty.count:
        return _ld(builder, ptr, off, ty)
    p = builder.gep(ptr, [off])
    mask = ir.Constant(_vec(_I1, ty.count), [1] * n + [0] * (ty.count - n))
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ty, [p.type, _I32, mask.type, ty]),
        f"llvm.masked.load.v{ty.count}i{ty.element.width}.p0")
    return builder.call(fn, [p, ir.Constant(_I32, 1), mask, ir.Constant(ty, None)])


def _low(builder: Any, v: Any, n: int) -> Any:
    """The first n lanes of vector v."""
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), list(range(n))))


def _widen(builder: Any, v: Any, n: int) -> Any:
    """v (<m x T>, m <= n) as <n x T>, the lanes past m zero."""
    m = v.type.count
    if m == n:
        return v
    zero = ir.Constant(v.type, None)
    return builder.shuffle_vector(v, zero, ir.Constant(
        _vec(_I32, n), list(range(m)) + [m] * (n - m)))


def _row_ptr(context: Any, builder: Any, aryty: Any, ary: Any, t: Any) -> Any:
    """i8* to ary[t, 0] of a C-contiguous 2-D array (no bounds check)."""
    arr = context.make_array(aryty)(context, builder, ary)
    ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [t, ir.Constant(t.type, 0)],
                                   wraparound=False, boundscheck=False)
    return builder.bitcast(ptr, _I8.as_pointer())


def _row_front(context: Any, builder: Any, signature: Any, args: Any, width_of: int,
               unit: int) -> tuple[Any, list[tuple[Any, Any]], Any, Any, Any, Any]:
    """The common front of a row-dot intrinsic's codegen, whose arguments are (w, the 2-D
    activation arrays..., t, out, r): i8* to w's bytes, the activation arrays as (type, value)
    pairs, t and r as intp, out as (type, value), and the row's count of `unit`-wide groups
    (the width of activation array `width_of` / unit) as i64."""
    *arrays_t, t_t, out_t, r_t = signature.args
    *arrays_v, t_v, out_v, r_v = args
    t_v = context.cast(builder, t_v, t_t, types.intp)
    r_v = context.cast(builder, r_v, r_t, types.intp)
    w_p = builder.bitcast(context.make_array(arrays_t[0])(context, builder, arrays_v[0]).data,
                          _I8.as_pointer())
    acts = list(zip(arrays_t[1:], arrays_v[1:], strict=True))
    aty, av = acts[width_of]
    width = builder.extract_value(context.make_array(aty)(context, builder, av).shape, 1)
    units = builder.udiv(width, ir.Constant(width.type, unit)) if unit > 1 else width
    u64 = ir.IntType(64)
    units = builder.zext(units, u64) if units.type.width < 64 else units
    return w_p, acts, t_v, (out_t, out_v), r_v, units


def _token_rows(context: Any, builder: Any, t: Any, ntok: int,
                arrays: list[tuple[Any, Any]]) -> list[tuple[Any, ...]]:
    """Per token j < ntok: i8* to row t + j of each (type, value) 2-D array."""
    rows = []
    for j in range(ntok):
        tj = builder.add(t, ir.Constant(t.type, j))
        rows.append(tuple(_row_ptr(context, builder, aty, av, tj) for aty, av in arrays))
    return rows


def _store_totals(context: Any, builder: Any, out_t: Any, out_v: Any, t: Any, r: Any,
                  totals: list[Any]) -> None:
    """out[t + j, r] = totals[j] (2-D f32 array, no bounds check)."""
    out_arr = context.make_array(out_t)(context, builder, out_v)
    for j, total in enumerate(totals):
        ptr = cgutils.get_item_pointer(context, builder, out_t, out_arr,
                                       [builder.add(t, ir.Constant(t.type, j)), r],
                                       wraparound=False, boundscheck=False)
        builder.store(total, ptr)


def _fma(builder: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c: one fused rounding where the target has FMA, else two (no fastmath flags, so
    the value depends only on the operands, whatever code surrounds it)."""
    if HAS_FMA:
        ty = a.type
        name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * 3), name)
        return builder.call(fn, [a, b, c])
    return builder.fadd(builder.fmul(a, b), c)


def _hsum(builder: Any, v: Any) -> Any:
    """Horizontal sum of a power-of-two vector in a fixed tree order (halves folded)."""
    return _hfold(builder, v, builder.fadd)


def _hfold(builder: Any, v: Any, combine: Any) -> Any:
    """combine(lo half, hi half) until one lane is left: `_hsum`'s tree for any operation."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = combine(_half(builder, v, 0), _half(builder, v, 1))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _f16s(builder: Any, w: Any, bases: list[Any], field: int, size: int) -> Any:
    """The f16 field at byte `field` of each of len(bases) consecutive blocks, <n x f32>."""
    count = len(bases)
    if count == 1:
        f = half_to_float(builder, _ld(builder, w, builder.add(bases[0], ir.Constant(
            bases[0].type, field)), _I16))
        return builder.insert_element(ir.Constant(_vec(_F32, 1), None), f, ir.Constant(_I32, 0))
    # one wide load of the blocks' bytes, then a byte shuffle picks the f16 fields
    span = size * (count - 1) + field + 2
    raw = _ld(builder, w, bases[0], _vec(_I8, span))
    idx = [size * k + field + i for k in range(count) for i in range(2)]
    pairs = builder.shuffle_vector(raw, raw, ir.Constant(_vec(_I32, 2 * count), idx))
    halves = builder.bitcast(pairs, _vec(_I16, count))
    if HAS_F16C:  # one vcvtph2ps
        return builder.fpext(builder.bitcast(halves, _vec(ir.HalfType(), count)),
                             _vec(_F32, count))
    wv = ir.Constant(_vec(_F32, count), None)
    for k in range(count):
        f = half_to_float(builder, builder.extract_element(halves, ir.Constant(_I32, k)))
        wv = builder.insert_element(wv, f, ir.Constant(_I32, k))
    return wv


def _e8m0s(builder: Any, w: Any, bases: list[Any], size: int) -> Any:
    """The E8M0 byte at the start of each of len(bases) consecutive blocks as ggml's
    GGML_E8M0_TO_FP32_HALF, 2^(e - 128) (subnormal below e = 2), <n x f32>: one wide load and
    a byte shuffle, then the f32 bits built from e."""
    count = len(bases)
    raw = _ld(builder, w, bases[0], _vec(_I8, size * (count - 1) + 1))
    picked = builder.shuffle_vector(raw, raw, ir.Constant(_vec(_I32, count),
                                                          [size * k for k in range(count)]))
    return e8m0_floats(builder, picked)


def e8m0_floats(builder: Any, picked: Any) -> Any:
    """<n x i8> E8M0 bytes as ggml's GGML_E8M0_TO_FP32_HALF, 2^(e - 128), <n x f32>."""
    count = picked.type.count
    e = builder.zext(picked, _vec(_I32, count))

    def c(v: int) -> Any:
        return ir.Constant(_vec(_I32, count), [v] * count)

    sub = builder.shl(c(0x00200000), e)
    normal = builder.shl(builder.sub(e, c(1)), c(23))
    bits = builder.select(builder.icmp_unsigned("<", e, c(2)), sub, normal)
    return builder.bitcast(bits, _vec(_F32, count))


def _lookup(builder: Any, codes: Any, table: tuple[int, ...]) -> Any:
    """<32 x i8> or <64 x i8> codes (each 0..15) mapped through a 16-entry table of int8
    levels: one vpshufb (the table in every 128-bit lane) with AVX2 (a zmm one with AVX512BW,
    else two ymm), else one select per entry."""
    n = codes.type.count
    if _HAS_AVX2 and n == 64 and not _HAS_AVX512BW:
        return _concat(builder, [_lookup(builder, _half(builder, codes, k), table)
                                 for k in (0, 1)])
    if _HAS_AVX2 and n in (32, 64):
        tbl = ir.Constant(_vec(_I8, n), [v & 0xFF for v in table] * (n // 16))
        name = "llvm.x86.avx512.pshuf.b.512" if n == 64 else "llvm.x86.avx2.pshuf.b"
        return _x86(builder, name, _vec(_I8, n), [tbl, codes])
    out = ir.Constant(_vec(_I8, n), None)
    for k, v in enumerate(table):
        out = builder.select(builder.icmp_unsigned("==", codes, _splat(builder, k, n)),
                             _splat(builder, v & 0xFF, n), out)
    return out


def _codes_at(builder: Any, w: Any, base: Any, qs_off: int, qh_off: int | None,
              signed: bool, lut: tuple[int, ...] | None = None) -> Any:
    """The 32 codes of the block at byte `base` of the row at i8* `w`, <32 x i8> (`lut`: its
    nibbles through that table of int8 levels, IQ4_NL / MXFP4)."""

    def at(off: int) -> Any:
        return builder.add(base, ir.Constant(base.type, off))

    if signed and lut is None:  # Q8_0
        return _ld(builder, w, at(qs_off), _vec(_I8, 32))
    codes = _nibbles(builder, _ld(builder, w, at(qs_off), _vec(_I8, 16)))
    if lut is not None:
        return _lookup(builder, codes, lut)
    if qh_off is not None:  # 5th bits: bit j of a u32 -> byte j
        qh = _ld(builder, w, at(qh_off), _I32)
        bits = builder.zext(builder.bitcast(qh, _vec(_I1, 32)), _vec(_I8, 32))
        codes = builder.or_(codes, builder.shl(bits, _splat(builder, 4, 32)))
    return codes


def _block_sums(builder: Any, parts: list[Any], count: int) -> Any:
    """<count x i32>: the exact per-block sums of `parts` (equal vectors holding the blocks'
    int lane sums in block order, each block's lanes contiguous): adjacent lanes are added
    pairwise (even + odd lanes of two vectors at once), halving the lanes per block."""
    while True:
        n = parts[0].type.count
        per_block = n * len(parts) // count
        if len(parts) > 1 and per_block >= 2:
            ev = ir.Constant(_vec(_I32, n), list(range(0, 2 * n, 2)))
            od = ir.Constant(_vec(_I32, n), list(range(1, 2 * n, 2)))
            parts = [builder.add(builder.shuffle_vector(x, y, ev),
                                 builder.shuffle_vector(x, y, od))
                     for x, y in zip(parts[::2], parts[1::2], strict=True)]
        elif len(parts) > 1:
            return _concat(builder, parts)
        elif per_block >= 2:
            v = parts[0]
            ev = ir.Constant(_vec(_I32, n // 2), list(range(0, n, 2)))
            od = ir.Constant(_vec(_I32, n // 2), list(range(1, n, 2)))
            parts = [builder.add(builder.shuffle_vector(v, v, ev),
                                 builder.shuffle_vector(v, v, od))]
        else:
            return parts[0]


def _transpose_codes(builder: Any, codes: list[Any]) -> list[Any]:
    """8 or 16 blocks' codes (<32 x i8> each) -> eight <4 count x i8>: vector j holds dword j
    (codes 4j..4j+3) of every block, block i at dword i. Three rounds of two-source shuffles,
    each swapping one bit of the vector index with one of the dword position."""
    count = len(codes)
    rows = [builder.bitcast(c, _vec(_I32, 8)) for c in codes]
    # 16 blocks: block i in vector i % 8, half i // 8 (so that lane i ends up holding block i)
    z = [_concat(builder, [rows[p], rows[p + 8]]) for p in range(8)] if count == 16 else rows
    n = z[0].type.count
    for k in range(3):
        bit = 1 << k
        lo = ir.Constant(_vec(_I32, n), [p if not p & bit else n + (p & ~bit) for p in range(n)])
        hi = ir.Constant(_vec(_I32, n), [p | bit if not p & bit else n + p for p in range(n)])
        nz = list(z)
        for v in range(8):
            if not v & bit:
                nz[v] = builder.shuffle_vector(z[v], z[v | bit], lo)
                nz[v | bit] = builder.shuffle_vector(z[v], z[v | bit], hi)
        z = nz
    return [builder.bitcast(v, _vec(_I8, 4 * count)) for v in z]


def _lanes(count: int) -> int:
    """The i32 lanes a group of `count` blocks' sums take: a group of 12 runs on 16 lanes."""
    return 16 if count == 12 else count


def _emit_blocks(builder: Any, w: Any, toks: list[tuple[Any, ...]], b: Any, count: int,
                 layout: Layout,
                 acc: list[Any], accm: list[Any], transposed: bool
                 ) -> tuple[list[Any], list[Any]]:
    """`count` consecutive blocks b.. of a weight row against each token of `toks` ((x, xt, xd,
    xs, xc, cb) i8* row pointers). The blocks are unpacked once and shared by the tokens. Per
    token the exact int32 dot of each block, (code - offset) . x, as <count x i32>, then
    d_w * d_x per block times its float fused into that token's accumulator `acc[j]` (its low
    lanes), and m_w * s_x fused into `accm[j]` (Q4_1 / Q5_1).

    The block sums come one of two ways, equal as integers: `transposed` (count 8, 12 or 16,
    a group of 12 on 16 lanes whose top 4 are zero; AVX512
    VNNI, several tokens): the codes are transposed once so that dword i of vector j is dword j
    of block i, and 8 vpdpbusd against the activation laid out the same way (`xt`, from
    `linear.dots32.block_transpose`), starting from the block's -offset * sum(x) (`cb`), leave
    block i's
    sum in lane i: 8 vpdpbusd per token for 16 blocks and nothing else. Otherwise (one token,
    tail blocks): the lane sums of each block (pairs of blocks per zmm vpdpbusd, started from
    `xc`) added down to one lane per block. The float operations for one token are the same
    either way, whatever the other tokens are: a token's result never depends on R."""
    size, qs_off, qh_off, offset, signed, m_off, lut, e8m0 = layout
    u64 = b.type
    bases = [builder.mul(builder.add(b, ir.Constant(u64, k)), ir.Constant(u64, size))
             for k in range(count)]
    xo = builder.mul(b, ir.Constant(u64, 32))
    fo = builder.mul(b, ir.Constant(u64, 4))
    codes = [_codes_at(builder, w, bases[k], qs_off, qh_off, signed, lut)
             for k in range(count)]
    dw = _e8m0s(builder, w, bases, size) if e8m0 else _f16s(builder, w, bases, 0, size)
    mw = _f16s(builder, w, bases, m_off, size) if m_off is not None else None
    out_acc, out_m = [], []
    use_corr = DOT4 and (offset or (signed and HAS_VNNI))
    nl = _lanes(count)
    ivec = _vec(_I32, nl)
    if transposed:
        if signed:
            codes = [builder.xor(c, _splat(builder, 0x80, 32)) for c in codes]
        zero = ir.Constant(_vec(_I8, 32), None)  # a group of 12: 4 blocks of zeros
        wt = _transpose_codes(builder, codes + [zero] * (nl - count))
    pair = HAS_VNNI512 and count % 2 == 0
    if pair and not transposed:  # two blocks' codes per zmm
        codes = [_concat(builder, codes[k:k + 2]) for k in range(0, count, 2)]
    co = builder.mul(b, ir.Constant(u64, 4 * LANES))
    for j, (x, xt, xd, xs, xc, cb) in enumerate(toks):
        if transposed:
            sums = [_ld_low(builder, cb, fo, count, ivec) if use_corr else ir.Constant(ivec, None),
                    ir.Constant(ivec, None)]
            for g in range(8):
                xv = _ld_low(builder, xt, builder.add(xo, ir.Constant(u64, 4 * count * g)),
                             4 * count, _vec(_I8, 4 * nl))
                sums[g % 2] = _vpdpbusd(builder, wt[g], xv, sums[g % 2])
            isum = builder.add(sums[0], sums[1])
            isum = _low(builder, isum, count) if nl > count else isum
        else:
            step = 2 if pair else 1
            parts = []
            for k in range(0, count, step):
                xv = _ld(builder, x, builder.add(xo, ir.Constant(u64, 32 * k)),
                         _vec(_I8, 32 * step))
                corr = _ld(builder, xc, builder.add(co, ir.Constant(u64, 4 * LANES * k)),
                           _vec(_I32, LANES * step)) if use_corr else None
                parts.append(_lane_sums(builder, codes[k // step], xv, offset, signed, corr))
            if count == 12:  # as 8 + 4 blocks (the same integers)
                eight = _block_sums(builder, parts[:8 // step], 8)
                four = _widen(builder, _block_sums(builder, parts[8 // step:], 4), 8)
                isum = builder.shuffle_vector(eight, four, ir.Constant(_vec(_I32, 12),
                                                                       list(range(12))))
            else:
                isum = _block_sums(builder, parts, count)
        dk = builder.fmul(dw, _ld(builder, xd, fo, _vec(_F32, count)))
        fsum = builder.sitofp(isum, _vec(_F32, count))
        if count == 4:  # folded as two pairs, the float steps of the pair path it replaced
            a = acc[j]
            for h in (0, 2):
                lanes = ir.Constant(_vec(_I32, 2), [h, h + 1])
                a = _fma_fold(builder, builder.shuffle_vector(dk, dk, lanes),
                              builder.shuffle_vector(fsum, fsum, lanes), a)
            out_acc.append(a)
        else:
            out_acc.append(_fma_fold(builder, dk, fsum, acc[j]))
        if mw is not None:
            out_m.append(_fma_fold(builder, mw, _ld(builder, xs, fo, _vec(_F32, count)),
                                   accm[j]))
    return out_acc, out_m


def _fma_fold(builder: Any, d: Any, v: Any, a: Any) -> Any:
    """a + d * v lane-wise (fused), the n lanes of d, v folded onto a's width W: lanes h..h+W
    in turn when n >= W (lowest first), else into a's lowest n lanes (the rest kept)."""
    n, width = d.type.count, a.type.count
    if n < width:
        low = ir.Constant(_vec(_I32, n), list(range(n)))
        part = _fma(builder, d, v, builder.shuffle_vector(a, a, low))
        wide = builder.shuffle_vector(part, part, ir.Constant(
            _vec(_I32, width), list(range(n)) + [0] * (width - n)))
        return builder.shuffle_vector(a, wide, ir.Constant(
            _vec(_I32, width), [width + i for i in range(n)] + list(range(n, width))))
    for h in range(0, n, width):
        sel = ir.Constant(_vec(_I32, width), list(range(h, h + width)))
        a = _fma(builder, builder.shuffle_vector(d, d, sel), builder.shuffle_vector(v, v, sel), a)
    return a


def _emit_blocks_lanes(builder: Any, w: Any, toks: list[tuple[Any, Any, Any, Any]], b: Any,
                       count: int, layout: Layout,
                       acc: list[Any], accm: list[Any]) -> tuple[list[Any], list[Any]]:
    """(Q8_0's form: per-lane float steps.) `count` consecutive blocks b.. of a weight row
    against each token of `toks` ((x, xd, xs, xc) i8* row pointers). The blocks are unpacked
    once and shared by the tokens. Per token: the int lane sums of (code - offset) * x, times
    d_w * d_x per block, fused into that token's accumulator `acc[j]` (the count*LANES lanes
    folded onto its width, lowest half first), and m_w * s_x fused into `accm[j]` (<count x
    f32>). The float operations for one
    token are the same whatever the other tokens are: a token's result never depends on R."""
    size, qs_off, qh_off, offset, signed, m_off, lut, e8m0 = layout
    u64 = b.type
    bases = [builder.mul(builder.add(b, ir.Constant(u64, k)), ir.Constant(u64, size))
             for k in range(count)]
    xo = builder.mul(b, ir.Constant(u64, 32))
    fo = builder.mul(b, ir.Constant(u64, 4))
    codes = [_codes_at(builder, w, bases[k], qs_off, qh_off, signed, lut)
             for k in range(count)]
    dw = _e8m0s(builder, w, bases, size) if e8m0 else _f16s(builder, w, bases, 0, size)
    mw = _f16s(builder, w, bases, m_off, size) if m_off is not None else None
    n = LANES * count
    out_acc, out_m = [], []
    # one row: 2nd vpdpbusd
    use_corr = DOT4 and (offset or (signed and HAS_VNNI)) and len(toks) > 1
    pair = HAS_VNNI512 and count % 2 == 0
    if pair:  # two blocks' codes per zmm
        codes = [_concat(builder, codes[k:k + 2]) for k in range(0, count, 2)]
    co = builder.mul(b, ir.Constant(u64, 4 * LANES))
    for j, (x, xd, xs, xc) in enumerate(toks):
        step = 2 if pair else 1
        parts = []
        for k in range(0, count, step):
            xv = _ld(builder, x, builder.add(xo, ir.Constant(u64, 32 * k)), _vec(_I8, 32 * step))
            corr = _ld(builder, xc, builder.add(co, ir.Constant(u64, 4 * LANES * k)),
                       _vec(_I32, LANES * step)) if use_corr else None
            parts.append(_lane_sums(builder, codes[k // step], xv, offset, signed, corr))
        lanes = builder.sitofp(_concat(builder, parts), _vec(_F32, n))
        dk = builder.fmul(dw, _ld(builder, xd, fo, _vec(_F32, count)))
        dv = builder.shuffle_vector(dk, dk, ir.Constant(
            _vec(_I32, n), [k for k in range(count) for _ in range(LANES)]))
        a = acc[j]
        width = a.type.count
        for h in range(0, n, width):  # fold the blocks' lanes onto the accumulator's width
            sel = ir.Constant(_vec(_I32, width), list(range(h, h + width)))
            a = _fma(builder, builder.shuffle_vector(dv, dv, sel),
                     builder.shuffle_vector(lanes, lanes, sel), a)
        out_acc.append(a)
        if mw is not None:
            out_m.append(_fma(builder, mw, _ld(builder, xs, fo, _vec(_F32, count)), accm[j]))
    return out_acc, out_m


def _prefetch_ir(builder: Any, ptr: Any, locality: int = 3) -> None:
    """Prefetch the cache line at ptr (locality 3: to L1, prefetcht0; 2: to L2, prefetcht1)."""
    i32 = ir.IntType(32)
    i8p = ir.IntType(8).as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0),
                      ir.Constant(i32, locality), ir.Constant(i32, 1)])


def _prefetch_span(builder: Any, ptr: Any, start: Any, n_bytes: int, locality: int = 3) -> None:
    """Prefetch n_bytes of i8* `ptr` from byte `start` (an i64) on, one call per 64-byte line:
    a weight stream's next stretch, however each kernel spaces it."""
    for off in range(0, n_bytes, 64):
        _prefetch_ir(builder, builder.gep(ptr, [builder.add(start, ir.Constant(start.type, off))]),
                     locality)


def _phi_loop(builder: Any, count: Any, init: list[Any], body: Any) -> list[Any]:
    """for i in range(count): vals = body(i, vals), with the values carried in phis (the
    accumulators stay in registers). Returns the final values."""
    u64 = count.type
    pre = builder.block
    head = builder.append_basic_block("acc.head")
    loop_bb = builder.append_basic_block("acc.body")
    done = builder.append_basic_block("acc.done")
    builder.branch(head)
    builder.position_at_end(head)
    idx = builder.phi(u64)
    idx.add_incoming(ir.Constant(u64, 0), pre)
    phis = []
    for v in init:
        p = builder.phi(v.type)
        p.add_incoming(v, pre)
        phis.append(p)
    builder.cbranch(builder.icmp_unsigned("<", idx, count), loop_bb, done)
    builder.position_at_end(loop_bb)
    new = body(idx, phis)
    nxt = builder.add(idx, ir.Constant(u64, 1))
    end_bb = builder.block
    idx.add_incoming(nxt, end_bb)
    for p, v in zip(phis, new, strict=True):
        p.add_incoming(v, end_bb)
    builder.branch(head)
    builder.position_at_end(done)
    return phis


def _row_dot(layout: Layout, ntok: int) -> Any:
    """An intrinsic rowdot(w, x, xt, xd, xs, xc, cb, t, out, r) -> None: out[t + j, r] = dot of
    the weight row w (uint8 block bytes) with the quantized activation rows x[t + j] (int8; xt
    the same transposed per block group (`linear.dots32.block_transpose`, read when ntok > 1), xd
    per-block scales, xs per-block Q8_1 sums, xc int32 -offset * 4-sums (`lane_corr`), cb int32
    -offset * block sums (`block_corr`, ntok > 1); all 2-D) for j < ntok. Each block is
    unpacked once and dotted against the ntok rows. Steps of BLOCKS_PER_CALL blocks, then the
    TAIL_GROUPS (12, 8, 4) where that many are left, then pairs, then one; per token one
    BLOCKS_PER_CALL-wide f32 accumulator (one fused multiply-add per step, the short steps into
    its low lanes), summed in a fixed tree at the end. The per-token float operations do not
    depend on ntok, so the batched result is bitwise the one-token result."""
    size, m_off = layout[0], layout[5]
    fast = ntok > 1 and HAS_VNNI512

    def typer(typingctx: Any, w: Any, x: Any, xt: Any, xd: Any, xs: Any, xc: Any, cb: Any,
              t: Any, out: Any, r: Any) -> Any:
        sig = types.void(w, x, xt, xd, xs, xc, cb, t, out, r)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            w_p, acts, t_v, (out_t, out_v), r_v, nb = _row_front(
                context, builder, signature, args, 0, 32)
            u64 = ir.IntType(64)
            n_main = builder.udiv(nb, ir.Constant(u64, BLOCKS_PER_CALL))
            toks = _token_rows(context, builder, t_v, ntok, acts)
            wide = _vec(_F32, BLOCKS_PER_CALL)
            zero = ir.Constant(wide, [0.0] * wide.count)
            has_m = m_off is not None

            def step(first: Any, count: int, prefetch: bool) -> Any:
                def body(i: Any, vals: list[Any]) -> list[Any]:
                    b = builder.add(first, builder.mul(i, ir.Constant(u64, count)))
                    if prefetch:
                        start = builder.add(builder.mul(b, ir.Constant(u64, size)),
                                            ir.Constant(u64, PREFETCH))
                        _prefetch_span(builder, w_p, start, size * count, PREFETCH_LOCALITY)
                    a, m = _emit_blocks(builder, w_p, toks, b, count, layout, vals[:ntok],
                                        vals[ntok:], fast and count >= 8)
                    return a + m
                return body

            init = [zero] * (2 * ntok if has_m else ntok)
            vals = _phi_loop(builder, n_main, init, step(ir.Constant(u64, 0), BLOCKS_PER_CALL,
                                                          True))
            # the remaining blocks: the TAIL_GROUPS where that many are left, pairs, one; into
            # the accumulators' low lanes
            done = builder.mul(n_main, ir.Constant(u64, BLOCKS_PER_CALL))
            for g in TAIL_GROUPS:
                n_g = builder.udiv(builder.sub(nb, done), ir.Constant(u64, g))
                vals = _phi_loop(builder, n_g, vals, step(done, g, False))
                done = builder.add(done, builder.mul(n_g, ir.Constant(u64, g)))
            left = builder.sub(nb, done)
            vals = _phi_loop(builder, builder.udiv(left, ir.Constant(u64, 2)), vals,
                             step(done, 2, False))
            last = builder.sub(nb, builder.urem(left, ir.Constant(u64, 2)))
            vals = _phi_loop(builder, builder.urem(left, ir.Constant(u64, 2)), vals,
                             step(last, 1, False))
            acc, accm = vals[:ntok], vals[ntok:]
            totals = [_hsum(builder, acc[j]) for j in range(ntok)]
            if has_m:
                totals = [builder.fadd(tot, _hsum(builder, m)) for tot, m in zip(
                    totals, accm, strict=True)]
            _store_totals(context, builder, out_t, out_v, t_v, r_v, totals)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


def _row_dot_lanes(layout: Layout, ntok: int) -> Any:
    """An intrinsic rowdot(w, x, xd, xs, xc, t, out, r) -> None: out[t + j, r] = dot of the
    weight row w (uint8 block bytes) with the quantized activation rows x[t + j] (int8; xd
    per-block scales, xs per-block Q8_1 sums, xc int32 -offset * 4-sums (`lane_corr`, read for
    code offsets with VNNI only); all 2-D) for j < ntok. Each block is unpacked once and
    dotted against the ntok rows. Steps of LANE_BLOCKS blocks, then single blocks; per token
    an ACC_BLOCKS-block-wide f32 accumulator (fused multiply-adds in block order) plus one for
    the tail blocks, summed in a fixed tree at the end. The per-token float operations do not
    depend on ntok, so the batched result is bitwise the one-token result."""
    size, m_off = layout[0], layout[5]

    def typer(typingctx: Any, w: Any, x: Any, xd: Any, xs: Any, xc: Any, t: Any, out: Any,
              r: Any) -> Any:
        sig = types.void(w, x, xd, xs, xc, t, out, r)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            w_p, acts, t_v, (out_t, out_v), r_v, nb = _row_front(
                context, builder, signature, args, 0, 32)
            u64 = ir.IntType(64)
            n_main = builder.udiv(nb, ir.Constant(u64, LANE_BLOCKS))
            toks = _token_rows(context, builder, t_v, ntok, acts)
            wide = _vec(_F32, LANES * ACC_BLOCKS)
            mvec = _vec(_F32, LANE_BLOCKS)
            zero_w = ir.Constant(wide, [0.0] * wide.count)
            zero_m = ir.Constant(mvec, [0.0] * mvec.count)
            has_m = m_off is not None

            def main_body(i: Any, vals: list[Any]) -> list[Any]:
                b = builder.mul(i, ir.Constant(u64, LANE_BLOCKS))
                start = builder.add(builder.mul(b, ir.Constant(u64, size)),
                                    ir.Constant(u64, PREFETCH))
                _prefetch_span(builder, w_p, start, size * LANE_BLOCKS, PREFETCH_LOCALITY)
                a, m = _emit_blocks_lanes(builder, w_p, toks, b, LANE_BLOCKS, layout,
                                    vals[:ntok], vals[ntok:])
                return a + m

            init = [zero_w] * ntok + ([zero_m] * ntok if has_m else [])
            vals = _phi_loop(builder, n_main, init, main_body)
            acc, accm = vals[:ntok], vals[ntok:]
            tail0 = builder.mul(n_main, ir.Constant(u64, LANE_BLOCKS))

            def tail_body(i: Any, vals: list[Any]) -> list[Any]:
                a, m = _emit_blocks_lanes(builder, w_p, toks, builder.add(tail0, i), 1, layout,
                                    vals[:ntok], vals[ntok:])
                return a + m

            z1 = ir.Constant(_vec(_F32, LANES), [0.0] * LANES)
            z1m = ir.Constant(_vec(_F32, 1), [0.0])
            init1 = [z1] * ntok + ([z1m] * ntok if has_m else [])
            vals1 = _phi_loop(builder, builder.sub(nb, tail0), init1, tail_body)
            acc1, accm1 = vals1[:ntok], vals1[ntok:]
            totals = []
            for j in range(ntok):
                total = builder.fadd(_hsum(builder, acc[j]), _hsum(builder, acc1[j]))
                if has_m:
                    msum = builder.fadd(_hsum(builder, accm[j]), builder.extract_element(
                        accm1[j], ir.Constant(_I32, 0)))
                    total = builder.fadd(total, msum)
                totals.append(total)
            _store_totals(context, builder, out_t, out_v, t_v, r_v, totals)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


BLOCKS_PER_CALL = 16  # blocks per step of the row loop (block_transpose groups: 16, then 12 or 8+4)
# After the groups of 16, each of these in turn where that many blocks are left: the one rule of
# the transposed activation (`linear.dots32.block_transpose`) and the row loop's multi-token steps.
# A
# group costs 8 vpdpbusd per token whatever its width, so 12 blocks (AVX512-VNNI: 16-lane vectors
# loaded masked) run as one group where 8 + 4 ran as two.
TAIL_GROUPS = (12, 8, 4) if HAS_VNNI512 else (8, 4)
# Software prefetch of a row's blocks: PREFETCH bytes ahead, into L2 (locality 2, prefetcht1).
# On weights past the L3's size (the 0.5B's Q5_0 FFN x 3, 431 MB; Intel SPR, 2 threads), against
# 1 KiB into L1: 1.12x compiled for Haswell (AVX2), 1.05x with AVX-512 (rows not interleaved).
# The K-quant rows keep their own (`simd.kquants.PREFETCH`).
PREFETCH = 4096
PREFETCH_LOCALITY = 2
# name: (block bytes, qs offset, qh offset, code offset, signed codes, m offset, the levels
# the 4-bit codes stand for (`_lookup`; IQ4_NL, MXFP4: int8, so signed as Q8_0's), an E8M0
# scale (MXFP4) in place of the f16 d)
_IQ4 = tuple(int(v) for v in IQ4_LEVELS)
_MXFP4 = tuple(int(v) for v in MXFP4_LEVELS)
_LAYOUTS: dict[str, Layout] = {
    "q4_0": (18, 2, None, 8, False, None, None, False),
    "q4_1": (20, 4, None, 0, False, 2, None, False),
    "q5_0": (22, 6, 2, 16, False, None, None, False),
    "q5_1": (24, 8, 4, 0, False, 2, None, False),
    "q8_0": (34, 2, None, 0, True, None, None, False),
    "iq4_nl": (18, 2, None, 0, True, None, _IQ4, False),
    "mxfp4": (17, 1, None, 0, True, None, _MXFP4, True),
}
# Q8_0 keeps the per-lane form (`_row_dot_lanes`): its codes need no unpacking, so the
# per-block sums' shuffles would make the one-row dot slower
LANE_BLOCKS = 8  # blocks per step of the per-lane form
ACC_BLOCKS = 4  # its blocks' worth of f32 lanes per token accumulator
MAX_TOKENS = 8  # activation rows per pass over a weight row (then passes of 4, 2, 1)
# 8-row passes only up to this many inputs: the 8 activation rows and their per-call
# corrections (about 2 bytes per value) must stay in L1 while a chunk's rows stream past
ROWS8_MAX_IN = 2048
# The token passes of a row kernel: (name suffix, activation rows per pass). Each type's
# intrinsics are module globals named `<prefix><suffix>_<type>`, imported by name by the drivers
# generated in `linear.row_drivers` (numba caches only calls of module globals).
PASSES = (("", 1), ("2", 2), ("4", 4), ("8", MAX_TOKENS))


def define_passes(namespace: dict[str, Any], prefix: str, make: Callable[[str, int], Any],
                  types: Iterable[str]) -> None:
    """namespace[`<prefix><suffix>_<type>`] = make(type, rows) for every type and pass."""
    for qt in types:
        for suffix, rows in PASSES:
            namespace[f"{prefix}{suffix}_{qt}"] = make(qt, rows)


define_passes(globals(), "rowdot",
              lambda qt, n: (_row_dot_lanes if qt == "q8_0" else _row_dot)(_LAYOUTS[qt], n),
              ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "mxfp4"))
