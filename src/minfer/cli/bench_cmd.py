"""`minfer bench [MODEL] [-p 512] [-n 128] [-d 0] [-r 3] [-t N] [-o md|csv|json] [--roofline]`:
llama-bench's shape. `--roofline` adds a row with the machine's measured read bandwidth (per
thread count) and prints each tg row's GB/s as a fraction of the bandwidth read again before
each of that row's repetitions: on a shared host the bandwidth drifts by 2x within minutes
(a 2-core AMD EPYC read 28-56 GB/s), so only a reading beside the decode is a fair ceiling.
Beside it, the model's own weight arrays read as a decode step reads them (`minfer.bench.
bandwidth.weights_read_bandwidth`): the ceiling of those pages, sizes and calls. A tg row's
GB/s counts the file's weight bytes (`bench.runner.weight_bytes_per_token`), and its roofline
percentage is of those; where the kernels read copies of another size (a type minfer widens,
`reencode.widen`), the bytes they read follow as "held" (`held_bytes_per_token`), and the
weights' read percentage is of the held bytes, the arrays that reading reads.

`minfer perplexity [MODEL] -f FILE [-c 512] [--chunks N] [-t N] [--json]`: the text's perplexity
as llama.cpp's `llama-perplexity` measures it (minfer.bench.perplexity): a quantization's cost
in quality, beside `bench`'s speed. `--kl-divergence-base OUT` also writes the model's
log-probabilities in llama-perplexity's file format; `--kl-divergence-base IN --kl-divergence`
runs this model on that file's tokens and prints the KL divergence from it, the Δppl and the
same-top-token rate as llama-perplexity prints them (minfer.bench.kld)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from minfer.cli.common import add_kv_args, kv_types, warm_up_announced
from minfer.errors import MinferError

if TYPE_CHECKING:
    from minfer.api import Model
    from minfer.bench.runner import BenchRow
    from minfer.engine.forward import Engine


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 128,256: {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("sizes must be >= 0")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure prefill and decode speed (llama-bench style)")
    p.add_argument("model", nargs="?", help="model path or cached name (default model if omitted)")
    p.add_argument("-m", "--model", dest="model_opt", help="the model, as a flag")
    p.add_argument("-p", "--n-prompt", type=_int_list, default=[512], help="pp sizes (512)")
    p.add_argument("-n", "--n-gen", type=_int_list, default=[128], help="tg sizes (128)")
    p.add_argument("-d", "--n-depth", type=_int_list, default=[0],
                   help="tokens already in the KV before each test (0)")
    p.add_argument("-r", "--repetitions", type=int, default=3,
                   help="runs of each test; the table shows mean ± stddev (3)")
    p.add_argument("-t", "--threads", type=_int_list, default=None,
                   help="thread counts, e.g. 1,2 (default: all cores, decode picking its own)")
    p.add_argument("-b", "--batch-size", type=int, default=512,
                   help="prefill chunk size in tokens (512)")
    p.add_argument("-c", "--n-ctx", type=int, default=0, help="context (default: fits the test)")
    add_kv_args(p)
    p.add_argument("--backend", choices=("auto", "cpu", "torch"), default=None,
                   help="compute backend (default: auto, or $MINFER_BACKEND)")
    p.add_argument("-o", "--output", choices=("md", "csv", "json"), default="md",
                   help="table format: markdown, csv or json (md)")
    p.add_argument("--roofline", action="store_true",
                   help="measure the machine's read bandwidth; print tg GB/s as a fraction of it")
    p.set_defaults(func=run)

    q = sub.add_parser("perplexity", help="a text's perplexity (llama-perplexity's method)",
                       description="Score FILE's tokens in chunks of N_CTX, the second half of "
                                   "each chunk, as llama.cpp's llama-perplexity does.")
    q.add_argument("model", nargs="?", help="model path or cached name (default model if omitted)")
    q.add_argument("-m", "--model", dest="model_opt", help="the model, as a flag")
    q.add_argument("-f", "--file", help="the text ('-' reads stdin; not with --kl-divergence)")
    q.add_argument("-c", "--n-ctx", type=int, default=512, help="chunk length in tokens (512)")
    q.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    q.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads (default: all)")
    add_kv_args(q)
    q.add_argument("--kl-divergence-base", metavar="FILE",
                   help="write the log-probabilities to FILE (llama-perplexity's format); with "
                        "--kl-divergence, read them from it")
    q.add_argument("--kl-divergence", action="store_true",
                   help="compare with --kl-divergence-base FILE on its tokens: KLD, Δppl, Δp, "
                        "same top token")
    q.add_argument("--json", action="store_true", help="print the result as JSON")
    q.set_defaults(func=run_perplexity)


def run(args: argparse.Namespace) -> int:
    import minfer
    from minfer.api import default_threads
    from minfer.bench.runner import BenchRow, run_test

    if args.repetitions < 1:
        raise MinferError("-r must be at least 1")
    threads_list = args.threads or [default_threads()]
    need = max(args.n_depth) + max([*args.n_prompt, *(n + 1 for n in args.n_gen), 1])
    model = minfer.load(args.model_opt or args.model, n_ctx=max(args.n_ctx, need),
                        k_type=kv_types(args)[0], v_type=kv_types(args)[1],
                        backend=args.backend, batch_size=args.batch_size)
    rows: list[BenchRow] = []
    for n_threads in threads_list:
        # a fresh engine per thread count; -t given: fixed counts, else decode as a run would
        model.set_threads(n_threads, adaptive=args.threads is None)
        engine = model.engine(need)
        if n_threads == threads_list[0]:
            warm_up_announced(model, None)
            print(f"KV cache {engine.ctx_params.kv_type}: "
                  f"{engine.kv.bytes_per_token / 1024:.1f} KiB per token", file=sys.stderr)
        backend = "+".join(engine.ctx_params.backends)
        roofline = None
        readings: list[float] = []  # the bandwidth read beside one tg row's repetitions
        weight_readings: list[float] = []  # the model's weights read, beside them too
        if args.roofline:
            from minfer.bench.bandwidth import read_bandwidth

            roofline = read_bandwidth(n_threads)
            rows.append(BenchRow(model=model.name, size_bytes=engine.weights.file.file_size,
                                 n_params=0, backend="read", n_threads=n_threads,
                                 test="roofline", n_prompt=0, n_gen=0, tokens_per_s=0.0,
                                 stddev=0.0, samples_s=[], gb_per_s=roofline))
            if args.output == "md":
                print(_md([rows[-1]], header=len(rows) == 1), end="", flush=True)
        tests = [(p, 0) for p in args.n_prompt if p] + [(0, n) for n in args.n_gen if n]
        for n_depth in args.n_depth:
            for n_prompt, n_gen in tests:
                read_beside = None
                if roofline and n_gen:
                    readings.clear()
                    weight_readings.clear()
                    read_beside = partial(_read_into, readings, weight_readings, engine,
                                          n_threads)
                row = run_test(engine, model=model.name, backend=backend, n_threads=n_threads,
                               n_prompt=n_prompt, n_gen=n_gen, n_depth=n_depth,
                               reps=args.repetitions, batch_size=args.batch_size,
                               before_rep=read_beside)
                if readings and row.gb_per_s is not None:
                    row.roofline_gb_per_s = statistics.fmean(readings)
                    row.roofline_fraction = row.gb_per_s / row.roofline_gb_per_s
                if weight_readings and row.held_gb_per_s is not None:
                    row.weights_read_gb_per_s = statistics.fmean(weight_readings)
                    row.weights_read_fraction = row.held_gb_per_s / row.weights_read_gb_per_s
                rows.append(row)
                if args.output == "md":
                    print(_md([rows[-1]], header=len(rows) == 1), end="", flush=True)
    if args.output == "json":
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    elif args.output == "csv":
        print(_csv(rows), end="")
    return 0


def run_perplexity(args: argparse.Namespace) -> int:
    import minfer
    from minfer.bench.perplexity import Perplexity, perplexity

    if args.chunks is not None and args.chunks < 1:
        raise MinferError("--chunks must be at least 1")
    if args.kl_divergence:
        return _run_kl_divergence(args)
    if args.file is None:
        raise MinferError("perplexity needs the text: -f FILE")
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text("utf-8")
    except OSError as exc:
        raise MinferError(f"cannot read {args.file}: {exc.strerror}") from None
    model = minfer.load(args.model_opt or args.model, n_ctx=args.n_ctx,
                        k_type=kv_types(args)[0], v_type=kv_types(args)[1],
                        batch_size=args.n_ctx)
    if args.threads:
        model.set_threads(args.threads)
    tok = model.tokenizer
    ids = tok.encode(text, special=False)
    warm_up_announced(model, min(args.n_ctx, max(len(ids), 1)))
    bos = tok.bos_id if tok.add_bos else None

    def score(chunk: list[int]) -> Sequence[float]:
        return [lp.logprob for lp in model.score(chunk)]

    def progress(p: Perplexity) -> None:
        if not args.json:
            print(f"[{p.n_chunks}]{p.running[-1]:.4f},", end="", flush=True)

    if not args.json:
        scored = args.n_ctx - 1 - args.n_ctx // 2
        print(f"{len(ids)} tokens; chunks of {args.n_ctx}, the last {scored} tokens of each "
              "scored", file=sys.stderr)
    with ExitStack() as stack:
        scorer = _base_writer(stack, args, model, ids) if args.kl_divergence_base else score
        result = perplexity(scorer, ids, args.n_ctx, bos, max_chunks=args.chunks,
                            progress=progress)
    if args.json:
        print(json.dumps({"model": model.name, "n_ctx": args.n_ctx, "n_tokens": len(ids),
                          "n_chunks": result.n_chunks, "n_scored": result.n_scored,
                          "ppl": result.ppl, "error": result.error, "running": result.running}))
    else:
        print(f"\nFinal estimate: PPL = {result.ppl:.4f} +/- {result.error:.5f}")
    return 0


def _base_writer(stack: ExitStack, args: argparse.Namespace, model: Model, ids: list[int]
                 ) -> Callable[[list[int]], Sequence[float]]:
    """A scorer that runs each chunk's scored rows and writes their log-probabilities to
    --kl-divergence-base as llama-perplexity does (its NLLs are the ones it scores with)."""
    import numpy as np

    from minfer.bench.kld import LogitsWriter
    from minfer.bench.perplexity import scored_logits

    engine = model.engine(args.n_ctx)
    n_chunks = len(ids) // args.n_ctx if args.chunks is None else min(args.chunks,
                                                                       len(ids) // args.n_ctx)
    try:
        out = stack.enter_context(open(args.kl_divergence_base, "wb"))  # noqa: SIM115
    except OSError as exc:
        raise MinferError(f"cannot write {args.kl_divergence_base}: {exc.strerror}") from None
    writer = LogitsWriter(out, args.n_ctx, model.hparams.n_vocab,
                          np.asarray(ids[:n_chunks * args.n_ctx], np.int32))
    first = args.n_ctx // 2

    def scorer(chunk: list[int]) -> Sequence[float]:
        logits = scored_logits(engine.forward, chunk, model.batch_size)
        return list(-writer.add_chunk(logits, np.asarray(chunk[first + 1:])))

    return scorer


def _run_kl_divergence(args: argparse.Namespace) -> int:
    """--kl-divergence: this model on the base file's tokens, compared row by row."""
    import numpy as np

    import minfer
    from minfer.bench.kld import CHUNK_HEADER, BaseFile, KLDResult
    from minfer.bench.perplexity import scored_logits

    if not args.kl_divergence_base:
        raise MinferError("--kl-divergence reads the base model's log-probabilities: give them "
                          "with --kl-divergence-base FILE")
    try:
        stream = open(args.kl_divergence_base, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise MinferError(f"cannot read {args.kl_divergence_base}: {exc.strerror}") from None
    with stream:
        base = BaseFile.open(stream, args.kl_divergence_base)
        n_ctx = base.n_ctx
        model = minfer.load(args.model_opt or args.model, n_ctx=n_ctx,
                            k_type=kv_types(args)[0], v_type=kv_types(args)[1], batch_size=n_ctx)
        if args.threads:
            model.set_threads(args.threads)
        if base.n_vocab != model.hparams.n_vocab:
            raise MinferError(f"inconsistent vocabulary ({base.n_vocab} in "
                              f"{args.kl_divergence_base} vs {model.hparams.n_vocab})")
        tok = model.tokenizer
        warm_up_announced(model, n_ctx)
        engine = model.engine(n_ctx)
        first = n_ctx // 2
        n_chunks = base.n_chunk if args.chunks is None else min(args.chunks, base.n_chunk)
        result = KLDResult()
        if not args.json:
            print(f"computing over {n_chunks} chunks, n_ctx={n_ctx}\n\n{CHUNK_HEADER}")
        for i, rows in zip(range(n_chunks), base.chunks(), strict=False):
            chunk = [int(t) for t in base.tokens[i * n_ctx:(i + 1) * n_ctx]]
            if tok.add_bos and tok.bos_id is not None:
                chunk[0] = tok.bos_id
            logits = scored_logits(engine.forward, chunk, model.batch_size)
            result.add(logits, rows, np.asarray(chunk[first + 1:]))
            if not args.json:
                print(result.chunk_line(i + 1), flush=True)
    if args.json:
        print(json.dumps({"model": model.name, "n_ctx": n_ctx, "n_chunks": n_chunks,
                          **result.stats()}))
    elif result.count >= 100:  # llama-perplexity does no statistics on fewer
        print(f"\n{result.report()}")
    return 0


def _read_into(readings: list[float], weight_readings: list[float], engine: Engine,
               n_threads: int) -> None:
    from minfer.bench.bandwidth import read_bandwidth, weights_read_bandwidth

    readings.append(read_bandwidth(n_threads, passes=3))
    tied = engine.hparams.tie_embeddings  # else the embedding is only gathered, row by row
    arrays = engine.weights.read_set(() if tied else ("token_embd.weight",))
    if arrays:  # (the warm-up ran: the decode tape has asked for its matrices)
        weight_readings.append(weights_read_bandwidth(arrays, n_threads, passes=2))


def _md(rows: list[BenchRow], *, header: bool) -> str:
    out = io.StringIO()
    if header:
        out.write("| model | size | params | backend | threads | test | t/s | GB/s |\n")
        out.write("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |\n")
    for r in rows:
        gb = f"{r.gb_per_s:.1f}" if r.gb_per_s is not None else ""
        held = r.held_gb_per_s
        if r.gb_per_s is not None and held is not None and abs(held - r.gb_per_s) > 1e-3 * held:
            gb += f", held {held:.1f}"  # the kernels read copies of another size
        if r.roofline_fraction is not None:
            gb += f" ({100 * r.roofline_fraction:.0f}% of {r.roofline_gb_per_s:.1f}"
            if r.weights_read_fraction is not None:
                gb += (f"; held {100 * r.weights_read_fraction:.0f}% of its weights' read "
                       f"{r.weights_read_gb_per_s:.1f}")
            gb += ")"
        rate = f"{r.tokens_per_s:.2f} ± {r.stddev:.2f}" if r.test != "roofline" else ""
        out.write(f"| {r.model} | {r.size_bytes / 2**20:.1f} MiB | {r.n_params / 1e6:.0f} M | "
                  f"{r.backend} | {r.n_threads} | {r.test} | {rate} | {gb} |\n")
    return out.getvalue()


def _csv(rows: list[BenchRow]) -> str:
    out = io.StringIO()
    fields = ["model", "size_bytes", "n_params", "backend", "n_threads", "test", "n_depth",
              "tokens_per_s", "stddev", "gb_per_s", "held_gb_per_s", "roofline_fraction",
              "roofline_gb_per_s", "weights_read_fraction", "weights_read_gb_per_s"]
    w = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(r.as_dict())
    return out.getvalue()


