"""The per-token attention's two products as LLVM vector IR: the scores and the value mix.

numba compiles `attn.attend._attention`'s loops reasonably but leaves work on the table at long
windows, where decode spends its attention time (19 ms of a 60 ms token at 4,096 cells on the
development model):

- `value_mix`: `acc[g] = sum_c p[g, c] V[c]`. numba keeps the group's accumulators in memory:
  for every cell it loads and stores all `group x head_dim` of them (28 vectors for Qwen2.5's 7
  query heads per KV head). Here they are loop-carried values in registers: five to eight heads
  together over `WIDE_COLUMNS` (32) columns at a time, fewer heads four, two or one at a time
  over `COLUMNS` (64), so a pass holds at most 16 zmm and each V row is loaded and widened from
  f16 once for all the heads of its pass (Qwen2.5's 7 heads: once, was three times; 16 rows at
  300 cells, one layer's mix 2.4 -> 1.9 us a (row, KV head), Intel SPR). Each output value is
  `fma(p, v, acc)` cell by cell, in cell order: the same operations in the same order as the
  loop it replaces, so the results are bitwise the same.
- `scores`: `s[g, c] = scale * (q[g] . K[c])`, each dot one chain of fused multiply-adds over
  the columns in order. Cells go in blocks of `BLOCK` (32) with the cells in the lanes: the
  block's K rows are widened and transposed in registers (16 x 16 at a time) into a stack
  buffer of columns, then per head two 16-cell accumulators take column j times q[g, j]
  broadcast; four heads run together (eight independent chains). Lanes past the window's end
  repeat its last cell and are never stored, so a cell's score is the same whichever block,
  tile or call computes it: the batch does not change it. `k_columns` / `scores_from` split the
  two halves so the row-blocked prefill kernel transposes a K tile once for all its rows.
  Against the former form (ggml's AVX-512 f16 dot order: a 16-lane partial per cell, four
  accumulators, then a transposing tree of shuffles per 16 cells) this cut the scores from
  about 146 to 105 cycles per head and 16 cells (7 heads, 2,048 cells, 1 thread, AMD EPYC
  Zen 4), and a 128-row prefill chunk's attention at depth 3,968 from 20-22 ms to 16.2 ms, on
  par with the sgemm-blocked kernel (2 threads). The order is no longer ggml's, so the scores
  round differently from llama.cpp's by an ulp or so: the reference tests' tolerances held.

At 4,096 cells, 24 layers' caches cycled as a decode step does, the first vector forms took
attention from 19.0 to about 10 ms a token in the per-op profile (2 threads, Intel Xeon,
Sapphire Rapids). Used where head_dim is a multiple of `COLUMNS` (the scores: up to
`MAX_HEAD_DIM`) and the target has FMA and F16C; elsewhere `attention` keeps its loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.simd.blocks import (
    _F32,
    _I8,
    _I16,
    _I32,
    HAS_FMA,
    _fma,
    _hfold,
    _ld,
    _phi_loop,
    _prefetch_span,
    _splat,
    _vec,
)
from minfer.backends.cpu.kernels.simd.llvm import HAS_F16C, halves_to_floats

COLUMNS = 64  # value-mix output columns per pass: four zmm
# Software prefetch (into L1) of the K and V rows this many cells ahead of the ones being read.
# A decode step's windows stream from DRAM (16 sequences x 24 layers: ~200 MB at 1,000 cells on
# the development model), and the row streams of one KV head are strided (every cell holds all
# KV heads), which left the reads waiting beside the arithmetic instead of under it: 16 rows x
# 24 layers, 2 threads, Intel SPR: 300 cells 4.7-4.8 -> 4.1-4.3 ms, 1,000 cells 22.3-24.2 ->
# 18.8-19.2 ms (32 cells ahead about as good, 64 no better); a whole 16-row decode step at
# 2,000 cells 82.2-85.9 -> 79.6-81.0 ms, at 300 cells and single-row steps within the noise.
# Prefetches never fault, so the rows past a window's end cost nothing but the slot.
PF_CELLS = 16
# The scores pass also prefetches each cell's V row into L2 (prefetcht1) as it reads the K row,
# so the value mix that follows finds its rows near instead of waiting on memory a second time:
# 16 decode rows in their own slots x 24 layers (2 threads, Intel SPR, bound kernel, 2-3
# alternating runs) at 300 cells 5.04-5.19 -> 4.76-4.96 ms, at 1,000 cells 21.5-21.7 -> 20.1
# ms; one row at 1,000 cells within the noise (0.99-1.19 against 1.01-1.05 ms). Prefetches
# change no value.
WIDE_COLUMNS = 32  # per pass of five to eight heads: each V row is widened once for them all
LANES = 16  # f32 lanes of a zmm
BLOCK = 32  # cells per score block: two vectors of scores per head
MAX_HEAD_DIM = 256  # the score block's stack buffer holds BLOCK cells of this many columns
HAS_MIX = HAS_FMA and HAS_F16C
_I64 = ir.IntType(64)
_ROW = _vec(_F32, COLUMNS)
_VEC = _vec(_F32, LANES)


def _each(builder: Any, count: Any, body: Callable[[Any], None]) -> None:
    """for i in range(count): body(i), nothing carried (`simd.blocks._phi_loop` without values)."""
    def step(i: Any, _: list[Any]) -> list[Any]:
        body(i)
        return []

    _phi_loop(builder, count, [], step)


def _k(value: int) -> Any:
    return ir.Constant(_I64, value)


def _by_heads(builder: Any, group: Any, heads: Callable[[Any, int], None]) -> None:
    """heads(g0, m) over a KV head's `group` query heads (an i64): m = 4 while four are left,
    then a pair, then one, so a pass holds m heads' accumulators in registers."""
    fours = builder.udiv(group, _k(4))
    _each(builder, fours, lambda i: heads(builder.mul(i, _k(4)), 4))
    g = builder.mul(fours, _k(4))
    pairs = builder.udiv(builder.sub(group, g), _k(2))
    _each(builder, pairs, lambda i: heads(builder.add(g, builder.mul(i, _k(2))), 2))
    g = builder.add(g, builder.mul(pairs, _k(2)))
    _each(builder, builder.sub(group, g), lambda i: heads(builder.add(g, i), 1))


