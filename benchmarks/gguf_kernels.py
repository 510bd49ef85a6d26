"""Time the matmul kernels on one layer of a GGUF file's weights, as the CPU backend runs them.

Each 2-D weight of layer `--layer` is taken as the backend takes it: the widened copy of the
types below 4 bits (`integer_weight`), interleaved 16 rows at a time where `packable`, else the
sgemm path from `prefill_min_tokens` rows on, else the plain integer rows; `--nt` activation
rows (pre-quantized, the kernel alone is timed). `--compare` also times the unpacked copy of
each packable weight (the path before it packed) in the same run, and prints the largest
difference of the two results relative to the largest output.

    python benchmarks/gguf_kernels.py MODEL.gguf [--nt 512] [--layer 0] [--compare]

Medians of `--reps` calls after one warm-up, in ms, and GFLOP/s (2 x nt x n_in x n_out).
"""

from __future__ import annotations

import argparse
import functools
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--nt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", action="store_true")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    f = GGUFFile.open(a.gguf)
    rng = np.random.default_rng(0)
    totals: dict[str, float] = {}
    for t in f.tensors.values():
        if not t.name.startswith(f"blk.{a.layer}.") or len(t.shape) != 2:
            continue
        n_in, n_out = t.shape
        raw = f.raw(t.name).reshape(n_out, -1)
        x = rng.standard_normal((a.nt, n_in)).astype(np.float32)
        out = np.empty((a.nt, n_out), np.float32)
        cells, outs = [], []
        for label, (w, qt) in paths(raw, t.ggml_type, n_in, n_out, a.nt, a.compare).items():
            if label == "sgemm":
                fn: Callable[[], object] = functools.partial(K.matmul_sgemm, w, qt, x, out)
            else:
                xq = new_activation(a.nt, n_in, qt)
                assert xq is not None
                bind_quantize(x, xq)()
                fn = bind_prequant_into(w, qt, xq, out)
            s = timed(fn, a.reps)[1]
            outs.append(out.copy())
            totals[label] = totals.get(label, 0.0) + s
            gf = 2 * a.nt * n_in * n_out / s / 1e9
            cells.append(f"{label} {K.QType(qt).name} {s * 1e3:7.2f} ms ({gf:4.0f} GF/s)")
        if len(outs) == 2:
            rel = np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max()
            cells.append(f"rel diff {rel:.1e}")
        print(f"{t.name.split('.', 2)[2]:20s} {t.type_name:8s} {n_out:6d} x {n_in:5d}  "
              + " | ".join(cells), flush=True)
    print("layer totals, ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
