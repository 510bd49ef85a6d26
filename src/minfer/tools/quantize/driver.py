"""`quantize_model`: read a GGUF, choose every tensor's type, stream the quantized file out.

One tensor at a time, in slabs of rows (at most ~32 MiB of f32 each): read the source rows
(memory-mapped, released after use), convert them to f32 (F16/BF16 exactly; quantized sources
only with `allow_requantize`, through minfer's dequantizers), quantize in parallel, append.
The header goes first (`gguf_out`), so memory stays a few slabs whatever the model's size.
The output is written to `OUT.part` and renamed when complete: a failure leaves no half file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from minfer.errors import MinferError
from minfer.gguf.reader import GGUFFile, TensorInfo

from .gguf_out import OutTensor, header_bytes, pad, raw_kv_entries
from .mix import MixOptions, ModelShape, choose_types, tensor_order
from .rows import QuantizeError, quantize_rows

QT = GGMLQuantizationType
SLAB_BYTES = 32 << 20
_FLOATS = frozenset({QT.F32, QT.F16, QT.BF16})

# progress(name, index, count, new_type): called before each tensor.
Progress = Callable[[str, int, int, QT], None]


@dataclass
class QuantizeReport:
    """What a run did: per-tensor (source type, new type), sizes and time."""

    types: dict[str, tuple[QT, QT]] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0


def model_shape(f: GGUFFile) -> ModelShape:
    meta = f.metadata
    arch = f.architecture

    def first_int(key: str, default: int) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, np.ndarray):
            value = value[0] if len(value) else default
        return int(value)

    n_head = first_int("attention.head_count", 0)
    return ModelShape(arch=arch, n_layer=first_int("block_count", 0), n_head=n_head,
                      n_head_kv=first_int("attention.head_count_kv", n_head),
                      n_expert=first_int("expert_count", 0))


def _to_f32(f: GGUFFile, t: TensorInfo, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of a tensor as f32 [rows, ne0]."""
    raw = f.raw(t.name)[r0:r1]
    qt = QT(t.ggml_type)
    if qt == QT.F32:
        return raw.view(np.float32)
    if qt == QT.F16:
        return raw.view(np.float16).astype(np.float32)
    if qt == QT.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    from minfer.backends.cpu.kernels.quant.dequant import dequantize

    try:
        return dequantize(raw, qt, t.shape[0])
    except (MinferError, ValueError) as exc:
        raise QuantizeError(f"{t.name}: minfer cannot dequantize {qt.name} to requantize it "
                            f"({exc})") from None


def plan(f: GGUFFile, opts: MixOptions, *, allow_requantize: bool) -> list[OutTensor]:
    """Every tensor in llama.cpp's order with its new type; refuses requantizing unless asked."""
    order = tensor_order(list(f.tensors))
    infos = [f.tensors[n] for n in order]
    types = choose_types([(t.name, t.shape, QT(t.ggml_type)) for t in infos], model_shape(f),
                         opts)
    for t in infos:
        cur = QT(t.ggml_type)
        if types[t.name] != cur and cur not in _FLOATS and not allow_requantize:
            raise QuantizeError(
                f"{t.name} is already quantized ({cur.name}); requantizing loses quality, so "
                "it is refused unless --allow-requantize is given (better: start from an "
                "F32/F16/BF16 file)")
    return [OutTensor(t.name, t.shape, types[t.name]) for t in infos]


def _write_tensor(f: GGUFFile, t: TensorInfo, new: QT, out: object) -> int:
    write = out.write  # type: ignore[attr-defined]
    ne0 = t.shape[0]
    step = max(1, SLAB_BYTES // (4 * ne0))
    written = 0
    for r0 in range(0, t.n_rows, step):
        r1 = min(t.n_rows, r0 + step)
        if new == QT(t.ggml_type):
            chunk = f.raw(t.name)[r0:r1]
        else:
            chunk = quantize_rows(_to_f32(f, t, r0, r1), new, name=t.name)
        write(np.ascontiguousarray(chunk).data)
        written += chunk.nbytes
        f.release(t.name, (r0, r1))
    return written


def quantize_model(src: str | Path, dst: str | Path, opts: MixOptions, *,
                   allow_requantize: bool = False,
                   progress: Progress | None = None) -> QuantizeReport:
    """Write `dst`: `src` quantized as llama.cpp's `llama_model_quantize` would (no imatrix)."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise QuantizeError("the output file must differ from the input file")
    start = time.perf_counter()
    report = QuantizeReport()
    with GGUFFile.open(src) as f:
        tensors = plan(f, opts, allow_requantize=allow_requantize)
        alignment = int(f.metadata.get("general.alignment", 32))
        head = header_bytes(raw_kv_entries(f.path), tensors, file_type=int(opts.ftype),
                            alignment=alignment)
        part = dst.with_name(dst.name + ".part")
        try:
            with open(part, "wb") as out:
                out.write(head)
                for i, ot in enumerate(tensors):
                    t = f.tensors[ot.name]
                    if progress is not None:
                        progress(ot.name, i, len(tensors), ot.qtype)
                    n = _write_tensor(f, t, ot.qtype, out)
                    if n != ot.nbytes:
                        raise QuantizeError(f"{ot.name}: wrote {n} bytes, expected {ot.nbytes}")
                    out.write(bytes(pad(n, alignment) - n))
                    report.types[ot.name] = (QT(t.ggml_type), ot.qtype)
                    report.bytes_in += t.nbytes
                    report.bytes_out += n
            os.replace(part, dst)
        finally:
            part.unlink(missing_ok=True)
    report.seconds = time.perf_counter() - start
    return report
