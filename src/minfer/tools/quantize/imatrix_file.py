"""Importance-matrix files as llama.cpp writes and reads them (`llama-imatrix`, `llama-quantize`).

An importance matrix holds, per weight matrix a model multiplies by, the sum over the tokens
seen of each input column's squared activation (`in_sum2`, one row per expert of a stacked
3-D tensor) and how many rows were summed (`counts`, per expert).

- The GGUF format (llama-imatrix's default): `general.type` = "imatrix", `imatrix.datasets`
  (strings), `imatrix.chunk_count`, `imatrix.chunk_size` (u32), and per matrix NAME the f32
  tensors `NAME.in_sum2` [n_mat, n] and `NAME.counts` [n_mat, 1], names sorted. `write_gguf`
  lays it out as ggml's gguf_write_to_file does (version 3, 32-byte alignment).
- The legacy `.dat` (llama-imatrix `--output-format dat`): i32 n_entries, then per entry i32
  name length, the name, i32 ncall, i32 nval, f32 values[nval] (mean squares times ncall), then
  optionally i32 chunk count, i32 dataset length and the dataset name. `write_legacy` writes it
  as save_imatrix_legacy does: entries that saw no row left out, names sorted, ncall the
  largest count over the chunk size rounded up, an expert that saw no row stored as 1.

`Imatrix.quant_weights()` is what llama-quantize hands ggml's quantizers: per matrix the mean
squared activation (sum / count per expert; 1 where an expert saw no rows; a legacy value
divided by its ncall).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from minfer.errors import MinferError

from .gguf_out import pad

ALIGNMENT = 32


@dataclass
class Entry:
    sums: np.ndarray  # [n_mat * n] f32
    counts: np.ndarray  # [n_mat] int64


@dataclass
class Imatrix:
    entries: dict[str, Entry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False
    has_metadata: bool = True

    def quant_weights(self) -> dict[str, np.ndarray]:
        """name → the f32 importance vector(s) llama-quantize computes from the file."""
        out: dict[str, np.ndarray] = {}
        for name, e in self.entries.items():
            sums = e.sums.astype(np.float32)
            if self.legacy:
                ncall = int(e.counts[0]) if len(e.counts) else 0
                out[name] = sums / np.float32(ncall) if ncall > 0 else sums
                continue
            n = len(sums) // len(e.counts)
            rows = sums.reshape(len(e.counts), n)
            counts = e.counts.astype(np.float32)[:, None]
            out[name] = np.where(counts > 0, rows / np.where(counts > 0, counts, 1),
                                 np.float32(1)).astype(np.float32).reshape(-1)
        return out


def read(path: str | Path) -> Imatrix:
    """A GGUF imatrix, or failing that a legacy .dat one (as common_imatrix_load tries)."""
    path = Path(path)
    try:
        head = path.read_bytes()[:4]
    except OSError as exc:
        raise MinferError(f"cannot read the importance matrix {path}: {exc.strerror}") from None
    return _read_gguf(path) if head == b"GGUF" else _read_legacy(path)


def _read_gguf(path: Path) -> Imatrix:
    from minfer.gguf.reader import GGUFFile

    with GGUFFile.open(path) as f:
        meta = f.metadata
        im = Imatrix(datasets=[str(d) for d in meta.get("imatrix.datasets", [])],
                     chunk_count=int(meta.get("imatrix.chunk_count", 0)),
                     chunk_size=int(meta.get("imatrix.chunk_size", 0)),
                     has_metadata=all(k in meta for k in ("imatrix.datasets",
                                                          "imatrix.chunk_count",
                                                          "imatrix.chunk_size")))
        names = {n.removesuffix(".in_sum2") for n in f.tensors if n.endswith(".in_sum2")}
        names |= {n.removesuffix(".counts") for n in f.tensors if n.endswith(".counts")}
        if not f.tensors:
            raise MinferError(f"no data in the importance matrix {path}")
        for name in sorted(names):
            sums, counts = f.tensors.get(f"{name}.in_sum2"), f.tensors.get(f"{name}.counts")
            if sums is None or counts is None:
                raise MinferError(f"{path}: mismatched sums and counts for {name}")
            if GGMLQuantizationType.F32 not in (sums.ggml_type, counts.ggml_type) or (
                    sums.ggml_type != counts.ggml_type):
                raise MinferError(f"{path}: sums and counts for {name} must be F32")
            im.entries[name] = Entry(
                np.array(f.raw(sums.name).view(np.float32).reshape(-1)),
                np.rint(f.raw(counts.name).view(np.float32).reshape(-1)).astype(np.int64))
    return im


def _read_legacy(path: Path) -> Imatrix:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise MinferError(f"{path} is neither a GGUF nor a legacy .dat importance matrix "
                              "(it ends early)")
        values = struct.unpack_from(fmt, data, pos)
        pos += size
        return values

    (n_entries,) = take("<i")
    if n_entries < 1:
        raise MinferError(f"no data in the importance matrix {path}")
    im = Imatrix(legacy=True)
    for _ in range(n_entries):
        (length,) = take("<i")
        name = data[pos:pos + length].split(b"\0")[0].decode()
        pos += length
        ncall, nval = take("<ii")
        if nval < 1:
            raise MinferError(f"{path}: failed reading the number of values of {name!r}")
        sums = np.frombuffer(data, "<f4", nval, pos).astype(np.float32)
        take(f"<{nval}f")
        im.entries[name] = Entry(sums, np.array([ncall], np.int64))
    if pos + 4 <= len(data):
        (im.chunk_count,) = take("<i")
        if pos + 4 <= len(data):
            (length,) = take("<i")
            if length > 0:
                im.datasets.append(data[pos:pos + length].decode(errors="replace"))
    return im


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path: str | Path, im: Imatrix) -> None:
    """The GGUF imatrix file, laid out as llama-imatrix's gguf_write_to_file writes it."""
    kv = [_string("general.type") + struct.pack("<I", GGUFValueType.STRING) + _string("imatrix"),
          _string("imatrix.datasets") + struct.pack("<IIQ", GGUFValueType.ARRAY,
                                                    GGUFValueType.STRING, len(im.datasets))
          + b"".join(_string(d) for d in im.datasets),
          _string("imatrix.chunk_count") + struct.pack("<II", GGUFValueType.UINT32,
                                                       im.chunk_count),
          _string("imatrix.chunk_size") + struct.pack("<II", GGUFValueType.UINT32,
                                                      im.chunk_size)]
    tensors: list[tuple[str, tuple[int, ...], np.ndarray]] = []
    for name in sorted(im.entries):
        e = im.entries[name]
        n_mat = len(e.counts)
        n = len(e.sums) // n_mat
        tensors.append((f"{name}.in_sum2", (n, n_mat), e.sums.astype("<f4")))
        tensors.append((f"{name}.counts", (1, n_mat), e.counts.astype("<f4")))
    infos = []
    offset = 0
    for name, ne, data in tensors:
        nd = 2 if ne[1] > 1 else 1  # ggml_n_dims: trailing 1s dropped
        infos.append(_string(name) + struct.pack(f"<I{nd}qIQ", nd, *ne[:nd],
                                                 GGMLQuantizationType.F32, offset))
        offset += pad(data.nbytes, ALIGNMENT)
    head = b"".join([b"GGUF", struct.pack("<Iqq", 3, len(tensors), len(kv)), *kv, *infos])
    with open(path, "wb") as out:
        out.write(head + bytes(pad(len(head), ALIGNMENT) - len(head)))
        for _, _, data in tensors:
            out.write(data.tobytes() + bytes(pad(data.nbytes, ALIGNMENT) - data.nbytes))


def write_legacy(path: str | Path, im: Imatrix) -> None:
    """The legacy `.dat` importance matrix, as llama-imatrix's save_imatrix_legacy writes it."""
    chunk = max(im.chunk_size, 1)
    parts: list[bytes] = []
    stored = 0
    for name in sorted(im.entries):
        e = im.entries[name]
        if not len(e.counts) or not e.counts.any():
            continue  # "has no data - skipping"
        stored += 1
        ncall = (int(e.counts.max()) + chunk - 1) // chunk
        n = len(e.sums) // len(e.counts)
        count = np.repeat(e.counts.astype(np.float32), n)
        value = np.where(count == 0, np.float32(1), e.sums.astype(np.float32))
        count = np.where(count == 0, np.float32(1), count)
        tmp = (value / count).astype(np.float32) * np.float32(ncall)
        raw = name.encode()
        parts.append(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, len(e.sums))
                     + tmp.astype("<f4").tobytes())
    dataset = im.datasets[-1].encode() if im.datasets else b""
    with open(path, "wb") as out:
        out.write(struct.pack("<i", stored) + b"".join(parts)
                  + struct.pack("<ii", im.chunk_count, len(dataset)) + dataset)
