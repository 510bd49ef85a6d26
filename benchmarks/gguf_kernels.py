"""Time the matmul kernels on one layer of a GGUF file's weights, as the CPU backend runs them.

Each 2-D weight of layer `--layer` is taken as the backend takes it: the widened copy of the
types below 4 bits (`integer_weight`), interleaved 16 rows at a time where `packable`, else the
sgemm path from `prefill_min_tokens` rows on, else the plain integer rows; `--nt` activation
rows (pre-quantized, the kernel alone is timed). `--compare` also times the unpacked copy of
each packable weight (the path before it packed) in the same run, and prints the largest
difference of the two results relative to the largest output. `--direct`: each weight of a
type the backend can read from the file's blocks (`quant.reencode.READ_DIRECT`, `simd.iquants`)
is timed both ways in the same run, the widened copy (packed where it packs) and the file's
blocks, calls alternated between the two; the bytes each holds are printed beside.

    python benchmarks/gguf_kernels.py MODEL.gguf [--nt 512] [--layer 0] [--compare] [--direct]

Medians of `--reps` calls after one warm-up, in ms, and GFLOP/s (2 x nt x n_in x n_out); with
`--direct` also the fastest call (less of a busy host's other work in it).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import numba
import numpy as np
from kernels_bench import timed  # benchmarks/ runs as the script's folder

from minfer.backends.cpu import kernels as K
from minfer.backends.cpu.kernels.linear.dispatch import (
    bind_prequant_into,
    bind_quantize,
    new_activation,
)
from minfer.backends.cpu.kernels.quant.reencode import READ_DIRECT
from minfer.gguf.reader import GGUFFile


def paths(raw: np.ndarray, qtype: int, n_in: int, n_out: int, nt: int, compare: bool
          ) -> dict[str, tuple[np.ndarray, int]]:
    """label -> (weight, type) of the paths to time: the backend's, and the unpacked copy."""
    w, wt = K.integer_weight(raw, qtype)
    if K.packable(wt, n_in, n_out):
        runs: dict[str, tuple[np.ndarray, int]] = {"packed": K.repack_weight(w, wt)}
        return {**runs, "plain": (w, wt)} if compare else runs
    if K.prefill_min_tokens(qtype) <= nt:
        return {"sgemm": (raw, qtype)}
    return {"plain": (w, wt)}


def direct_paths(raw: np.ndarray, qtype: int, n_in: int, n_out: int
                 ) -> dict[str, tuple[np.ndarray, int]]:
    """The widened copy as the backend runs it (MINFER_IQ_WIDEN / no MINFER_IQ_DIRECT for the
    call, packed where it packs) and the file's blocks."""
    saved = {k: os.environ.pop(k, None) for k in ("MINFER_IQ_DIRECT", "MINFER_IQ_WIDEN")}
    os.environ["MINFER_IQ_WIDEN"] = "1"
    try:
        w, wt = K.integer_weight(raw, qtype)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    widened = K.repack_weight(w, wt) if K.packable(wt, n_in, n_out) else (w, wt)
    return {"widened": widened, "direct": (raw, qtype)}


def alternated(fns: list[Callable[[], object]], reps: int) -> list[tuple[float, float]]:
    """(best, median) seconds of each fn over `reps` rounds of one call each, after one
    warm-up round."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(reps + 1):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            if r:
                ts.append(time.perf_counter() - t0)
    return [(min(ts), float(np.median(ts))) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--nt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--direct", action="store_true")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    f = GGUFFile.open(a.gguf)
    rng = np.random.default_rng(0)
    totals: dict[str, float] = {}
    held: dict[str, int] = {}
    for t in f.tensors.values():
        if not t.name.startswith(f"blk.{a.layer}.") or len(t.shape) != 2:
            continue
        n_in, n_out = t.shape
        raw = f.raw(t.name).reshape(n_out, -1)
        x = rng.standard_normal((a.nt, n_in)).astype(np.float32)
        out = np.empty((a.nt, n_out), np.float32)
        cells, outs, fns = [], [], {}
        runs = (direct_paths(raw, t.ggml_type, n_in, n_out)
                if a.direct and t.ggml_type in READ_DIRECT
                else paths(raw, t.ggml_type, n_in, n_out, a.nt, a.compare))
        for label, (w, qt) in runs.items():
            if label == "sgemm":
                fn: Callable[[], object] = functools.partial(K.matmul_sgemm, w, qt, x, out)
            else:
                xq = new_activation(a.nt, n_in, qt)
                assert xq is not None
                bind_quantize(x, xq)()
                fn = bind_prequant_into(w, qt, xq, out)
            fn()
            outs.append(out.copy())
            fns[label] = (fn, qt, w.nbytes)
        times = (alternated([f for f, _, _ in fns.values()], a.reps) if a.direct
                 else [timed(f, a.reps) for f, _, _ in fns.values()])
        for (label, (_, qt, nbytes)), (best, s) in zip(fns.items(), times, strict=True):
            key = f"{label} {K.QType(t.ggml_type).name}" if a.direct else label
            totals[key] = totals.get(key, 0.0) + s
            gf = 2 * a.nt * n_in * n_out / s / 1e9
            cell = f"{label} {K.QType(qt).name} {s * 1e3:7.2f} ms ({gf:4.0f} GF/s)"
            if a.direct:
                held[key] = held.get(key, 0) + nbytes
                cell += f" best {best * 1e3:.2f}, {nbytes / 1e6:.1f} MB"
            cells.append(cell)
        if len(outs) == 2:
            rel = np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max()
            cells.append(f"rel diff {rel:.1e}")
        print(f"{t.name.split('.', 2)[2]:20s} {t.type_name:8s} {n_out:6d} x {n_in:5d}  "
              + " | ".join(cells), flush=True)
    print("layer totals, ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in totals.items()))
    if held:
        print("bytes held, MB: " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in held.items()))


if __name__ == "__main__":
    main()