def _mix_heads(builder: Any, group: Any, heads: Callable[[Any, int, int], None]) -> None:
    """heads(g0, m, columns) over a KV head's `group` query heads (an i64), so that a pass holds
    m heads' accumulators of `columns` values in registers (16 zmm or fewer): eight heads of
    WIDE_COLUMNS at a time while eight are left, then the rest: five to seven together (of
    WIDE_COLUMNS), else four, a pair, one (of COLUMNS). Every head's values are the same sums
    whichever pass computes them."""
    eights = builder.udiv(group, _k(8))
    _each(builder, eights, lambda i: heads(builder.mul(i, _k(8)), 8, WIDE_COLUMNS))
    g = builder.mul(eights, _k(8))
    rest = builder.sub(group, g)
    for m in (5, 6, 7):
        with builder.if_then(builder.icmp_unsigned("==", rest, _k(m))):
            heads(g, m, WIDE_COLUMNS)
    small = builder.select(builder.icmp_unsigned(">=", rest, _k(5)), _k(0), rest)
    fours = builder.udiv(small, _k(4))
    _each(builder, fours, lambda i: heads(builder.add(g, builder.mul(i, _k(4))), 4, COLUMNS))
    g = builder.add(g, builder.mul(fours, _k(4)))
    small = builder.sub(small, builder.mul(fours, _k(4)))
    pairs = builder.udiv(small, _k(2))
    _each(builder, pairs, lambda i: heads(builder.add(g, builder.mul(i, _k(2))), 2, COLUMNS))
    g = builder.add(g, builder.mul(pairs, _k(2)))
    _each(builder, builder.sub(small, builder.mul(pairs, _k(2))),
          lambda i: heads(builder.add(g, i), 1, COLUMNS))


