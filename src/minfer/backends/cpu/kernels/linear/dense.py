"""A batch-invariant f32 GEMM: `out = x @ W.T` over an f32 copy of W laid out in column tiles.

For models whose weights fit as f32 (small encoders: all-MiniLM's are 90 MB), where the integer
path's quantized activations cost accuracy and its per-row drivers cost speed, and BLAS sgemm is
fast but rounds a row differently depending on where the batch puts it (measured: OpenBLAS on
AMD EPYC Zen 3 from 16 rows a call on).

Here every output element is one chain of fused multiply-adds over the input columns in order,
starting from zero: `acc = fma(x[t, k], W[j, k], acc)` for k = 0 .. K-1. A tile of `ROWS` rows
x `COLS` columns keeps its accumulators in vector registers (LLVM vector IR, `tile`), loading
each weight segment once for the tile's rows; the weight is stored tile by tile (`dense_weight`)
and each group of ROWS activation rows packed k-major, so a step reads two consecutive lines.
Leftover rows run the same chain one row at a time, leftover columns as numba scalars with the
same fused steps. Whatever rows surround a row, its values are bitwise the same. Threads split
the column tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.region.parts import share
from minfer.backends.cpu.kernels.simd.blocks import _F32, _I8, _fma, _ld, _phi_loop, _splat, _vec
from minfer.backends.cpu.kernels.simd.llvm import target_has

# f32 lanes per vector: a zmm where the target has AVX-512, else a ymm. The width changes no
# bits: every output element is the same FMA chain whichever lane it sits in.
LANES = 16 if target_has("avx512f") else 8
COLS = 2 * LANES  # output columns per tile
ROWS = 6  # rows per tile: 12 accumulators, 2 weight loads and 6 broadcasts per input column
GROUP_BLOCK = 8  # row groups walked over all of a thread's column tiles before the next ones
_ROW = _vec(_F32, LANES)


def store_tile(builder: Any, accs: list[Any], o_ptr: Any, oi: Any, o_row: Any, col: Any) -> None:
    """A tile's accumulators (two vectors a row) into out rows oi.. (row stride o_row bytes)
    from byte column col."""
    for r in range(len(accs) // 2):
        base = builder.add(builder.mul(builder.add(oi, ir.Constant(oi.type, r)), o_row), col)
        for h in range(2):
            dst = builder.gep(o_ptr, [builder.add(base, ir.Constant(oi.type, 4 * LANES * h))])
            builder.store(accs[2 * r + h], builder.bitcast(dst, _ROW.as_pointer()), align=1)


def _tile(typingctx: Any, x: Any, xi: Any, wt: Any, out: Any, oi: Any, j0: Any, m: Any) -> Any:
    """out[oi+r, j0:j0+COLS] = x[xi+r] @ wt[:, :COLS] for r < m (a literal <= ROWS); x is
    read through its strides (a packed block's transposed view, or the activation itself)."""
    if not isinstance(m, types.IntegerLiteral):
        return None
    n_rows = m.literal_value
    sig = types.void(x, xi, wt, out, oi, j0, m)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x_t, xi_t, wt_t, out_t, oi_t, j_t, _ = signature.args
        xa = context.make_array(x_t)(context, builder, args[0])
        wa = context.make_array(wt_t)(context, builder, args[2])
        oa = context.make_array(out_t)(context, builder, args[3])
        xi_v = context.cast(builder, args[1], xi_t, types.intp)
        oi_v = context.cast(builder, args[4], oi_t, types.intp)
        j_v = context.cast(builder, args[5], j_t, types.intp)
        intp = xi_v.type
        n_k = builder.extract_value(xa.shape, 1)
        x_row = builder.extract_value(xa.strides, 0)  # bytes
        x_col = builder.extract_value(xa.strides, 1)
        w_row = builder.extract_value(wa.strides, 0)
        o_row = builder.extract_value(oa.strides, 0)
        i8p = _I8.as_pointer()
        x_ptr, w_ptr, o_ptr = (builder.bitcast(a.data, i8p) for a in (xa, wa, oa))

        def k(value: int) -> Any:
            return ir.Constant(intp, value)

        col = builder.mul(j_v, k(4))
        x_rows = [builder.mul(builder.add(xi_v, k(r)), x_row) for r in range(n_rows)]

        def step(kk: Any, accs: list[Any]) -> list[Any]:
            w_off = builder.mul(kk, w_row)
            ws = [_ld(builder, w_ptr, builder.add(w_off, k(4 * LANES * h)), _ROW)
                  for h in range(2)]
            x_off = builder.mul(kk, x_col)
            out = []
            for r in range(n_rows):
                xv = _splat(builder, _ld(builder, x_ptr, builder.add(x_rows[r], x_off), _F32),
                            LANES)
                out += [_fma(builder, xv, ws[h], accs[2 * r + h]) for h in range(2)]
            return out

        zero = ir.Constant(_ROW, [0.0] * LANES)
        accs = _phi_loop(builder, n_k, [zero] * (2 * n_rows), step)
        store_tile(builder, accs, o_ptr, oi_v, o_row, col)
        return context.get_dummy_value()

    return sig, codegen


tile: Any = intrinsic(_tile)


@njit(inline="always")
def tile_rows(x, x0, x1, wt, out, o0, j0):
    """`tile` over rows x0..x1 of x into out rows o0.., ROWS at a time, then the rest one by one
    (the same chains either way)."""
    full = x1 - (x1 - x0) % ROWS
    for i in range(x0, full, ROWS):
        tile(x, i, wt, out, o0 + i - x0, j0, ROWS)
    for i in range(full, x1):
        tile(x, i, wt, out, o0 + i - x0, j0, 1)


@njit(inline="always")
def _add_bias(out, i0, i1, j0, j1, bias):
    """The bias onto a tile just written (still in L1): the same single rounding as a
    separate add after the product."""
    if bias.shape[0]:
        for i in range(i0, i1):
            for j in range(j0, j1):
                out[i, j] += bias[j]


@njit(cache=True, parallel=True, error_model="numpy", fastmath={"contract"})
def _gemm(x, wp, wr, xp, out, bias, n_parts):
    nt, n_in = x.shape
    n_tiles = wp.shape[0]
    n_groups = nt // ROWS
    for g in prange(n_groups):  # whole groups of ROWS rows packed k-major: one line per step
        for kk in range(n_in):
            for r in range(ROWS):
                xp[g, kk, r] = x[g * ROWS + r, kk]
    for part in prange(n_parts):  # each thread its share of the column tiles
        t_lo, t_hi = share(part, n_parts, n_tiles)
        for g0 in range(0, n_groups, GROUP_BLOCK):  # row groups that stay in L2 over the tiles
            for jb in range(t_lo, t_hi):
                w = wp[jb]
                j0 = jb * COLS
                for g in range(g0, min(n_groups, g0 + GROUP_BLOCK)):
                    tile(xp[g].T, 0, w, out, g * ROWS, j0, ROWS)
                    _add_bias(out, g * ROWS, (g + 1) * ROWS, j0, j0 + COLS, bias)
        for jb in range(t_lo, t_hi):  # the last rows (fewer than ROWS) one at a time
            tile_rows(x, n_groups * ROWS, nt, wp[jb], out, n_groups * ROWS, jb * COLS)
            _add_bias(out, n_groups * ROWS, nt, jb * COLS, (jb + 1) * COLS, bias)
    j0 = n_tiles * COLS
    for i in range(nt):  # the columns past the last whole tile, one fused chain each
        for j in range(wr.shape[1]):
            acc = np.float32(0.0)
            for kk in range(n_in):
                acc += x[i, kk] * wr[kk, j]
            out[i, j0 + j] = acc
        _add_bias(out, i, i + 1, j0, j0 + wr.shape[1], bias)


@dataclass(frozen=True)
class DenseWeight:
    """A weight laid out for `gemm`: whole tiles `[n_tiles, K, COLS]` (each tile's K rows of
    COLS columns contiguous) and the leftover columns `[K, N % COLS]`."""

    tiles: np.ndarray
    rest: np.ndarray

    @property
    def n_out(self) -> int:
        return self.tiles.shape[0] * COLS + self.rest.shape[1]


def dense_weight(w: np.ndarray) -> DenseWeight:
    """The `gemm` layout of an f32 `[N, K]` weight."""
    w = np.asarray(w, np.float32)
    n_out, n_in = w.shape
    n_tiles = n_out // COLS
    tiles = np.ascontiguousarray(
        w[: n_tiles * COLS].reshape(n_tiles, COLS, n_in).transpose(0, 2, 1))
    rest = np.ascontiguousarray(w[n_tiles * COLS:].T)
    return DenseWeight(tiles, rest)


def scratch_size(nt: int, n_in: int) -> int:
    """f32 values of the packed-activation scratch `bind_gemm` needs for x `[nt, n_in]`."""
    return max(1, nt // ROWS) * n_in * ROWS


def check_operands(x: np.ndarray, out: np.ndarray, n_in: int, n_out: int) -> None:
    """A GEMM's x `[nt, n_in]` and out `[nt, n_out]`: C-contiguous f32, or a ValueError."""
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ValueError(f"x {x.shape} does not match the weight's {n_in} inputs")
    for a in (x, out):
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("a GEMM takes C-contiguous f32 arrays")
    if out.shape != (x.shape[0], n_out):
        raise ValueError(f"out must be {(x.shape[0], n_out)}, got {out.shape}")


def bind_gemm(x: np.ndarray, w: DenseWeight, out: np.ndarray,
              scratch: np.ndarray | None = None,
              bias: np.ndarray | None = None) -> Callable[[], None]:
    """`out[nt, N] = x[nt, K] @ W.T (+ bias[N])` over fixed arrays (checked once). `scratch`:
    at least `scratch_size(nt, K)` f32 values for the packed rows, which gemm calls that never
    run at the same time may share (one is allocated otherwise)."""
    n_in = w.tiles.shape[1] if w.tiles.shape[0] else w.rest.shape[0]
    check_operands(x, out, n_in, w.n_out)
    size = scratch_size(x.shape[0], n_in)
    if scratch is None:
        scratch = np.empty(size, np.float32)
    xp = scratch[:size].reshape(max(1, x.shape[0] // ROWS), n_in, ROWS)
    b = np.zeros(0, np.float32) if bias is None else np.ascontiguousarray(bias, np.float32)
    if bias is not None and b.shape != (w.n_out,):
        raise ValueError(f"bias of shape {b.shape}, expected ({w.n_out},)")
    return partial(_gemm, x, w.tiles, w.rest, xp, out, b, max(1, numba.get_num_threads()))


def gemm(x: np.ndarray, w: DenseWeight, out: np.ndarray) -> None:
    bind_gemm(x, w, out)()
