"""RMSNorm over rows (`rms_norm`) and over each head of a row (`head_rms_norm`, Qwen3's q/k norm).

As ggml's `rms_norm` followed by the weight `mul`: the f32 squares are summed in f64 (ggml's
`ggml_float`), scale = 1/sqrtf(mean + eps) in f32, y = (x * scale) * w with two f32 roundings.
Serial kernels: rows are short and a parallel region costs more than the work at decode sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit


@njit(cache=True, error_model="numpy")
def _rms_rows(x, w, eps, out, n_seg, seg):
    """Normalise each `seg`-long segment of every row (n_seg per row) with weight w[seg]."""
    for t in range(x.shape[0]):
        for h in range(n_seg):
            base = h * seg
            ssum = 0.0
            for j in range(seg):
                v = x[t, base + j]
                ssum += np.float64(v * v)  # f32 square, f64 sum: as ggml
            mean = np.float32(ssum / seg)
            scale = np.float32(1.0) / np.sqrt(mean + eps)
            for j in range(seg):
                out[t, base + j] = (x[t, base + j] * scale) * w[j]


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
    return partial(_rms_rows, x, np.asarray(w, np.float32), np.float32(eps), out, 1, x.shape[1])


def bind_head_rms_norm(x: np.ndarray, w: np.ndarray, *, n_head: int, head_dim: int, eps: float,
                       out: np.ndarray) -> Callable[[], None]:
    """`head_rms_norm` over fixed arrays: checked once, then the kernel alone."""
    if x.ndim != 2 or x.shape[1] != n_head * head_dim:
        raise ValueError(f"x of shape {x.shape} is not [nt, {n_head}*{head_dim}]")
    _check(x, out, head_dim, w)
    return partial(_rms_rows, x, np.asarray(w, np.float32), np.float32(eps), out, n_head,
                   head_dim)
