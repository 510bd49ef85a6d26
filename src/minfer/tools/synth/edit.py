"""Rewriting a GGUF with one defect (metadata changed or dropped, tensors left out), for tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from minfer.gguf.parse import StringArray
from minfer.gguf.reader import GGUFFile

_ARRAY_TYPES = {"b": gguf.GGUFValueType.BOOL, "i": gguf.GGUFValueType.INT32,
                "u": gguf.GGUFValueType.UINT32, "f": gguf.GGUFValueType.FLOAT32}


def _value_type(value: Any) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None, Any]:
    """(type, element type, packable value) for a metadata value as GGUFFile returns it."""
    if isinstance(value, StringArray):
        return gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, value.tolist()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, value
    if isinstance(value, np.ndarray):
        return gguf.GGUFValueType.ARRAY, _ARRAY_TYPES[value.dtype.kind], value.tolist()
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL, None, value
    if isinstance(value, int):
        fits = 0 <= value < 1 << 32
        return (gguf.GGUFValueType.UINT32 if fits else gguf.GGUFValueType.INT64), None, value
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32, None, value
    return gguf.GGUFValueType.STRING, None, str(value)


def copy_gguf(src: str | Path, dst: str | Path, *, metadata: Mapping[str, Any] | None = None,
              drop_tensors: Sequence[str] = ()) -> Path:
    """Rewrite a GGUF with some metadata changed (a value of None drops the key) and some
    tensors left out: for tests that need one specific defect. Integer keys become UINT32
    (INT64 when out of range), floats FLOAT32."""
    changes = dict(metadata or {})
    with GGUFFile.open(src) as f:
        meta = {**f.metadata, **changes}
        w = gguf.GGUFWriter(dst, str(meta.get("general.architecture") or ""))
        w.kv_data[0].clear()  # the writer pre-adds general.architecture; keep meta's order
        for key, value in meta.items():
            if value is None:
                continue
            if key == "general.alignment":
                w.add_custom_alignment(int(value))
                continue
            vtype, sub_type, packable = _value_type(value)
            w.add_key_value(key, packable, vtype, sub_type)
        for name, t in f.tensors.items():
            if name not in drop_tensors:
                byte_shape = (*t.shape[:0:-1], t.row_bytes)  # reversed ne, ne0 in bytes
                w.add_tensor(name, np.array(f.raw(name)).reshape(byte_shape),
                             raw_dtype=QType(t.ggml_type))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(dst)
