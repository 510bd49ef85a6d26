"""The per-token attention's two products as LLVM vector IR: the scores and the value mix.

numba compiles `attention._attention`'s loops reasonably but leaves work on the table at long
windows, where decode spends its attention time (19 ms of a 60 ms token at 4,096 cells on the
development model):

- `value_mix`: `acc[g] = sum_c p[g, c] V[c]`. numba keeps the group's accumulators in memory:
  for every cell it loads and stores all `group x head_dim` of them (28 vectors for Qwen2.5's 7
  query heads per KV head). Here they are loop-carried values in registers: heads four at a
  time, then a pair, then one; head_dim `COLUMNS` at a time, so four heads hold 16 zmm and a V
  row's 64 values are loaded and widened from f16 once for all four. Each output value is
  `fma(p, v, acc)` cell by cell, in cell order: the same operations in the same order as the
  loop it replaces, so the results are bitwise the same.
- `scores`: `s[g, c] = scale * (q[g] . K[c])`. The loop reduced every (cell, head) dot to a
  scalar with its own horizontal sum. Here cells go in blocks of `CELLS`: the block's K rows are
  widened once into a stack buffer, then per head one 16-lane partial vector per cell and the
  16 partials are summed together in a fixed transposing tree, leaving the 16 dots in one
  vector. The last n % 16 cells are summed one by one, in the same order. A dot is added up as
  ggml's f16 dot on AVX-512 adds it (four 16-lane accumulators taking 16 columns in turn, then
  (a0 + a2) + (a1 + a3), then halves folded onto halves), so the scores round as llama.cpp's do:
  the
  numba loop's order put the Gemma 3 reference test's top-10 logits 0.37-0.55 from llama.cpp's,
  a first version of this kernel with one accumulator 0.20-0.74, this one 0.26-0.55. The order
  is fixed by head_dim alone, so a token's scores do not depend on the batch.

At 4,096 cells, 24 layers' caches cycled as a decode step does, the two took attention from
19.0 to about 10 ms a token in the per-op profile (2 threads, Intel Xeon, Sapphire Rapids).
The scores' step loop is unrolled for 1, 2 and 4 steps (head_dim 64, 128, 256): as a loop of
one step it went through LLVM's remainder code with stack reloads once per cell and head, and
the scores of a 128-row chunk at depth 4,000 took 30 ms a layer against 15.5 unrolled.
Used where head_dim is a multiple of `COLUMNS` (the scores: up to `MAX_HEAD_DIM`) and the
target has FMA and F16C; elsewhere `attention` keeps its loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import HAS_F16C
from .simd import (
    _F32,
    _I8,
    _I16,
    _I32,
    HAS_FMA,
    _fma,
    _hfold,
    _hsum,
    _ld,
    _phi_loop,
    _splat,
    _vec,
)

COLUMNS = 64  # value-mix output columns per pass: four zmm
LANES = 16  # f32 lanes of a zmm
CELLS = 16  # cells per score block: one vector of scores per head
MAX_HEAD_DIM = 256  # the score block's stack buffer holds CELLS rows of this many f32
HAS_MIX = HAS_FMA and HAS_F16C
_ROW = _vec(_F32, COLUMNS)
_VEC = _vec(_F32, LANES)


def _each(builder: Any, count: Any, body: Callable[[Any], None]) -> None:
    """for i in range(count): body(i), nothing carried (`simd._phi_loop` without values)."""
    def step(i: Any, _: list[Any]) -> list[Any]:
        body(i)
        return []

    _phi_loop(builder, count, [], step)


def _widened(builder: Any, ptr: Any, off: Any, n: int, half: bool) -> Any:
    """<n x f32> at byte `off` of a cache row: f16 bits widened, or f32 as they are."""
    if not half:
        return _ld(builder, ptr, off, _vec(_F32, n))
    return builder.fpext(builder.bitcast(_ld(builder, ptr, off, _vec(_I16, n)),
                                         _vec(ir.HalfType(), n)), _vec(_F32, n))


def _mix(typingctx: Any, p: Any, v: Any, s0: Any, n: Any, col0: Any, acc: Any) -> Any:
    """acc[g, :] = sum over c < n of p[g, c] * v[s0 + c, col0:col0 + hd], hd = acc.shape[1]
    (a multiple of COLUMNS). p, acc: 2-D f32 with contiguous rows; v: the 2-D cache (f16 bits
    as uint16, or f32) with contiguous rows. Nothing is bounds-checked."""
    return _mix_codegen(p, v, s0, n, col0, acc, carry=False)


def _mix_on(typingctx: Any, p: Any, v: Any, s0: Any, n: Any, col0: Any, acc: Any) -> Any:
    """`value_mix` that carries on from acc's values instead of zeros: the chain of fused
    multiply-adds over cells [0, n) then [n, m) in two calls is the one-call chain over [0, m),
    bit for bit (an f32 store and load change nothing)."""
    return _mix_codegen(p, v, s0, n, col0, acc, carry=True)


def _mix_codegen(p: Any, v: Any, s0: Any, n: Any, col0: Any, acc: Any, carry: bool) -> Any:
    sig = types.void(p, v, s0, n, col0, acc)
    half = v.dtype == types.uint16

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        p_t, v_t, s0_t, n_t, col_t, acc_t = signature.args
        pa = context.make_array(p_t)(context, builder, args[0])
        va = context.make_array(v_t)(context, builder, args[1])
        aa = context.make_array(acc_t)(context, builder, args[5])
        s0_v = context.cast(builder, args[2], s0_t, types.intp)
        n_v = context.cast(builder, args[3], n_t, types.intp)
        col_v = context.cast(builder, args[4], col_t, types.intp)
        group = builder.extract_value(aa.shape, 0)
        passes = builder.udiv(builder.extract_value(aa.shape, 1),
                              ir.Constant(group.type, COLUMNS))
        p_row = builder.extract_value(pa.strides, 0)  # bytes
        v_row = builder.extract_value(va.strides, 0)
        a_row = builder.extract_value(aa.strides, 0)
        i8p = _I8.as_pointer()
        p_ptr, v_ptr, a_ptr = (builder.bitcast(x.data, i8p) for x in (pa, va, aa))
        width = 2 if half else 4
        intp = group.type

        def k(value: int) -> Any:
            return ir.Constant(intp, value)

        def heads(g0: Any, m: int) -> None:
            """Heads g0 .. g0 + m - 1, every pass of COLUMNS columns."""
            def one_pass(h: Any) -> None:
                col = builder.add(col_v, builder.mul(h, k(COLUMNS)))
                first = builder.add(builder.mul(s0_v, v_row), builder.mul(col, k(width)))
                p_rows = [builder.mul(builder.add(g0, k(i)), p_row) for i in range(m)]

                def cell(c: Any, accs: list[Any]) -> list[Any]:
                    row = _widened(builder, v_ptr, builder.add(first, builder.mul(c, v_row)),
                                   COLUMNS, half)
                    weights = [_ld(builder, p_ptr, builder.add(p_rows[i], builder.mul(c, k(4))),
                                   _F32) for i in range(m)]
                    return [_fma(builder, _splat(builder, w, COLUMNS), row, a)
                            for w, a in zip(weights, accs, strict=True)]

                dsts = [builder.bitcast(builder.gep(a_ptr, [builder.add(
                    builder.mul(builder.add(g0, k(i)), a_row), builder.mul(h, k(COLUMNS * 4)))]),
                    _ROW.as_pointer()) for i in range(m)]
                init = ([builder.load(d, align=4) for d in dsts] if carry
                        else [ir.Constant(_ROW, [0.0] * COLUMNS)] * m)
                accs = _phi_loop(builder, n_v, init, cell)
                for a, d in zip(accs, dsts, strict=True):
                    builder.store(a, d, align=4)

            _each(builder, passes, one_pass)

        fours = builder.udiv(group, k(4))
        _each(builder, fours, lambda i: heads(builder.mul(i, k(4)), 4))
        g = builder.mul(fours, k(4))
        pairs = builder.udiv(builder.sub(group, g), k(2))
        _each(builder, pairs, lambda i: heads(g, 2))
        g = builder.add(g, builder.mul(pairs, k(2)))
        _each(builder, builder.sub(group, g), lambda i: heads(g, 1))
        return context.get_dummy_value()

    return sig, codegen


value_mix: Any = intrinsic(_mix)
value_mix_on: Any = intrinsic(_mix_on)


def _sum_each(builder: Any, parts: list[Any]) -> Any:
    """LANES vectors of LANES lanes -> one vector whose lane i is the sum of parts[i], each
    part's lanes added in `simd._hsum`'s order (halves folded onto halves): pairs of vectors
    halve the lanes each holds per part, lower halves added to upper halves."""
    width = LANES
    while len(parts) > 1:
        half = width // 2
        lo = [c * width + i for c in range(LANES // width) for i in range(half)]
        hi = [c * width + half + i for c in range(LANES // width) for i in range(half)]
        lo_mask = ir.Constant(_vec(ir.IntType(32), LANES), lo + [LANES + i for i in lo])
        hi_mask = ir.Constant(_vec(ir.IntType(32), LANES), hi + [LANES + i for i in hi])
        parts = [builder.fadd(builder.shuffle_vector(a, b, lo_mask),
                              builder.shuffle_vector(a, b, hi_mask))
                 for a, b in zip(parts[::2], parts[1::2], strict=True)]
        width = half
    return parts[0]


def _scores(typingctx: Any, q: Any, k: Any, s0: Any, n: Any, col0: Any, scale: Any,
            out: Any) -> Any:
    """out[g, c] = scale * (q[g, :] . k[s0 + c, col0:col0 + hd]) for c < n and g < q.shape[0],
    hd = q.shape[1] (a multiple of 4 * LANES, at most MAX_HEAD_DIM). q, out: 2-D f32 with
    contiguous rows; k: the 2-D cache (f16 bits as uint16, or f32) with contiguous rows.
    Nothing is bounds-checked."""
    sig = types.void(q, k, s0, n, col0, scale, out)
    half = k.dtype == types.uint16

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        q_t, k_t, s0_t, n_t, col_t, scale_t, out_t = signature.args
        qa = context.make_array(q_t)(context, builder, args[0])
        ka = context.make_array(k_t)(context, builder, args[1])
        oa = context.make_array(out_t)(context, builder, args[6])
        s0_v = context.cast(builder, args[2], s0_t, types.intp)
        n_v = context.cast(builder, args[3], n_t, types.intp)
        col_v = context.cast(builder, args[4], col_t, types.intp)
        scale_v = context.cast(builder, args[5], scale_t, types.float32)
        group = builder.extract_value(qa.shape, 0)
        head_dim = builder.extract_value(qa.shape, 1)
        intp = group.type

        def k_(value: int) -> Any:
            return ir.Constant(intp, value)

        steps = builder.udiv(head_dim, k_(4 * LANES))  # four chunks of LANES columns a step
        q_row = builder.extract_value(qa.strides, 0)
        k_row = builder.extract_value(ka.strides, 0)
        o_row = builder.extract_value(oa.strides, 0)
        i8p = _I8.as_pointer()
        q_ptr, k_ptr, o_ptr = (builder.bitcast(x.data, i8p) for x in (qa, ka, oa))
        width = 2 if half else 4
        first = builder.add(builder.mul(s0_v, k_row), builder.mul(col_v, k_(width)))
        with builder.goto_entry_block():
            stack = builder.alloca(_F32, size=ir.Constant(ir.IntType(32), CELLS * MAX_HEAD_DIM))
        block_buf = builder.bitcast(stack, i8p)

        def k_chunk(cell: Any, j: Any) -> Any:
            return _widened(builder, k_ptr, builder.add(builder.add(
                first, builder.mul(cell, k_row)), builder.mul(j, k_(LANES * width))), LANES, half)

        def buffered(i: int, j: Any) -> Any:
            """Byte offset of chunk j of the block's i-th widened K row."""
            return builder.add(builder.mul(k_(i * 4), head_dim), builder.mul(j, k_(LANES * 4)))

        def partial(g: Any, row: Callable[[Any], Any], known: int | None) -> Any:
            """<LANES x f32> partial sums of q[g] . row: four accumulators take the chunks in
            turn (one fused multiply-add each), then (a0 + a2) + (a1 + a3), ggml's f16 dot.
            `known`: the number of steps when the caller has fixed it (straight-line code)."""
            def step(s: Any, accs: list[Any]) -> list[Any]:
                j0 = builder.mul(s, k_(4))
                return [_fma(builder, _ld(builder, q_ptr, builder.add(
                            builder.mul(g, q_row), builder.mul(j, k_(LANES * 4))), _VEC),
                             row(j), a)
                        for j, a in ((builder.add(j0, k_(i)), accs[i]) for i in range(4))]

            a = [ir.Constant(_VEC, [0.0] * LANES)] * 4
            if known is None:
                a = _phi_loop(builder, steps, a, step)
            else:
                for s_ in range(known):
                    a = step(k_(s_), a)
            return builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3]))

        def chunks(count: Any, known: int | None, body: Callable[[Any], None]) -> None:
            """body(j) for the 4 * steps chunks of a row: a loop, or unrolled when known."""
            if known is None:
                _each(builder, count, body)
            else:
                for j in range(4 * known):
                    body(k_(j))

        scales = _splat(builder, scale_v, LANES)
        blocks = builder.udiv(n_v, k_(CELLS))
        rest = builder.mul(blocks, k_(CELLS))

        def block(b: Any, known: int | None) -> None:
            c0 = builder.mul(b, k_(CELLS))

            def widen(i: int) -> Callable[[Any], None]:
                cell = builder.add(c0, k_(i))
                return lambda j: builder.store(k_chunk(cell, j), builder.bitcast(
                    builder.gep(block_buf, [buffered(i, j)]), _VEC.as_pointer()), align=4)

            def from_buffer(i: int) -> Callable[[Any], Any]:
                return lambda j: _ld(builder, block_buf, buffered(i, j), _VEC)

            for i in range(CELLS):  # the block's K rows, widened once for every head
                chunks(builder.mul(steps, k_(4)), known, widen(i))

            def head(g: Any) -> None:
                parts = [partial(g, from_buffer(i), known) for i in range(CELLS)]
                at = builder.gep(o_ptr, [builder.add(builder.mul(g, o_row),
                                                     builder.mul(c0, k_(4)))])
                builder.store(builder.fmul(_sum_each(builder, parts), scales),
                              builder.bitcast(at, _VEC.as_pointer()), align=4)

            _each(builder, group, head)

        def last(i: Any, known: int | None) -> None:  # the cells after the last whole block
            cell = builder.add(rest, i)

            def head(g: Any) -> None:
                total = _hsum(builder, partial(g, lambda j: k_chunk(cell, j), known))
                at = builder.gep(o_ptr, [builder.add(builder.mul(g, o_row),
                                                     builder.mul(cell, k_(4)))])
                builder.store(builder.fmul(total, scale_v),
                              builder.bitcast(at, _F32.as_pointer()))

            _each(builder, group, head)

        def emit(known: int | None) -> None:
            _each(builder, blocks, lambda b: block(b, known))
            _each(builder, builder.sub(n_v, rest), lambda i: last(i, known))

        def dispatch(cases: tuple[int, ...]) -> None:
            """Straight-line code for the common head sizes (64, 128, 256: 1, 2, 4 steps), a
            loop over the steps otherwise; the same operations in the same order either way.
            (A loop of one step went through LLVM's unrolled-loop remainder code, with stack
            reloads, once per cell and head.)"""
            if not cases:
                emit(None)
                return
            with builder.if_else(builder.icmp_unsigned("==", steps, k_(cases[0]))) as (
                    then, other):
                with then:
                    emit(cases[0])
                with other:
                    dispatch(cases[1:])

        dispatch((1, 2, 4))
        return context.get_dummy_value()

    return sig, codegen


