"""The quantized file's header, laid out byte for byte as llama.cpp's quantizer writes it.

llama.cpp copies the source's metadata in order (its raw entries, so every value keeps its
type), drops the split keys, and appends `general.quantization_version` (2) and
`general.file_type`, moving them to the end when the source already had them. Tensor infos
follow in quantization order with ggml's n_dims (trailing 1s dropped) and offsets padded to the
alignment; tensor data then follows, each tensor padded with zeros to the alignment.
Knowing every tensor's new type up front, the whole header is written first and the data is
streamed after it, tensor by tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from minfer.gguf.parse import Cursor

GGML_QNT_VERSION = 2
GGUF_VERSION = 3
DROPPED_KEYS = frozenset({"split.no", "split.count", "split.tensors.count",
                          "general.quantization_version", "general.file_type"})


@dataclass(frozen=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]  # ne order
    qtype: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        n = 1
        for d in self.shape:
            n *= d
        return n // block * type_size


def raw_kv_entries(path: str | Path) -> list[tuple[str, bytes]]:
    """Every metadata entry of a GGUF file as (key, its exact bytes: key, type and value)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = Cursor(memoryview(data), str(path))  # type: ignore[arg-type]
    cur.pos = 8
    cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    entries = []
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string("metadata key")
        cur.value(cur.u32(f"type of {key!r}"), repr(key))
        entries.append((key, bytes(cur.buf[start:cur.pos])))
    return entries


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def u32_kv(key: str, value: int) -> tuple[str, bytes]:
    return key, _string(key) + struct.pack("<II", GGUFValueType.UINT32, value)


def str_kv(key: str, value: str) -> tuple[str, bytes]:
    return key, _string(key) + struct.pack("<I", GGUFValueType.STRING) + _string(value)


def pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _n_dims(shape: Sequence[int]) -> int:
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


def header_bytes(kv: Sequence[tuple[str, bytes]], tensors: Sequence[OutTensor], *,
                 file_type: int, alignment: int,
                 extra: Sequence[tuple[str, bytes]] = ()) -> bytes:
    """Header, metadata and tensor infos, zero-padded to the alignment (data starts after).
    extra: entries set after the file type (llama-quantize's kv_overrides), each replacing a
    source entry of its key by moving it to the end, as gguf_set_val does."""
    replaced = DROPPED_KEYS | {key for key, _ in extra}
    entries = [raw for key, raw in kv if key not in replaced]
    entries.append(u32_kv("general.quantization_version", GGML_QNT_VERSION)[1])
    entries.append(u32_kv("general.file_type", file_type)[1])
    entries += [raw for _, raw in extra]
    parts = [b"GGUF", struct.pack("<Iqq", GGUF_VERSION, len(tensors), len(entries)), *entries]
    offset = 0
    for t in tensors:
        nd = _n_dims(t.shape)
        parts.append(_string(t.name) + struct.pack(f"<I{nd}qIQ", nd, *t.shape[:nd], t.qtype,
                                                   offset))
        offset += pad(t.nbytes, alignment)
    head = b"".join(parts)
    return head + bytes(pad(len(head), alignment) - len(head))
