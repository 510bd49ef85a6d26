"""A batch-invariant bf16 GEMM on Intel AMX tiles: `out = x @ W.T (+ bias)` in f32, for
encoders whose file stores its weights below f32 (f16, q8_0, ...).

AMX's `tdpbf16ps` multiplies a 16 x 32 bf16 tile of activation rows by a 32 x 16 bf16 tile of
weight columns into a 16 x 16 f32 tile, accumulating in f32. The weight is rounded to bf16 once
(`amx_weight`, round to nearest even) and packed tile by tile in the pair order the instruction
reads (`[N/16][K/32][16 k-pairs][16 columns][2]`); each thread rounds the 32 activation rows of
its tasks the same way into its own zero-padded buffer, once per row block (tasks go row block
by row block, so no thread waits for another's rounding). A task is a 32 x 32 block of
the output (2 x 2 accumulator tiles, 2 activation and 2 weight tiles: the eight tile registers),
its K steps in order from the bias (zero without one), so every output element is one fixed
chain whatever rows surround it: a row's values are bitwise the same alone or in any batch.
Threads split the tasks.

The bf16 operands cost accuracy against the f32 path (`linear.dense`), less than the file's own
rounding: against sentence-transformers' f32, all-MiniLM-L6-v2's f16 file keeps a minimum
cosine of 0.99997 here (0.9999996 on the f32 GEMM), its q8_0 file 0.99955 (0.99959). An f32
file keeps the exact f32 GEMM.

Linux hands out the tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`, once per process): `usable()` makes that request where the compile target
has AMX and says whether it was granted; nothing here runs unless it was.
"""

from __future__ import annotations

import ctypes
import functools
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

from minfer.backends.cpu.kernels.linear.dense import check_operands
from minfer.backends.cpu.kernels.linear.float_rows import round_to_bf16
from minfer.backends.cpu.kernels.quant.dequant import bf16_bits
from minfer.backends.cpu.kernels.region.parts import share
from minfer.backends.cpu.kernels.simd.llvm import target_has

TILE_ROWS = 16  # rows of a tile (activation rows, k pairs, output rows)
K_STEP = 32  # bf16 values of K per tile step (64 bytes a row)
BLOCK = 32  # output rows and columns per task: 2 x 2 accumulator tiles
HAS_AMX = target_has("amx-tile", "amx-bf16")

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_I8 = ir.IntType(8)
_I8P = _I8.as_pointer()
_VOID = ir.VoidType()

# palette 1; tiles 0-7 all 16 rows x 64 bytes (bytes 16-31: colsb per tile as u16; 48-55: rows)
_CONFIG = np.zeros(64, np.uint8)
_CONFIG[0] = 1
_CONFIG[16:32:2] = 64
_CONFIG[48:56] = TILE_ROWS


@functools.cache
def usable() -> bool:
    """Whether this process may run the AMX kernel: the compile target has AMX tiles and bf16,
    and Linux granted the tile data state (asked once)."""
    if not HAS_AMX:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def _call(builder: Any, name: str, args: list[Any]) -> None:
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_VOID, [a.type for a in args]), name)
    builder.call(fn, args)


def _byte_ptr(context: Any, builder: Any, ty: Any, arr: Any, off: Any, off_ty: Any) -> Any:
    a = context.make_array(ty)(context, builder, arr)
    return builder.gep(builder.bitcast(a.data, _I8P),
                       [context.cast(builder, off, off_ty, types.intp)])


def _tile_config_typer(typingctx: Any, cfg: Any) -> Any:
    """Load the tile configuration (a 64-byte array) into this thread's tile state."""
    sig = types.void(cfg)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = context.make_array(signature.args[0])(context, builder, args[0])
        _call(builder, "llvm.x86.ldtilecfg", [builder.bitcast(a.data, _I8P)])
        return context.get_dummy_value()

    return sig, codegen


