"""GGML tensor types the CPU kernels handle, and their block layouts.

Each quantized row of a GGUF weight is a run of fixed-size blocks; `w_raw` arrays are
`uint8[n_out, row_bytes]` views of those bytes (zero-copy from the file's memmap).
Byte layouts (little-endian, f16 = IEEE half):

  Q4_0  (32 values, 18 B): d f16 | qs[16] (low nibbles = values 0..15, high = 16..31), v = d*(q-8)
  Q4_1  (32 values, 20 B): d f16 | m f16 | qs[16],                       v = d*q + m
  Q5_0  (32 values, 22 B): d f16 | qh u32 (bit j = 5th bit of value j) | qs[16], v = d*(q-16)
  Q5_1  (32 values, 24 B): d f16 | m f16 | qh u32 | qs[16],              v = d*q + m
  Q8_0  (32 values, 34 B): d f16 | qs int8[32],                          v = d*q
  Q4_K  (256 values, 144 B): d f16 | dmin f16 | scales[12] (8 six-bit scales + 8 six-bit mins)
        | qs[128] (4 chunks of 64: low nibbles = values 0..31 of the chunk, high = 32..63),
        v = d*sc*q - dmin*m per 32-value sub-block
  Q5_K  (256 values, 176 B): d | dmin | scales[12] | qh[32] (bit 2j / 2j+1 = 5th bit of chunk j's
        low / high half) | qs[128]
  Q6_K  (256 values, 210 B): ql[128] | qh[64] | scales int8[16] | d f16,
        v = d*sc*(q-32) per 16-value sub-block
  Q2_K  (256 values, 84 B): scales[16] (low nibble scale, high nibble min) | qs[64] (2-bit
        codes, 4 per byte) | d f16 | dmin f16, v = d*sc*q - dmin*m per 16-value sub-block
  Q3_K  (256 values, 110 B): hmask[32] (third bits) | qs[64] | scales[12] (16 six-bit) | d f16,
        v = d*(sc-32)*(q-4 if the third bit is clear else q) per 16-value sub-block
  IQ4_NL (32 values, 18 B): d f16 | qs[16] (as Q4_0), v = d*level[q], ggml's 16 levels
  IQ1_S .. IQ4_XS, TQ1_0, TQ2_0, MXFP4: see `quant.iquants` (each dequantized exactly; IQ4_XS
        and MXFP4 dotted in their own blocks as IQ4_NL is, TQ2_0 in its own as Q2_K, the
        others run as exact re-encodings into Q6_K / Q7_K, `quant.reencode`)
  Q7_K  (minfer's own, never in a file; 256 values, 276 B): codes u8[256] (q + 64, |q| <= 63)
        | scales int8[16] | d f32, v = d*sc*q per 16-value sub-block. The re-encoding of the
        IQ2 types, whose lattice values (up to 43) do not fit Q6_K's codes (and of IQ1 /
        IQ3 / TQ weights with a block's d below f16's normal range).

Float weights: F32 (float32), F16 (uint16 half bits or float16), BF16 (uint16 bits).

The *_PACKED types are minfer's own ids (never in a file): the CPU backend's repacked copies of
Q4_0 / Q5_0 / Q8_0 / Q4_K / Q6_K / IQ4_NL / IQ4_XS / MXFP4 / Q2_K / TQ2_0 weights and of the
widened Q7_K copies
(Q7_K_PACKED, which replaces the Q7_K copy: no more memory) (`quant.repack`: the same
information rearranged 16 rows at a time, so that int32 lane i of the integer dots' vectors is
row i). Only the integer matmul reads them; nothing dequantizes them.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from minfer.errors import ModelError
from minfer.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_G = GGMLQuantizationType


class QType(IntEnum):
    """The GGML type ids the kernels take (values from `minfer.gguf.constants`), and minfer's
    own layouts (Q7_K; the repacked ones 0x1000 + the type they repack)."""

    F32 = _G.F32.value
    F16 = _G.F16.value
    Q4_0 = _G.Q4_0.value
    Q4_1 = _G.Q4_1.value
    Q5_0 = _G.Q5_0.value
    Q5_1 = _G.Q5_1.value
    Q8_0 = _G.Q8_0.value
    Q8_1 = _G.Q8_1.value
    Q2_K = _G.Q2_K.value
    Q3_K = _G.Q3_K.value
    Q4_K = _G.Q4_K.value
    Q5_K = _G.Q5_K.value
    Q6_K = _G.Q6_K.value
    Q8_K = _G.Q8_K.value
    IQ4_NL = _G.IQ4_NL.value
    BF16 = _G.BF16.value
    IQ2_XXS = _G.IQ2_XXS.value
    IQ2_XS = _G.IQ2_XS.value
    IQ2_S = _G.IQ2_S.value
    IQ3_XXS = _G.IQ3_XXS.value
    IQ3_S = _G.IQ3_S.value
    IQ1_S = _G.IQ1_S.value
    IQ1_M = _G.IQ1_M.value
    IQ4_XS = _G.IQ4_XS.value
    TQ1_0 = _G.TQ1_0.value
    TQ2_0 = _G.TQ2_0.value
    MXFP4 = _G.MXFP4.value
    Q4_0_PACKED = 0x1000 + _G.Q4_0.value
    Q5_0_PACKED = 0x1000 + _G.Q5_0.value
    Q8_0_PACKED = 0x1000 + _G.Q8_0.value
    Q4_K_PACKED = 0x1000 + _G.Q4_K.value
    Q6_K_PACKED = 0x1000 + _G.Q6_K.value
    IQ4_NL_PACKED = 0x1000 + _G.IQ4_NL.value
    IQ4_XS_PACKED = 0x1000 + _G.IQ4_XS.value
    MXFP4_PACKED = 0x1000 + _G.MXFP4.value
    Q2_K_PACKED = 0x1000 + _G.Q2_K.value
    TQ2_0_PACKED = 0x1000 + _G.TQ2_0.value
    Q7_K = 0x2000  # minfer's own wide layout (see the module docstring)
    Q7_K_PACKED = 0x1000 + 0x2000


# (values per block, bytes per block) of the weight types the kernels accept: GGML's, and for a
# repacked layout its type's (the same blocks, rearranged)
_WEIGHT_TYPES = (QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q5_0,
                 QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q2_K,
                 QType.Q3_K, QType.IQ4_NL, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S,
                 QType.IQ3_XXS, QType.IQ3_S, QType.IQ1_S, QType.IQ1_M, QType.IQ4_XS,
                 QType.TQ1_0, QType.TQ2_0, QType.MXFP4, QType.Q4_0_PACKED, QType.Q5_0_PACKED,
                 QType.Q8_0_PACKED, QType.Q4_K_PACKED, QType.Q6_K_PACKED, QType.IQ4_NL_PACKED,
                 QType.IQ4_XS_PACKED, QType.MXFP4_PACKED, QType.Q2_K_PACKED,
                 QType.TQ2_0_PACKED)
BLOCK_LAYOUT: dict[QType, tuple[int, int]] = {
    **{qt: GGML_QUANT_SIZES[_G(qt & 0xFFF)] for qt in _WEIGHT_TYPES}, QType.Q7_K: (256, 276),
    QType.Q7_K_PACKED: (256, 276)}
PACKED_TYPES = {QType.Q4_0: QType.Q4_0_PACKED, QType.Q5_0: QType.Q5_0_PACKED,
                QType.Q8_0: QType.Q8_0_PACKED, QType.Q4_K: QType.Q4_K_PACKED,
                QType.Q6_K: QType.Q6_K_PACKED, QType.IQ4_NL: QType.IQ4_NL_PACKED,
                QType.IQ4_XS: QType.IQ4_XS_PACKED, QType.MXFP4: QType.MXFP4_PACKED,
                QType.Q7_K: QType.Q7_K_PACKED, QType.Q2_K: QType.Q2_K_PACKED,
                QType.TQ2_0: QType.TQ2_0_PACKED}

FLOAT_TYPES = frozenset({QType.F32, QType.F16, QType.BF16})
BLOCK32_TYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
                           QType.IQ4_NL, QType.MXFP4})
# the types dotted with a Q8_K activation (ggml's vec_dot_type Q8_K)
KQUANT_TYPES = frozenset({QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
                          QType.Q4_K_PACKED, QType.Q6_K_PACKED, QType.Q7_K, QType.Q7_K_PACKED,
                          QType.IQ4_XS,
                          QType.IQ4_XS_PACKED,
                          QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S,
                          QType.IQ1_S, QType.IQ1_M, QType.TQ1_0, QType.TQ2_0,
                          QType.Q2_K_PACKED, QType.TQ2_0_PACKED})
# minfer's own layouts, made from a file's weights (never read from a file)
DERIVED_TYPES = frozenset({QType.Q4_0_PACKED, QType.Q5_0_PACKED, QType.Q8_0_PACKED,
                           QType.Q4_K_PACKED, QType.Q6_K_PACKED, QType.IQ4_NL_PACKED,
                           QType.IQ4_XS_PACKED, QType.MXFP4_PACKED, QType.Q7_K,
                           QType.Q7_K_PACKED, QType.Q2_K_PACKED, QType.TQ2_0_PACKED})


# the GGML types a file's weights may have (what `qtype_of` accepts from a file), by name
RUNNABLE_TYPE_NAMES = tuple(qt.name for qt in _WEIGHT_TYPES if qt not in DERIVED_TYPES)


def type_name(qtype: int) -> str:
    """A GGML type id's name (`#id` for an id GGML does not know)."""
    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"#{int(qtype)}"


