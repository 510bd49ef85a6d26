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
  vector. The last n % 16 cells are summed one by one. A dot is added up as ggml's f16 dot on
  AVX-512 adds it (four 16-lane accumulators taking 16 columns in turn, then (a0 + a2) +
  (a1 + a3), then halves folded onto halves), so the scores round as llama.cpp's do: the
  numba loop's order put the Gemma 3 reference test's top-10 logits 0.37-0.55 from llama.cpp's,
  a first version of this kernel with one accumulator 0.20-0.74, this one 0.26-0.55. The order
  is fixed by head_dim alone, so a token's scores do not depend on the batch.

At 4,096 cells, 24 layers' caches cycled as a decode step does, the two took attention from
19.0 to about 10 ms a token in the per-op profile (2 threads, Intel Xeon, Sapphire Rapids).
Used where head_dim is a multiple of `COLUMNS` (the scores: up to `MAX_HEAD_DIM`) and the
target has FMA and F16C; elsewhere `attention` keeps its loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import HAS_F16C, target_has

COLUMNS = 64  # value-mix output columns per pass: four zmm
LANES = 16  # f32 lanes of a zmm
CELLS = 16  # cells per score block: one vector of scores per head
MAX_HEAD_DIM = 256  # the score block's stack buffer holds CELLS rows of this many f32
HAS_MIX = target_has("fma") and HAS_F16C
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_I8P = ir.IntType(8).as_pointer()
_ROW = ir.VectorType(_F32, COLUMNS)
_VEC = ir.VectorType(_F32, LANES)


def _for(builder: Any, count: Any, body: Callable[[Any], None]) -> None:
    """for i in range(count): body(i), nothing carried."""
    pre = builder.block
    head = builder.append_basic_block("mix.for")
    loop = builder.append_basic_block("mix.body")
    done = builder.append_basic_block("mix.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(count.type)
    i.add_incoming(ir.Constant(count.type, 0), pre)
    builder.cbranch(builder.icmp_signed("<", i, count), loop, done)
    builder.position_at_end(loop)
    body(i)
    i.add_incoming(builder.add(i, ir.Constant(count.type, 1)), builder.block)
    builder.branch(head)
    builder.position_at_end(done)


def _mix(typingctx: Any, p: Any, v: Any, s0: Any, n: Any, col0: Any, acc: Any) -> Any:
    """acc[g, :] = sum over c < n of p[g, c] * v[s0 + c, col0:col0 + hd], hd = acc.shape[1]
    (a multiple of COLUMNS). p, acc: 2-D f32 with contiguous rows; v: the 2-D cache (f16 bits
    as uint16, or f32) with contiguous rows. Nothing is bounds-checked."""
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
        p_ptr, v_ptr, a_ptr = (builder.bitcast(x.data, _I8P) for x in (pa, va, aa))
        width = 2 if half else 4
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_ROW, [_ROW] * 3), f"llvm.fma.v{COLUMNS}f32")
        intp = group.type

        def k(value: int) -> Any:
            return ir.Constant(intp, value)

        def heads(g0: Any, m: int) -> None:
            """Heads g0 .. g0 + m - 1, every pass of COLUMNS columns."""
            def one_pass(h: Any) -> None:
                col = builder.add(col_v, builder.mul(h, k(COLUMNS)))
                first = builder.add(builder.mul(s0_v, v_row), builder.mul(col, k(width)))
                p_rows = [builder.mul(builder.add(g0, k(i)), p_row) for i in range(m)]
                pre = builder.block
                head = builder.append_basic_block("mix.cells")
                loop = builder.append_basic_block("mix.cell")
                done = builder.append_basic_block("mix.stored")
                builder.branch(head)
                builder.position_at_end(head)
                c = builder.phi(intp)
                c.add_incoming(k(0), pre)
                accs = []
                for _ in range(m):
                    a = builder.phi(_ROW)
                    a.add_incoming(ir.Constant(_ROW, [0.0] * COLUMNS), pre)
                    accs.append(a)
                builder.cbranch(builder.icmp_signed("<", c, n_v), loop, done)
                builder.position_at_end(loop)
                at = builder.gep(v_ptr, [builder.add(first, builder.mul(c, v_row))])
                if half:
                    bits = builder.load(builder.bitcast(at, ir.VectorType(_I16, COLUMNS)
                                                        .as_pointer()), align=2)
                    row = builder.fpext(builder.bitcast(bits, ir.VectorType(
                        ir.HalfType(), COLUMNS)), _ROW)
                else:
                    row = builder.load(builder.bitcast(at, _ROW.as_pointer()), align=4)
                new = []
                for i in range(m):
                    pp = builder.gep(p_ptr, [builder.add(p_rows[i], builder.mul(c, k(4)))])
                    w = builder.load(builder.bitcast(pp, _F32.as_pointer()))
                    w = builder.insert_element(ir.Constant(_ROW, None), w, ir.Constant(_I32, 0))
                    w = builder.shuffle_vector(w, w, ir.Constant(ir.VectorType(_I32, COLUMNS),
                                                                 [0] * COLUMNS))
                    new.append(builder.call(fma, [w, row, accs[i]]))
                end = builder.block
                c.add_incoming(builder.add(c, k(1)), end)
                for a, value in zip(accs, new, strict=True):
                    a.add_incoming(value, end)
                builder.branch(head)
                builder.position_at_end(done)
                for i in range(m):
                    dst = builder.gep(a_ptr, [builder.add(
                        builder.mul(builder.add(g0, k(i)), a_row),
                        builder.mul(h, k(COLUMNS * 4)))])
                    builder.store(accs[i], builder.bitcast(dst, _ROW.as_pointer()), align=4)

            _for(builder, passes, one_pass)

        fours = builder.udiv(group, k(4))
        _for(builder, fours, lambda i: heads(builder.mul(i, k(4)), 4))
        g = builder.mul(fours, k(4))
        pairs = builder.udiv(builder.sub(group, g), k(2))
        _for(builder, pairs, lambda i: heads(g, 2))
        g = builder.add(g, builder.mul(pairs, k(2)))
        _for(builder, builder.sub(group, g), lambda i: heads(g, 1))
        return context.get_dummy_value()

    return sig, codegen


