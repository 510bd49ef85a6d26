"""A small lazy GGUF reader: header and metadata parsed once, tensors as zero-copy memmap views.

Owns opening a GGUF file (v2 or v3, or a split set `name-00001-of-0000N.gguf` merged into one
tensor index), validating its tensor table against the file's size, and handing out tensor
bytes. Metadata parsing lives in `parse.py`; hyper-parameters in `hparams.py`.
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import GGUFError
from minfer.gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType
from minfer.gguf.parse import Cursor

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# Element dtypes of the tensor types `GGUFFile.array` returns as typed views (BF16 as raw uint16).
_PLAIN_DTYPES: dict[int, str] = {
    GGMLQuantizationType.F32: "<f4",
    GGMLQuantizationType.F16: "<f2",
    GGMLQuantizationType.BF16: "<u2",
    GGMLQuantizationType.F64: "<f8",
    GGMLQuantizationType.I8: "<i1",
    GGMLQuantizationType.I16: "<i2",
    GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` in GGUF ne order, `offset` absolute within its part file."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    part: int

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.n_rows if self.n_rows else 0

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


@dataclass
class _Part:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data: np.memmap


def _tensor_nbytes(ggml_type: int, shape: tuple[int, ...], name: str, cur: Cursor) -> int:
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise cur.fail(f"tensor {name!r} has unknown type {ggml_type}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise cur.fail(f"tensor {name!r} has unsupported type {qtype.name}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape[0] % block:
        raise cur.fail(f"tensor {name!r}: ne0={shape[0]} is not a multiple of the "
                       f"{qtype.name} block size {block}")
    return math.prod(shape) // block * type_size


def _read_tensor_info(cur: Cursor) -> tuple[str, int, tuple[int, ...], int]:
    name = cur.string("tensor name")
    n_dims = cur.u32(f"dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
    shape = tuple(cur.u64(f"shape of tensor {name!r}") for _ in range(n_dims))
    if any(d == 0 for d in shape):
        raise cur.fail(f"tensor {name!r} has an empty dimension {shape}")
    ggml_type = cur.u32(f"type of tensor {name!r}")
    offset = cur.u64(f"offset of tensor {name!r}")
    return name, ggml_type, shape, offset


def _parse_part(path: Path, part_no: int) -> _Part:
    """Parse one GGUF file: header, metadata, tensor table, all checked against its size."""
    try:
        size = path.stat().st_size
        if size < 24:
            raise GGUFError(path, f"truncated: {size} bytes is too short for a GGUF header")
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as exc:
        raise GGUFError(path, exc.strerror or str(exc)) from None
    cur = Cursor(memoryview(data), str(path))  # type: ignore[arg-type]
    if bytes(cur.buf[:4]) != GGUF_MAGIC:
        raise cur.fail(f"not a GGUF file (magic {bytes(cur.buf[:4])!r})")
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail(f"unsupported GGUF version {version} (minfer reads 2 and 3)")
    n_tensors = cur.count("tensor table", 24)
    n_kv = cur.count("metadata", 13)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        metadata[key] = cur.value(cur.u32(f"type of {key!r}"), repr(key))
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment={alignment!r} is not a power of two")
    raw_infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, ggml_type, shape, offset in raw_infos:
        nbytes = _tensor_nbytes(ggml_type, shape, name, cur)
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} offset {offset} is not aligned to {alignment}")
        start = data_start + offset
        if start + nbytes > size:
            raise cur.fail(f"tensor {name!r} data ({nbytes} bytes at {start}) runs past the "
                           f"end of the file ({size} bytes)")
        tensors.append(TensorInfo(name, ggml_type, shape, start, nbytes, part_no))
    return _Part(path, version, metadata, tensors, data)


def _split_field(path: Path, meta: Mapping[str, Any], key: str, default: int) -> int:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 100000:
        raise GGUFError(path, f"{key}={value!r} is not a valid split number")
    return value


def _split_paths(path: Path, meta: Mapping[str, Any]) -> list[Path]:
    """All part paths of the split set whose first part is `path` ([path] if not split)."""
    count = _split_field(path, meta, "split.count", 1)
    if count <= 1:
        return [path]
    m = _SPLIT_RE.match(path.name)
    if not m or int(m["count"]) != count:
        raise GGUFError(path, f"split.count={count} but the name is not "
                              f"'<name>-00001-of-{count:05d}.gguf'")
    split_no = _split_field(path, meta, "split.no", 0)
    if split_no != 0:
        first = f"{m['stem']}-00001-of-{count:05d}.gguf"
        raise GGUFError(path, f"is part {split_no + 1} of a split set; open {first}")
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """An open GGUF model (one file or a merged split set). Create with `GGUFFile.open(path)`."""

    def __init__(self, parts: list[_Part]) -> None:
        self._parts = parts
        self.path: Path = parts[0].path
        self.version: int = parts[0].version
        self.metadata: Mapping[str, Any] = parts[0].metadata
        self.file_size: int = sum(len(p.data) for p in parts)
        self.tensors: dict[str, TensorInfo] = {}
        for part in parts:
            for t in part.tensors:
                if t.name in self.tensors:
                    raise GGUFError(part.path, f"duplicate tensor {t.name!r}")
                self.tensors[t.name] = t

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        first = _parse_part(path, 0)
        paths = _split_paths(path, first.metadata)
        parts = [first]
        for i, p in enumerate(paths[1:], start=1):
            if not p.is_file():
                raise GGUFError(path, f"split part {p.name} is missing")
            part = _parse_part(p, i)
            if part.metadata.get("split.no") != i:
                raise GGUFError(p, f"split.no is {part.metadata.get('split.no')}, expected {i}")
            parts.append(part)
        f = cls(parts)
        declared = first.metadata.get("split.tensors.count")
        if len(paths) > 1 and declared is not None and declared != len(f.tensors):
            raise GGUFError(path, f"split.tensors.count={declared} but the parts hold "
                                  f"{len(f.tensors)} tensors")
        return f

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop this object's mappings (views handed out keep theirs alive)."""
        self._parts = []

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def _info(self, name: str) -> TensorInfo:
        if not self._parts:
            raise GGUFError(self.path, "the file has been closed")
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(self.path, f"no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy read-only uint8 view of a tensor's bytes, shaped [n_rows, row_bytes]."""
        t = self._info(name)
        flat = self._parts[t.part].data[t.offset : t.offset + t.nbytes]
        return np.asarray(flat).reshape(t.n_rows, t.row_bytes)

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        """Drop this process's hold on a tensor's pages, or on those of its rows [r0, r1)
        (MADV_DONTNEED on the read-only file mapping: they leave the RSS; a later read faults
        them back in from the page cache). For a tensor a backend has copied into its own
        layout. Releasing rows in order releases every page the rows cover: a page shared
        with rows before r0 goes with them, one shared with other tensors never."""
        t = self._info(name)
        mm = getattr(self._parts[t.part].data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        first = -(-t.offset // page) * page
        r0, r1 = rows if rows is not None else (0, t.n_rows)
        start = max(first, (t.offset + r0 * t.row_bytes) // page * page) if r0 else first
        end = (t.offset + r1 * t.row_bytes) // page * page
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy typed view of an unquantized tensor, shaped reversed-ne (BF16 as uint16)."""
        t = self._info(name)
        if t.ggml_type not in _PLAIN_DTYPES:
            raise GGUFError(self.path, f"tensor {name!r} is {t.type_name}; use raw() for "
                                       "quantized tensors")
        flat = self._parts[t.part].data[t.offset : t.offset + t.nbytes]
        return np.asarray(flat).view(_PLAIN_DTYPES[t.ggml_type]).reshape(t.shape[::-1])

    def type_census(self) -> dict[str, int]:
        """How many tensors of each type, most common first."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"