def _widened(builder: Any, ptr: Any, off: Any, n: int, half: bool) -> Any:
    """<n x f32> at byte `off` of a cache row: f16 bits widened, or f32 as they are."""
    if not half:
        return _ld(builder, ptr, off, _vec(_F32, n))
    return halves_to_floats(builder, _ld(builder, ptr, off, _vec(_I16, n)))


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
        head_dim = builder.extract_value(aa.shape, 1)
        p_row = builder.extract_value(pa.strides, 0)  # bytes
        v_row = builder.extract_value(va.strides, 0)
        a_row = builder.extract_value(aa.strides, 0)
        i8p = _I8.as_pointer()
        p_ptr, v_ptr, a_ptr = (builder.bitcast(x.data, i8p) for x in (pa, va, aa))
        width = 2 if half else 4
        intp = group.type

        def k(value: int) -> Any:
            return ir.Constant(intp, value)

        def heads(g0: Any, m: int, columns: int) -> None:
            """Heads g0 .. g0 + m - 1, every pass of `columns` columns."""
            vec = _vec(_F32, columns)

            def one_pass(h: Any) -> None:
                col = builder.add(col_v, builder.mul(h, k(columns)))
                first = builder.add(builder.mul(s0_v, v_row), builder.mul(col, k(width)))
                p_rows = [builder.mul(builder.add(g0, k(i)), p_row) for i in range(m)]

                def cell(c: Any, accs: list[Any]) -> list[Any]:
                    ahead = builder.add(first, builder.mul(builder.add(c, k(PF_CELLS)), v_row))
                    _prefetch_span(builder, v_ptr, ahead, columns * width, 3)
                    row = _widened(builder, v_ptr, builder.add(first, builder.mul(c, v_row)),
                                   columns, half)
                    weights = [_ld(builder, p_ptr, builder.add(p_rows[i], builder.mul(c, k(4))),
                                   _F32) for i in range(m)]
                    return [_fma(builder, _splat(builder, w, columns), row, a)
                            for w, a in zip(weights, accs, strict=True)]

                dsts = [builder.bitcast(builder.gep(a_ptr, [builder.add(
                    builder.mul(builder.add(g0, k(i)), a_row), builder.mul(h, k(columns * 4)))]),
                    vec.as_pointer()) for i in range(m)]
                init = ([builder.load(d, align=4) for d in dsts] if carry
                        else [ir.Constant(vec, [0.0] * columns)] * m)
                accs = _phi_loop(builder, n_v, init, cell)
                for a, d in zip(accs, dsts, strict=True):
                    builder.store(a, d, align=4)

            _each(builder, builder.udiv(head_dim, k(columns)), one_pass)

        _mix_heads(builder, group, heads)
        return context.get_dummy_value()

    return sig, codegen


value_mix: Any = intrinsic(_mix)
value_mix_on: Any = intrinsic(_mix_on)


def _transpose16(builder: Any, rows: list[Any]) -> list[Any]:
    """The 16 x 16 f32 matrix held as 16 row vectors, as its 16 column vectors: four rounds
    of block swaps (blocks of 8, 4, 2, 1 lanes between vectors 8, 4, 2, 1 apart)."""
    for b in (8, 4, 2, 1):
        lo = ir.Constant(_vec(_I32, LANES),
                         [i if not i & b else LANES + i - b for i in range(LANES)])
        hi = ir.Constant(_vec(_I32, LANES),
                         [i + b if not i & b else LANES + i for i in range(LANES)])
        out = list(rows)
        for i in range(LANES):
            if not i & b:
                out[i] = builder.shuffle_vector(rows[i], rows[i + b], lo)
                out[i + b] = builder.shuffle_vector(rows[i], rows[i + b], hi)
        rows = out
    return rows


