"""RMSNorm over rows (`rms_norm`) and over each head of a row (`head_rms_norm`, Qwen3's q/k norm),
a residual add and the RMSNorm of its sum as one step (`bind_add_rms_norm`);
LayerNorm with weight and bias over rows (`layer_norm`, BERT's), its sums made the same way.

As ggml's `rms_norm` followed by the weight `mul`: the f32 squares are summed in f64 (ggml's
`ggml_float`), scale = 1/sqrtf(mean + eps) in f32, y = (x * scale) * w with two f32 roundings.
The f64 sum runs in eight lanes combined in a fixed order (ggml adds one element after another:
a chain of dependent f64 adds, 0.8 ms for the 1.5B's 512 x 1536 prefill rows); the order does
not depend on the batch, and the f32 mean it rounds to is ggml's but for ties of the last bit.
Rows run on the calling thread at decode sizes (a parallel region costs more than the work) and
across the threads from PARALLEL_MIN_ROWS rows on.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.elementwise.arith import _add
from minfer.backends.cpu.kernels.region.parts import share

_LANES = 8  # f64 partial sums per segment: lane k sums elements k, k + 8, ...
# From this many rows on, rows are split across the threads (prefill); fewer run on the caller.
PARALLEL_MIN_ROWS = 64


@njit(inline="always", error_model="numpy")
def _lane_sum(xr, lo, hi, shift, square):
    """Sum over xr[lo:hi] of f64(d * d) (`square`) or f64(d), d = xr[j] - shift in f32 (ggml's
    f32 value or square, summed as `ggml_float`): lane k takes elements lo + k, lo + k + 8, ...,
    the lanes are combined in a fixed order, then the tail is added in order. `shift` and
    `square` are constants at each call, so the compiled loop is the plain one."""
    n8 = (hi - lo) - (hi - lo) % _LANES
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    for j in range(lo, lo + n8, _LANES):
        d0, d1 = xr[j] - shift, xr[j + 1] - shift
        d2, d3 = xr[j + 2] - shift, xr[j + 3] - shift
        d4, d5 = xr[j + 4] - shift, xr[j + 5] - shift
        d6, d7 = xr[j + 6] - shift, xr[j + 7] - shift
        if square:
            d0, d1, d2, d3 = d0 * d0, d1 * d1, d2 * d2, d3 * d3
            d4, d5, d6, d7 = d4 * d4, d5 * d5, d6 * d6, d7 * d7
        a0 += np.float64(d0)
        a1 += np.float64(d1)
        a2 += np.float64(d2)
        a3 += np.float64(d3)
        a4 += np.float64(d4)
        a5 += np.float64(d5)
        a6 += np.float64(d6)
        a7 += np.float64(d7)
    total = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
    for j in range(lo + n8, hi):
        d = xr[j] - shift
        total += np.float64(d * d if square else d)
    return total


@njit(inline="always", error_model="numpy")
def _rms_row(x, w, eps, out, t, n_seg, seg):
    """Row t, its n_seg segments of `seg` values each normalised with weight w[seg]."""
    xr, yr = x[t], out[t]
    for h in range(n_seg):
        base = h * seg
        ssum = _lane_sum(xr, base, base + seg, np.float32(0.0), True)
        mean = np.float32(ssum / seg)
        scale = np.float32(1.0) / np.sqrt(mean + eps)
        for j in range(seg):
            yr[base + j] = (xr[base + j] * scale) * w[j]


@njit(cache=True, error_model="numpy")
def _rms_rows(x, w, eps, out, n_seg, seg):
    """Normalise each `seg`-long segment of every row (n_seg per row) with weight w[seg]."""
    for t in range(x.shape[0]):
        _rms_row(x, w, eps, out, t, n_seg, seg)


@njit(cache=True, error_model="numpy", parallel=True)
def _rms_rows_par(x, w, eps, out, n_seg, seg):
    for t in prange(x.shape[0]):
        _rms_row(x, w, eps, out, t, n_seg, seg)


@njit(cache=True, error_model="numpy")
def _rms_rows_par_part(part, n_parts, x, w, eps, out, n_seg, seg):
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    for t in range(*share(part, n_parts, x.shape[0])):
        _rms_row(x, w, eps, out, t, n_seg, seg)


def _rows_kernel(x: np.ndarray) -> Callable[..., None]:
    return _rms_rows_par if x.shape[0] >= PARALLEL_MIN_ROWS else _rms_rows


@njit(cache=True, error_model="numpy")
def _add_rms_rows(a, b, w, eps, total, out):
    """total = a + b (`arith._add`'s row, its bits), then out = rms_norm(total) * w, row by row:
    the residual add and the norm after it as one step (`graph.fusion.fuse_add_norm`)."""
    for t in range(a.shape[0]):
        _add(a[t], b[t], total[t])
        _rms_row(total, w, eps, out, t, 1, a.shape[1])


@njit(cache=True, error_model="numpy", parallel=True)
def _add_rms_rows_par(a, b, w, eps, total, out):
    for t in prange(a.shape[0]):
        _add(a[t], b[t], total[t])
        _rms_row(total, w, eps, out, t, 1, a.shape[1])


@njit(cache=True, error_model="numpy")
def _add_rms_rows_par_part(part, n_parts, a, b, w, eps, total, out):
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    for t in range(*share(part, n_parts, a.shape[0])):
        _add(a[t], b[t], total[t])
        _rms_row(total, w, eps, out, t, 1, a.shape[1])


def bind_add_rms_norm(a: np.ndarray, b: np.ndarray, w: np.ndarray, eps: float,
                      total: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    """total = a + b and out = rms_norm(total) * w over fixed arrays (one op-tape step; the
    bits of `add` then `rms_norm`): checked once, then the kernel alone."""
    _check(total, out, total.shape[1], w)
    if not a.shape == b.shape == total.shape or a.dtype != np.float32 or b.dtype != np.float32:
        raise ValueError(f"add_rms_norm wants f32 a, b of the sum's shape {total.shape}, got "
                         f"{a.shape} / {b.shape}")
    kernel = _add_rms_rows_par if a.shape[0] >= PARALLEL_MIN_ROWS else _add_rms_rows
    return partial(kernel, a, b, np.asarray(w, np.float32), np.float32(eps), total, out)


def _check(x: np.ndarray, out: np.ndarray, width: int, w: np.ndarray) -> None:
    if x.ndim != 2 or x.dtype != np.float32 or out.shape != x.shape or out.dtype != np.float32:
        raise ValueError(f"rms_norm wants f32 [nt, n] x and out, got {x.shape} / {out.shape}")
    if w.shape != (width,):
        raise ValueError(f"norm weight of shape {w.shape}, expected ({width},)")


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, per row; out may be x."""
    bind_rms_norm(x, w, eps, out)()


def head_rms_norm(x: np.ndarray, w: np.ndarray, *, n_head: int, head_dim: int, eps: float,
                  out: np.ndarray) -> None:
    """RMSNorm of each head's `head_dim` slice of x `[nt, n_head*head_dim]`, weight `[head_dim]`."""
    bind_head_rms_norm(x, w, n_head=n_head, head_dim=head_dim, eps=eps, out=out)()


def bind_rms_norm(x: np.ndarray, w: np.ndarray, eps: float,
                  out: np.ndarray) -> Callable[[], None]:
    """`rms_norm` over fixed arrays: checked once, then the kernel alone (the op tape)."""
    _check(x, out, x.shape[1], w)
    return partial(_rows_kernel(x), x, np.asarray(w, np.float32), np.float32(eps), out, 1,
                   x.shape[1])


def bind_head_rms_norm(x: np.ndarray, w: np.ndarray, *, n_head: int, head_dim: int, eps: float,
                       out: np.ndarray) -> Callable[[], None]:
    """`head_rms_norm` over fixed arrays: checked once, then the kernel alone."""
    if x.ndim != 2 or x.shape[1] != n_head * head_dim:
        raise ValueError(f"x of shape {x.shape} is not [nt, {n_head}*{head_dim}]")
    _check(x, out, head_dim, w)
    return partial(_rows_kernel(x), x, np.asarray(w, np.float32), np.float32(eps), out, n_head,
                   head_dim)


@njit(inline="always", error_model="numpy")
def _layer_row(x, w, b, eps, out, t):
    """ggml's `norm` then `* w + b`: the f32 values summed in f64 (the mean), the centred row's
    squares summed in f64 (the variance), scale = 1/sqrtf(var + eps) in f32."""
    n = x.shape[1]
    xr, yr = x[t], out[t]
    mean = np.float32(_lane_sum(xr, 0, n, np.float32(0.0), False) / n)
    var = np.float32(_lane_sum(xr, 0, n, mean, True) / n)
    scale = np.float32(1.0) / np.sqrt(var + eps)
    for j in range(n):
        yr[j] = ((xr[j] - mean) * scale) * w[j] + b[j]


@njit(cache=True, error_model="numpy")
def _layer_rows(x, w, b, eps, out):
    for t in range(x.shape[0]):
        _layer_row(x, w, b, eps, out, t)


@njit(cache=True, error_model="numpy", parallel=True)
def _layer_rows_par(x, w, b, eps, out):
    for t in prange(x.shape[0]):
        _layer_row(x, w, b, eps, out, t)


@njit(cache=True, error_model="numpy")
def _layer_rows_par_part(part, n_parts, x, w, b, eps, out):
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    for t in range(*share(part, n_parts, x.shape[0])):
        _layer_row(x, w, b, eps, out, t)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out[t] = (x[t] - mean) / sqrt(var + eps) * w + b, per row (BERT's LayerNorm); out may
    be x."""
    bind_layer_norm(x, w, b, eps, out)()


def bind_layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float,
                    out: np.ndarray) -> Callable[[], None]:
    """`layer_norm` over fixed arrays: checked once, then the kernel alone (the op tape)."""
    _check(x, out, x.shape[1], w)
    if b.shape != w.shape:
        raise ValueError(f"norm bias of shape {b.shape}, expected {w.shape}")
    kernel = _layer_rows_par if x.shape[0] >= PARALLEL_MIN_ROWS else _layer_rows
    return partial(kernel, x, np.asarray(w, np.float32), np.asarray(b, np.float32),
                   np.float32(eps), out)
