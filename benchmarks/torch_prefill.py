"""Prefill with the torch backend (bf16 GEMMs) against the CPU backend: pp512, TTFT, peak RSS.

Not part of the test suite. Each configuration runs in its own subprocess, so peak RSS is its
own; `--rounds` alternates them to spread machine drift. Per configuration: pp<P> tokens/s
(best and mean of `--reps`), time-to-first-token of a `--ttft`-token prompt (prefilled in chunks
of 512: cold = the process's first long prefill, warm = the next one), peak RSS, and the
crossings per pp<P> forward (all edges between backends / those not from input leaves).

    .venv/bin/python benchmarks/torch_prefill.py -t 2                   # cpu, auto, scratch, bf16
    .venv/bin/python benchmarks/torch_prefill.py --inproc --rounds 5    # speed on a busy machine
    .venv/bin/python benchmarks/torch_prefill.py --sweep                # min_rows crossover
    .venv/bin/python benchmarks/torch_prefill.py --threads-check        # numba + torch pools
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

CONFIGS = {  # name -> (--backend, extra environment)
    "cpu": ("cpu", {}),
    "auto": ("auto", {}),
    "torch-scratch": ("torch", {"MINFER_TORCH_DEVICE": "cpu", "MINFER_TORCH_WEIGHTS": "scratch"}),
    "torch-bf16": ("torch", {"MINFER_TORCH_DEVICE": "cpu", "MINFER_TORCH_WEIGHTS": "bf16"}),
}

CHILD = textwrap.dedent(
    """
    import json, os, resource, sys, time
    import numpy as np
    import minfer
    from minfer.engine.generate import prefill
    from minfer.graph import ir, scheduler
    path, backend, threads, pp, ttft, reps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    model = minfer.load(path, n_ctx=max(pp, ttft) + 8, threads=threads, backend=backend)
    engine = model.engine(max(pp, ttft) + 8)
    rng = np.random.default_rng(1234)
    toks = lambda n: rng.integers(0, engine.hparams.n_vocab, size=n).tolist()
    def timed(n):
        t0 = time.perf_counter(); prefill(engine, toks(n), 0, 512); return time.perf_counter() - t0
    out = {"backends": "+".join(engine.ctx_params.backends)}
    timed(64)  # compile / warm the kernels on a short prompt
    if ttft:
        out["ttft_cold_s"], out["ttft_warm_s"] = timed(ttft), timed(ttft)
    timed(pp)
    rates = [pp / timed(pp) for _ in range(reps)]
    out["pp_best"], out["pp_mean"] = max(rates), sum(rates) / len(rates)
    prep = engine.cache.get(engine.params_for(pp, 1))
    g, live = prep.graph, prep.plan.live
    out["crossings"] = scheduler.count_crossings(g, live)
    out["crossings_not_inputs"] = sum(
        g.nodes[s].backend != n.backend and not isinstance(g.nodes[s].op, ir.Input)
        for n in g.nodes if live[n.id] for s in n.srcs)
    out["splits"] = len(prep.splits)
    out["threads_in_process"] = len(os.listdir("/proc/self/task"))
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    """
)

SWEEP = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from minfer.backends.cpu.backend import CpuBackend
    from minfer.backends.torch_backend.backend import TorchBackend
    from minfer.engine.forward import Engine, set_threads
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile
    path, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(v) for v in sys.argv[4].split(",")]
    f = GGUFFile.open(path); hp = HParams.from_gguf(f)
    mk = lambda b: Engine(f, hp, n_ctx=520, backends=b, n_threads=threads)
    engines = {"cpu": mk([CpuBackend()]),
               "scratch": mk([TorchBackend(min_rows=1), CpuBackend()]),
               "bf16": mk([TorchBackend(min_rows=1, weights="bf16"), CpuBackend()])}
    rng = np.random.default_rng(0)
    print("rows  " + "  ".join(f"{k:>12s}" for k in engines) + "   (ms per forward, best)")
    for nt in sizes:
        ids = rng.integers(0, hp.n_vocab, nt).tolist()
        best = {}
        for k, e in engines.items():
            e.forward(ids, 0)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter(); e.forward(ids, 0); ts.append(time.perf_counter() - t0)
            best[k] = min(ts) * 1e3
        print(f"{nt:4d}  " + "  ".join(f"{v:12.1f}" for v in best.values()), flush=True)
    """
)


