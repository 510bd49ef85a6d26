"""LLVM intrinsics the compiled kernels need and numba does not expose.

- `prefetch(arr, i)`: a software prefetch (`llvm.prefetch`, read, L1 locality) of the byte at
  `arr[i]`. Decode is memory-bound; streaming a weight row without prefetch reaches only a
  fraction of the bandwidth on this machine kind. Out-of-range addresses are harmless: a
  prefetch never faults.
- `f16_to_f32(bits)` / `f32_to_f16(x)`: IEEE half conversions through LLVM's `half` type, so
  the CPU's F16C instructions do them (exact, round-to-nearest-even, NaN/Inf/subnormals right).
  numba has no float16 arrays on the CPU, so halves travel as uint16 bit patterns. On a target
  without F16C (e.g. NUMBA_CPU_NAME=generic) exact integer versions are used instead.
- `target_has(*features)`: whether the CPU numba compiles for has all of the LLVM features.
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic, overload

_I8P = ir.IntType(8).as_pointer()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)


def target_has(*features: str) -> bool:
    """Whether the CPU numba compiles for has every LLVM feature named (e.g. "f16c"). Follows
    numba's own rule: NUMBA_CPU_FEATURES when set (NUMBA_CPU_NAME=generic sets it empty), else
    the host's features, even with another NUMBA_CPU_NAME (numba then still compiles with the
    host's features: NUMBA_CPU_NAME=haswell alone emits AVX-512 on an AVX-512 host; an AVX2
    target needs NUMBA_CPU_FEATURES too, see .ci/run)."""
    cpu_features = getattr(numba_config, "CPU_FEATURES", None)
    if cpu_features is not None:
        feats = set(cpu_features.split(","))
        return all(f"+{f}" in feats for f in features)
    host = llvm.get_host_cpu_features()
    return all(host.get(f) for f in features)


HAS_F16C = target_has("f16c")


def half_to_float(builder: Any, bits: Any) -> Any:
    """IR: an i16 half bit pattern -> f32, exactly (F16C, or integer ops and one exact multiply:
    the 15 exponent+mantissa bits moved into f32 position, times 2^112, rebias normals and
    subnormals alike; Inf/NaN get the all-ones exponent; then the sign)."""
    if HAS_F16C:
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
    h = builder.zext(bits, _I32)

    def c(v: int) -> Any:
        return ir.Constant(_I32, v)

    em = builder.shl(builder.and_(h, c(0x7FFF)), c(13))
    scaled = builder.fmul(builder.bitcast(em, ir.FloatType()),
                          ir.Constant(ir.FloatType(), 2.0**112))
    is_special = builder.icmp_unsigned("==", builder.and_(h, c(0x7C00)), c(0x7C00))
    body = builder.select(is_special, builder.or_(em, c(0x7F800000)),
                          builder.bitcast(scaled, _I32))
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(body, sign), ir.FloatType())


def halves_to_floats(builder: Any, bits: Any) -> Any:
    """IR: <n x i16> half bit patterns -> <n x f32>, exactly (one vcvtph2ps with F16C, else
    `half_to_float` lane by lane)."""
    n = bits.type.count
    if HAS_F16C:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n)),
                             ir.VectorType(ir.FloatType(), n))
    out = ir.Constant(ir.VectorType(ir.FloatType(), n), None)
    for i in range(n):
        lane = half_to_float(builder, builder.extract_element(bits, ir.Constant(_I32, i)))
        out = builder.insert_element(out, lane, ir.Constant(_I32, i))
    return out


def _prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Prefetch the cache line holding `arr[idx]` (1-D contiguous array, no bounds check)."""
    sig = types.void(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(
            context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False
        )
        fnty = ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # (address, rw=read, locality=3 (keep in all levels), cache type=data)
        builder.call(
            fn,
            [builder.bitcast(ptr, _I8P), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
             ir.Constant(_I32, 1)],
        )
        return context.get_dummy_value()

    return sig, codegen


prefetch: Any = intrinsic(_prefetch)


def _f16_to_f32(typingctx: Any, bits: Any) -> Any:
    """uint16 half bit pattern -> float32 (exact)."""
    sig = types.float32(types.uint16)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return half_to_float(builder, args[0])

    return sig, codegen


f16_to_f32: Any = intrinsic(_f16_to_f32)


def _f32_to_f16(typingctx: Any, x: Any) -> Any:
    """float32 -> uint16 half bit pattern (round to nearest even, as numpy's astype)."""
    sig = types.uint16(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


def _bits_of_f32(typingctx: Any, x: Any) -> Any:
    """Reinterpret a float32 as its uint32 bit pattern."""
    sig = types.uint32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], _I32)

    return sig, codegen


