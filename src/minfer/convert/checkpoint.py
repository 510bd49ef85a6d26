"""Safetensors checkpoints read through numpy memory maps: one tensor materialised at a time.

The format is an 8-byte little-endian header length, a JSON header (name → dtype, shape,
data_offsets) and the raw little-endian data. Tensors come back as zero-copy views of the
mapping (BF16 widened to float32 only when `load` is called), so converting a checkpoint never
holds more than the tensor in hand. Part files (`model-0000i-of-0000N.safetensors`) are read in
sorted order and, within a file, tensors in name order — the order llama.cpp's converter uses.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minfer.errors import MinferError

_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I64": "<i8", "I32": "<i4",
           "I16": "<i2", "I8": "<i1", "U8": "<u1", "BOOL": "<u1"}


class CheckpointError(MinferError):
    """A Hugging Face checkpoint that cannot be converted: names the file and the problem."""


@dataclass(frozen=True)
class SafeTensor:
    """One tensor of a checkpoint: where its bytes are and how to read them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int

    def load(self, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor (or its rows [r0, r1)) as float32 (floats) or its own integer dtype,
        shaped like in torch; a fresh array, the mapping is dropped before returning."""
        if self.dtype not in _DTYPES:
            raise CheckpointError(f"{self.path.name}: tensor {self.name!r} has dtype "
                                  f"{self.dtype}, which minfer does not convert")
        r0, r1 = rows if rows is not None else (0, self.shape[0] if self.shape else 1)
        row_bytes = (self.end - self.start) // max(1, self.shape[0] if self.shape else 1)
        shape = (r1 - r0, *self.shape[1:]) if self.shape else ()
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start + r0 * row_bytes,
                        shape=(max(1, (r1 - r0) * row_bytes),))
        data = raw.view(_DTYPES[self.dtype]).reshape(shape)
        if self.dtype == "BF16":  # widen in place: one f32 array, no temporaries
            out = np.empty(shape, dtype=np.uint32)
            out[...] = data
            out <<= 16
            return out.view(np.float32)
        if data.dtype.kind == "f":
            return data.astype(np.float32)
        return np.array(data)


def _read_header(path: Path) -> list[SafeTensor]:
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            size = path.stat().st_size
            if n > size - 8:
                raise CheckpointError(f"{path}: header length {n} runs past the file")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
    base = 8 + n
    tensors = []
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        start, end = (base + int(o) for o in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        itemsize = np.dtype(_DTYPES.get(info["dtype"], "<u1")).itemsize
        if end > size or end - start != math.prod(shape) * itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent offsets")
        tensors.append(SafeTensor(name, info["dtype"], shape, path, start, end))
    return tensors


def checkpoint_tensors(model_dir: Path) -> list[SafeTensor]:
    """Every tensor of the checkpoint in `model_dir`, in llama.cpp's converter order."""
    parts = sorted(p for p in model_dir.glob("*.safetensors") if p.name.startswith("model"))
    if not parts:
        parts = sorted(model_dir.glob("*.safetensors"))
    if not parts:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (only safetensors "
                              "checkpoints are converted)")
    return [t for p in parts for t in _read_header(p)]
