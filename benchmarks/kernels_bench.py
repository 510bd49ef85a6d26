"""Time the CPU matmul kernels on the development model's shapes.

Decode (one token): matrix-vector per weight type, reported as weight GB/s (the roofline is
memory bandwidth). Prefill: nt tokens through `matmul` (dequantized tiles + sgemm), in GFLOP/s.
`--crossover` times the integer path against the sgemm path (where prefill_min_tokens switches).

    python benchmarks/kernels_bench.py [--threads 2] [--types Q5_0,Q8_0] [--prefill 128,512]
    python benchmarks/kernels_bench.py --threads 1 --no-decode --prefill "" --batch 1,4,8

Timings are best-of-N (the machine is shared; the best run is the kernel's own speed) with the
median alongside.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numba
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf.quants import quantize

from minfer.backends.cpu.kernels import (
    QType,
    matmul,
    matmul_prequant,
    matmul_sgemm,
    quantize_activation,
)
from minfer.backends.cpu.kernels.quant.types import FLOAT_TYPES, KQUANT_TYPES
from minfer.backends.cpu.kernels.reference import random_kquant_blocks

DECODE_SHAPES = [(896, 4864), (4864, 896), (896, 151936)]  # (n_in, n_out)
ALL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]


def make_weight(qt: QType, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights; big matrices tile a 2048-row pattern (the bytes, not the values, matter)."""
    rows = min(n_out, 2048)
    if qt in KQUANT_TYPES:
        w = random_kquant_blocks(qt, rows, n_in, rng)
    else:
        data = rng.standard_normal((rows, n_in)).astype(np.float32)
        if qt is QType.F32:
            w = data
        elif qt is QType.F16:
            w = data.astype(np.float16).view(np.uint16)
        else:
            w = quantize(data, GT(int(qt)))
            w = w.view(np.uint16) if qt is QType.BF16 else w
    reps = -(-n_out // rows)
    return np.ascontiguousarray(np.tile(w, (reps, 1))[:n_out])


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(best, median) seconds of `reps` calls after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), float(np.median(ts))


def bench_decode(types: list[QType], reps: int, rng: np.random.Generator) -> None:
    print("decode (1 token, activation pre-quantized): weight GB/s  best / median")
    for qt in types:
        cells = []
        for n_in, n_out in DECODE_SHAPES:
            if qt in KQUANT_TYPES and n_in % 256:
                cells.append(f"{n_in}->{n_out}: n/a")
                continue
            w = make_weight(qt, n_out, n_in, rng)
            x = rng.standard_normal((1, n_in)).astype(np.float32)
            out = np.empty((1, n_out), np.float32)
            xq = quantize_activation(x, qt)
            n = max(5, reps // 4) if n_out > 100_000 else reps
            best, med = timed(lambda w=w, qt=qt, xq=xq, out=out: matmul_prequant(w, qt, xq, out), n)
            gbs = w.nbytes / 1e9
            cells.append(f"{n_in}->{n_out}: {gbs / best:5.1f} / {gbs / med:5.1f}")
        print(f"  {qt.name:5s} " + "   ".join(cells), flush=True)


def bench_batch(types: list[QType], rows: list[int], reps: int, rng: np.random.Generator) -> None:
    """Server batching: the integer kernels with several activation rows (each weight block is
    unpacked once for all of them), as µs and as a multiple of the one-row call."""
    print("batched rows (integer path, activation pre-quantized): us best (x one row)")
    for qt in types:
        if qt in FLOAT_TYPES:
            continue
        for n_in, n_out in DECODE_SHAPES[:2]:
            if qt in KQUANT_TYPES and n_in % 256:
                n_in = 1024
            w = make_weight(qt, n_out, n_in, rng)
            cells, one = [], 0.0
            for nt in rows:
                xq = quantize_activation(rng.standard_normal((nt, n_in)).astype(np.float32), qt)
                out = np.empty((nt, n_out), np.float32)
                best, _ = timed(lambda w=w, qt=qt, xq=xq, out=out: matmul_prequant(
                    w, qt, xq, out), reps)
                one = one or best
                cells.append(f"nt={nt}: {best * 1e6:7.1f} ({best / one:4.2f}x)")
            print(f"  {qt.name:5s} {n_in}->{n_out:<6d} " + "  ".join(cells), flush=True)


def bench_prefill(types: list[QType], nts: list[int], reps: int, rng: np.random.Generator) -> None:
    print("prefill (896->4864; K-quants 4864->896; dequant tiles + sgemm): GFLOP/s  best / median")
    for qt in types:
        n_in, n_out = (4864, 896) if qt in KQUANT_TYPES else (896, 4864)
        w = make_weight(qt, n_out, n_in, rng)
        cells = []
        for nt in nts:
            x = rng.standard_normal((nt, n_in)).astype(np.float32)
            out = np.empty((nt, n_out), np.float32)
            best, med = timed(lambda w=w, qt=qt, x=x, out=out: matmul_sgemm(w, qt, x, out), reps)
            flop = 2.0 * nt * n_in * n_out
            cells.append(f"nt={nt}: {flop / best / 1e9:6.1f} / {flop / med / 1e9:6.1f}")
        print(f"  {qt.name:5s} " + "   ".join(cells), flush=True)


def bench_crossover(types: list[QType], reps: int, rng: np.random.Generator) -> None:
    print("crossover: GFLOP/s integer path / sgemm path (best of N) -> prefill_min_tokens")
    for qt in types:
        if qt in FLOAT_TYPES:
            continue
        n_in, n_out = (4864, 896) if qt in KQUANT_TYPES else (896, 4864)
        w = make_weight(qt, n_out, n_in, rng)
        cells = []
        for nt in (4, 16, 32, 64, 128):
            x = rng.standard_normal((nt, n_in)).astype(np.float32)
            out = np.empty((nt, n_out), np.float32)
            ti, _ = timed(lambda w=w, qt=qt, x=x, out=out: matmul_prequant(
                w, qt, quantize_activation(x, qt), out), reps)
            ts, _ = timed(lambda w=w, qt=qt, x=x, out=out: matmul_sgemm(w, qt, x, out), reps)
            gflop = 2.0 * nt * n_in * n_out / 1e9
            cells.append(f"{nt}: {gflop / ti:4.0f}/{gflop / ts:4.0f}")
        print(f"  {qt.name:5s} {n_in}->{n_out}  " + "  ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--types", default=",".join(ALL_TYPES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prefill", default="128,512", help="token counts for the prefill rows")
    ap.add_argument("--crossover", action="store_true", help="integer vs sgemm at small nt")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--batch", default="", help="row counts for the batched integer kernels, "
                    "e.g. 1,4,8 (first should be 1)")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    types = [QType[name] for name in args.types.split(",")]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    matmul(make_weight(QType.Q8_0, 8, 256, rng), QType.Q8_0, np.ones((1, 256), np.float32),
           np.empty((1, 8), np.float32))
    print(f"threads {args.threads}; first kernel call (compile or cache load) "
          f"{time.perf_counter() - t0:.2f}s")
    if not args.no_decode:
        bench_decode(types, args.reps, rng)
    if args.batch:
        bench_batch(types, [int(n) for n in args.batch.split(",")], args.reps, rng)
    if args.prefill:
        nts = [int(n) for n in args.prefill.split(",")]
        bench_prefill([t for t in types if t in (QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.F16)]
                      or types[:1], nts, max(3, args.reps // 10), rng)
    if args.crossover:
        bench_crossover(types, max(3, args.reps // 5), rng)


if __name__ == "__main__":
    main()
