"""A decode step's op tape as its parallel regions run it (issue #66): per step its node, kernel,
whether every thread takes a share or thread 0 runs it alone, whether a barrier stands before it,
and its time from inside the region (`RegionRun.timeline`, medians over several decode steps).

    PYTHONPATH=src python benchmarks/region_census.py [MODEL.gguf] [--threads 2] [--runs 30]
        [--layer 1] [--off FUSION ...] [--ab ROUNDS]

Prints one layer's steps in full and the whole tape's totals: steps, serial steps, barriers,
the time in steps (each step's slowest thread), in serial steps, and in barrier gaps (from the
slowest thread's end of a step to the next step's start). `--off` turns fusions off (the
EngineConfig fields in FUSIONS). With `--ab ROUNDS`: decode tok/s with every fusion against
those of `--off` off (without `--off`: round 20's, ROUND_20), two engines in one process taking
turns, ROUNDS turns of 32 tokens each (median and range).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import numba
import numpy as np
from numba import njit

from minfer.backends.cpu.kernels.region.sync import cycles
from minfer.backends.cpu.regions import RegionRun
from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.jit_cache import kernel_call

DEFAULT_MODEL = Path.home() / ".cache/minfer/qwen2.5-coder-0.5b-instruct.gguf"
FUSIONS = ("fuse_add_norm", "fuse_norm_quant", "fuse_bias", "fuse_rope_store", "fuse_gate_up",
           "fuse_attn_quant")
ROUND_20 = ("fuse_norm_quant", "fuse_bias", "fuse_rope_store")  # `--ab` turns off for "before"


@njit
def _tsc() -> int:
    return cycles()  # type: ignore[no-any-return]


def _tsc_per_us() -> float:
    _tsc()
    t0, c0 = time.perf_counter(), _tsc()
    time.sleep(0.2)
    t1, c1 = time.perf_counter(), _tsc()
    return (c1 - c0) / ((t1 - t0) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--off", nargs="*", default=[], choices=FUSIONS)
    ap.add_argument("--ab", type=int, default=0)
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    f = GGUFFile.open(a.model)
    if a.ab:
        _ab(f, a.threads, a.ab, tuple(a.off) or ROUND_20)
        return
    e = Engine(f, HParams.from_gguf(f), n_ctx=512, n_threads=a.threads,
               **dict.fromkeys(a.off, False))
    e.forward(list(range(1, 33)), 0)
    t0 = time.perf_counter()
    for i in range(16):
        e.forward([100 + i], 32 + i)
    print(f"16 decode forwards: {(time.perf_counter() - t0) / 16 * 1e3:.2f} ms each")
    prepared = e.cache.get(e.params_for(1, 1))
    tape = prepared.scratch["tape"][1]
    graph = prepared.graph
    regions = [c for c in tape.program if isinstance(c, RegionRun)]
    print(f"decode tape: {len(tape.steps)} steps, {len(tape.program)} calls, "
          f"{len(regions)} region(s) of {[len(r.steps) for r in regions]} steps")
    region = max(regions, key=lambda r: len(r.steps))
    node_of: dict[int, str] = {}  # step -> "layer:node" (a layer opens at its attn_norm)
    ids = {id(s): i for i, s in enumerate(tape.steps)}
    n_layer = -1
    for node_id, first, end in tape.spans:
        name = graph.nodes[node_id].name
        n_layer += name == "attn_norm"
        for k in range(first, end):
            node_of[k] = f"{n_layer}:{name}"
    names = []
    for s in region.steps:
        bound = kernel_call(s)
        kernel = bound[0] if bound else s
        func = getattr(kernel, "py_func", kernel)
        names.append((node_of.get(ids.get(id(s), -1), "?"), getattr(func, "__name__", "?")))
    per_us = _tsc_per_us()
    stamps = np.stack([region.timeline() for _ in range(a.runs)])  # [runs, threads, 2n]
    starts, ends = stamps[:, :, 0::2], stamps[:, :, 1::2]
    step = (ends - starts).max(1) / per_us  # [runs, n]: the slowest thread's time in it
    gap = np.zeros_like(step)  # thread 0's wait before it (the barrier; thread 0 runs serials)
    gap[:, 1:] = (starts[:, 0, 1:] - ends[:, 0, :-1]) / per_us
    med_step, med_gap = np.median(step, 0), np.median(gap, 0)
    forms = region.forms
    bar = region.barriers.astype(bool)
    layer = f"{a.layer}:"
    print(f"\nlayer {a.layer}'s steps (us, medians of {a.runs}; B: a barrier before it, "
          "S: thread 0 alone; the slowest thread's time, +thread 0's wait before it):")
    for i, (node, kern) in enumerate(names):
        if node.startswith(layer):
            print(f"  {i:4d} {'B' if bar[i] else ' '} {' ' if forms[i].split else 'S'} "
                  f"{med_step[i]:7.1f} +{med_gap[i]:5.1f}  {node:28s} {kern}")
    serial = np.array([not fm.split for fm in forms])
    print(f"\ntotals: {len(forms)} steps, {serial.sum()} serial, {bar.sum()} barriers; "
          f"in steps {med_step.sum() / 1e3:.2f} ms (serial {med_step[serial].sum() / 1e3:.2f}),"
          f" thread 0's waits {med_gap.sum() / 1e3:.2f} ms; region wall "
          f"{np.median(ends[:, 0, -1] - starts[:, 0, 0]) / per_us / 1e3:.2f} ms")
    kinds = Counter(k for _, k in names)
    by_kind = {k: med_step[[i for i, (_, kk) in enumerate(names) if kk == k]].sum()
               for k in kinds}
    print("by kernel (steps, ms):")
    for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:32s} {kinds[k]:4d} {t / 1e3:6.3f}")


def _ab(f: GGUFFile, threads: int, rounds: int, off: tuple[str, ...], n: int = 32) -> None:
    """After: every fusion; before: those in `off` off."""
    engines = {fused: Engine(f, HParams.from_gguf(f), n_ctx=512, n_threads=threads,
                             **dict.fromkeys(off, fused)) for fused in (True, False)}
    rates: dict[bool, list[float]] = {True: [], False: []}
    for fused, e in engines.items():
        e.forward(list(range(1, 33)), 0)
        e.forward([7], 32)
        region = next(c for c in e.cache.get(e.params_for(1, 1)).scratch["tape"][1].program
                      if isinstance(c, RegionRun))
        print(f"{'after' if fused else 'before'}: {len(region.steps)} steps, "
              f"{region.barriers.sum()} barriers")
    for r in range(rounds):
        for fused in ((True, False) if r % 2 == 0 else (False, True)):
            e = engines[fused]
            t0 = time.perf_counter()
            for i in range(n):
                e.forward([100 + i], 33 + i)
            rates[fused].append(n / (time.perf_counter() - t0))
    for fused, rs in rates.items():
        print(f"{'after' if fused else 'before'}: median {np.median(rs):.1f} tok/s, range "
              f"{min(rs):.1f}-{max(rs):.1f} ({rounds} x {n} tokens)")
    ratio = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
    print(f"after / before, paired: median {np.median(ratio):.3f}, range "
          f"{min(ratio):.3f}-{max(ratio):.3f}")


if __name__ == "__main__":
    main()
