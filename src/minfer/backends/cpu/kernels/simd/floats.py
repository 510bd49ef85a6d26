"""Float weight rows dotted with an f32 activation row, in LLVM vector IR of a fixed order.

`fdot_f32` / `fdot_f16` / `fdot_bf16` (row, x) -> f32: the row's values widened to f32 (F16 by
vcvtph2ps or exact integer ops, BF16 by a 16-bit shift), four accumulators of 16 lanes taking 64
values a step by fused multiply-adds, folded as (a0 + a1) + (a2 + a3) then halves to one lane;
the values past the last multiple of 64 go into one scalar chain added last. The float row
drivers (`linear.row_drivers`' `mv_f32` / `mv_f16` / `mv_bf16`) call these: written as a
loop of `acc += w * x` under fastmath, LLVM chose the reduction's lanes from the code around
it, so the dense driver and its expert form, or one process's compile and the disk cache's,
gave different bits for the same row (a few ulps). Here every operation is spelled out and
carries no fastmath flag: a row's dot is the same bits in every driver, batch and process. The
vectors are 16 lanes on every target (two ymm halves on AVX2), so the order, and the bits,
follow only from whether the target has FMA.

`update_dot(row, s, d, k, x)`: a row rewritten in place as fma(d, k, row * s), then dotted with
x in the same order (the gated delta rule's state rows, `recurrent.delta_net`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.simd.blocks import (
    _F32,
    _I8,
    _I16,
    _I32,
    _fma,
    _hsum,
    _ld,
    _phi_loop,
    _prefetch_ir,
    _splat,
    _vec,
)
from minfer.backends.cpu.kernels.simd.llvm import halves_to_floats

LANES = 16
STEP = 4 * LANES  # values per loop step
PREFETCH = 512  # values ahead of the step the row's cache lines are asked for


def _widen(builder: Any, ptr: Any, off: Any, kind: str, n: int) -> Any:
    """<n x f32>: n row values of `kind` at byte offset `off`, exactly widened."""
    if kind == "f32":
        return _ld(builder, ptr, off, _vec(_F32, n))
    bits = _ld(builder, ptr, off, _vec(_I16, n))
    if kind == "f16":
        return halves_to_floats(builder, bits)
    wide = builder.shl(builder.zext(bits, _vec(_I32, n)), ir.Constant(_vec(_I32, n), 16))
    return builder.bitcast(wide, _vec(_F32, n))


def _ordered_dot(builder: Any, n: Any, xp: Any, term: Callable[[Any, int], Any],
                 at_step: Callable[[Any], None] | None = None) -> Any:
    """f32: the sum over v < n of term(v) * x[v] (`xp`: x's bytes) in the one fixed order:
    four accumulators of LANES taking STEP values a step by fused multiply-adds (`term(v,
    LANES)`: the row's values v.. as <LANES x f32>; `at_step(v0)` first in each step), folded
    (a0 + a1) + (a2 + a3) then halves to one lane; the values past the last multiple of STEP
    (`term(v, 1)`: one f32) in one scalar chain added last."""
    intp = n.type

    def k(v: int) -> Any:
        return ir.Constant(intp, v)

    def step(i: Any, accs: list[Any]) -> list[Any]:
        v0 = builder.mul(i, k(STEP))
        if at_step is not None:
            at_step(v0)
        out = []
        for j, acc in enumerate(accs):
            v = builder.add(v0, k(j * LANES))
            w = term(v, LANES)
            out.append(_fma(builder, w, _ld(builder, xp, builder.mul(v, k(4)),
                                            _vec(_F32, LANES)), acc))
        return out

    zero = ir.Constant(_vec(_F32, LANES), [0.0] * LANES)
    steps = builder.udiv(n, k(STEP))
    a0, a1, a2, a3 = _phi_loop(builder, steps, [zero] * 4, step)
    done = builder.mul(steps, k(STEP))

    def tail(i: Any, acc: list[Any]) -> list[Any]:
        v = builder.add(done, i)
        w = term(v, 1)
        xv = _ld(builder, xp, builder.mul(v, k(4)), _F32)
        return [_fma(builder, w, xv, acc[0])]

    (rest,) = _phi_loop(builder, builder.sub(n, done), [ir.Constant(_F32, 0.0)], tail)
    total = _hsum(builder, builder.fadd(builder.fadd(a0, a1), builder.fadd(a2, a3)))
    return builder.fadd(total, rest)


def _fdot(kind: str) -> Any:
    width = 4 if kind == "f32" else 2
    element = types.float32 if kind == "f32" else types.uint16

    def typer(typingctx: Any, row: Any, x: Any) -> Any:
        for arr, dtype in ((row, element), (x, types.float32)):
            if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == dtype
                    and arr.layout == "C"):
                raise TypingError(f"fdot_{kind}: wants a contiguous 1-D {dtype} array, got {arr}")
        sig = types.float32(row, x)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ra = context.make_array(signature.args[0])(context, builder, args[0])
            xa = context.make_array(signature.args[1])(context, builder, args[1])
            n = builder.extract_value(xa.shape, 0)
            rp, xp = (builder.bitcast(a.data, _I8.as_pointer()) for a in (ra, xa))

            def k(v: int) -> Any:
                return ir.Constant(n.type, v)

            def prefetch(v0: Any) -> None:
                _prefetch_ir(builder, builder.gep(rp, [builder.mul(builder.add(v0, k(PREFETCH)),
                                                                   k(width))]))

            def term(v: Any, lanes: int) -> Any:
                w = _widen(builder, rp, builder.mul(v, k(width)), kind, lanes)
                return w if lanes > 1 else builder.extract_element(w, ir.Constant(_I32, 0))

            return _ordered_dot(builder, n, xp, term, prefetch)

        return sig, codegen

    typer.__name__ = f"_fdot_{kind}"
    return intrinsic(typer)


fdot_f32: Any = _fdot("f32")
fdot_f16: Any = _fdot("f16")
fdot_bf16: Any = _fdot("bf16")


def _update_dot(typingctx: Any, row: Any, s: Any, d: Any, k: Any, x: Any) -> Any:
    """update_dot(row, s, d, k, x) -> f32: row[i] = fma(d, k[i], row[i] * s) in place, then the
    updated row dotted with x in `fdot_f32`'s order (`_ordered_dot`). The delta rule's two
    passes over a state row: the decay (s = exp(g), d = 0) dotted with k, then the rank-one
    update (s = 1, d = delta_j) dotted with q."""
    for arr in (row, k, x):
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32
                and arr.layout == "C"):
            raise TypingError(f"update_dot: wants 1-D f32 arrays, got {arr}")
    sig = types.float32(row, types.float32, types.float32, k, x)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ra, ka, xa = (context.make_array(signature.args[i])(context, builder, args[i])
                      for i in (0, 3, 4))
        n = builder.extract_value(ra.shape, 0)
        rp, kp, xp = (builder.bitcast(a.data, _I8.as_pointer()) for a in (ra, ka, xa))
        splats = tuple(_splat(builder, args[i], LANES) for i in (1, 2))

        def term(v: Any, lanes: int) -> Any:
            off = builder.mul(v, ir.Constant(n.type, 4))
            ty = _vec(_F32, lanes) if lanes > 1 else _F32
            sv, dv = splats if lanes > 1 else (args[1], args[2])
            new = _fma(builder, dv, _ld(builder, kp, off, ty),
                       builder.fmul(_ld(builder, rp, off, ty), sv))
            builder.store(new, builder.bitcast(builder.gep(rp, [off]), ty.as_pointer()),
                          align=1 if lanes > 1 else None)
            return new

        return _ordered_dot(builder, n, xp, term)

    return sig, codegen


update_dot: Any = intrinsic(_update_dot)