def _masked_store(builder: Any, value: Any, ptr: Any, count: Any) -> None:
    """The first `count` lanes (an i64 in [0, LANES]) of <LANES x f32> `value` to f32* ptr."""
    lanes = ir.Constant(_vec(_I64, LANES), list(range(LANES)))
    mask = builder.icmp_unsigned("<", lanes, _splat(builder, count, LANES))
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_VEC, ptr.type, _I32, mask.type]),
        f"llvm.masked.store.v{LANES}f32.p0")
    builder.call(fn, [value, ptr, ir.Constant(_I32, 4), mask])


def _min_i(builder: Any, a: Any, b: Any) -> Any:
    return builder.select(builder.icmp_signed("<", a, b), a, b)


class _Cache:
    """A K cache argument: base pointer, row stride, element width (f16 bits or f32)."""

    def __init__(self, context: Any, builder: Any, ty: Any, value: Any, col0: Any) -> None:
        arr = context.make_array(ty)(context, builder, value)
        self.ptr = builder.bitcast(arr.data, _I8.as_pointer())
        self.row = builder.extract_value(arr.strides, 0)
        self.half = ty.dtype == types.uint16
        self.width = 2 if self.half else 4
        self.col0 = builder.mul(col0, _k(self.width))


class _F32Rows:
    """A 2-D f32 argument with contiguous rows: base pointer, row stride in bytes, shape."""

    def __init__(self, context: Any, builder: Any, ty: Any, value: Any) -> None:
        arr = context.make_array(ty)(context, builder, value)
        self.ptr = builder.bitcast(arr.data, _I8.as_pointer())
        self.row = builder.extract_value(arr.strides, 0)
        self.rows = builder.extract_value(arr.shape, 0)
        self.cols = builder.extract_value(arr.shape, 1)

    def at(self, builder: Any, r: Any, c: Any) -> Any:
        """Byte offset of element [r, c]."""
        return builder.add(builder.mul(r, self.row), builder.mul(c, _k(4)))