scores: Any = intrinsic(_scores)


# -- the prefill softmax's two passes over a tile row (`attention_blocked`) --------------------
# numba left both scalar: its float `max` carries NaN semantics LLVM does not turn into a vector
# reduction (1 ns a cell, a compare-and-select chain), and the exp loop went out in 8 lanes.
_LOG2E, _LN2_HI, _LN2_LO = 1.4426950408889634, 0.693145751953125, 1.4286068203094172e-06
_EXP_POLY = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0]


def _const(ty: ir.Type, value: float) -> Any:
    """An f32 constant of `ty` (a scalar, or every lane of a vector)."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [float(np.float32(value))] * ty.count)
    return ir.Constant(ty, float(np.float32(value)))


def _unary(builder: Any, name: str, x: Any) -> Any:
    """llvm.<name> on x, for a scalar or a vector x."""
    ty = x.type
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ty, [ty]), f"llvm.{name}.{suffix}")
    return builder.call(fn, [x])


def _max(builder: Any, a: Any, b: Any) -> Any:
    """a > b ? a : b, as x86's maxps computes it (one instruction; llvm.maxnum's NaN rules cost
    a compare and a blend more on the loop-carried chain). Scores are never NaN here."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _min(builder: Any, a: Any, b: Any) -> Any:
    return builder.select(builder.fcmp_ordered("<", a, b), a, b)


