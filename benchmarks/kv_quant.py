"""Quantized KV caches on the development model: fidelity against the f16 cache, and speed at depth.

    PYTHONPATH=$PWD/src python benchmarks/kv_quant.py [--model PATH] [--depth 4096] [--rounds 3]

Fidelity: for each public prompt of tests/fixtures/greedy.json (llama.cpp's greedy continuations),
the prompt plus its continuation is run through one prefill with every row out; at each position
the f16 cache's top-10 tokens are looked up in each cache type's logits and |Δlogit| is taken
(max and mean over all positions and prompts). Also the fraction of positions whose argmax
matches the f16 cache's.

Speed: one engine per type is filled to `--depth` tokens (512-token chunks), then, in rounds that
alternate the types (the machine may be shared: only ratios within one run mean anything),
16 decode steps at the depth and one 512-token prefill at the depth are timed. Reported: medians
and the ratio to f16.

Measured 2026-12-01 (Intel Xeon Sapphire Rapids, 2 threads, machine shared with other jobs):
fidelity max/mean |dlogit|, argmax kept of 217: f32 0.39/0.07 216; q8_0 13.5/0.22 207;
q4_0 19.3/2.06 153; q8_0/f16 12.5/0.23 206; f16/q4_0 1.6/0.13 214 (llama.cpp 0.3.36, same
positions against its own f16 cache: q8_0 8.8/0.18 211, q4_0 29.9/2.59 140). Speed at depth 4096,
ratio to f16: pp512 f32 0.99, q8_0 1.02, q4_0 0.96; decode f32 0.98, q8_0 0.96, q4_0 0.90.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from minfer.engine.forward import Batch, Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

TYPES = [("f16", "f16"), ("f32", "f32"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"),
         ("f16", "q4_0")]
FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "greedy.json"


def _engine(f: GGUFFile, hp: HParams, kt: str, vt: str, n_ctx: int, threads: int) -> Engine:
    return Engine(f, hp, n_ctx=n_ctx, k_type=kt, v_type=vt, fuse_gate_up=False,
                  n_threads=threads)


def fidelity(f: GGUFFile, hp: HParams, threads: int) -> None:
    cases = json.loads(FIXTURE.read_text())["cases"]
    seqs = [c["prompt_ids"] + c["greedy_ids"][:-1] for c in cases]
    logits: dict[str, list[np.ndarray]] = {}
    for kt, vt in TYPES:
        e = _engine(f, hp, kt, vt, 512, threads)
        name = kt if kt == vt else f"{kt}/{vt}"
        logits[name] = [e.forward_batch(Batch.single(s, 0, n_out=len(s))) for s in seqs]
    ref = logits["f16"]
    print(f"fidelity: {len(seqs)} public prompts + llama.cpp greedy continuations, "
          f"{sum(map(len, seqs))} positions; top-10 of the f16 cache")
    print("| cache K/V | KiB/token | top-10 max abs dlogit | mean | argmax = f16 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    n_kv = hp.n_head_kv * hp.head_dim
    from minfer.backends.cpu.kernels.attn.kv_formats import bytes_per_token

    for name, got in logits.items():
        deltas, same, total = [], 0, 0
        for a, b in zip(got, ref, strict=True):
            top = np.argsort(-b, axis=1)[:, :10]
            d = np.abs(np.take_along_axis(a, top, 1) - np.take_along_axis(b, top, 1))
            deltas.append(d.ravel())
            same += int((a.argmax(1) == b.argmax(1)).sum())
            total += a.shape[0]
        kt, _, vt = name.partition("/")
        kib = bytes_per_token(hp.n_layer, n_kv, kt, vt or kt) / 1024
        alld = np.concatenate(deltas)
        print(f"| {name} | {kib:.1f} | {alld.max():.4f} | {alld.mean():.4f} | "
              f"{same}/{total} |")


def speed(f: GGUFFile, hp: HParams, depth: int, rounds: int, threads: int) -> None:
    rng = np.random.default_rng(0)
    n_ctx = depth + 512 + 32
    engines = {}
    fill_s = {}
    for kt, vt in TYPES[:4]:
        e = _engine(f, hp, kt, vt, n_ctx, threads)
        toks = rng.integers(100, 20000, depth).tolist()
        t0 = time.perf_counter()
        for i in range(0, depth, 512):
            e.forward(toks[i:i + 512], i)
        fill_s[kt] = time.perf_counter() - t0
        engines[kt] = e
    tg: dict[str, list[float]] = {k: [] for k in engines}
    pp: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(rounds):
        for name, e in engines.items():
            t0 = time.perf_counter()
            for i in range(16):
                e.forward([int(rng.integers(100, 20000))], depth + i)
            tg[name].append(16 / (time.perf_counter() - t0))
        for name, e in engines.items():
            toks = rng.integers(100, 20000, 512).tolist()
            t0 = time.perf_counter()
            e.forward(toks, depth)
            pp[name].append(512 / (time.perf_counter() - t0))
    print(f"\nspeed at depth {depth}, {threads} threads, {rounds} rounds alternating the types "
          f"(medians; ratios to f16 within this run)")
    print("| cache | fill 0..depth t/s | pp512 @depth t/s | ratio | tg @depth t/s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base_pp, base_tg = statistics.median(pp["f16"]), statistics.median(tg["f16"])
    for name in engines:
        p, t = statistics.median(pp[name]), statistics.median(tg[name])
        print(f"| {name} | {depth / fill_s[name]:.1f} | {p:.1f} | {p / base_pp:.2f} | "
              f"{t:.2f} | {t / base_tg:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/minfer/"
                                           "qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-fidelity", action="store_true")
    args = ap.parse_args()
    f = GGUFFile.open(args.model)
    hp = HParams.from_gguf(f)
    if not args.skip_fidelity:
        fidelity(f, hp, args.threads)
    if not args.skip_speed:
        speed(f, hp, args.depth, args.rounds, args.threads)


if __name__ == "__main__":
    main()
