"""minfer vs llama.cpp, side by side in one run: pp512 and tg128 ratios and peak RSS.

Not part of the test suite. Each engine runs in its own subprocess (so peak RSS is its own),
alternating minfer / llama.cpp for `--rounds` rounds to spread machine drift over both; the
ratio is minfer / llama.cpp of the mean tokens/s. llama.cpp runs through llama-cpp-python from
a separate interpreter (`--ref-python`, see the README's development section).

    .venv/bin/python benchmarks/vs_llamacpp.py --ref-python /tmp/refvenv/bin/python -t 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

LLAMA_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, time
    import numpy as np
    from llama_cpp import Llama
    path, threads, n_ctx, pp, tg, reps = sys.argv[1], *map(int, sys.argv[2:7])
    llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, n_ubatch=512, verbose=False)
    rng = np.random.default_rng(1234)
    n_vocab = llm.n_vocab()
    def run_pp():
        toks = rng.integers(0, n_vocab, size=pp).tolist()
        llm.reset(); llm._ctx.kv_cache_clear()
        t0 = time.perf_counter(); llm.eval(toks); return time.perf_counter() - t0
    def run_tg():
        toks = rng.integers(0, n_vocab, size=tg + 1).tolist()
        llm.reset(); llm._ctx.kv_cache_clear(); llm.eval(toks[:1])
        t0 = time.perf_counter()
        for t in toks[1:]:
            llm.eval([t])
        return time.perf_counter() - t0
    out = {}
    for name, fn, n in (("pp%d" % pp, run_pp, pp), ("tg%d" % tg, run_tg, tg)):
        fn()
        out[name] = [n / fn() for _ in range(reps)]
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    """
)

MINFER_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import minfer
    from minfer.bench.runner import run_test
    path, threads, n_ctx, pp, tg, reps = sys.argv[1], *map(int, sys.argv[2:7])
    backend = sys.argv[7]
    model = minfer.load(path, n_ctx=n_ctx, threads=threads, backend=backend)
    engine = model.engine(n_ctx)
    out = {}
    for kw in ({"n_prompt": pp}, {"n_gen": tg}):
        row = run_test(engine, model=model.name, backend=backend, n_threads=threads, reps=reps,
                       **kw)
        out[row.test] = [row.n_prompt / s if row.n_prompt else row.n_gen / s
                         for s in row.samples_s]
        if row.gb_per_s:
            out["gb_per_s"] = row.gb_per_s
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    """
)


def run_one(python: str, script: str, args: list[str]) -> dict[str, object]:
    proc = subprocess.run([python, "-c", script, *args], capture_output=True, text=True,
                          check=False, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{python} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF path (default: the default model)")
    ap.add_argument("--ref-python", required=True, help="python with llama-cpp-python installed")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    if args.model is None:
        from minfer.store import resolve_model

        args.model = str(resolve_model(None))
    common = [args.model, str(args.threads), str(args.n_ctx), str(args.p), str(args.n),
              str(args.reps)]
    results: dict[str, list[dict[str, object]]] = {"minfer": [], "llama.cpp": []}
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr)
        results["minfer"].append(run_one(sys.executable, MINFER_SCRIPT, [*common, args.backend]))
        results["llama.cpp"].append(run_one(args.ref_python, LLAMA_SCRIPT, common))

    def mean_rate(name: str, test: str) -> tuple[float, float]:
        rates = [r for res in results[name] for r in res[test]]  # type: ignore[attr-defined]
        return statistics.fmean(rates), statistics.pstdev(rates)

    def peak(name: str) -> float:
        return max(float(res["peak_rss_mib"]) for res in results[name])  # type: ignore[arg-type]

    print(f"\nmodel {args.model}, {args.threads} threads, n_ctx {args.n_ctx}, "
          f"minfer backend {args.backend}\n")
    print("| test | minfer tok/s | llama.cpp tok/s | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for test in (f"pp{args.p}", f"tg{args.n}"):
        m, ms = mean_rate("minfer", test)
        ll, ls = mean_rate("llama.cpp", test)
        print(f"| {test} | {m:.1f} ± {ms:.1f} | {ll:.1f} ± {ls:.1f} | {m / ll:.2f}× |")
    pm, pl = peak("minfer"), peak("llama.cpp")
    print(f"| peak RSS | {pm:.0f} MiB | {pl:.0f} MiB | {pm / pl:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
