"""`minfer quantize IN OUT TYPE`: requantize a GGUF like llama-quantize (the same bytes), with
`--imatrix FILE` (ggml's importance-weighted quantizers), `--tensor-type PATTERN=TYPE` overrides,
`--output-tensor-type`, `--token-embedding-type`.

`minfer imatrix [MODEL] -f TEXT [-o imatrix.gguf] [--output-format gguf|dat] [-c 512] [-b 512]
[--chunks N] [--process-output]`: llama-imatrix's importance matrix of TEXT
(minfer.tools.imatrix) in its GGUF or legacy `.dat` format, for `quantize --imatrix`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minfer.cli.info_cmd import human_bytes
from minfer.errors import MinferError

if TYPE_CHECKING:  # the quantizer (numba kernels) is imported when the command runs, not at start
    from gguf import GGMLQuantizationType

    from minfer.tools.quantize import QuantizeReport


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize", help="quantize a GGUF model (llama-quantize's types and mixes)",
        description="Quantize IN to OUT as llama.cpp's llama-quantize does: the same "
                    "per-tensor choices and the same bytes, with or without an importance "
                    "matrix.")
    p.add_argument("input", metavar="IN", help="source .gguf (F32/F16/BF16, or quantized with "
                                               "--allow-requantize)")
    p.add_argument("output", metavar="OUT", help="the .gguf to write")
    p.add_argument("type", metavar="TYPE",
                   help="a llama-quantize type or mix: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, "
                        "Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K, IQ4_NL, IQ4_XS, MXFP4_MOE, "
                        "IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M, IQ3_XXS, IQ3_XS (these "
                        "need --imatrix), IQ3_S, IQ3_M, F16, BF16 (Q3_K, Q4_K, Q5_K are "
                        "llama.cpp's aliases of the _M mixes)")
    p.add_argument("--pure", action="store_true",
                   help="TYPE for every quantizable tensor (no mix; llama.cpp's --pure)")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow a source whose tensors are already quantized (loses quality)")
    p.add_argument("--output-tensor-type", metavar="T", help="type of output.weight")
    p.add_argument("--token-embedding-type", metavar="T", help="type of token_embd.weight")
    p.add_argument("--tensor-type", metavar="PATTERN=TYPE", action="append", default=[],
                   help="TYPE for the tensors whose name PATTERN (a regular expression) matches, "
                        "e.g. attn_q=q8_0; repeatable, the first match wins")
    p.add_argument("--imatrix", metavar="FILE",
                   help="importance matrix (minfer imatrix / llama-imatrix, GGUF or legacy "
                        ".dat): quantize with ggml's importance-weighted quantizers")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--force", action="store_true", help="replace OUT if it already exists")
    p.set_defaults(func=run)

    m = subparsers.add_parser(
        "imatrix", help="an importance matrix for quantize --imatrix (llama-imatrix's)",
        description="Sum each matmul input's squared activations per column over TEXT's "
                    "chunks, as llama.cpp's llama-imatrix does; write its GGUF (or legacy .dat) "
                    "format.")
    m.add_argument("model", nargs="?", help="model path or cached name (default model if omitted)")
    m.add_argument("-m", "--model", dest="model_opt", help="the model, as a flag")
    m.add_argument("-f", "--file", required=True, help="the calibration text ('-' reads stdin)")
    m.add_argument("-o", "--output", default="imatrix.gguf", help="output file (imatrix.gguf)")
    m.add_argument("--output-format", choices=("gguf", "dat"), default=None,
                   help="gguf (the default) or llama.cpp's legacy .dat (as llama-imatrix, the "
                        "file's suffix does not choose it)")
    m.add_argument("-c", "--n-ctx", type=int, default=512, help="chunk length in tokens (512)")
    m.add_argument("-b", "--batch-size", type=int, default=512,
                   help="tokens per forward (512; capped at -c)")
    m.add_argument("--chunks", type=int, default=None, help="use at most this many chunks")
    m.add_argument("--process-output", action="store_true",
                   help="also collect output.weight's input")
    m.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all)")
    m.set_defaults(func=run_imatrix)


class _Bar:
    """A rich bar on a terminal; elsewhere nothing until the one summary line."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._task: Any = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(TextColumn("quantizing"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"),
                                 console=Console(file=sys.stderr), transient=True)

    def __call__(self, name: str, i: int, n: int, qtype: GGMLQuantizationType) -> None:
        if self._bar is None:
            return
        if self._task is None:
            self._bar.start()
            self._task = self._bar.add_task("", total=n)
        self._bar.update(self._task, completed=i, description=f"{name} → {qtype.name}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _summary(report: QuantizeReport, out: str) -> str:
    counts: dict[str, int] = {}
    for _, new in report.types.values():
        counts[new.name] = counts.get(new.name, 0) + 1
    census = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return (f"minfer: wrote {out}: {len(report.types)} tensors ({census}), "
            f"{human_bytes(report.bytes_in)} → {human_bytes(report.bytes_out)} "
            f"in {report.seconds:.1f} s")


def run(args: argparse.Namespace) -> int:
    from minfer.tools.quantize import MixOptions, parse_ftype, parse_tensor_type, quantize_model
    from minfer.tools.quantize.mix import parse_tensor_type_override

    if Path(args.output).exists() and not args.force:
        raise MinferError(f"{args.output} already exists; not overwriting it (--force "
                          "replaces it)")
    opts = MixOptions(
        parse_ftype(args.type), pure=args.pure,
        output_tensor_type=(parse_tensor_type(args.output_tensor_type)
                            if args.output_tensor_type else None),
        token_embedding_type=(parse_tensor_type(args.token_embedding_type)
                              if args.token_embedding_type else None),
        tensor_types=tuple(parse_tensor_type_override(t) for t in args.tensor_type))
    if args.threads is not None:
        from minfer.engine.forward import set_threads

        set_threads(args.threads)
    bar = _Bar()
    t0 = time.perf_counter()
    try:
        report = quantize_model(args.input, args.output, opts,
                                allow_requantize=args.allow_requantize, imatrix=args.imatrix,
                                progress=bar)
    finally:
        bar.close()
    report.seconds = time.perf_counter() - t0
    print(_summary(report, args.output), file=sys.stderr)
    return 0


def run_imatrix(args: argparse.Namespace) -> int:
    import minfer
    from minfer.tools.imatrix import collect
    from minfer.tools.quantize.imatrix_file import write_gguf, write_legacy

    if args.chunks is not None and args.chunks < 1:
        raise MinferError("--chunks must be at least 1")
    if args.batch_size < 1:
        raise MinferError("-b must be at least 1")
    batch_size = min(args.batch_size, args.n_ctx)  # as llama-imatrix caps n_batch
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text("utf-8")
    except OSError as exc:
        raise MinferError(f"cannot read {args.file}: {exc.strerror}") from None
    model = minfer.load(args.model_opt or args.model, n_ctx=args.n_ctx,
                        batch_size=batch_size)
    if args.threads:
        model.set_threads(args.threads)
    tok = model.tokenizer
    ids = tok.encode(text, special=False)
    bos = tok.bos_id if tok.add_bos else None

    def progress(done: int, total: int) -> None:
        print(f"[{done}/{total}]", end=" ", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    im = collect(model.engine(args.n_ctx), ids, args.n_ctx, bos=bos,
                 batch_size=batch_size, max_chunks=args.chunks,
                 process_output=args.process_output,
                 dataset="" if args.file == "-" else args.file, progress=progress)
    if args.output_format == "dat":
        write_legacy(args.output, im)
    else:
        if args.output_format is None and not args.output.endswith(".gguf"):
            print("\nminfer: saving the imatrix in the GGUF format with a suffix other than "
                  ".gguf (--output-format dat writes the legacy format)", file=sys.stderr)
        write_gguf(args.output, im)
    print(f"\nminfer: wrote {args.output}: {len(im.entries)} matrices, {im.chunk_count} chunks "
          f"of {args.n_ctx} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
