"""minfer vs llama.cpp, side by side in one run: pp512 and tg128 ratios and peak RSS.

Not part of the test suite. Each engine runs in its own subprocess (so peak RSS is its own),
alternating minfer / llama.cpp for `--rounds` rounds to spread machine drift over both; the
ratio is minfer / llama.cpp of the mean tokens/s. llama.cpp runs through llama-cpp-python from
a separate interpreter (`--ref-python`, see the README's development section).

- `--target avx2`: both engines as on an AVX2-only CPU (Haswell: AVX2/FMA/F16C, no AVX-512 or
  VNNI): minfer compiles with NUMBA_CPU_NAME=haswell and Haswell's NUMBA_CPU_FEATURES, and
  llama.cpp comes from a second interpreter built without AVX-512 (`--ref-python-avx2`:
  CMAKE_ARGS as in the README with -DGGML_AVX512*=OFF and -DGGML_AVX_VNNI=OFF).
- `--busy N`: N busy-loop processes run for the whole benchmark (a busy machine); they are
  stopped by pid at the end, also on errors and Ctrl-C.
- `--minfer-threads` / `--llama-threads`: comma-separated thread counts to compare in one run
  (`default` for minfer: no count passed, minfer chooses); both default to `-t`.
- `-d DEPTH`: llama-bench's depth: each test runs after DEPTH random tokens already sit in
  the KV (prefilled untimed per repetition); n_ctx grows to fit.
- `--stale-pages`: keep the page cache as it is; by default the model's files are evicted
  before each engine's run (`fresh_pages.py`: idle pages read slower on these hosts).
- `--json PATH`: also write every sample and the summary (with target and busy count) as JSON.
- `--minfer-tree DIR` (repeatable): also run the minfer of another checkout (DIR/src first on
  the path), alternating with this one: a before/after comparison in the same run.
- `--synthetic NAME`: instead of a GGUF path, a random-weight model in a real model's shapes
  (`minfer.tools.synth`), written once into `--synthetic-dir` (~/.cache/minfer/synthetic):
  qwen35-0.8b / qwen35-2b (Qwen3.5's shapes, Q4_K_M mix), gptoss (gpt-oss-20b's layers, 16 of
  24, 8 of 32 experts, MXFP4_MOE mix), qwen3moe (the scaled Qwen3-30B-A3B), qwen25-0.5b.

    .venv/bin/python benchmarks/vs_llamacpp.py --ref-python /tmp/refvenv/bin/python -t 2
    .venv/bin/python benchmarks/vs_llamacpp.py --target avx2 \
        --ref-python-avx2 /tmp/refvenv2/bin/python -t 2
    .venv/bin/python benchmarks/vs_llamacpp.py --ref-python /tmp/refvenv/bin/python --busy 1 \
        --minfer-threads default,1,2 --llama-threads 1,2
    .venv/bin/python benchmarks/vs_llamacpp.py --synthetic qwen35-0.8b -t 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from cpu_targets import TARGET_ENV
from fresh_pages import drop_pages, model_files

LLAMA_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, time
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama
    path, threads, n_ctx, pp, tg, reps, depth = sys.argv[1], *map(int, sys.argv[2:8])
    llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, n_ubatch=512, verbose=False)
    rng = np.random.default_rng(1234)
    n_vocab = llm.n_vocab()
    def fill():
        llm.reset(); llm._ctx.kv_cache_clear()
        if depth:
            llm.eval(rng.integers(0, n_vocab, size=depth).tolist())
    def run_pp():
        toks = rng.integers(0, n_vocab, size=pp).tolist()
        fill()
        t0 = time.perf_counter(); llm.eval(toks); return time.perf_counter() - t0
    def run_tg():
        toks = rng.integers(0, n_vocab, size=tg + 1).tolist()
        fill(); llm.eval(toks[:1])
        t0 = time.perf_counter()
        for t in toks[1:]:
            llm.eval([t])
        return time.perf_counter() - t0
    out = {"threads": threads}
    for name, fn, n in (("pp%d" % pp, run_pp, pp), ("tg%d" % tg, run_tg, tg)):
        if not n:  # -p 0 / -n 0: that test is not run
            continue
        fn()
        out[name] = [n / fn() for _ in range(reps)]
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        out["system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    except Exception:
        pass
    print(json.dumps(out))
    """
)

