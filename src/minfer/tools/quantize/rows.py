"""Quantize a block of f32 rows to one GGML type, rows in parallel (numba prange).

`quantize_rows(x, qtype)` is the one entry point: it checks the rows (finite, a whole number of
blocks) and returns the rows' bytes exactly as llama.cpp's `ggml_quantize_chunk` writes them
without an importance matrix. Each type gets its own parallel driver so a run compiles only the
types it uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit, prange

from minfer.errors import MinferError

from . import blocks32, kquants

QT = GGMLQuantizationType


class QuantizeError(MinferError):
    """A tensor or option the quantizer refuses (shape, values, type)."""


# One parallel driver per type (not a closure factory: numba's cache keys on the qualified
# name, so generated closures would overwrite each other's cache entries).
_PAR: dict[str, Any] = {"parallel": True, "cache": True, "error_model": "numpy"}


@njit(**_PAR)
def _rows_f16(x, out):
    for r in prange(x.shape[0]):
        blocks32.f16_row(x[r], out[r])


@njit(**_PAR)
def _rows_bf16(x, out):
    for r in prange(x.shape[0]):
        blocks32.bf16_row(x[r], out[r])


@njit(**_PAR)
def _rows_q4_0(x, out):
    for r in prange(x.shape[0]):
        blocks32.q4_0_row(x[r], out[r])


@njit(**_PAR)
def _rows_q4_1(x, out):
    for r in prange(x.shape[0]):
        blocks32.q4_1_row(x[r], out[r])


@njit(**_PAR)
def _rows_q5_0(x, out):
    for r in prange(x.shape[0]):
        blocks32.q5_0_row(x[r], out[r])


@njit(**_PAR)
def _rows_q5_1(x, out):
    for r in prange(x.shape[0]):
        blocks32.q5_1_row(x[r], out[r])


@njit(**_PAR)
def _rows_q8_0(x, out):
    for r in prange(x.shape[0]):
        blocks32.q8_0_row(x[r], out[r])


@njit(**_PAR)
def _rows_q2_k(x, out):
    for r in prange(x.shape[0]):
        kquants.q2_k_row(x[r], out[r])


@njit(**_PAR)
def _rows_q3_k(x, out):
    for r in prange(x.shape[0]):
        kquants.q3_k_row(x[r], out[r])


@njit(**_PAR)
def _rows_q4_k(x, out):
    for r in prange(x.shape[0]):
        kquants.q4_k_row(x[r], out[r])


@njit(**_PAR)
def _rows_q5_k(x, out):
    for r in prange(x.shape[0]):
        kquants.q5_k_row(x[r], out[r])


@njit(**_PAR)
def _rows_q6_k(x, out):
    for r in prange(x.shape[0]):
        kquants.q6_k_row(x[r], out[r])


@njit(**_PAR)
def _rows_iq4_nl(x, out):
    for r in prange(x.shape[0]):
        blocks32.iq4_nl_row(x[r], out[r])


_DRIVERS: dict[QT, Any] = {
    QT.IQ4_NL: _rows_iq4_nl,
    QT.F16: _rows_f16,
    QT.BF16: _rows_bf16,
    QT.Q4_0: _rows_q4_0,
    QT.Q4_1: _rows_q4_1,
    QT.Q5_0: _rows_q5_0,
    QT.Q5_1: _rows_q5_1,
    QT.Q8_0: _rows_q8_0,
    QT.Q2_K: _rows_q2_k,
    QT.Q3_K: _rows_q3_k,
    QT.Q4_K: _rows_q4_k,
    QT.Q5_K: _rows_q5_k,
    QT.Q6_K: _rows_q6_k,
}

SUPPORTED = frozenset({QT.F32, *_DRIVERS})


def row_bytes(qtype: QT, n: int) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return n // block * type_size


def quantize_rows(x: np.ndarray, qtype: QT, *, name: str = "tensor") -> np.ndarray:
    """[n_rows, n] f32 → [n_rows, row_bytes] uint8 in qtype (F32 rows come back as bytes)."""
    if qtype not in SUPPORTED:
        raise QuantizeError(f"{name}: minfer cannot quantize to {qtype.name}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[1]
    block = GGML_QUANT_SIZES[qtype][0]
    if n % block:
        raise QuantizeError(f"{name}: rows of {n} values are not a whole number of "
                            f"{qtype.name} blocks ({block})")
    if not np.isfinite(x).all():
        raise QuantizeError(f"{name}: holds NaN or Inf values (llama.cpp refuses them too)")
    if qtype == QT.F32:
        return x.view(np.uint8)
    out = np.empty((x.shape[0], row_bytes(qtype, n)), dtype=np.uint8)
    _DRIVERS[qtype](x, out)
    return out
