"""Activation quantization: Q8_0/Q8_1 (32-value blocks) and Q8_K (256-value blocks).

Quantized weights are dotted against an activation row quantized the way ggml does on x86, so
the integer sums are exactly ggml's:

- Q8_0 / Q8_1 (ggml `quantize_row_q8_0` / `_q8_1`, AVX path): amax = max|x| over the block,
  d = amax/127 stored as f16, q = round-half-even(x * (127/amax)). Q8_1 adds
  s = f16(d * sum(q)) (d unrounded), used by Q4_1/Q5_1 for their `m` offsets. Both are produced
  together: `Q8Blocks` carries qs, d (the f16 value as f32), s and the integer block sums, which the
  kernels use to move unsigned weight codes onto the u8 x s8 dot (an exact integer identity).
- Q8_K (ggml `quantize_row_q8_K_ref`): the first element of largest magnitude `max` sets
  iscale = -127/max; q = min(127, round-half-even(iscale*x)); d = 1/iscale in f32; bsums are
  int16 sums of each 16 quants.

Quantize once per activation and share it across every matmul that reads it (q/k/v, gate/up).
These kernels are exact (only order-insensitive fastmath flags; see _FM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.region.parts import share
from minfer.backends.cpu.kernels.simd.blocks import _F32, _I32, _splat, _vec
from minfer.backends.cpu.kernels.simd.blocks import _x86 as _call  # any LLVM intrinsic, by name
from minfer.backends.cpu.kernels.simd.llvm import f16_to_f32, f32_to_f16


@dataclass(frozen=True)
class Q8Blocks:
    """An activation `[nt, n]` quantized in blocks of 32 (serves as Q8_0 and Q8_1)."""

    qs: np.ndarray  # int8 [nt, n]
    d: np.ndarray  # f32 [nt, n/32], the f16-rounded scale
    s: np.ndarray  # f32 [nt, n/32], Q8_1's f16(d * sum(qs))
    isum: np.ndarray  # int32 [nt, n/32], sum(qs) per block


@dataclass(frozen=True)
class Q8KBlocks:
    """An activation `[nt, n]` quantized in blocks of 256 (Q8_K)."""

    qs: np.ndarray  # int8 [nt, n]
    d: np.ndarray  # f32 [nt, n/256]
    bsums: np.ndarray  # int16 [nt, n/16]


# Exactness allows reordering the max-|x| reductions and integer sums, but nothing that could
# change a single rounding (no `arcp`: 127/amax must stay a true division; no `contract`).
_FM = {"nnan", "ninf", "nsz", "reassoc"}


# The per-block loops as explicit vector IR (16 lanes; portable LLVM vector code, legalised to
# whatever the CPU has): written as plain loops inside the per-block loop, LLVM vectorised the
# *block* loop instead, with gathers and byte extracts (measured ~2.6 ns per value).
_V16F = _vec(_F32, 16)
_V16I = _vec(_I32, 16)


def _elem_ptr(context: Any, builder: Any, aryty: Any, ary: Any, off: Any, ty: Any) -> Any:
    arr = context.make_array(aryty)(context, builder, ary)
    return builder.bitcast(builder.gep(arr.data, [off]), ty.as_pointer())


def _extreme(n: int, which: str) -> Any:
    """An intrinsic (x, off) -> f32: the max (or min) of x[off:off + n] (n a multiple of 16)."""
    op = "maxnum" if which == "max" else "minnum"

    def typer(typingctx: Any, x: Any, off: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], _V16F)
            acc = builder.load(p, align=4)
            for k in range(1, n // 16):
                v = builder.load(builder.gep(p, [ir.Constant(ir.IntType(64), k)]), align=4)
                acc = _call(builder, f"llvm.{op}.v16f32", _V16F, [acc, v])
            return _call(builder, f"llvm.vector.reduce.f{which}.v16f32", _F32, [acc])
        return types.float32(x, off), codegen

    return intrinsic(typer)


def _quantizer(n: int, clamp: bool, bits: int = 8) -> Any:
    """An intrinsic (x, off, scale, q) -> int32: q[off:off + n] = round-half-even(scale * x)
    (at most 127 when `clamp`), as int8 (int16 with bits=16); returns their sum."""

    def typer(typingctx: Any, x: Any, off: Any, scale: Any, q: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            px = _elem_ptr(context, builder, sig.args[0], args[0], args[1], _V16F)
            pq = _elem_ptr(context, builder, sig.args[3], args[3], args[1],
                           _vec(ir.IntType(bits), 16))
            splat = _splat(builder, args[2], 16)
            total = ir.Constant(_V16I, [0] * 16)
            for k in range(n // 16):
                i = ir.Constant(ir.IntType(64), k)
                v = builder.fmul(builder.load(builder.gep(px, [i]), align=4), splat)
                r = builder.fptosi(_call(builder, "llvm.rint.v16f32", _V16F, [v]), _V16I)
                if clamp:
                    r = _call(builder, "llvm.smin.v16i32", _V16I,
                              [r, ir.Constant(_V16I, [127] * 16)])
                builder.store(builder.trunc(r, _vec(ir.IntType(bits), 16)),
                              builder.gep(pq, [i]), align=1)
                total = builder.add(total, r)
            return _call(builder, "llvm.vector.reduce.add.v16i32", _I32, [total])
        return types.int32(x, off, scale, q), codegen

    return intrinsic(typer)


_max32, _min32 = _extreme(32, "max"), _extreme(32, "min")
_max256, _min256 = _extreme(256, "max"), _extreme(256, "min")
_quant32 = _quantizer(32, False)
_quant16_clamped = _quantizer(16, True)
quant32_i16 = _quantizer(32, False, 16)  # `linear.gemm_i16`'s activation codes


# From this many rows on, the rows are split across the threads (prefill); fewer stay on the
# calling thread (decode: a parallel region costs more than the row).
PARALLEL_MIN_ROWS = 16


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _q8_0_blocks(x, qs, d, s, isum, t, b0, b1):
    xr, qr = x[t], qs[t]
    for b in range(b0, b1):
        o = b * 32
        amax = max(_max32(xr, o), -_min32(xr, o))
        dd = amax / np.float32(127.0)
        idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        total = _quant32(xr, o, idd, qr)
        d[t, b] = f16_to_f32(f32_to_f16(dd))
        s[t, b] = f16_to_f32(f32_to_f16(dd * np.float32(total)))
        isum[t, b] = total


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _q8_0_row(x, qs, d, s, isum, t):
    _q8_0_blocks(x, qs, d, s, isum, t, 0, x.shape[1] // 32)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _quantize_q8_0_rows(x, qs, d, s, isum):
    for t in range(x.shape[0]):
        _q8_0_row(x, qs, d, s, isum, t)


@njit(cache=True, fastmath=_FM, error_model="numpy", parallel=True)
def _quantize_q8_0_rows_par(x, qs, d, s, isum):
    for t in prange(x.shape[0]):
        _q8_0_row(x, qs, d, s, isum, t)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _quantize_q8_0_rows_par_part(part, n_parts, x, qs, d, s, isum):
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    for t in range(*share(part, n_parts, x.shape[0])):
        _q8_0_row(x, qs, d, s, isum, t)


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _q8_k_blocks(x, qs, d, bsums, t, b0, b1):
    xr, qr = x[t], qs[t]
    for b in range(b0, b1):
        o = b * 256
        mx, mn = _max256(xr, o), _min256(xr, o)
        if mx == 0 and mn == 0:
            d[t, b] = 0.0
            qr[o : o + 256] = 0
            bsums[t, b * 16 : b * 16 + 16] = 0
            continue
        # the first element of largest magnitude sets the sign of the scale: only a tie
        # (both +max and -max present) needs the search
        if mx != -mn:
            top = mx if mx > -mn else mn
        else:
            first = 0
            while abs(xr[o + first]) != mx:
                first += 1
            top = xr[o + first]
        iscale = np.float32(-127.0) / top
        for g in range(16):
            bsums[t, b * 16 + g] = _quant16_clamped(xr, o + g * 16, iscale, qr)
        d[t, b] = np.float32(1.0) / iscale


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _q8_k_row(x, qs, d, bsums, t):
    _q8_k_blocks(x, qs, d, bsums, t, 0, x.shape[1] // 256)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _quantize_q8_k_rows(x, qs, d, bsums):
    for t in range(x.shape[0]):
        _q8_k_row(x, qs, d, bsums, t)


@njit(cache=True, fastmath=_FM, error_model="numpy", parallel=True)
def _quantize_q8_k_rows_par(x, qs, d, bsums):
    for t in prange(x.shape[0]):
        _q8_k_row(x, qs, d, bsums, t)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _quantize_q8_k_rows_par_part(part, n_parts, x, qs, d, bsums):
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    for t in range(*share(part, n_parts, x.shape[0])):
        _q8_k_row(x, qs, d, bsums, t)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def quantize_q8_0_blocks(x, qs, d, s, isum, t, b0, b1):
    """Blocks [b0, b1) of row t, as the row kernels quantize them (under their flags: numba
    inlines a row function into its caller's): a step that computed those values itself
    (`linear.gate_up`) quantizes them with no step of its own."""
    _q8_0_blocks(x, qs, d, s, isum, t, b0, b1)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def quantize_q8_k_blocks(x, qs, d, bsums, t, b0, b1):
    """Q8_K's blocks [b0, b1) of row t (see `quantize_q8_0_blocks`)."""
    _q8_k_blocks(x, qs, d, bsums, t, b0, b1)


def _rows(x: np.ndarray, block: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] % block:
        raise ValueError(f"activation of shape {x.shape} is not rows of whole {block}-blocks")
    return x


def quantize_q8_0(x: np.ndarray) -> Q8Blocks:
    """Quantize f32 `[nt, n]` (n % 32 == 0) to Q8_0 blocks, with Q8_1's `s` alongside."""
    x = _rows(x, 32)
    nt, n = x.shape
    out = Q8Blocks(
        qs=np.empty((nt, n), np.int8),
        d=np.empty((nt, n // 32), np.float32),
        s=np.empty((nt, n // 32), np.float32),
        isum=np.empty((nt, n // 32), np.int32),
    )
    rows = _quantize_q8_0_rows_par if nt >= PARALLEL_MIN_ROWS else _quantize_q8_0_rows
    rows(x, out.qs, out.d, out.s, out.isum)
    return out


def quantize_q8_k(x: np.ndarray) -> Q8KBlocks:
    """Quantize f32 `[nt, n]` (n % 256 == 0) to Q8_K blocks."""
    x = _rows(x, 256)
    nt, n = x.shape
    out = Q8KBlocks(
        qs=np.empty((nt, n), np.int8),
        d=np.empty((nt, n // 256), np.float32),
        bsums=np.empty((nt, n // 16), np.int16),
    )
    rows = _quantize_q8_k_rows_par if nt >= PARALLEL_MIN_ROWS else _quantize_q8_k_rows
    rows(x, out.qs, out.d, out.bsums)
    return out


@njit(cache=True, parallel=True)
def _dequantize_rows(qs, d, out):
    nt, n = qs.shape
    block = n // d.shape[1]
    for t in prange(nt):
        for b in range(d.shape[1]):
            scale = d[t, b]
            for i in range(b * block, (b + 1) * block):
                out[t, i] = np.float32(qs[t, i]) * scale


def dequantize_activation(xq: Q8Blocks | Q8KBlocks) -> np.ndarray:
    """The values a quantized activation stands for, f32 `[nt, n]`: each code times its block's
    scale (what the integer dots multiply the weights by, up to where they round)."""
    out = np.empty(xq.qs.shape, np.float32)
    _dequantize_rows(xq.qs, xq.d, out)
    return out


def new_q8_0(nt: int, n: int) -> Q8Blocks:
    """Empty Q8_0 blocks for `[nt, n]`, to be filled by `bind_quantize_q8_0`."""
    return Q8Blocks(qs=np.empty((nt, n), np.int8), d=np.empty((nt, n // 32), np.float32),
                    s=np.empty((nt, n // 32), np.float32),
                    isum=np.empty((nt, n // 32), np.int32))


def new_q8_k(nt: int, n: int) -> Q8KBlocks:
    """Empty Q8_K blocks for `[nt, n]`, to be filled by `bind_quantize_q8_k`."""
    return Q8KBlocks(qs=np.empty((nt, n), np.int8), d=np.empty((nt, n // 256), np.float32),
                     bsums=np.empty((nt, n // 16), np.int16))


def bind_quantize_q8_0(x: np.ndarray, out: Q8Blocks) -> Callable[[], None]:
    """`quantize_q8_0(x)` into `out`, as a call over fixed buffers (shapes checked here)."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or out.qs.shape != _rows(x, 32).shape:
        raise ValueError(f"cannot quantize {x.dtype} {x.shape} into Q8_0 {out.qs.shape}")
    rows = _quantize_q8_0_rows_par if x.shape[0] >= PARALLEL_MIN_ROWS else _quantize_q8_0_rows
    return partial(rows, x, out.qs, out.d, out.s, out.isum)


def bind_quantize_q8_k(x: np.ndarray, out: Q8KBlocks) -> Callable[[], None]:
    """`quantize_q8_k(x)` into `out`, as a call over fixed buffers (shapes checked here)."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or out.qs.shape != _rows(x, 256).shape:
        raise ValueError(f"cannot quantize {x.dtype} {x.shape} into Q8_K {out.qs.shape}")
    rows = _quantize_q8_k_rows_par if x.shape[0] >= PARALLEL_MIN_ROWS else _quantize_q8_k_rows
    return partial(rows, x, out.qs, out.d, out.bsums)