bits_of_f32: Any = intrinsic(_bits_of_f32)


def _bits_to_f32(typingctx: Any, bits: Any) -> Any:
    """Reinterpret a uint32 bit pattern as float32 (used for bf16: bits << 16)."""
    sig = types.float32(types.uint32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


bits_to_f32: Any = intrinsic(_bits_to_f32)


@njit(inline="always")
def _f32_to_f16_soft(x):
    """float32 -> half bits with round-to-nearest-even, in integer ops (no F16C)."""
    u = bits_of_f32(x)
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    u &= np.uint32(0x7FFFFFFF)
    if u >= np.uint32(0x7F800000):  # Inf / NaN
        h = np.uint32(0x7C00) | (np.uint32(0x200) if u > np.uint32(0x7F800000) else np.uint32(0))
    elif u >= np.uint32(0x477FF000):  # rounds to Inf
        h = np.uint32(0x7C00)
    elif u < np.uint32(0x38800000):  # half subnormal: let an f32 add do the rounding
        h = bits_of_f32(bits_to_f32(u) + np.float32(0.5)) - np.uint32(0x3F000000)
    else:
        odd = (u >> np.uint32(13)) & np.uint32(1)
        h = (u + np.uint32(0xC8000FFF) + odd) >> np.uint32(13)
    return np.uint16(h | sign)


f32_to_f16: Any = intrinsic(_f32_to_f16) if HAS_F16C else _f32_to_f16_soft




def as_f32(v: Any) -> Any:
    """A cache element as f32: uint16 values are f16 bit patterns, anything else is cast."""
    raise NotImplementedError("only callable from compiled code")


@overload(as_f32, inline="always")
def _as_f32(v):  # unannotated: numba matches it against the lambdas below
    if v == types.uint16:
        return lambda v: f16_to_f32(v)
    return lambda v: np.float32(v)


def _call_sgemm_rm_nt(typingctx: Any, fptr: Any, m: Any, n: Any, k: Any, a: Any, lda: Any,
                      b: Any, ldb: Any, c: Any, ldc: Any) -> Any:
    """Call cblas_sgemm (64-bit ints) at address `fptr`: C[m,n] = A[m,k] @ B[n,k]^T, row-major,
    alpha 1, beta 0. Pointers and sizes are int64 (array.ctypes.data and plain ints)."""
    sig = types.void(fptr, m, n, k, a, lda, b, ldb, c, ldc)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        flt = ir.FloatType()
        fnty = ir.FunctionType(ir.VoidType(), [_I32, _I32, _I32, i64, i64, i64, flt, _I8P, i64,
                                               _I8P, i64, flt, _I8P, i64])
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        ints = [builder.sext(v, i64) if v.type.width < 64 else v for v in args[1:]]
        m_, n_, k_, a_, lda_, b_, ldb_, c_, ldc_ = ints
        ptr = [builder.inttoptr(v, _I8P) for v in (a_, b_, c_)]
        row_major, no_trans, trans = (ir.Constant(_I32, v) for v in (101, 111, 112))
        builder.call(fn, [row_major, no_trans, trans, m_, n_, k_, ir.Constant(flt, 1.0), ptr[0],
                          lda_, ptr[1], ldb_, ir.Constant(flt, 0.0), ptr[2], ldc_])
        return context.get_dummy_value()

    return sig, codegen


call_sgemm_rm_nt: Any = intrinsic(_call_sgemm_rm_nt)


def _call_int_fn(typingctx: Any, fptr: Any, value: Any) -> Any:
    """Call `int f(int)` at address `fptr` (e.g. openblas_set_num_threads_local)."""
    sig = types.int32(fptr, value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(_I32, [_I32])
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(fn, [builder.trunc(args[1], _I32) if args[1].type.width > 32
                                 else args[1]])

    return sig, codegen


call_int_fn: Any = intrinsic(_call_int_fn)


def _thread_count(typingctx: Any) -> Any:
    """The calling thread's numba thread count (`numba.get_num_threads()`), read through the
    threading layer's `get_num_threads` symbol as numba's own parallel launch reads it: a
    function that calls numba's `get_num_threads()` keeps a ctypes pointer and cannot be cached
    on disk; a call to the symbol by name can."""
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()  # registers the threading layer's symbols with LLVM

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(cgutils.intp_t, [])
        return builder.call(
            cgutils.get_or_insert_function(builder.module, fnty, "get_num_threads"), [])

    return types.intp(), codegen


thread_count: Any = intrinsic(_thread_count)