def _exp(builder: Any, x: Any) -> Any:
    """`elementwise.fast_exp` in IR: x clamped to [-87, 88], x = n ln2 + r (two-step reduction),
    2^n * p(r) with p the degree-7 Taylor polynomial in fused multiply-adds."""
    ty = x.type
    x = _min(builder, _max(builder, x, _const(ty, -87.0)), _const(ty, 88.0))
    n = _unary(builder, "rint", builder.fmul(x, _const(ty, _LOG2E)))
    r = builder.fsub(builder.fsub(x, builder.fmul(n, _const(ty, _LN2_HI))),
                     builder.fmul(n, _const(ty, _LN2_LO)))
    p = _const(ty, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = _fma(builder, p, r, _const(ty, c))
    ity = _vec(_I32, ty.count) if isinstance(ty, ir.VectorType) else _I32
    bits = builder.shl(builder.add(builder.fptosi(n, ity), _int_const(ity, 127)),
                       _int_const(ity, 23))
    return builder.fmul(p, builder.bitcast(bits, ty))


def _int_const(ty: ir.Type, value: int) -> Any:
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _in_place(context: Any, builder: Any, signature: Any, args: Any,
              cell: Callable[[Any], tuple[Any, Any]], init: Any,
              combine: Callable[[Any, Any], Any]) -> Any:
    """row[c] = cell(row[c]) for c < n in place (row: a contiguous 1-D f32 array, n: the
    second argument; nothing bounds-checked), LANES cells a step, then the last n % LANES one
    by one; cell(x) -> (new x, its part of the result), for a vector or a scalar x. The parts
    are combined into the <LANES> `init`, folded to one lane (`simd._hfold`), then the tail's
    parts are combined onto that. Returns the result."""
    ra = context.make_array(signature.args[0])(context, builder, args[0])
    ptr = builder.bitcast(ra.data, _I8.as_pointer())
    n_v = context.cast(builder, args[1], signature.args[1], types.intp)
    intp = n_v.type

    def at(i: Any, ty: ir.Type, width: int) -> Any:
        off = builder.mul(i, ir.Constant(intp, 4 * width))
        return builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer())

    def step(i: Any, acc: list[Any], ty: ir.Type, width: int) -> list[Any]:
        where = at(i, ty, width)
        x, part = cell(builder.load(where, align=4))
        builder.store(x, where, align=4)
        return [combine(acc[0], part)]

    blocks = builder.udiv(n_v, ir.Constant(intp, LANES))
    (vec,) = _phi_loop(builder, blocks, [init], lambda i, acc: step(i, acc, _VEC, LANES))
    first = builder.mul(blocks, ir.Constant(intp, LANES))
    (total,) = _phi_loop(builder, builder.sub(n_v, first), [_hfold(builder, vec, combine)],
                         lambda i, acc: step(builder.add(first, i), acc, _F32, 1))
    return total


