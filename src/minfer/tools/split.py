"""Splitting a GGUF into llama.cpp's `-00001-of-0000N.gguf` parts, and merging parts back.

The layout is `llama-gguf-split`'s: the first part carries every metadata pair of the input
followed by `split.no` (u16), `split.count` (u16) and `split.tensors.count` (i32); the other
parts carry only those three keys; every part packs its tensors in input order, each padded
to the alignment. Metadata pairs are copied as raw bytes (never re-encoded), so `merge` —
which drops the `split.*` keys and re-packs the tensors — gives back the input byte for byte
when the input was laid out canonically (tensors packed in order, as gguf-py and llama.cpp
write them). Tensor bytes stream from the mmap'd input one tensor at a time, in chunks, and
their pages are released after copying; outputs appear by rename only once complete.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFValueType

from minfer.errors import GGUFError, MinferError
from minfer.gguf.parse import Cursor
from minfer.gguf.reader import GGUF_MAGIC, GGUFFile, TensorInfo
from minfer.tools.progress import Advance, byte_progress

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_CHUNK = 16 << 20
_SIZE_RE = re.compile(r"^(\d+)([KMG]?)$")
_SIZE_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3}


class SplitError(MinferError):
    """A split or merge that cannot be done (bad limits, an existing output, not a split set)."""


def parse_size(text: str) -> int:
    """`200M`, `4G`, `512K` (decimal units, as llama-gguf-split) or a plain byte count."""
    m = _SIZE_RE.match(text.strip().upper())
    if not m or int(m[1]) <= 0:
        raise SplitError(f"bad size {text!r}: expected a positive number with K, M or G")
    return int(m[1]) * _SIZE_UNITS[m[2]]


def split_path(prefix: str | Path, index: int, count: int) -> Path:
    """llama_split_path: `<prefix>-<index+1:05>-of-<count:05>.gguf`."""
    return Path(f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf")


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _gguf_string(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _kv(key: str, vtype: GGUFValueType, value: int) -> bytes:
    fmt = {GGUFValueType.UINT16: "<H", GGUFValueType.INT32: "<i", GGUFValueType.UINT32: "<I"}
    return _gguf_string(key) + struct.pack("<I", vtype) + struct.pack(fmt[vtype], value)


def raw_metadata(path: Path) -> list[tuple[str, bytes]]:
    """Each metadata pair of a GGUF file as (key, its exact bytes: key, type and value)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = Cursor(memoryview(data), str(path))  # type: ignore[arg-type]
    cur.pos = 16  # magic, version, tensor count
    n_kv = cur.count("metadata", 13)
    pairs = []
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string("metadata key")
        cur.value(cur.u32(f"type of {key!r}"), repr(key))
        pairs.append((key, bytes(cur.buf[start : cur.pos])))
    return pairs


@dataclass(frozen=True)
class Part:
    """One output file: its metadata pairs (raw bytes) and tensors, in order."""

    kvs: tuple[bytes, ...]
    tensors: tuple[TensorInfo, ...]
    alignment: int

    def header(self, version: int) -> bytes:
        out = [GGUF_MAGIC, struct.pack("<IQQ", version, len(self.tensors), len(self.kvs)),
               *self.kvs]
        offset = 0
        for t in self.tensors:
            out += [_gguf_string(t.name), struct.pack("<I", len(t.shape)),
                    struct.pack(f"<{len(t.shape)}Q", *t.shape),
                    struct.pack("<IQ", t.ggml_type, offset)]
            offset += _pad(t.nbytes, self.alignment)
        head = b"".join(out)
        return head + bytes(_pad(len(head), self.alignment) - len(head))

    def size(self, version: int) -> int:
        return len(self.header(version)) + sum(_pad(t.nbytes, self.alignment)
                                               for t in self.tensors)


def plan_split(tensors: list[TensorInfo], *, max_bytes: int | None = None,
               max_tensors: int | None = None, alignment: int = GGUF_DEFAULT_ALIGNMENT,
               no_tensor_first: bool = False) -> list[list[TensorInfo]]:
    """Group tensors into parts as llama-gguf-split does (a new part when the padded tensor
    bytes would pass max_bytes, or every max_tensors tensors); one part never starts empty."""
    if (max_bytes is None) == (max_tensors is None):
        raise SplitError("give exactly one of --split-max-size and --split-max-tensors")
    if max_tensors is not None and max_tensors <= 0:
        raise SplitError(f"--split-max-tensors must be positive, got {max_tensors}")
    groups: list[list[TensorInfo]] = [[], []] if no_tensor_first else [[]]
    size = 0
    for i, t in enumerate(tensors):
        n = _pad(t.nbytes, alignment)
        if max_bytes is not None:
            new = size + n > max_bytes and bool(groups[-1])
        else:
            new = i > 0 and i % (max_tensors or 1) == 0
        if new:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def _split_kvs(no: int, count: int, n_tensors: int) -> list[bytes]:
    return [_kv("split.no", GGUFValueType.UINT16, no),
            _kv("split.count", GGUFValueType.UINT16, count),
            _kv("split.tensors.count", GGUFValueType.INT32, n_tensors)]


