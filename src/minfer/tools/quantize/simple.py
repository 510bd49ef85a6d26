"""Quantizing float weights into GGUF block formats, for writing synthetic models and tests.

`gguf.quants.quantize` covers F16/BF16 and the 32-blocks (Q4_0 … Q8_0) but not the K-quants the
development model uses (Q4_K, Q5_K, Q6_K), so this module adds straightforward reference
quantizers for those. They produce valid blocks (checked against `gguf.quants.dequantize`) with
plain min/max scale choice, not ggml's error-minimising search: good for tests, not for shipping.
Q2_K, Q3_K and MXFP4 come from `rows` beside it (llama.cpp's exact quantizers, the ones
`minfer quantize` ships). The i-quants (IQ1_S .. IQ4_XS) get stand-ins, not quantizers: random
valid blocks (grid indices, signs, sub-scales) whose scale gives each block the data's RMS, for
synthetic models whose reference is the dequantized weights; TQ1_0 and TQ2_0 are gguf.quants'.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[nb] float → [nb, 2] little-endian f16 bytes."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _scale_and_code(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block super-scale d ([nb]) and 6/8-bit codes ([nb, n]) so values ≈ d * codes."""
    d = values.max(axis=1) / top
    safe = np.where(d > 0, d, 1.0)
    codes = np.clip(np.rint(values / safe[:, None]), 0, top).astype(np.uint8)
    return d.astype(np.float16).astype(np.float32), codes


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack eight 6-bit scales and mins per block into ggml's 12-byte layout ([nb, 12])."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _affine_k(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Shared Q4_K/Q5_K step: per 32-sub-block scale and min, quantized to 6 bits.

    Returns (d, dmin, packed scales [nb, 12], q [nb, 8, 32] in 0..levels).
    """
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # [nb, 8], <= 0
    scale = (sub.max(axis=2) - lo) / levels
    d, sc = _scale_and_code(scale, 63)
    dmin, mq = _scale_and_code(-lo, 63)
    step = d[:, None] * sc
    offset = dmin[:, None] * mq
    safe = np.where(step > 0, step, 1.0)
    q = np.rint((sub + offset[:, :, None]) / safe[:, :, None])
    q = np.clip(q, 0, levels).astype(np.uint8)
    return d, dmin, _pack_k4_scales(sc, mq), q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """[nb, 8, 32] codes → [nb, 128]: byte 32c+l holds sub-block 2c (low) and 2c+1 (high)."""
    pairs = q.reshape(-1, 4, 2, 32) & 0xF
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine_k(blocks, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, _low_nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine_k(blocks, 31)
    high = (q >> 4).astype(np.uint8)  # [nb, 8, 32]; sub-block j's bit goes to bit j of qh[l]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, _low_nibbles(q)], axis=1)


def _exact(qtype: GGMLQuantizationType) -> Callable[[np.ndarray], np.ndarray]:
    def run(blocks: np.ndarray) -> np.ndarray:
        # imported on first use, for start-up time: the exact quantizers load compiled kernels
        from minfer.tools.quantize.rows import quantize_rows

        return quantize_rows(blocks, qtype)

    return run


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    d, sc = _scale_and_code(np.abs(sub).max(axis=2) / 31, 127)
    step = d[:, None] * sc
    safe = np.where(step > 0, step, 1.0)
    q_signed = np.clip(np.rint(sub / safe[:, :, None]), -32, 31)
    q = (q_signed + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [nb, half, quarter, l]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
    qh = qh | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


# Types gguf.quants.quantize implements (it only dequantizes the K-quants).
_GGUF_QUANTIZED = frozenset({
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.TQ1_0,
    GGMLQuantizationType.TQ2_0,
})
_PLAIN = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16})

_K_QUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
    GGMLQuantizationType.Q2_K: _exact(GGMLQuantizationType.Q2_K),
    GGMLQuantizationType.Q3_K: _exact(GGMLQuantizationType.Q3_K),
}
# Whole rows to `rows`' exact quantizer (gguf-py's bytes, without its [blocks, 32, 16] temporaries).
_EXACT_ROWS = frozenset({GGMLQuantizationType.MXFP4})


def _stand_in(qtype: GGMLQuantizationType) -> Callable[[np.ndarray], np.ndarray]:
    def run(blocks: np.ndarray) -> np.ndarray:
        from minfer.backends.cpu.kernels.reference import random_iquant_blocks

        rng = np.random.default_rng(zlib.crc32(blocks.tobytes()))
        rms = np.sqrt((blocks.astype(np.float64) ** 2).mean(-1))[:, None]
        return random_iquant_blocks(int(qtype), blocks.shape[0], QK_K, rng, rms=rms)

    return run


for _t in (GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ2_XS, GGMLQuantizationType.IQ2_S,
           GGMLQuantizationType.IQ3_XXS, GGMLQuantizationType.IQ3_S, GGMLQuantizationType.IQ1_S,
           GGMLQuantizationType.IQ1_M, GGMLQuantizationType.IQ4_XS):
    _K_QUANTIZERS[_t] = _stand_in(_t)


def can_quantize(qtype: GGMLQuantizationType, n_in: int) -> bool:
    """Whether `quantize` handles qtype for rows of n_in values."""
    supported = (qtype in _K_QUANTIZERS or qtype in _GGUF_QUANTIZED or qtype in _PLAIN
                 or qtype in _EXACT_ROWS)
    return supported and n_in % GGML_QUANT_SIZES[qtype][0] == 0


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Float weights [..., n_in] → F32/F16 typed arrays, or uint8 block rows [..., row_bytes]."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if not can_quantize(qtype, data.shape[-1]):
        raise ValueError(f"cannot quantize rows of {data.shape[-1]} values to {qtype.name} "
                         f"(block size {block}; K-quants need multiples of {QK_K})")
    if qtype == GGMLQuantizationType.F32:
        return data
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    if qtype in _EXACT_ROWS:
        rows = _exact(qtype)(data.reshape(-1, data.shape[-1]))
        return rows.reshape(*data.shape[:-1], rows.shape[-1])
    if qtype in _K_QUANTIZERS:
        rows = _K_QUANTIZERS[qtype](data.reshape(-1, QK_K))
        return rows.reshape(*data.shape[:-1], data.shape[-1] // block * type_size)
    return quants.quantize(data, qtype)
