"""The LLVM intrinsics a parallel region is built from, which numba does not expose.

- `atomic_add(arr, i, v)`: `arr[i] += v` as one sequentially consistent read-modify-write
  (`atomicrmw add`), returning the old value; `atomic_load(arr, i)` (acquire) and
  `atomic_store(arr, i, v)` (release) on int64 arrays. The barrier's counters live in such an
  array, each on its own cache line.
- `spin_pause()`: x86's `pause` (a spinning thread gives its core's pipeline to the other
  hyperthread and leaves the spin loop without a memory-order flush).
- `call_step(fn, t, nt, args)`: a call of `void fn(int64 t, int64 nt, int64 *args)` at address
  `fn` (a `numba.cfunc`'s), and `call_int(fn)`: `int fn(void)` (`sched_yield`). Addresses are
  arguments, never constants, so the callers stay cacheable on disk.
- `cycles()`: the time-stamp counter (`llvm.readcyclecounter`), for per-step timelines.
- `address_at(addr)`: an int64 address as a `void *`, for `numba.carray`; `as_float64(bits)`,
  `as_float32(bits)`: the float an int64 (or its low 32 bits) holds.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _element_pointer(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any) -> Any:
    arr = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, arr, [idx], wraparound=False,
                                    boundscheck=False)


def _atomic_add(typingctx: Any, arr: Any, idx: Any, value: Any) -> Any:
    """arr[idx] += value atomically (int64 array); the old value."""
    sig = types.int64(arr, idx, value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        val = args[2] if args[2].type == _I64 else builder.sext(args[2], _I64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return sig, codegen


def _atomic_load(typingctx: Any, arr: Any, idx: Any) -> Any:
    sig = types.int64(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


def _atomic_store(typingctx: Any, arr: Any, idx: Any, value: Any) -> Any:
    sig = types.void(arr, idx, value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        val = args[2] if args[2].type == _I64 else builder.sext(args[2], _I64)
        builder.store_atomic(val, ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


def _spin_pause(typingctx: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(ir.VoidType(), [])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty,
                                                    "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()

    return types.void(), codegen


def _call_step(typingctx: Any, fn: Any, t: Any, nt: Any, args: Any) -> Any:
    """void fn(int64, int64, int64 *) at address fn; args: an int64 address."""
    sig = types.void(fn, t, nt, args)

    def codegen(context: Any, builder: Any, signature: Any, llargs: Any) -> Any:
        fnty = ir.FunctionType(ir.VoidType(), [_I64, _I64, _I64.as_pointer()])
        ints = [v if v.type == _I64 else builder.sext(v, _I64) for v in llargs]
        target = builder.inttoptr(ints[0], fnty.as_pointer())
        builder.call(target, [ints[1], ints[2], builder.inttoptr(ints[3], _I64.as_pointer())])
        return context.get_dummy_value()

    return sig, codegen


def _call_int(typingctx: Any, fn: Any) -> Any:
    """int fn(void) at address fn."""
    sig = types.int32(fn)

    def codegen(context: Any, builder: Any, signature: Any, llargs: Any) -> Any:
        fnty = ir.FunctionType(_I32, [])
        return builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), [])

    return sig, codegen


def _cycles(typingctx: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(_I64, [])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty,
                                                           "llvm.readcyclecounter"), [])

    return types.int64(), codegen


def _address_at(typingctx: Any, addr: Any) -> Any:
    sig = types.voidptr(addr)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return sig, codegen


atomic_add: Any = intrinsic(_atomic_add)
atomic_load: Any = intrinsic(_atomic_load)
atomic_store: Any = intrinsic(_atomic_store)
spin_pause: Any = intrinsic(_spin_pause)
call_step: Any = intrinsic(_call_step)
call_int: Any = intrinsic(_call_int)
cycles: Any = intrinsic(_cycles)
address_at: Any = intrinsic(_address_at)



def _as_float64(typingctx: Any, bits: Any) -> Any:
    """The float64 whose bits an int64 holds."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(bits), codegen


def _as_float32(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bits are an int64's low 32."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.trunc(args[0], _I32), ir.FloatType())

    return types.float32(bits), codegen


as_float64: Any = intrinsic(_as_float64)
as_float32: Any = intrinsic(_as_float32)