def _scale_max(typingctx: Any, row: Any, n: Any, scale: Any) -> Any:
    """row[c] *= scale for c < n, in place; returns the largest of them (-inf for n == 0).
    row: a contiguous 1-D f32 array; nothing is bounds-checked."""
    sig = types.float32(row, n, scale)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        s = context.cast(builder, args[2], signature.args[2], types.float32)
        svec = _splat(builder, s, LANES)

        def cell(x: Any) -> tuple[Any, Any]:
            y = builder.fmul(x, svec if isinstance(x.type, ir.VectorType) else s)
            return y, y

        return _in_place(context, builder, signature, args, cell, _const(_VEC, -np.inf),
                         lambda a, b: _max(builder, a, b))

    return sig, codegen


def _exp_sum(typingctx: Any, row: Any, n: Any, m: Any) -> Any:
    """row[c] = exp(row[c] - m) for c < n, in place (`fast_exp`'s arithmetic); returns their
    sum in f64. row: a contiguous 1-D f32 array; nothing is bounds-checked."""
    sig = types.float64(row, n, m)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        m_v = context.cast(builder, args[2], signature.args[2], types.float32)
        mvec = _splat(builder, m_v, LANES)
        f64 = ir.DoubleType()

        def cell(x: Any) -> tuple[Any, Any]:
            vector = isinstance(x.type, ir.VectorType)
            e = _exp(builder, builder.fsub(x, mvec if vector else m_v))
            return e, builder.fpext(e, _vec(f64, LANES) if vector else f64)

        return _in_place(context, builder, signature, args, cell,
                         ir.Constant(_vec(f64, LANES), [0.0] * LANES), builder.fadd)

    return sig, codegen


scale_max: Any = intrinsic(_scale_max)
exp_sum: Any = intrinsic(_exp_sum)