MINFER_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import minfer
    from minfer.bench.runner import run_test
    path, threads, n_ctx, pp, tg, reps, depth = sys.argv[1], *map(int, sys.argv[2:8])
    backend = sys.argv[8]
    # threads 0: pass none, minfer chooses (minfer.load's default)
    model = minfer.load(path, n_ctx=n_ctx, threads=threads or None, backend=backend)
    engine = model.engine(n_ctx)
    out = {"threads": model.threads}
    for kw in [k for k in ({"n_prompt": pp}, {"n_gen": tg}) if any(k.values())]:
        row = run_test(engine, model=model.name, backend=backend, n_threads=model.threads,
                       reps=reps, n_depth=depth, **kw)
        key = "pp%d" % pp if row.n_prompt else "tg%d" % tg
        out[key] = [row.n_prompt / s if row.n_prompt else row.n_gen / s
                         for s in row.samples_s]
        if row.gb_per_s:
            out["gb_per_s"] = row.gb_per_s
    try:  # (a --minfer-tree from before these has neither)
        from minfer.bench.runner import held_bytes_per_token, weight_bytes_by_type
    except ImportError:
        pass
    else:  # the file's weight bytes a decode step reads, by type, and as the backend holds them
        out["bytes_by_type"] = weight_bytes_by_type(engine)
        out["held_bytes_per_token"] = held_bytes_per_token(engine)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    """
)


def run_one(python: str, script: str, args: list[str],
            env: dict[str, str] | None = None) -> dict[str, object]:
    proc = subprocess.run([python, "-c", script, *args], capture_output=True, text=True,
                          check=False, timeout=1800, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_busy(n: int) -> list[subprocess.Popen[bytes]]:
    """N single-threaded busy loops (each keeps one core busy while the scheduler lets it)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop exactly the processes start_busy made (by their Popen handles, i.e. their pids)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def thread_list(text: str, allow_default: bool) -> list[int]:
    """Thread counts from e.g. "default,1,2": [0, 1, 2] (0: let minfer choose)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if item == "default" and allow_default:
            out.append(0)
        elif item.isdigit() and int(item) > 0:
            out.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"bad thread count {item!r}")
    return out


# --synthetic NAME → (file name, writer name in minfer.tools.synth, its keyword arguments)
SYNTHETIC: dict[str, tuple[str, str, dict[str, object]]] = {
    "qwen35-0.8b": ("qwen35-0.8b-q4_k_m.gguf", "write_model_like_qwen35", {"size": "0.8b"}),
    "qwen35-2b": ("qwen35-2b-q4_k_m.gguf", "write_model_like_qwen35", {"size": "2b"}),
    "gptoss": ("gptoss-20b-16L-8E-mxfp4.gguf", "write_model_like_gptoss_20b", {}),
    "qwen3moe": ("qwen3moe-a3b-like-q4_k.gguf", "write_moe_like_qwen3_a3b", {}),
    "qwen25-0.5b": ("qwen25-0.5b-like.gguf", "write_model_like_qwen25_05b", {}),
}


def synthetic_model(name: str, directory: Path) -> Path:
    """The synthetic model's path, written (to a .part file, then renamed) if missing."""
    from minfer.tools import synth

    file_name, writer, kwargs = SYNTHETIC[name]
    path = directory / file_name
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        print(f"writing {path} (once) ...", file=sys.stderr, flush=True)
        getattr(synth, writer)(part, **kwargs)
        part.rename(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF path (default: the default model)")
    ap.add_argument("--ref-python", default="/tmp/refvenv/bin/python",
                    help="python with llama-cpp-python installed (native target)")
    ap.add_argument("--ref-python-avx2", default="/tmp/refvenv2/bin/python",
                    help="python with llama-cpp-python built without AVX-512 (--target avx2)")
    ap.add_argument("--target", choices=sorted(TARGET_ENV), default="native",
                    help="native: this CPU; avx2: both engines as on an AVX2-only CPU; "
                    "avx512-vnni: minfer as on AVX-512 VNNI without AMX (llama.cpp: native)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="run N busy-loop processes for the whole benchmark")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--minfer-threads", type=lambda t: thread_list(t, True), default=None,
                    help="comma-separated minfer thread counts, 'default': minfer chooses "
                         "(default: -t)")
    ap.add_argument("--llama-threads", type=lambda t: thread_list(t, False), default=None,
                    help="comma-separated llama.cpp thread counts (default: -t)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("-d", "--depth", type=int, default=0,
                    help="tokens already in the KV before each test (llama-bench's -d)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--stale-pages", action="store_true",
                    help="do not evict the model's files from the page cache before each run")
    ap.add_argument("--minfer-tree", type=Path, action="append", default=[], metavar="DIR",
                    help="another checkout's minfer to run beside this one (repeatable)")
    ap.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None,
                    help="a random-weight model in a real model's shapes instead of MODEL")
    ap.add_argument("--synthetic-dir", type=Path,
                    default=Path.home() / ".cache" / "minfer" / "synthetic",
                    help="where --synthetic models are written once and reused")
    args = ap.parse_args()
    if args.synthetic is not None:
        if args.model is not None:
            ap.error("give MODEL or --synthetic, not both")
        args.model = str(synthetic_model(args.synthetic, args.synthetic_dir))
    if args.model is None:
        from minfer.store import resolve_model

        args.model = str(resolve_model(None))
    ref_python = args.ref_python_avx2 if args.target == "avx2" else args.ref_python
    if not Path(ref_python).exists():
        ap.error(f"no reference interpreter at {ref_python} (see the README's development "
                 "section; --target avx2 uses --ref-python-avx2)")
    if args.target == "avx2":
        # pip reuses a cached wheel of the same version whatever CMAKE_ARGS say, so a second
        # build made without --no-cache-dir is the first one again (seen: AVX512 = 1 here)
        probe = subprocess.run([ref_python, "-c", "import llama_cpp; print(llama_cpp."
                                "llama_print_system_info().decode())"],
                               capture_output=True, text=True)
        info = probe.stdout
        if probe.returncode:
            ap.error(f"{ref_python} cannot import llama_cpp: {probe.stderr.strip()[-300:]}")
        if "AVX512 = 1" in info:
            ap.error(f"{ref_python}'s llama.cpp was built with AVX-512 ({info.strip()}): "
                     "rebuild it with pip's --no-cache-dir as the README shows")
    minfer_threads = args.minfer_threads or [args.threads]
    llama_threads = args.llama_threads or [args.threads]
    minfer_env = {**os.environ, **TARGET_ENV[args.target]}
    if 0 in minfer_threads:  # "default" is minfer's own choice, not a MINFER_THREADS override
        minfer_env.pop("MINFER_THREADS", None)
    n_ctx = max(args.n_ctx, args.depth + max(args.p, args.n + 1))
    shape = [str(n_ctx), str(args.p), str(args.n), str(args.reps), str(args.depth)]
    trees = {"minfer": None, **{f"minfer@{d.resolve().name}": d.resolve()
                                for d in args.minfer_tree}}
    jobs = [(name, t) for name in trees for t in minfer_threads] + \
        [("llama.cpp", t) for t in llama_threads]
    results: dict[tuple[str, int], list[dict[str, object]]] = {job: [] for job in jobs}
    files = [] if args.stale_pages else model_files(args.model)

    busy = start_busy(args.busy)
    try:
        if busy:
            print(f"{len(busy)} busy processes running (pids "
                  f"{', '.join(str(p.pid) for p in busy)})", file=sys.stderr)
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr)
            for engine, t in jobs if rnd % 2 == 0 else jobs[::-1]:  # alternate to spread drift
                drop_pages(files)
                if engine in trees:
                    tree = trees[engine]
                    env = minfer_env if tree is None else {**minfer_env,
                                                           "PYTHONPATH": str(tree / "src")}
                    res = run_one(sys.executable, MINFER_SCRIPT,
                                  [args.model, str(t), *shape, args.backend], env)
                else:
                    res = run_one(ref_python, LLAMA_SCRIPT, [args.model, str(t), *shape])
                results[(engine, t)].append(res)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        stop_busy(busy)

    tests = (f"pp{args.p}", f"tg{args.n}")

    def label(job: tuple[str, int]) -> str:
        engine, t = job
        if t == 0:
            return f"{engine} default ({results[job][0]['threads']} threads)"
        return f"{engine} -t {t}"

    def mean_rate(job: tuple[str, int], test: str) -> tuple[float, float]:
        rates = [r for res in results[job] for r in res[test]]  # type: ignore[attr-defined]
        return statistics.fmean(rates), statistics.pstdev(rates)

    def peak(job: tuple[str, int]) -> float:
        return max(float(res["peak_rss_mib"]) for res in results[job])  # type: ignore[arg-type]

    sysinfo = next((str(r["system_info"]) for job in jobs for r in results[job]
                    if "system_info" in r), None)
    print(f"\nmodel {args.model}, target {args.target}, n_ctx {n_ctx}, depth {args.depth}, "
          f"minfer backend {args.backend}, {args.busy} busy processes running, "
          f"{args.rounds} rounds × {args.reps} reps")
    if args.target != "native":
        print(f"minfer: {' '.join(f'{k}={v}' for k, v in TARGET_ENV[args.target].items())}")
    print(f"llama.cpp: {ref_python}" + (f" ({sysinfo})" if sysinfo else "") + "\n")
    print(f"| engine | {' | '.join(f'{t} tok/s' for t in tests)} | peak RSS |")
    print(f"| --- |{' ---: |' * len(tests)} ---: |")
    for job in jobs:
        cells = [f"{m:.1f} ± {sd:.1f}" for m, sd in (mean_rate(job, t) for t in tests)]
        print(f"| {label(job)} | {' | '.join(cells)} | {peak(job):.0f} MiB |")

    # ratios (of mean tok/s; peak RSS against the smallest llama.cpp peak)
    llama_jobs = [j for j in jobs if j[0] == "llama.cpp"]
    fixed = [j for j in jobs if j[0] == "minfer" and j[1] != 0]
    summary: dict[str, dict[str, float]] = {}
    print(f"\n| ratio | {' | '.join(tests)} | peak RSS |")
    print(f"| --- |{' ---: |' * len(tests)} ---: |")
    for job in (j for j in jobs if j[0] in trees):
        row = {t: mean_rate(job, t)[0] / max(mean_rate(j, t)[0] for j in llama_jobs)
               for t in tests}
        row["peak_rss"] = peak(job) / min(peak(j) for j in llama_jobs)
        best = "" if len(llama_jobs) == 1 else "best "
        name = f"{label(job)} / {best}{label(llama_jobs[0]) if not best else 'llama.cpp'}"
        summary[name] = row
        print(f"| {name} | {' | '.join(f'{row[t]:.2f}×' for t in tests)} | "
              f"{row['peak_rss']:.2f}× |")
    if (0 in minfer_threads) and fixed:
        row = {t: mean_rate(("minfer", 0), t)[0] / max(mean_rate(j, t)[0] for j in fixed)
               for t in tests}
        name = f"{label(('minfer', 0))} / best fixed minfer"
        summary[name] = row
        print(f"| {name} | {' | '.join(f'{row[t]:.2f}×' for t in tests)} | |")

    if args.json:
        args.json.write_text(json.dumps({
            "model": args.model, "target": args.target,
            "target_env": TARGET_ENV[args.target], "ref_python": ref_python,
            "llama_system_info": sysinfo, "busy": args.busy, "n_ctx": n_ctx, "depth": args.depth,
            "backend": args.backend, "rounds": args.rounds, "reps": args.reps,
            "results": {label(j): results[j] for j in jobs}, "ratios": summary,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