value_mix: Any = intrinsic(_mix)


def _sum_each(builder: Any, parts: list[Any]) -> Any:
    """LANES vectors of LANES lanes -> one vector whose lane i is the sum of parts[i]: pairs of
    vectors halve the lanes each holds per part, lower halves added to upper halves, in a
    fixed order."""
    width = LANES
    while len(parts) > 1:
        half = width // 2
        lo = [c * width + i for c in range(LANES // width) for i in range(half)]
        hi = [c * width + half + i for c in range(LANES // width) for i in range(half)]
        lo_mask = ir.Constant(ir.VectorType(_I32, LANES), lo + [LANES + i for i in lo])
        hi_mask = ir.Constant(ir.VectorType(_I32, LANES), hi + [LANES + i for i in hi])
        parts = [builder.fadd(builder.shuffle_vector(a, b, lo_mask),
                              builder.shuffle_vector(a, b, hi_mask))
                 for a, b in zip(parts[::2], parts[1::2], strict=True)]
        width = half
    return parts[0]


def _scores(typingctx: Any, q: Any, k: Any, s0: Any, n: Any, col0: Any, scale: Any,
            out: Any) -> Any:
    """out[g, c] = scale * (q[g, :] . k[s0 + c, col0:col0 + hd]) for c < n and g < q.shape[0],
    hd = q.shape[1] (a multiple of LANES, at most MAX_HEAD_DIM). q, out: 2-D f32 with
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

        chunks = builder.udiv(head_dim, k_(LANES))
        q_row = builder.extract_value(qa.strides, 0)
        k_row = builder.extract_value(ka.strides, 0)
        o_row = builder.extract_value(oa.strides, 0)
        q_ptr, k_ptr, o_ptr = (builder.bitcast(x.data, _I8P) for x in (qa, ka, oa))
        width = 2 if half else 4
        first = builder.add(builder.mul(s0_v, k_row), builder.mul(col_v, k_(width)))
        with builder.goto_entry_block():
            stack = builder.alloca(_F32, size=ir.Constant(_I32, CELLS * MAX_HEAD_DIM))
        block_buf = builder.bitcast(stack, _I8P)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3),
                                             f"llvm.fma.v{LANES}f32")
        vec_ptr = _VEC.as_pointer()

        def k_chunk(cell: Any, j: Any) -> Any:
            at = builder.gep(k_ptr, [builder.add(builder.add(first, builder.mul(cell, k_row)),
                                                 builder.mul(j, k_(LANES * width)))])
            if not half:
                return builder.load(builder.bitcast(at, vec_ptr), align=4)
            bits = builder.load(builder.bitcast(at, ir.VectorType(_I16, LANES).as_pointer()),
                                align=2)
            return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)),
                                 _VEC)

        def q_chunk(g: Any, j: Any) -> Any:
            at = builder.gep(q_ptr, [builder.add(builder.mul(g, q_row),
                                                 builder.mul(j, k_(LANES * 4)))])
            return builder.load(builder.bitcast(at, vec_ptr), align=4)

        def buffered(i: int, j: Any) -> Any:
            """Pointer to chunk j of the block's i-th widened K row."""
            return builder.bitcast(builder.gep(block_buf, [builder.add(
                builder.mul(k_(i * 4), head_dim), builder.mul(j, k_(LANES * 4)))]), vec_ptr)

        def partial(g: Any, row: Callable[[Any], Any]) -> Any:
            """<LANES x f32> partial sums of q[g] . row: four accumulators take the chunks in
            turn (one fused multiply-add each), then (a0 + a2) + (a1 + a3), ggml's f16 dot."""
            pre = builder.block
            head = builder.append_basic_block("qk.chunks")
            loop = builder.append_basic_block("qk.chunk")
            done = builder.append_basic_block("qk.summed")
            builder.branch(head)
            builder.position_at_end(head)
            j = builder.phi(intp)
            j.add_incoming(k_(0), pre)
            accs = []
            for _ in range(4):
                acc = builder.phi(_VEC)
                acc.add_incoming(ir.Constant(_VEC, [0.0] * LANES), pre)
                accs.append(acc)
            builder.cbranch(builder.icmp_signed("<", j, chunks), loop, done)
            builder.position_at_end(loop)
            new = [builder.call(fma, [q_chunk(g, builder.add(j, k_(i))),
                                      row(builder.add(j, k_(i))), accs[i]]) for i in range(4)]
            end = builder.block
            j.add_incoming(builder.add(j, k_(4)), end)
            for acc, value in zip(accs, new, strict=True):
                acc.add_incoming(value, end)
            builder.branch(head)
            builder.position_at_end(done)
            return builder.fadd(builder.fadd(accs[0], accs[2]), builder.fadd(accs[1], accs[3]))

        scales = builder.shuffle_vector(
            builder.insert_element(ir.Constant(_VEC, None), scale_v, ir.Constant(_I32, 0)),
            ir.Constant(_VEC, None), ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
        blocks = builder.udiv(n_v, k_(CELLS))

        def block(b: Any) -> None:
            c0 = builder.mul(b, k_(CELLS))
            def widen(i: int) -> Callable[[Any], None]:
                cell = builder.add(c0, k_(i))
                return lambda j: builder.store(k_chunk(cell, j), buffered(i, j), align=4)

            def from_buffer(i: int) -> Callable[[Any], Any]:
                return lambda j: builder.load(buffered(i, j), align=4)

            for i in range(CELLS):  # the block's K rows, widened once for every head
                _for(builder, chunks, widen(i))

            def head(g: Any) -> None:
                parts = [partial(g, from_buffer(i)) for i in range(CELLS)]
                at = builder.gep(o_ptr, [builder.add(builder.mul(g, o_row),
                                                     builder.mul(c0, k_(4)))])
                builder.store(builder.fmul(_sum_each(builder, parts), scales),
                              builder.bitcast(at, vec_ptr), align=4)

            _for(builder, group, head)

        _for(builder, blocks, block)
        rest = builder.mul(blocks, k_(CELLS))
        ordered_sum = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32, [_F32, _VEC]),
            f"llvm.vector.reduce.fadd.v{LANES}f32")

        def last(i: Any) -> None:  # the cells after the last whole block, one by one
            cell = builder.add(rest, i)

            def head(g: Any) -> None:
                total = builder.call(ordered_sum, [ir.Constant(_F32, 0.0),
                                                   partial(g, lambda j: k_chunk(cell, j))])
                at = builder.gep(o_ptr, [builder.add(builder.mul(g, o_row),
                                                     builder.mul(cell, k_(4)))])
                builder.store(builder.fmul(total, scale_v),
                              builder.bitcast(at, _F32.as_pointer()))

            _for(builder, group, head)

        _for(builder, builder.sub(n_v, rest), last)
        return context.get_dummy_value()

    return sig, codegen


scores: Any = intrinsic(_scores)