_tile_config: Any = intrinsic(_tile_config_typer)


def _tile_release_typer(typingctx: Any) -> Any:
    sig = types.void()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _call(builder, "llvm.x86.tilerelease", [])
        return context.get_dummy_value()

    return sig, codegen


_tile_release: Any = intrinsic(_tile_release_typer)


def _tile_move(name: str) -> Callable[..., Any]:
    def typer(typingctx: Any, tile: Any, arr: Any, off: Any, stride: Any) -> Any:
        """Tile `tile` loaded from / stored to arr's bytes at `off`, rows `stride` bytes apart."""
        if not isinstance(tile, types.IntegerLiteral):
            return None
        sig = types.void(tile, arr, off, stride)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            _, arr_t, off_t, stride_t = signature.args
            ptr = _byte_ptr(context, builder, arr_t, args[1], args[2], off_t)
            st = context.cast(builder, args[3], stride_t, types.int64)
            _call(builder, name, [ir.Constant(_I8, tile.literal_value), ptr, st])
            return context.get_dummy_value()

        return sig, codegen

    return typer


_tile_load: Any = intrinsic(_tile_move("llvm.x86.tileloadd64"))
_tile_store: Any = intrinsic(_tile_move("llvm.x86.tilestored64"))


def _tile_dot_typer(typingctx: Any, c: Any, a: Any, b: Any) -> Any:
    """Tile c += a . b over bf16 pairs (tdpbf16ps)."""
    if not all(isinstance(t, types.IntegerLiteral) for t in (c, a, b)):
        return None
    sig = types.void(c, a, b)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _call(builder, "llvm.x86.tdpbf16ps",
              [ir.Constant(_I8, t.literal_value) for t in (c, a, b)])
        return context.get_dummy_value()

    return sig, codegen


_tile_dot: Any = intrinsic(_tile_dot_typer)


@njit(inline="always")
def _round_block(x, r0, ab):
    """Rows r0 .. r0 + BLOCK of x -> ab [BLOCK, Kp] bf16 bits (uint16), rounded to nearest
    even; rows past x's and columns past K zero."""
    nt, k = x.shape
    for i in range(BLOCK):
        if r0 + i < nt:
            for j in range(k):
                ab[i, j] = bf16_bits(x[r0 + i, j])
            for j in range(k, ab.shape[1]):
                ab[i, j] = 0
        else:
            for j in range(ab.shape[1]):
                ab[i, j] = 0