def split_parts(src: GGUFFile, groups: list[list[TensorInfo]]) -> list[Part]:
    """The parts for a plan: all metadata in the first, only the split keys in the others."""
    meta = [raw for key, raw in raw_metadata(src.path) if key not in SPLIT_KEYS]
    alignment = int(src.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    n, total = len(groups), len(src.tensors)
    later_extra = [] if alignment == GGUF_DEFAULT_ALIGNMENT else [
        _kv("general.alignment", GGUFValueType.UINT32, alignment)]
    return [Part(tuple((meta if i == 0 else later_extra) + _split_kvs(i, n, total)),
                 tuple(g), alignment) for i, g in enumerate(groups)]


def _copy_tensor(src: GGUFFile, t: TensorInfo, out: BinaryIO, alignment: int,
                 advance: Advance) -> None:
    flat = src.raw(t.name).reshape(-1)
    for start in range(0, t.nbytes, _CHUNK):
        out.write(memoryview(flat[start : start + _CHUNK]))  # type: ignore[arg-type]
        advance(min(_CHUNK, t.nbytes - start))
    out.write(bytes(_pad(t.nbytes, alignment) - t.nbytes))
    src.release(t.name)


@contextlib.contextmanager
def _publishing(finals: list[Path]) -> Iterator[list[Path]]:
    """Yield `.partial` paths for finals; rename them into place only if the body succeeds."""
    partials = [p.with_name(p.name + ".partial") for p in finals]
    try:
        yield partials
    except BaseException:
        for p in partials:
            with contextlib.suppress(OSError):
                p.unlink()
        raise
    for partial, final in zip(partials, finals, strict=True):
        os.replace(partial, final)


def write_parts(src: GGUFFile, parts: list[Part], paths: list[Path], *,
                progress: bool = True, label: str = "write") -> None:
    """Write each part (header, then its tensors streamed from src) to its path, atomically."""
    for p in paths:
        if p.exists():
            raise SplitError(f"{p} already exists; not overwriting it")
    total = sum(part.size(src.version) for part in parts)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    with _publishing(paths) as partials, byte_progress(label, total, enabled=progress) as adv:
        for part, path in zip(parts, partials, strict=True):
            try:
                with path.open("wb") as out:
                    head = part.header(src.version)
                    out.write(head)
                    adv(len(head))
                    for t in part.tensors:
                        _copy_tensor(src, t, out, part.alignment, adv)
            except OSError as exc:
                raise SplitError(f"cannot write {path}: {exc.strerror or exc}") from None


def _open(path: Path) -> GGUFFile:
    if not path.is_file():
        raise GGUFError(path, "no such file")
    return GGUFFile.open(path)


def split_gguf(src_path: str | Path, out_prefix: str | Path, *, max_bytes: int | None = None,
               max_tensors: int | None = None, no_tensor_first: bool = False,
               dry_run: bool = False, progress: bool = True) -> list[tuple[Path, Part]]:
    """Split src into `<out_prefix>-0000i-of-0000N.gguf`; return (path, part) per part."""
    prefix = str(out_prefix).removesuffix(".gguf")
    with _open(Path(src_path)) as src:
        alignment = int(src.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        groups = plan_split(list(src.tensors.values()), max_bytes=max_bytes,
                            max_tensors=max_tensors, alignment=alignment,
                            no_tensor_first=no_tensor_first)
        parts = split_parts(src, groups)
        paths = [split_path(prefix, i, len(parts)) for i in range(len(parts))]
        if not dry_run:
            write_parts(src, parts, paths, progress=progress, label=f"split {src.path.name}")
    return list(zip(paths, parts, strict=True))


def merge_gguf(first_part: str | Path, out_path: str | Path, *, progress: bool = True) -> Path:
    """Merge a split set (given its first part) into one GGUF without the split keys."""
    first_part, out = Path(first_part), Path(out_path)
    with _open(first_part) as src:
        if int(src.metadata.get("split.count", 0)) <= 1:
            raise SplitError(f"{first_part} is not a split set (no split.count > 1)")
        meta = tuple(raw for key, raw in raw_metadata(first_part) if key not in SPLIT_KEYS)
        alignment = int(src.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        part = Part(meta, tuple(src.tensors.values()), alignment)
        write_parts(src, [part], [out], progress=progress, label=f"merge {first_part.name}")
    return out
