"""Quantize a block of f32 rows to one GGML type, rows in parallel (numba prange).

`quantize_rows(x, qtype)` is the one entry point: it checks the rows (finite, a whole number of
blocks) and returns the rows' bytes exactly as llama.cpp's `ggml_quantize_chunk` writes them
without an importance matrix. Each type gets its own parallel driver so a run compiles only the
types it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit, prange

from minfer.errors import MinferError

from . import blocks32, kquants

QT = GGMLQuantizationType


class QuantizeError(MinferError):
    """A tensor or option the quantizer refuses (shape, values, type)."""


def _driver(row_fn: Any) -> Callable[[np.ndarray, np.ndarray], None]:
    @njit(parallel=True, cache=True, error_model="numpy")
    def run(x: np.ndarray, out: np.ndarray) -> None:  # [n_rows, n] f32 -> [n_rows, row_bytes]
        for r in prange(x.shape[0]):
            row_fn(x[r], out[r])

    return run  # type: ignore[no-any-return]


_ROW_FUNCTIONS: dict[QT, Any] = {
    QT.F16: blocks32.f16_row,
    QT.BF16: blocks32.bf16_row,
    QT.Q4_0: blocks32.q4_0_row,
    QT.Q4_1: blocks32.q4_1_row,
    QT.Q5_0: blocks32.q5_0_row,
    QT.Q5_1: blocks32.q5_1_row,
    QT.Q8_0: blocks32.q8_0_row,
    QT.Q2_K: kquants.q2_k_row,
    QT.Q3_K: kquants.q3_k_row,
    QT.Q4_K: kquants.q4_k_row,
    QT.Q5_K: kquants.q5_k_row,
    QT.Q6_K: kquants.q6_k_row,
}
_DRIVERS: dict[QT, Callable[[np.ndarray, np.ndarray], None]] = {}

SUPPORTED = frozenset({QT.F32, *_ROW_FUNCTIONS})


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
    if qtype not in _DRIVERS:
        _DRIVERS[qtype] = _driver(_ROW_FUNCTIONS[qtype])
    _DRIVERS[qtype](x, out)
    return out