INPROC = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from minfer.backends.cpu.backend import CpuBackend
    from minfer.backends.torch_backend.backend import TorchBackend
    from minfer.engine.forward import Engine
    from minfer.engine.generate import prefill
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile
    path, threads, pp, ttft, rounds = sys.argv[1], *map(int, sys.argv[2:6])
    f = GGUFFile.open(path); hp = HParams.from_gguf(f)
    n_ctx = max(pp, ttft) + 8
    mk = lambda b: Engine(f, hp, n_ctx=n_ctx, backends=[*b, CpuBackend()], n_threads=threads)
    engines = {"cpu": mk([]), "torch-scratch": mk([TorchBackend(min_rows=48)]),
               "torch-bf16": mk([TorchBackend(min_rows=16, weights="bf16")])}
    rng = np.random.default_rng(0)
    def timed(e, n):
        toks = rng.integers(0, hp.n_vocab, n).tolist()
        t0 = time.perf_counter(); prefill(e, toks, 0, 512); return time.perf_counter() - t0
    best = {k: {"pp": 1e9, "ttft": 1e9} for k in engines}
    for e in engines.values():
        timed(e, 64)
    for _ in range(rounds):  # alternate, so load spikes hit every config alike
        for k, e in engines.items():
            best[k]["pp"] = min(best[k]["pp"], timed(e, pp))
            if ttft:
                best[k]["ttft"] = min(best[k]["ttft"], timed(e, ttft))
    print(f"| config | pp{pp} tok/s (best of {rounds}) | TTFT {ttft} tokens s (best) |")
    print("|---|---|---|")
    for k, v in best.items():
        print(f"| {k} | {pp / v['pp']:.1f} | {v['ttft'] if ttft else 0:.2f} |")
    """
)


def run_child(script: str, args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env={**os.environ, **env}, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({env}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def compare(a: argparse.Namespace) -> None:
    names = a.configs.split(",")
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(a.rounds):
        for name in names:
            backend, env = CONFIGS[name]
            argv = [a.model, backend, str(a.threads), str(a.pp), str(a.ttft), str(a.reps)]
            results[name].append(json.loads(run_child(CHILD, argv, env).splitlines()[-1]))
    print(f"\npp{a.pp}, TTFT of a {a.ttft}-token prompt, {a.threads} threads, "
          f"{a.rounds} round(s) x {a.reps} reps (load avg {os.getloadavg()[0]:.1f})\n")
    print(f"| config | backends | pp{a.pp} best | pp{a.pp} mean | TTFT cold s | TTFT warm s "
          f"| peak RSS MiB | crossings (non-input) | splits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        best = max(r["pp_best"] for r in runs)
        mean = statistics.mean(r["pp_mean"] for r in runs)
        cold = min(r.get("ttft_cold_s", 0.0) for r in runs)
        warm = min(r.get("ttft_warm_s", 0.0) for r in runs)
        rss = max(r["peak_rss_mib"] for r in runs)
        r0 = runs[0]
        print(f"| {name} | {r0['backends']} | {best:.1f} | {mean:.1f} | {cold:.2f} | {warm:.2f} "
              f"| {rss:.0f} | {r0['crossings']} ({r0['crossings_not_inputs']}) "
              f"| {r0['splits']} |")


def threads_check(a: argparse.Namespace) -> None:
    """pp with the most ping-pong between the pools (claim=matmul), under runtime settings."""
    variants = {
        "default (numba omp, torch omp)": {},
        "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
        "NUMBA_THREADING_LAYER=workqueue": {"NUMBA_THREADING_LAYER": "workqueue"},
    }
    base = {"MINFER_TORCH_DEVICE": "cpu", "MINFER_TORCH_CLAIM": "matmul"}
    print(f"pp{a.pp}, torch takes matmuls only (the most alternation), {a.threads} threads")
    for label, env in variants.items():
        rows = []
        for _ in range(a.rounds):
            argv = [a.model, "torch", str(a.threads), str(a.pp), "0", str(a.reps)]
            rows.append(json.loads(run_child(CHILD, argv, {**base, **env}).splitlines()[-1]))
        best = max(r["pp_best"] for r in rows)
        print(f"  {label:34s} pp{a.pp} best {best:7.1f} tok/s, "
              f"threads in process {rows[0]['threads_in_process']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/tmp/model.gguf")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--ttft", type=int, default=2000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--inproc", action="store_true",
                   help="cpu / scratch / bf16 alternating in one process (robust to load)")
    p.add_argument("--sweep", action="store_true", help="ms per forward by row count")
    p.add_argument("--sweep-sizes", default="4,8,16,32,64,128")
    p.add_argument("--threads-check", action="store_true")
    a = p.parse_args()
    if a.inproc:
        print(run_child(INPROC, [a.model, str(a.threads), str(a.pp), str(a.ttft),
                                 str(a.rounds)], {}))
    elif a.sweep:  # streamed: the CPU rows at large sizes take a while
        subprocess.run([sys.executable, "-c", SWEEP, a.model, str(a.threads), str(a.reps),
                        a.sweep_sizes], check=True)
    elif a.threads_check:
        threads_check(a)
    else:
        compare(a)


if __name__ == "__main__":
    main()
