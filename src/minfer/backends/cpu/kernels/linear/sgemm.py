"""The prefill matmul: dequantized weight tiles times f32 activations through BLAS sgemm.

Prefill is compute-bound, and a BLAS sgemm on f32 is far faster than integer dots in numba. A
numba parallel loop runs over tiles of weight rows; each thread dequantizes its tile (exactly, as
`quant.dequant`) into a private f32 buffer and calls a *single-threaded* sgemm on it, writing
straight
into its columns of `out`. numba stays the only thread pool: a multi-threaded BLAS next to numba's
OpenMP workers made the two pools spin against each other on 2 cores (100x slowdowns measured).

BLAS is numpy's own OpenBLAS (the `scipy-openblas64` library numpy wheels bundle), called through
its address: `openblas_set_num_threads_local(1)` keeps each call on its calling thread. Where that
library is not found, a plain sequential loop of `numpy.matmul` calls per tile is used.
This path uses f32 activations, so it differs from llama.cpp's integer path by float rounding only.
"""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.quant.dequant import dequant_row, dequantize_into
from minfer.backends.cpu.kernels.quant.types import QType
from minfer.backends.cpu.kernels.simd.llvm import (
    bits_to_f32,
    call_int_fn,
    call_sgemm_rm_nt,
    f16_to_f32,
)

_TILE_BYTES = 1 << 19  # f32 bytes of one dequantized tile (fits L2 with the sgemm's packing)
# ...but at least this many rows: each sgemm call packs the whole activation again, so the 16-row
# tiles 2^19 bytes gave at 8960 inputs ran at a third of the speed. Q2_K ffn_down (1536 x 8960,
# the first three of llama-quantize's IQ2_XXS mix of the 1.5B), 512 tokens, 2 threads, Intel SPR
# on a busy host: 16 rows 393-430 ms, 64 280, 128 272-279, 256 241; 8960 x 1536 (80 rows before)
# 239-252 -> 233-237 ms. The outputs measured the same bits at every tile size tried.
_MIN_TILE_ROWS = 128


def _find_openblas() -> tuple[int, int]:
    """Addresses of (cblas_sgemm, openblas_set_num_threads_local) in numpy's OpenBLAS, or 0s."""
    libs = os.path.join(os.path.dirname(np.__file__) + ".libs", "libscipy_openblas64_*.so*")
    for path in glob.glob(libs):
        try:
            lib = ctypes.CDLL(path)
            sgemm = ctypes.cast(lib.scipy_cblas_sgemm64_, ctypes.c_void_p).value
            local = ctypes.cast(lib.openblas_set_num_threads_local, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if sgemm and local:
            return sgemm, local
    return 0, 0


SGEMM, SET_THREADS_LOCAL = _find_openblas()


@njit(inline="always")
def _gemm_tile(x, tile, out, r0, sgemm, set_threads):
    """out[:, r0:r0+m] = x @ tile.T on this thread alone (its previous OpenBLAS setting is put
    back: the calling Python thread is one of numba's workers)."""
    prev = call_int_fn(set_threads, 1)
    nt, n_in = x.shape
    call_sgemm_rm_nt(sgemm, nt, tile.shape[0], n_in, x.ctypes.data, n_in, tile.ctypes.data, n_in,
                     out.ctypes.data + r0 * 4, out.shape[1])
    call_int_fn(set_threads, prev)


@njit(parallel=True, cache=True)
def _tiles_quant(w, qtype, x, out, rows, sgemm, set_threads):
    n_out, n_in = out.shape[1], x.shape[1]
    for ti in prange((n_out + rows - 1) // rows):
        r0 = ti * rows
        tile = np.empty((min(n_out, r0 + rows) - r0, n_in), np.float32)
        for r in range(tile.shape[0]):
            dequant_row(w[r0 + r], qtype, tile[r])
        _gemm_tile(x, tile, out, r0, sgemm, set_threads)


@njit(parallel=True, cache=True)
def _tiles_half(w, bf16, x, out, rows, sgemm, set_threads):
    n_out, n_in = out.shape[1], x.shape[1]
    for ti in prange((n_out + rows - 1) // rows):
        r0 = ti * rows
        tile = np.empty((min(n_out, r0 + rows) - r0, n_in), np.float32)
        for r in range(tile.shape[0]):
            for j in range(n_in):
                if bf16:
                    tile[r, j] = bits_to_f32(np.uint32(w[r0 + r, j]) << np.uint32(16))
                else:
                    tile[r, j] = f16_to_f32(w[r0 + r, j])
        _gemm_tile(x, tile, out, r0, sgemm, set_threads)


@njit(parallel=True, cache=True)
def _tiles_f32(w, x, out, rows, sgemm, set_threads):
    n_out = out.shape[1]
    for ti in prange((n_out + rows - 1) // rows):
        r0 = ti * rows
        _gemm_tile(x, w[r0 : min(n_out, r0 + rows)], out, r0, sgemm, set_threads)


def sgemm_tiles(w: np.ndarray, qt: QType, x: np.ndarray, out: np.ndarray) -> None:
    """out[nt, n_out] = x @ dequant(w).T; w already normalised by `weight_view`, x C-contiguous."""
    n_in = x.shape[1]
    rows = max(16, min(out.shape[1], max(_MIN_TILE_ROWS, _TILE_BYTES // (4 * n_in))) // 16 * 16)
    if not SGEMM:
        _numpy_tiles(w, qt, x, out, rows)
    elif qt is QType.F32:
        _tiles_f32(w, x, out, rows, SGEMM, SET_THREADS_LOCAL)
    elif qt in (QType.F16, QType.BF16):
        _tiles_half(w, qt is QType.BF16, x, out, rows, SGEMM, SET_THREADS_LOCAL)
    else:
        _tiles_quant(w, int(qt), x, out, rows, SGEMM, SET_THREADS_LOCAL)


def _numpy_tiles(w: np.ndarray, qt: QType, x: np.ndarray, out: np.ndarray, rows: int) -> None:
    """Fallback without a callable BLAS: sequential tiles through numpy.matmul."""
    tile = np.empty((rows, x.shape[1]), np.float32)
    for r0 in range(0, out.shape[1], rows):
        r1 = min(out.shape[1], r0 + rows)
        dequantize_into(w, qt, np.arange(r0, r1), tile[: r1 - r0])
        out[:, r0:r1] = x @ tile[: r1 - r0].T