@njit(cache=True, parallel=True, error_model="numpy")
def _gemm_amx(x, wp, out, bias, ab, cs, cfg, n_parts):
    nt, n_out = out.shape
    kp = ab.shape[2]
    n_k = kp // K_STEP
    x_stride = kp * 2  # bytes between activation rows
    w_tile = TILE_ROWS * K_STEP * 2  # bytes of one packed weight tile
    w_cols = n_k * w_tile  # bytes of one 16-column group's tiles
    n_rb = (nt + BLOCK - 1) // BLOCK
    n_cb = wp.shape[0] // 2  # 32-column blocks (the packed weight is padded to them)
    n_tasks = n_rb * n_cb
    for part in prange(n_parts):
        _tile_config(cfg)
        c = cs[part]
        a = ab[part]  # this thread's 32 activation rows in bf16, rounded once per row block
        held = -1
        for task in range(*share(part, n_parts, n_tasks)):
            rb = task // n_cb
            cb = task % n_cb
            if rb != held:
                _round_block(x, rb * BLOCK, a)
                held = rb
            b0 = cb * BLOCK * 4  # the accumulators start from the bias: each row of it
            _tile_load(0, bias, b0, 0)
            _tile_load(1, bias, b0 + TILE_ROWS * 4, 0)
            _tile_load(2, bias, b0, 0)
            _tile_load(3, bias, b0 + TILE_ROWS * 4, 0)
            w0 = 2 * cb * w_cols
            for kk in range(n_k):
                _tile_load(4, a, kk * K_STEP * 2, x_stride)
                _tile_load(5, a, TILE_ROWS * x_stride + kk * K_STEP * 2, x_stride)
                _tile_load(6, wp, w0 + kk * w_tile, 64)
                _tile_load(7, wp, w0 + w_cols + kk * w_tile, 64)
                _tile_dot(0, 4, 6)
                _tile_dot(1, 4, 7)
                _tile_dot(2, 5, 6)
                _tile_dot(3, 5, 7)
            i0 = rb * BLOCK
            j0 = cb * BLOCK
            if i0 + BLOCK <= nt and j0 + BLOCK <= n_out:  # a whole block: straight into out
                o_row = n_out * 4
                o0 = (i0 * n_out + j0) * 4
                _tile_store(0, out, o0, o_row)
                _tile_store(1, out, o0 + TILE_ROWS * 4, o_row)
                _tile_store(2, out, o0 + TILE_ROWS * o_row, o_row)
                _tile_store(3, out, o0 + TILE_ROWS * o_row + TILE_ROWS * 4, o_row)
                continue
            _tile_store(0, c, 0, BLOCK * 4)  # an edge block: through this thread's block
            _tile_store(1, c, TILE_ROWS * 4, BLOCK * 4)
            _tile_store(2, c, TILE_ROWS * BLOCK * 4, BLOCK * 4)
            _tile_store(3, c, TILE_ROWS * BLOCK * 4 + TILE_ROWS * 4, BLOCK * 4)
            for i in range(min(BLOCK, nt - i0)):
                for j in range(min(BLOCK, n_out - j0)):
                    out[i0 + i, j0 + j] = c[i, j]
        _tile_release()


@dataclass(frozen=True)
class AmxWeight:
    """A weight rounded to bf16 and packed for `_gemm_amx`: `[Np/16, Kp/32, 16, 16, 2]` (Np, Kp:
    N and K padded with zeros to multiples of 32)."""

    packed: np.ndarray
    n_out: int
    n_in: int


def amx_weight(w: np.ndarray) -> AmxWeight:
    """The AMX layout of an f32 `[N, K]` weight."""
    n_out, n_in = w.shape
    np_, kp = -(-n_out // BLOCK) * BLOCK, -(-n_in // K_STEP) * K_STEP
    bits = np.zeros((np_, kp), np.uint16)
    bits[:n_out, :n_in] = round_to_bf16(w).view(np.uint32) >> 16
    packed = bits.reshape(np_ // TILE_ROWS, TILE_ROWS, kp // K_STEP, TILE_ROWS, 2)
    return AmxWeight(np.ascontiguousarray(packed.transpose(0, 2, 3, 1, 4)), n_out, n_in)


def bind_gemm_amx(x: np.ndarray, w: AmxWeight, out: np.ndarray,
                  bias: np.ndarray | None = None) -> Callable[[], None]:
    """`out[nt, N] = x[nt, K] @ W.T (+ bias[N])` over fixed arrays (checked once)."""
    if not usable():
        raise RuntimeError("the AMX GEMM needs AMX tiles granted to this process")
    check_operands(x, out, w.n_in, w.n_out)
    b = np.zeros(w.packed.shape[0] * TILE_ROWS, np.float32)  # padded to whole blocks
    if bias is not None:
        if np.shape(bias) != (w.n_out,):
            raise ValueError(f"bias of shape {np.shape(bias)}, expected ({w.n_out},)")
        b[:w.n_out] = bias
    n_parts = max(1, numba.get_num_threads())
    ab = np.empty((n_parts, BLOCK, w.packed.shape[1] * K_STEP), np.uint16)
    cs = np.empty((n_parts, BLOCK, BLOCK), np.float32)
    return partial(_gemm_amx, x, w.packed, out, b, ab, cs, _CONFIG, n_parts)
