"""`quantize_model`: read a GGUF, choose every tensor's type, stream the quantized file out.

One tensor at a time, in slabs of rows (at most ~32 MiB of f32 each): read the source rows
(memory-mapped, released after use), convert them to f32 (F16/BF16 exactly; quantized sources
only with `allow_requantize`, through minfer's dequantizers), quantize in parallel, append.
The header goes first (`gguf_out`), so memory stays a few slabs whatever the model's size.
The output is written to `OUT.part` and renamed when complete: a failure leaves no half file.
With an importance matrix (`imatrix`: a file `imatrix_file` reads) each tensor it names is
quantized by ggml's weighted quantizers (`rows.quantize_rows(imatrix=…)`, each expert of a
stacked tensor by its own vector), the mix's imatrix rules apply, and the header gains
llama-quantize's `quantize.imatrix.*` entries. As llama-quantize, it refuses the lowest-bit
i-quants (IQ2_XXS, IQ3_XXS) without an importance matrix, or for a tensor the matrix lacks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from minfer.errors import MinferError
from minfer.gguf.reader import GGUFFile, TensorInfo

from .gguf_out import OutTensor, header_bytes, pad, raw_kv_entries, str_kv, u32_kv
from .imatrix_file import Imatrix, read
from .mix import MixOptions, ModelShape, choose_types, requires_imatrix, tensor_order
from .rows import SUPPORTED, QuantizeError, quantize_rows

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
        new = types[t.name]
        if new != cur and new not in SUPPORTED:
            raise QuantizeError(f"{t.name}: the mix puts it at {new.name}, which minfer cannot "
                                "quantize to yet (name another type with --tensor-type)")
        if new != cur and not opts.imatrix and requires_imatrix(t.name, new):
            raise QuantizeError(f"this quantization requires an importance matrix (--imatrix): "
                                f"{t.name} would be {new.name}")
        if new != cur and cur not in _FLOATS and not allow_requantize:
            raise QuantizeError(
                f"{t.name} is already quantized ({cur.name}); requantizing loses quality, so "
                "it is refused unless --allow-requantize is given (better: start from an "
                "F32/F16/BF16 file)")
    return [OutTensor(t.name, t.shape, types[t.name]) for t in infos]


def _importance(weights: dict[str, np.ndarray] | None, t: TensorInfo) -> np.ndarray | None:
    """The tensor's importance vectors [n_mat, ne0], as llama-quantize finds them: none when
    the file lacks the tensor; a size that is not ne0 x n_mat refused (but for token_embd,
    which is quantized without)."""
    if weights is None or t.name not in weights:
        return None
    qw = weights[t.name]
    n_mat = t.shape[2] if len(t.shape) > 2 else 1
    if qw.size != t.shape[0] * n_mat:
        if t.name in ("token_embd.weight", "per_layer_token_embd.weight"):
            return None
        raise QuantizeError(f"imatrix size {qw.size} is different from tensor size "
                            f"{t.shape[0] * n_mat} for {t.name}")
    return qw.reshape(n_mat, t.shape[0])


def _write_tensor(f: GGUFFile, t: TensorInfo, new: QT, out: object,
                  qw: np.ndarray | None = None) -> int:
    write = out.write  # type: ignore[attr-defined]
    ne0 = t.shape[0]
    step = max(1, SLAB_BYTES // (4 * ne0))
    written = 0
    for r0 in range(0, t.n_rows, step):
        r1 = min(t.n_rows, r0 + step)
        if new == QT(t.ggml_type):
            chunk = f.raw(t.name)[r0:r1]
        else:
            chunk = quantize_rows(_to_f32(f, t, r0, r1), new, name=t.name, imatrix=qw,
                                  first_row=r0, rows_per_mat=t.shape[1] if qw is not None
                                  else 0)
        write(np.ascontiguousarray(chunk).data)
        written += chunk.nbytes
        f.release(t.name, (r0, r1))
    return written


def imatrix_entries(path: str, im: Imatrix) -> list[tuple[str, bytes]]:
    """The metadata llama-quantize adds for an importance matrix (its kv_overrides: strings
    cut to 127 bytes, integers as u32)."""
    entries = [str_kv("quantize.imatrix.file", path[:127])]
    if im.datasets:
        entries.append(str_kv("quantize.imatrix.dataset", im.datasets[0][:127]))
    entries.append(u32_kv("quantize.imatrix.entries_count", len(im.entries)))
    if im.chunk_count > 0:
        entries.append(u32_kv("quantize.imatrix.chunks_count", im.chunk_count))
    return entries


def load_imatrix(path: str | Path) -> tuple[Imatrix, dict[str, np.ndarray]]:
    """The file and the importance vectors llama-quantize derives from it (checked finite)."""
    im = read(path)
    if not im.legacy and not im.has_metadata:
        raise QuantizeError(f"missing imatrix metadata in file {path}")
    weights = im.quant_weights()
    for name, qw in weights.items():
        if not np.isfinite(qw).all():
            raise QuantizeError(f"imatrix contains non-finite values ({name})")
    return im, weights


def quantize_model(src: str | Path, dst: str | Path, opts: MixOptions, *,
                   allow_requantize: bool = False, imatrix: str | Path | None = None,
                   progress: Progress | None = None) -> QuantizeReport:
    """Write `dst`: `src` quantized as llama.cpp's `llama_model_quantize` would, with the
    importance matrix file `imatrix` when given (llama-quantize --imatrix)."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise QuantizeError("the output file must differ from the input file")
    start = time.perf_counter()
    report = QuantizeReport()
    weights = None
    extra: list[tuple[str, bytes]] = []
    if imatrix is not None:
        im, weights = load_imatrix(imatrix)
        opts = replace(opts, imatrix=True)
        extra = imatrix_entries(str(imatrix), im)
    with GGUFFile.open(src) as f:
        tensors = plan(f, opts, allow_requantize=allow_requantize)
        alignment = int(f.metadata.get("general.alignment", 32))
        head = header_bytes(raw_kv_entries(f.path), tensors, file_type=int(opts.ftype),
                            alignment=alignment, extra=extra)
        part = dst.with_name(dst.name + ".part")
        try:
            with open(part, "wb") as out:
                out.write(head)
                for i, ot in enumerate(tensors):
                    t = f.tensors[ot.name]
                    if progress is not None:
                        progress(ot.name, i, len(tensors), ot.qtype)
                    qw = _importance(weights, t) if ot.qtype != QT(t.ggml_type) else None
                    if qw is None and ot.qtype != QT(t.ggml_type) and requires_imatrix(
                            ot.name, ot.qtype):
                        raise QuantizeError(f"missing importance matrix for tensor {ot.name} "
                                            f"in a very low-bit quantization ({ot.qtype.name})")
                    n = _write_tensor(f, t, ot.qtype, out, qw)
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
