"""Decode speed with the per-step trace off and on (the cost `minfer viz` / MINFER_TRACE adds);
not a test.

    .venv/bin/python benchmarks/viz_trace_bench.py [--model PATH] [-n 32] [--rounds 5]
        [--compare-src /path/to/other/checkout/src]

One engine on the development model, a 32-token prefill, then rounds of `-n` decode steps at the
same positions, alternating untraced (tracer None) and traced (every node summarized: statistics
and heatmap) rounds so both see the same machine load. Prints ms/token per mode (median over the
rounds) and the ratio. With `--compare-src`, untraced rounds also run in child processes whose
PYTHONPATH is that checkout's src (e.g. the main branch, without the tracer hook), alternating
with children on this checkout: the row that shows the untraced path is unchanged.

Measured on a 2-core Intel Xeon (Sapphire Rapids) shared with ~5 other jobs (load average
10-12, so absolute figures are ~6x an idle machine's; only the side-by-side ratios count), the
0.5B development model, 2 threads: traced decode 1.12x and 1.15x the untraced time in two runs
(7 and 9 alternating rounds of 32 steps); summarizing all 440 node outputs of one decode step
6.0-12.1 ms; untraced decode on this branch vs its base commit (2c443cc, no tracer hook) in
alternating child processes: 0.93x (noise; the hook is one None check per forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_TOKENS = 32


def decode_ms(engine: object, n: int, start: int) -> float:
    t0 = time.perf_counter()
    token = 1
    for i in range(n):
        logits = engine.forward([token], start + i)  # type: ignore[attr-defined]
        token = int(logits[0].argmax())
    return (time.perf_counter() - t0) * 1e3 / n


def make_engine(model: str, threads: int) -> object:
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile

    f = GGUFFile.open(model)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=512, n_threads=threads)
    engine.forward(list(range(100, 100 + PROMPT_TOKENS)), 0)
    decode_ms(engine, 8, PROMPT_TOKENS)  # compile / warm
    return engine


def in_process(args: argparse.Namespace) -> dict[str, list[float]]:
    from minfer.engine.trace import StepTracer

    engine = make_engine(args.model, args.threads)
    rows: dict[str, list[float]] = {"untraced": [], "traced": []}
    for _ in range(args.rounds):
        engine.tracer = None  # type: ignore[attr-defined]
        rows["untraced"].append(decode_ms(engine, args.n, PROMPT_TOKENS))
        engine.tracer = StepTracer(max_steps=4)  # type: ignore[attr-defined]
        rows["traced"].append(decode_ms(engine, args.n, PROMPT_TOKENS))
    return rows


def summaries_alone(args: argparse.Namespace) -> float:
    """ms per decode step spent summarizing every node's output (the trace's own work),
    timed on one step's captured outputs, away from the forward."""
    import numpy as np

    from minfer.engine.tensor_stats import STAT_KEYS, summarize_into
    from minfer.engine.trace import StepTracer

    engine = make_engine(args.model, args.threads)
    engine.tracer = StepTracer(capture=True, max_steps=1)  # type: ignore[attr-defined]
    decode_ms(engine, 1, PROMPT_TOKENS)
    outputs = list(engine.tracer.steps[-1].outputs.values())  # type: ignore[attr-defined]
    values = np.empty(len(STAT_KEYS))
    t0 = time.perf_counter()
    for _ in range(20):
        for out in outputs:
            summarize_into(out, values)
    return (time.perf_counter() - t0) * 1e3 / 20


def child(args: argparse.Namespace) -> None:
    """One untraced measurement in this process (whatever minfer PYTHONPATH gives)."""
    engine = make_engine(args.model, args.threads)
    if hasattr(engine, "tracer"):
        engine.tracer = None
    print(json.dumps([decode_ms(engine, args.n, PROMPT_TOKENS) for _ in range(args.rounds)]))


def across_checkouts(args: argparse.Namespace) -> dict[str, list[float]]:
    here = str(Path(__file__).resolve().parents[1] / "src")
    rows: dict[str, list[float]] = {"this checkout": [], args.compare_src: []}
    for _ in range(3):
        for label, src in ((args.compare_src, args.compare_src), ("this checkout", here)):
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model,
                                  "-n", str(args.n), "--rounds", "2", "-t", str(args.threads)],
                                 env=env, capture_output=True, text=True, check=True)
            rows[label] += json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def report(rows: dict[str, list[float]], base: str) -> None:
    ref = statistics.median(rows[base])
    print(f"| mode | ms/token (median of {len(rows[base])}) | tok/s | vs {base} |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.2f} | {1e3 / med:.1f} | {med / ref:.3f}x |")


def main() -> int:
    from minfer.store import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("-n", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--compare-src", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model = str(resolve_model(args.model))
    if args.child:
        child(args)
        return 0
    print(f"model {Path(args.model).name}, {args.threads} threads, {args.n} decode steps/round")
    report(in_process(args), "untraced")
    print(f"summarizing every node of one decode step alone: {summaries_alone(args):.2f} ms")
    if args.compare_src:
        report(across_checkouts(args), args.compare_src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
