"""Matrix-vector kernels for float weights (F32, F16, BF16) at small token counts.

ggml converts the activation to the weight's type before the dot (`vec_dot_type` F16 / BF16) and
accumulates in f32, so the callers round x to f16 / bf16 first and these kernels multiply the
widened weight by that rounded x in f32. F32 needs no rounding. Row-parallel like `dot32`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._llvm import bits_to_f32, f16_to_f32, prefetch
from .dot32 import _CHUNK, U

_PF = 512  # prefetch distance, in elements of the weight row


@njit(parallel=True, fastmath=True, cache=True)
def mv_f32(w, x, out):
    n_out, nt, n = w.shape[0], x.shape[0], x.shape[1]
    n64 = U(n - n % 64)
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = x[t]
                acc = np.float32(0.0)
                for j0 in range(U(0), n64, U(64)):
                    prefetch(row, j0 + U(_PF))
                    for j in range(U(64)):
                        acc += row[j0 + j] * xr[j0 + j]
                for j0 in range(n64, U(n)):
                    acc += row[j0] * xr[j0]
                out[t, r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def mv_f16(w, x, out):
    """w: uint16 half bits [n_out, n]; x: f32 values already rounded to f16."""
    n_out, nt, n = w.shape[0], x.shape[0], x.shape[1]
    n64 = U(n - n % 64)
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = x[t]
                acc = np.float32(0.0)
                for j0 in range(U(0), n64, U(64)):
                    prefetch(row, j0 + U(_PF))
                    for j in range(U(64)):
                        acc += f16_to_f32(row[j0 + j]) * xr[j0 + j]
                for j0 in range(n64, U(n)):
                    acc += f16_to_f32(row[j0]) * xr[j0]
                out[t, r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def mv_bf16(w, x, out):
    """w: uint16 bf16 bits [n_out, n]; x: f32 values already rounded to bf16."""
    n_out, nt, n = w.shape[0], x.shape[0], x.shape[1]
    n64 = U(n - n % 64)
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        for r in range(c * _CHUNK, min(n_out, c * _CHUNK + _CHUNK)):
            row = w[r]
            for t in range(nt):
                xr = x[t]
                acc = np.float32(0.0)
                for j0 in range(U(0), n64, U(64)):
                    prefetch(row, j0 + U(_PF))
                    for j in range(U(64)):
                        acc += bits_to_f32(np.uint32(row[j0 + j]) << np.uint32(16)) * xr[j0 + j]
                for j0 in range(n64, U(n)):
                    acc += bits_to_f32(np.uint32(row[j0]) << np.uint32(16)) * xr[j0]
                out[t, r] = acc


def round_to_f16(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest f16 (ties to even), back in f32."""
    return x.astype(np.float16).astype(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 (ties to even, as ggml_compute_fp32_to_bf16), in f32."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