def _emit_columns(builder: Any, k: _Cache, s0: Any, m: Any, chunks: Any, kt: Any, kt_row: Any,
                  c_out: Any, v_rows: _Cache | None = None) -> None:
    """Cells s0 .. s0 + min(m, BLOCK) - 1 of the cache, widened, as columns of kt: kt row j
    (bytes kt_row apart) gets column j of the cells from element c_out on. Past m cells the
    block repeats the last one (lanes the readers of kt never store). Every lane of the block
    is written, even where none of a half's cells is in the window: the dots read both halves,
    and with a half left as it was (the stack's or a fresh tile's leftovers) a window of 16
    cells or fewer took 18 us a head group instead of 0.4 (7 heads, Intel SPR), the mark of
    microcode assists on subnormal leftovers."""
    for sub in range(BLOCK // LANES):
        cells = [builder.add(s0, _min_i(builder, _k(LANES * sub + i), builder.sub(m, _k(1))))
                 for i in range(LANES)]

        def chunk(j: Any, cells: list[Any] = cells, sub: int = sub) -> None:
            col = builder.add(k.col0, builder.mul(j, _k(LANES * k.width)))
            for c in cells:
                _prefetch_span(builder, k.ptr, builder.add(col, builder.mul(
                    builder.add(c, _k(PF_CELLS)), k.row)), LANES * k.width, 3)
            if v_rows is not None:  # the value mix's rows into L2 while the scores compute
                v_col = builder.add(v_rows.col0, builder.mul(j, _k(LANES * v_rows.width)))
                for c in cells:
                    _prefetch_span(builder, v_rows.ptr, builder.add(v_col, builder.mul(
                        c, v_rows.row)), LANES * v_rows.width, 2)
            rows = [_widened(builder, k.ptr, builder.add(col, builder.mul(c, k.row)), LANES,
                             k.half) for c in cells]
            for r, v in enumerate(_transpose16(builder, rows)):
                at = builder.add(builder.mul(builder.add(builder.mul(j, _k(LANES)), _k(r)),
                                             kt_row),
                                 builder.mul(builder.add(c_out, _k(LANES * sub)), _k(4)))
                builder.store(v, builder.bitcast(builder.gep(kt, [at]), _VEC.as_pointer()),
                              align=4)

        _each(builder, chunks, chunk)


def _emit_dots(builder: Any, q: _F32Rows, kt: Any, kt_row: Any, c_in: Any, m: Any,
               chunks: Any, out: _F32Rows, c_out: Any, scale: Any) -> None:
    """out[g, c_out + c] = scale * (q[g] . column c_in + c of kt) for c < min(m, BLOCK) and
    every g: per head and vector of 16 cells one chain of fused multiply-adds over the columns
    in order, heads four at a time (eight chains), then a pair, then one."""
    per = BLOCK // LANES
    scales = _splat(builder, scale, LANES)

    def heads(g0: Any, nh: int) -> None:
        def column_chunk(jc: Any, accs: list[Any]) -> list[Any]:
            for jj in range(LANES):
                j = builder.add(builder.mul(jc, _k(LANES)), _k(jj))
                base = builder.add(builder.mul(j, kt_row), builder.mul(c_in, _k(4)))
                ktv = [_ld(builder, kt, builder.add(base, _k(4 * LANES * v)), _VEC)
                       for v in range(per)]
                qs = [_splat(builder, _ld(builder, q.ptr, q.at(builder, builder.add(g0, _k(h)), j),
                                          _F32), LANES) for h in range(nh)]
                accs = [_fma(builder, qs[h], ktv[v], accs[h * per + v])
                        for h in range(nh) for v in range(per)]
            return accs

        zero = ir.Constant(_VEC, [0.0] * LANES)
        accs = _phi_loop(builder, chunks, [zero] * (nh * per), column_chunk)
        for h in range(nh):
            for v in range(per):
                at = out.at(builder, builder.add(g0, _k(h)), builder.add(c_out, _k(LANES * v)))
                left = builder.sub(m, _k(LANES * v))
                count = builder.select(builder.icmp_signed("<", left, _k(0)), _k(0),
                                       _min_i(builder, left, _k(LANES)))
                _masked_store(builder, builder.fmul(accs[h * per + v], scales),
                              builder.bitcast(builder.gep(out.ptr, [at]), _F32.as_pointer()),
                              count)

    _by_heads(builder, q.rows, heads)


def _blocks(builder: Any, n: Any, body: Callable[[Any, Any], None]) -> None:
    """body(c0, m) for the blocks of BLOCK cells of [0, n): c0 the block's first cell, m the
    cells left from it (the block holds min(m, BLOCK))."""
    count = builder.udiv(builder.add(n, _k(BLOCK - 1)), _k(BLOCK))

    def one(b: Any) -> None:
        c0 = builder.mul(b, _k(BLOCK))
        body(c0, builder.sub(n, c0))

    _each(builder, count, one)


def _scores(typingctx: Any, q: Any, k: Any, v: Any, s0: Any, n: Any, col0: Any, scale: Any,
            out: Any) -> Any:
    """out[g, c] = scale * (q[g, :] . k[s0 + c, col0:col0 + hd]) for c < n and g < q.shape[0]
    (v: the V cache, whose rows of those cells are prefetched for the value mix),
    hd = q.shape[1] (a multiple of LANES, at most MAX_HEAD_DIM), each dot one chain of fused
    multiply-adds over the columns in order. q, out: 2-D f32 with contiguous rows; k: the 2-D
    cache (f16 bits as uint16, or f32) with contiguous rows. Nothing is bounds-checked."""
    sig = types.void(q, k, v, s0, n, col0, scale, out)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        t = signature.args
        qa = _F32Rows(context, builder, t[0], args[0])
        oa = _F32Rows(context, builder, t[7], args[7])
        col0_v = context.cast(builder, args[5], t[5], types.intp)
        kc = _Cache(context, builder, t[1], args[1], col0_v)
        vc = _Cache(context, builder, t[2], args[2], col0_v)
        s0_v = context.cast(builder, args[3], t[3], types.intp)
        n_v = context.cast(builder, args[4], t[4], types.intp)
        scale_v = context.cast(builder, args[6], t[6], types.float32)
        chunks = builder.udiv(qa.cols, _k(LANES))
        with builder.goto_entry_block():
            stack = builder.alloca(_F32, size=ir.Constant(_I32, BLOCK * MAX_HEAD_DIM))
        kt = builder.bitcast(stack, _I8.as_pointer())
        kt_row = _k(4 * BLOCK)

        def block(c0: Any, m: Any) -> None:
            _emit_columns(builder, kc, builder.add(s0_v, c0), m, chunks, kt, kt_row, _k(0), vc)
            _emit_dots(builder, qa, kt, kt_row, _k(0), m, chunks, oa, c0, scale_v)

        _blocks(builder, n_v, block)
        return context.get_dummy_value()

    return sig, codegen


def _k_columns(typingctx: Any, k: Any, s0: Any, n: Any, col0: Any, kt: Any) -> Any:
    """kt[j, c] = k[s0 + c, col0 + j] as f32 for c < n and j < kt.shape[0] (a multiple of
    LANES): a tile of the cache transposed once for `scores_from`'s many query rows. kt: 2-D f32
    with contiguous rows, at least n rounded up to BLOCK wide. Nothing is bounds-checked."""
    sig = types.void(k, s0, n, col0, kt)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        t = signature.args
        kc = _Cache(context, builder, t[0], args[0],
                    context.cast(builder, args[3], t[3], types.intp))
        ka = _F32Rows(context, builder, t[4], args[4])
        s0_v = context.cast(builder, args[1], t[1], types.intp)
        n_v = context.cast(builder, args[2], t[2], types.intp)
        chunks = builder.udiv(ka.rows, _k(LANES))
        _blocks(builder, n_v, lambda c0, m: _emit_columns(
            builder, kc, builder.add(s0_v, c0), m, chunks, ka.ptr, ka.row, c0))
        return context.get_dummy_value()

    return sig, codegen


def _scores_from(typingctx: Any, q: Any, kt: Any, c0: Any, n: Any, scale: Any, out: Any) -> Any:
    """`scores` from a tile `k_columns` made: out[g, c] = scale * (q[g] . kt[:, c0 + c]) for
    c < n, the same bits as `scores` on the cells kt holds. kt must be at least c0 + n rounded
    up to BLOCK wide (the last block's extra lanes are read, never stored)."""
    sig = types.void(q, kt, c0, n, scale, out)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        t = signature.args
        qa = _F32Rows(context, builder, t[0], args[0])
        oa = _F32Rows(context, builder, t[5], args[5])
        ka = _F32Rows(context, builder, t[1], args[1])
        c0_v = context.cast(builder, args[2], t[2], types.intp)
        n_v = context.cast(builder, args[3], t[3], types.intp)
        scale_v = context.cast(builder, args[4], t[4], types.float32)
        chunks = builder.udiv(qa.cols, _k(LANES))
        _blocks(builder, n_v, lambda b0, m: _emit_dots(
            builder, qa, ka.ptr, ka.row, builder.add(c0_v, b0), m, chunks, oa, b0, scale_v))
        return context.get_dummy_value()

    return sig, codegen


scores: Any = intrinsic(_scores)
k_columns: Any = intrinsic(_k_columns)
scores_from: Any = intrinsic(_scores_from)


# -- the prefill softmax's two passes over a tile row (`attn.blocked`) --------------------
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
    """`elementwise.arith.fast_exp` in IR: x clamped to [-87, 88], x = n ln2 + r (two-step
    reduction),
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
    are combined into the <LANES> `init`, folded to one lane (`simd.blocks._hfold`), then the tail's
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