def qtype_of(qtype: int) -> QType:
    """The QType for a GGML type id; anything the kernels cannot run is refused by name."""
    try:
        qt = QType(int(qtype))
    except ValueError:
        raise ModelError(f"tensor type {type_name(qtype)} is not supported by the CPU "
                         "kernels") from None
    if qt not in BLOCK_LAYOUT:
        raise ModelError(f"tensor type {qt.name} is not supported as a CPU weight")
    return qt


def row_bytes(qtype: int, n_in: int) -> int:
    """Bytes of one row of `n_in` values stored as `qtype`."""
    block, size = BLOCK_LAYOUT[qtype_of(qtype)]
    if n_in % block:
        raise ModelError(f"row length {n_in} is not a multiple of the {QType(qtype).name} "
                         f"block size {block}")
    return n_in // block * size


def weight_view(w: np.ndarray, qtype: int) -> tuple[np.ndarray, int]:
    """Normalise a weight to what the kernels take, and return it with its row length n_in.

    Quantized: `uint8[n_out, row_bytes]`. F32: `float32[n_out, n_in]`. F16 and BF16:
    `uint16[n_out, n_in]` bit patterns. A float weight may also arrive as raw bytes (uint8).
    """
    qt = qtype_of(qtype)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D, got shape {w.shape}")
    if w.strides[1] != w.itemsize:
        raise ValueError("weight rows must be contiguous")
    if qt in FLOAT_TYPES:
        want = np.dtype(np.float32) if qt is QType.F32 else np.dtype(np.uint16)
        if w.dtype == np.uint8 or (qt is QType.F16 and w.dtype == np.float16):
            w = w.view(want)
        if w.dtype != want:
            raise ValueError(f"{qt.name} weight has dtype {w.dtype}")
        return w, w.shape[1]
    if w.dtype != np.uint8:
        raise ValueError(f"{qt.name} weight must be uint8 block bytes, got {w.dtype}")
    block, size = BLOCK_LAYOUT[qt]
    if w.shape[1] % size:
        raise ValueError(f"{qt.name} row of {w.shape[1]} bytes is not whole blocks of {size}")
    return w, w.shape[1] // size * block
