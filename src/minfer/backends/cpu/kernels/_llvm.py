"""LLVM intrinsics the compiled kernels need and numba does not expose.

- `prefetch(arr, i)`: a software prefetch (`llvm.prefetch`, read, L1 locality) of the byte at
  `arr[i]`. Decode is memory-bound; streaming a weight row without prefetch reaches only a
  fraction of the bandwidth on this machine kind. Out-of-range addresses are harmless: a
  prefetch never faults.
- `f16_to_f32(bits)` / `f32_to_f16(x)`: IEEE half conversions through LLVM's `half` type, so
  the CPU's F16C instructions do them (exact, round-to-nearest-even, NaN/Inf/subnormals right).
  numba has no float16 arrays on the CPU, so halves travel as uint16 bit patterns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)


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
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


f16_to_f32: Any = intrinsic(_f16_to_f32)


def _f32_to_f16(typingctx: Any, x: Any) -> Any:
    """float32 -> uint16 half bit pattern (round to nearest even, as numpy's astype)."""
    sig = types.uint16(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


f32_to_f16: Any = intrinsic(_f32_to_f16)


def _bits_to_f32(typingctx: Any, bits: Any) -> Any:
    """Reinterpret a uint32 bit pattern as float32 (used for bf16: bits << 16)."""
    sig = types.float32(types.uint32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


bits_to_f32: Any = intrinsic(_bits_to_f32)


def as_f32(v: Any) -> Any:
    """A cache element as f32: uint16 values are f16 bit patterns, anything else is cast."""
    raise NotImplementedError("only callable from compiled code")


@overload(as_f32, inline="always")
def _as_f32(v):  # unannotated: numba matches it against the lambdas below
    if v == types.uint16:
        return lambda v: f16_to_f32(v)
    return lambda v: np.float32(v)
