"""Block dot products written as LLVM vector IR (numba intrinsics).

numba's auto-vectorisation of these small u8 x s8 dots is fragile: whether LLVM finds
`vpdpbusd` depends on loop shapes, SLP settings and function size. These intrinsics spell the
vector work out in portable LLVM IR -- load `<N x i8>`, unpack the weight codes, widen
(zext weight, sext activation), multiply, `llvm.vector.reduce.add` -- which the x86 backend lowers
to `vpdpbusd` on VNNI machines and to `pmaddwd` sequences elsewhere. They are inlined into the
calling kernel, so each costs no call. Every one returns the exact int32 sum.

Arguments are 1-D contiguous arrays plus element offsets (no bounds checks: callers own that).
Weight codes are unsigned: callers subtract any offset (8, 16, 32, 128) via activation sums.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat8(v: Any, n: int, builder: Any = None) -> Any:
    if isinstance(v, int):
        return ir.Constant(_vec(_I8, n), [v] * n)
    v8 = builder.trunc(v, _I8) if v.type.width > 8 else v
    undef = ir.Constant(_vec(_I8, n), None)
    v1 = builder.insert_element(undef, v8, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v1, undef, ir.Constant(_vec(_I32, n), [0] * n))


def _load(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any, n: int) -> Any:
    """Unaligned load of <n x i8> starting at ary[idx]."""
    arr = context.make_array(aryty)(context, builder, ary)
    ptr = cgutils.get_item_pointer(
        context, builder, aryty, arr, [idx], wraparound=False, boundscheck=False
    )
    return builder.load(builder.bitcast(ptr, _vec(_I8, n).as_pointer()), align=1)


def _dot(builder: Any, u: Any, s: Any) -> Any:
    """sum(zext(u) * sext(s)) as i32."""
    n = u.type.count
    prod = builder.mul(builder.zext(u, _vec(_I32, n)), builder.sext(s, _vec(_I32, n)))
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_I32, [prod.type]), f"llvm.vector.reduce.add.v{n}i32"
    )
    return builder.call(fn, [prod])


def _concat(builder: Any, a: Any, b: Any) -> Any:
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 2 * n), list(range(2 * n))))


def _dot_q8(typingctx: Any, w: Any, wo: Any, x: Any, xo: Any) -> Any:
    """sum_j (w[wo+j] ^ 0x80) * x[xo+j], j < 32: an int8 weight moved to u8 (= q + 128)."""
    sig = types.int32(w, wo, x, xo)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        q = _load(context, builder, a[0], args[0], args[1], 32)
        q = builder.xor(q, _splat8(0x80, 32))
        return _dot(builder, q, _load(context, builder, a[2], args[2], args[3], 32))

    return sig, codegen


dot_q8: Any = intrinsic(_dot_q8)


def _dot_q4(typingctx: Any, w: Any, wo: Any, x: Any, xo: Any) -> Any:
    """16 packed bytes at w[wo:]: low nibbles . x[xo:xo+16] + high nibbles . x[xo+16:xo+32]."""
    sig = types.int32(w, wo, x, xo)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        q = _load(context, builder, a[0], args[0], args[1], 16)
        u = _concat(builder, builder.and_(q, _splat8(15, 16)), builder.lshr(q, _splat8(4, 16)))
        return _dot(builder, u, _load(context, builder, a[2], args[2], args[3], 32))

    return sig, codegen


dot_q4: Any = intrinsic(_dot_q4)


def _dot_q5(typingctx: Any, w: Any, wo: Any, qho: Any, x: Any, xo: Any) -> Any:
    """`dot_q4` with value j's 5th bit = bit j of the little-endian uint32 at w[qho:]."""
    sig = types.int32(w, wo, qho, x, xo)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        q = _load(context, builder, a[0], args[0], args[1], 16)
        u = _concat(builder, builder.and_(q, _splat8(15, 16)), builder.lshr(q, _splat8(4, 16)))
        qh = builder.bitcast(_load(context, builder, a[0], args[0], args[2], 4), _I32)
        bits = builder.zext(builder.bitcast(qh, _vec(ir.IntType(1), 32)), _vec(_I8, 32))
        u = builder.or_(u, builder.shl(bits, _splat8(4, 32)))
        return _dot(builder, u, _load(context, builder, a[3], args[3], args[4], 32))

    return sig, codegen


dot_q5: Any = intrinsic(_dot_q5)


def _dot_nib32(typingctx: Any, w: Any, wo: Any, shift: Any, x: Any, xo: Any) -> Any:
    """sum_j ((w[wo+j] >> shift) & 15) * x[xo+j], j < 32 (a K-quant nibble half)."""
    sig = types.int32(w, wo, shift, x, xo)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        q = _load(context, builder, a[0], args[0], args[1], 32)
        u = builder.and_(builder.lshr(q, _splat8(args[2], 32, builder)), _splat8(15, 32))
        return _dot(builder, u, _load(context, builder, a[3], args[3], args[4], 32))

    return sig, codegen


dot_nib32: Any = intrinsic(_dot_nib32)


def _dot_nib32h(typingctx: Any, w: Any, wo: Any, shift: Any, qho: Any, bit: Any, x: Any,
               xo: Any) -> Any:
    """`dot_nib32` with a 5th bit: ((w[qho+j] >> bit) & 1) << 4 (Q5_K)."""
    sig = types.int32(w, wo, shift, qho, bit, x, xo)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        q = _load(context, builder, a[0], args[0], args[1], 32)
        u = builder.and_(builder.lshr(q, _splat8(args[2], 32, builder)), _splat8(15, 32))
        h = _load(context, builder, a[0], args[0], args[3], 32)
        h = builder.and_(builder.lshr(h, _splat8(args[4], 32, builder)), _splat8(1, 32))
        u = builder.or_(u, builder.shl(h, _splat8(4, 32)))
        return _dot(builder, u, _load(context, builder, a[5], args[5], args[6], 32))

    return sig, codegen


dot_nib32h: Any = intrinsic(_dot_nib32h)


def _dot_q6(typingctx: Any, w: Any, lo: Any, lshift: Any, ho: Any, hshift: Any, x: Any,
           xo: Any) -> Any:
    """16 six-bit codes ((w[lo+j] >> lshift) & 15) | (((w[ho+j] >> hshift) & 3) << 4) . x (Q6_K)."""
    sig = types.int32(w, lo, lshift, ho, hshift, x, xo)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        q = _load(context, builder, a[0], args[0], args[1], 16)
        u = builder.and_(builder.lshr(q, _splat8(args[2], 16, builder)), _splat8(15, 16))
        h = _load(context, builder, a[0], args[0], args[3], 16)
        h = builder.and_(builder.lshr(h, _splat8(args[4], 16, builder)), _splat8(3, 16))
        u = builder.or_(u, builder.shl(h, _splat8(4, 16)))
        return _dot(builder, u, _load(context, builder, a[5], args[5], args[6], 16))

    return sig, codegen



dot_q6: Any = intrinsic(_dot_q6)
