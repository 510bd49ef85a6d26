"""An RMSNorm (after a residual add, or alone) and the Q8 quantization of its rows as one step
(`graph.fusion.fuse_norm_quant`, issue #66): each row is normalised (`norm._rms_row`, after
`arith._add` where the add was fused into the norm) and quantized (`activations._q8_0_row` or
`_q8_k_row`) by the thread that normalised it, so the op tape has no quantize step (and, split
across threads, no barrier) between the norm and the projections reading its activation.

The same row functions as the unfused steps, so the same bits: the kernels take no fastmath flags
(numba inlines a row function into its caller's flags, and the norm's f64 sums must not be
reordered); the row's quantization is a function of its own under the quantize kernels' flags
(inlined without them it ran at a third of their speed: 896 values, 6.4 against 2.1 us). Arguments:
(a, b, w, eps, total, out, qs, d, aux, isum): b None normalises a itself (total None), else
total = a + b is normalised; isum None quantizes to Q8_K (aux: bsums), else Q8_0 (aux: s).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.elementwise.arith import _add
from minfer.backends.cpu.kernels.elementwise.norm import _check, _rms_row
from minfer.backends.cpu.kernels.quant.activations import (
    _FM,
    PARALLEL_MIN_ROWS,
    Q8Blocks,
    Q8KBlocks,
    _q8_0_row,
    _q8_k_row,
)
from minfer.backends.cpu.kernels.region.parts import share


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _q8_0_one(x, qs, d, s, isum, t):
    _q8_0_row(x, qs, d, s, isum, t)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _q8_k_one(x, qs, d, bsums, t):
    _q8_k_row(x, qs, d, bsums, t)


@njit(inline="always", error_model="numpy")
def _norm_q8_row(t, a, b, w, eps, total, out, qs, d, aux, isum):
    """Row t: normalised (after the add where b is given) and quantized."""
    x = a
    if b is not None:
        _add(a[t], b[t], total[t])
        x = total
    _rms_row(x, w, eps, out, t, 1, a.shape[1])
    if isum is None:
        _q8_k_one(out, qs, d, aux, t)
    else:
        _q8_0_one(out, qs, d, aux, isum, t)


@njit(cache=True, error_model="numpy")
def _norm_q8_rows(a, b, w, eps, total, out, qs, d, aux, isum):
    for t in range(a.shape[0]):
        _norm_q8_row(t, a, b, w, eps, total, out, qs, d, aux, isum)


@njit(cache=True, error_model="numpy", parallel=True)
def _norm_q8_rows_par(a, b, w, eps, total, out, qs, d, aux, isum):
    for t in prange(a.shape[0]):
        _norm_q8_row(t, a, b, w, eps, total, out, qs, d, aux, isum)


@njit(cache=True, error_model="numpy")
def _norm_q8_rows_par_part(part, n_parts, a, b, w, eps, total, out, qs, d, aux, isum):
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    for t in range(*share(part, n_parts, a.shape[0])):
        _norm_q8_row(t, a, b, w, eps, total, out, qs, d, aux, isum)


def bind_norm_quant(a: np.ndarray, b: np.ndarray | None, w: np.ndarray, eps: float,
                    total: np.ndarray | None, out: np.ndarray,
                    xq: Q8Blocks | Q8KBlocks) -> Callable[[], None]:
    """out = rms_norm(a [+ b]) * w (the sum into total where b is given) and out quantized into
    xq, over fixed arrays (one op-tape step; the bits of the norm then `bind_quantize`)."""
    x = a if total is None else total
    _check(x, out, x.shape[1], w)
    if b is not None and (total is None or not a.shape == b.shape == total.shape
                          or a.dtype != np.float32 or b.dtype != np.float32):
        raise ValueError(f"norm_quant wants f32 a, b of the sum's shape, got {a.shape} / "
                         f"{b.shape}")
    block = 256 if isinstance(xq, Q8KBlocks) else 32
    if xq.qs.shape != out.shape or out.shape[1] % block or not out.flags.c_contiguous:
        raise ValueError(f"cannot quantize rows {out.shape} into {type(xq).__name__} "
                         f"{xq.qs.shape}")
    aux, isum = (xq.bsums, None) if isinstance(xq, Q8KBlocks) else (xq.s, xq.isum)
    kernel = _norm_q8_rows_par if a.shape[0] >= PARALLEL_MIN_ROWS else _norm_q8_rows
    return partial(kernel, a, b, np.asarray(w, np.float32), np.float32(eps), total, out,
                   xq.qs, xq.d, aux, isum)
