"""A batch-invariant integer GEMM for encoders without AMX: `out = x @ W.T (+ bias)` with the
activation rounded to int16 and the weight's int8 codes, exact int32 sums per 32-value block.

The weight is a block type's int8 codes with one f32 scale per 32 values (Q8_0's own codes, or
any type re-encoded: `int8_codes`), stored int16-widened tile by tile: `[N/COLS][K/32][16 k
pairs][COLS][2]`, so one `pmaddwd` (`vpdpwssd` with VNNI) multiplies a k pair of all of a vector's
columns by a broadcast pair of the activation. Each activation row is rounded per 32-value block
to 15-bit codes (`rint(x * 32767 / max|x|)`, scale `max|x| / 32767`), far finer than Q8_0's 7
bits; a block's products add up in int32 exactly (32 x 32767 x 128 < 2^31), then go into the f32
accumulator as `acc = fma(f32(sum), w_scale * x_scale, acc)`, block after block from zero. A row's
codes, its sums and its accumulation order do not depend on the rows around it: its values are
bitwise the same alone or in any batch.

The tiling, thread split and row groups are `linear.dense`'s (ROWS rows x COLS columns a tile,
the rows past the last group one at a time); the activation needs no packing (a block of a row is
one 64-byte line). Leftover columns run as numba scalars with the same steps.
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
from numba.core import cgutils
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.linear.dense import (
    COLS,
    GROUP_BLOCK,
    LANES,
    ROWS,
    _add_bias,
    check_operands,
    store_tile,
)
from minfer.backends.cpu.kernels.quant.activations import _FM, _max32, _min32, quant32_i16
from minfer.backends.cpu.kernels.region.parts import share
from minfer.backends.cpu.kernels.simd.blocks import (
    _F32,
    _I8,
    _I16,
    _I32,
    _fma,
    _ld,
    _phi_loop,
    _splat,
    _vec,
    _x86,
)
from minfer.backends.cpu.kernels.simd.llvm import target_has

BLOCK = 32  # values per scale (weight and activation)
CODE_MAX = 32767  # the activation's int16 codes
_PAIRS = BLOCK // 2
_WIDE = LANES == 16 and target_has("avx512bw")  # zmm pmaddwd
# vpdpwssd (pmaddwd and the add in one): zmm with AVX512-VNNI, ymm with VL or AVX-VNNI
_VNNI = (target_has("avx512vnni") if _WIDE
         else target_has("avxvnni") or target_has("avx512vnni", "avx512vl"))
_ACC = _vec(_I32, LANES)
_PAIR = _vec(_I16, 2 * LANES)
_ROW = _vec(_F32, LANES)


def _dot_pairs(builder: Any, w: Any, x: Any, acc: Any) -> Any:
    """acc + sums of adjacent i16 products of w and x (<2L x i16> -> <L x i32>): one
    vpdpwssd, or pmaddwd and an add."""
    if _VNNI:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_ACC, [_ACC] * 3),
            f"llvm.x86.avx512.vpdpwssd.{32 * LANES}")
        return builder.call(fn, [acc, builder.bitcast(w, _ACC),
                                 builder.bitcast(x, _ACC)])
    name = "llvm.x86.avx512.pmaddw.d.512" if _WIDE else "llvm.x86.avx2.pmadd.wd"
    prod = _x86(builder, name, _ACC, [w, x])
    return builder.add(acc, prod)


def _tile(typingctx: Any, x: Any, xs: Any, xi: Any, w: Any, ws: Any, out: Any, oi: Any,
          j0: Any, m: Any) -> Any:
    """out[oi+r, j0:j0+COLS] = the rows xi+r (r < m, a literal <= ROWS) of the int16 codes x
    (scales xs [nt, K/32]) times one weight tile w `[K/32, 16 * COLS * 2]` (scales ws
    `[K/32, COLS]`)."""
    if not isinstance(m, types.IntegerLiteral):
        return None
    n_rows = m.literal_value
    sig = types.void(x, xs, xi, w, ws, out, oi, j0, m)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        arrays = [context.make_array(signature.args[i])(context, builder, args[i])
                  for i in (0, 1, 3, 4, 5)]
        wa = arrays[2]
        xi_v, oi_v, j_v = (context.cast(builder, args[i], signature.args[i], types.intp)
                           for i in (2, 6, 7))
        intp = xi_v.type
        n_blocks = builder.extract_value(wa.shape, 0)
        x_row, xs_row, w_row, ws_row, o_row = (builder.extract_value(a.strides, 0)
                                               for a in arrays)
        x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr = (builder.bitcast(a.data, _I8.as_pointer())
                                               for a in arrays)

        def k(value: int) -> Any:
            return ir.Constant(intp, value)

        rows = [builder.add(xi_v, k(r)) for r in range(n_rows)]

        def block(b: Any, accs: list[Any]) -> list[Any]:
            w_off = builder.mul(b, w_row)
            x_offs = [builder.add(builder.mul(r, x_row), builder.mul(b, k(2 * BLOCK)))
                      for r in rows]

            def pair(p: Any, sums: list[Any]) -> list[Any]:
                # a loop, not straight code: integer adds reassociate, and LLVM regroups a
                # whole unrolled block row by row, spilling the weight vectors
                w_p = builder.add(w_off, builder.mul(p, k(4 * COLS)))
                ws_p = [_ld(builder, w_ptr, builder.add(w_p, k(4 * LANES * h)), _PAIR)
                        for h in range(2)]
                new_sums = []
                for r in range(n_rows):
                    x_p = builder.add(x_offs[r], builder.mul(p, k(4)))
                    xv = builder.bitcast(_splat(builder, _ld(builder, x_ptr, x_p, _I32), LANES),
                                         _PAIR)
                    new_sums += [_dot_pairs(builder, ws_p[h], xv, sums[2 * r + h])
                                 for h in range(2)]
                return new_sums

            sums = _phi_loop(builder, k(_PAIRS), [ir.Constant(_ACC, [0] * LANES)] * (2 * n_rows),
                             pair)
            s_off = builder.mul(b, ws_row)
            scales = [_ld(builder, ws_ptr, builder.add(s_off, k(4 * LANES * h)), _ROW)
                      for h in range(2)]
            new = []
            for r, row in enumerate(rows):
                d = _ld(builder, xs_ptr, builder.add(builder.mul(row, xs_row),
                                                     builder.mul(b, k(4))), _F32)
                dv = _splat(builder, d, LANES)
                for h in range(2):
                    total = builder.sitofp(sums[2 * r + h], _ROW)
                    new.append(_fma(builder, total, builder.fmul(scales[h], dv),
                                    accs[2 * r + h]))
            return new

        zero = ir.Constant(_ROW, [0.0] * LANES)
        accs = _phi_loop(builder, n_blocks, [zero] * (2 * n_rows), block)
        store_tile(builder, accs, o_ptr, oi_v, o_row, builder.mul(j_v, k(4)))
        return context.get_dummy_value()

    return sig, codegen


tile: Any = intrinsic(_tile)


@njit(cache=True, parallel=True, error_model="numpy", fastmath=_FM)
def _quantize(x, xq, xs):
    """Each row of x as int16 codes per 32-value block (Q8_0's rounding at 32767) and their
    scales."""
    for i in prange(x.shape[0]):
        xr, qr = x[i], xq[i]
        for b in range(x.shape[1] // BLOCK):
            o = b * BLOCK
            amax = max(_max32(xr, o), -_min32(xr, o))
            xs[i, b] = amax / np.float32(CODE_MAX)
            quant32_i16(xr, o, np.float32(CODE_MAX) / amax if amax != 0 else np.float32(0.0),
                        qr)


@njit(inline="always")
def _rest(xq, xs, i, rq, rs, out, j0):
    """out[i, j0 + j] for the leftover columns j: `tile`'s steps as scalars."""
    for j in range(rq.shape[0]):
        acc = np.float32(0.0)
        for b in range(xs.shape[1]):
            s = np.int32(0)
            for kk in range(b * BLOCK, (b + 1) * BLOCK):
                s += np.int32(xq[i, kk]) * np.int32(rq[j, kk])
            acc += np.float32(s) * (rs[j, b] * xs[i, b])
        out[i, j0 + j] = acc


@njit(cache=True, parallel=True, error_model="numpy", fastmath={"contract"})
def _gemm(xq, xs, wq, ws, rq, rs, out, bias, n_parts):
    nt = xq.shape[0]
    n_tiles = wq.shape[0]
    n_groups = nt // ROWS
    for part in prange(n_parts):  # each thread its share of the column tiles
        t_lo, t_hi = share(part, n_parts, n_tiles)
        for g0 in range(0, n_groups, GROUP_BLOCK):  # row groups that stay in L2 over the tiles
            for jb in range(t_lo, t_hi):
                j0 = jb * COLS
                for g in range(g0, min(n_groups, g0 + GROUP_BLOCK)):
                    tile(xq, xs, g * ROWS, wq[jb], ws[jb], out, g * ROWS, j0, ROWS)
                    _add_bias(out, g * ROWS, (g + 1) * ROWS, j0, j0 + COLS, bias)
        for jb in range(t_lo, t_hi):  # the last rows (fewer than ROWS) one at a time
            for i in range(n_groups * ROWS, nt):
                tile(xq, xs, i, wq[jb], ws[jb], out, i, jb * COLS, 1)
            _add_bias(out, n_groups * ROWS, nt, jb * COLS, (jb + 1) * COLS, bias)
    j0 = n_tiles * COLS
    for i in prange(nt):  # the columns past the last whole tile
        _rest(xq, xs, i, rq, rs, out, j0)
        _add_bias(out, i, i + 1, j0, j0 + rq.shape[0], bias)


@dataclass(frozen=True)
class I16Weight:
    """A weight laid out for `bind_gemm_i16`: whole tiles `[N/COLS, K/32, 32 * COLS]` int16 with
    scales `[N/COLS, K/32, COLS]` f32, and the leftover columns' codes `[N % COLS, K]` int16 and
    scales `[N % COLS, K/32]`."""

    tiles: np.ndarray
    scales: np.ndarray
    rest: np.ndarray
    rest_scales: np.ndarray

    @property
    def n_in(self) -> int:
        return self.rest.shape[1]

    @property
    def n_out(self) -> int:
        return self.tiles.shape[0] * COLS + self.rest.shape[0]


def int8_codes(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An f32 `[N, K]` weight (K a multiple of 32) as int8 codes and one f32 scale per 32
    values, Q8_0's rounding (`d = max|w| / 127`, nearest even): for block types other than
    Q8_0, whose codes `i16_weight` takes as they are."""
    n_out, n_in = w.shape
    blocks = np.asarray(w, np.float32).reshape(n_out, n_in // BLOCK, BLOCK)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    codes = np.rint(blocks * inv[:, :, None]).astype(np.int8).reshape(n_out, n_in)
    return codes, d.astype(np.float32)


def q8_0_codes(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows (uint8 `[N, K/32 * 34]`: an f16 scale, then 32 int8 codes a block) as their
    codes `[N, K]` and f32 scales `[N, K/32]`, exactly."""
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, 2 + BLOCK)
    scales = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    codes = blocks[:, :, 2:].view(np.int8).reshape(raw.shape[0], -1)
    return codes, scales


def i16_weight(codes: np.ndarray, scales: np.ndarray) -> I16Weight:
    """The `bind_gemm_i16` layout of int8 codes `[N, K]` (K a multiple of 32) with their f32
    scales `[N, K/32]`."""
    n_out, n_in = codes.shape
    if n_in % BLOCK or scales.shape != (n_out, n_in // BLOCK):
        raise ValueError(f"codes {codes.shape} with scales {scales.shape}: K must be a "
                         f"multiple of {BLOCK}, one scale per block")
    n_tiles, nb = n_out // COLS, n_in // BLOCK
    whole = codes[: n_tiles * COLS].astype(np.int16)
    tiles = np.ascontiguousarray(whole.reshape(n_tiles, COLS, nb, _PAIRS, 2)
                                 .transpose(0, 2, 3, 1, 4)).reshape(n_tiles, nb, BLOCK * COLS)
    s = np.asarray(scales, np.float32)
    tile_scales = np.ascontiguousarray(s[: n_tiles * COLS].reshape(n_tiles, COLS, nb)
                                       .transpose(0, 2, 1))
    return I16Weight(tiles, tile_scales, codes[n_tiles * COLS:].astype(np.int16),
                     np.ascontiguousarray(s[n_tiles * COLS:]))


def scratch_size(nt: int, n_in: int) -> int:
    """f32 values of the scratch `bind_gemm_i16` needs for x `[nt, n_in]`: its int16 codes and
    their scales."""
    return nt * n_in // 2 + nt * (n_in // BLOCK)


def bind_gemm_i16(x: np.ndarray, w: I16Weight, out: np.ndarray,
                  scratch: np.ndarray | None = None,
                  bias: np.ndarray | None = None) -> list[Callable[[], None]]:
    """The two calls (x rounded to int16 per 32-value block, then the product) that make
    `out[nt, N] = x[nt, K] @ W.T (+ bias[N])` over fixed arrays (checked once). `scratch`: at
    least `scratch_size(nt, K)` f32 values for the rounded rows, which calls that never run at
    the same time may share (one is allocated otherwise)."""
    check_operands(x, out, w.n_in, w.n_out)
    nt, n_in = x.shape
    size = scratch_size(nt, n_in)
    if scratch is None:
        scratch = np.empty(size, np.float32)
    xq = scratch[: nt * n_in // 2].view(np.int16).reshape(nt, n_in)
    xs = scratch[nt * n_in // 2: size].reshape(nt, n_in // BLOCK)
    b = np.zeros(0, np.float32) if bias is None else np.ascontiguousarray(bias, np.float32)
    if bias is not None and b.shape != (w.n_out,):
        raise ValueError(f"bias of shape {b.shape}, expected ({w.n_out},)")
    return [partial(_quantize, x, xq, xs),
            partial(_gemm, xq, xs, w.tiles, w.scales, w.rest, w.rest_scales, out, b,
                    max(1, numba.get_num_threads()))]
