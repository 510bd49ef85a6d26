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

`--vs-llamacpp PYTHON`: instead, each cache type against llama.cpp's (llama-cpp-python in that
interpreter, flash attention on, which llama.cpp needs for a quantized V): every position of the
public prompts (with their continuations) and of tests/fixtures/kv_long_prompt.txt, |dlogit|
over llama.cpp f16's top-10, pair by pair (minfer's cache vs llama.cpp's same type, llama.cpp's
quantized caches with and without its rotation vs its f16 cache, minfer f16 vs llama.cpp f16).

Measured (AMD EPYC Zen 3, AVX2, 2 threads, after the rotation follows llama.cpp's chunks):
fidelity max/mean |dlogit|, argmax kept of 217: f32 0.46/0.07 216; q8_0 7.2/0.17 209; q4_0
27.8/2.67 138; q8_0/f16 8.7/0.18 209; f16/q4_0 1.5/0.14 210 (with the 32-value rotation before:
q8_0 12.5/0.23 205, q4_0 19.2/2.06 151). --vs-llamacpp, public / long prompt: minfer q8_0 vs
llama.cpp q8_0 2.0/0.085, 0.70/0.086 (before 12.5/0.29, 1.7/0.15); q4_0 8.3/0.46, 14.4/0.68
(before 30.4/2.27, 17.2/1.59); llama.cpp q4_0 vs its f16 30.9/2.58, 20.0/2.18; minfer f16 vs
llama.cpp f16 0.56/0.063, 0.44/0.068. Speed at depth 4096, ratio to f16 (2026-12-01, Intel Xeon
Sapphire Rapids, 2 threads, shared machine, the 32-value rotation): pp512 f32 0.99, q8_0 1.02,
q4_0 0.96; decode f32 0.98, q8_0 0.96, q4_0 0.90.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

from minfer.engine.forward import Batch, Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

TYPES = [("f16", "f16"), ("f32", "f32"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"),
         ("f16", "q4_0")]
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
FIXTURE = FIXTURES / "greedy.json"
LONG_PROMPT = FIXTURES / "kv_long_prompt.txt"  # 378 tokens of prose and Python (Qwen2.5)


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


# llama.cpp's side of --vs-llamacpp: every sequence through one context per cache type (flash
# attention on: llama.cpp needs it for a quantized V), logits at every position. The f16 run
# picks, per position, its top-32 ids; every run keeps its logits at those ids.
LLAMA_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from llama_cpp import Llama
    path, seq_file, out, threads = sys.argv[1:5]
    seqs = json.loads(open(seq_file).read())
    ggml = {"f16": 1, "q4_0": 2, "q8_0": 8}
    ids, vals = [], {}
    for name in ("f16", "q8_0", "q4_0", "q8_0 norot", "q4_0 norot"):
        kv, _, norot = name.partition(" ")
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1" if norot else "0"
        llm = Llama(model_path=path, n_ctx=1024, n_batch=1024, n_ubatch=1024,
                    n_threads=int(threads), n_threads_batch=int(threads), type_k=ggml[kv],
                    type_v=ggml[kv], flash_attn=True, logits_all=True, verbose=False)
        got = []
        for i, s in enumerate(seqs):
            llm.reset()
            llm.eval(s)
            lg = np.array(llm.scores[: len(s)], np.float32)
            if name == "f16":
                ids.append(np.argsort(-lg, axis=1)[:, :32])
            got.append(np.take_along_axis(lg, ids[i], 1))
        vals[name] = got
        del llm
    np.savez(out, **{f"ids{i}": a for i, a in enumerate(ids)},
             **{f"{n}|{i}": a for n, g in vals.items() for i, a in enumerate(g)})
    print("ok")
    """)


def _sequences(model: str, f: GGUFFile) -> dict[str, list[list[int]]]:
    """The public prompts with their greedy continuations, and the long prompt."""
    from minfer.tokenizer.tokenizer import load_tokenizer

    gemma = "gemma" in Path(model).name
    cases = json.loads((FIXTURES / ("gemma3_greedy.json" if gemma else "greedy.json"))
                       .read_text())["cases"]
    long_ids = load_tokenizer(f).encode(LONG_PROMPT.read_text())
    return {"public": [c["prompt_ids"] + c["greedy_ids"][:-1] for c in cases],
            "long": [long_ids]}


def vs_llamacpp(model: str, f: GGUFFile, hp: HParams, ref_python: str, threads: int) -> None:
    """Max / mean |dlogit| over llama.cpp f16's top-10 at every position, pair by pair:
    minfer's quantized caches against llama.cpp's same type, next to llama.cpp's own quantized
    caches (with and without its rotation) against its f16 cache."""
    groups = _sequences(model, f)
    seqs = [s for g in groups.values() for s in g]
    with tempfile.TemporaryDirectory() as tmp:
        seq_file, out = Path(tmp) / "seqs.json", Path(tmp) / "llama.npz"
        seq_file.write_text(json.dumps(seqs))
        proc = subprocess.run([ref_python, "-c", LLAMA_CHILD, model, str(seq_file), str(out),
                               str(threads)], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        z = np.load(out)
        ids = [z[f"ids{i}"] for i in range(len(seqs))]
        vals = {k.split("|")[0]: [z[f"{k.split('|')[0]}|{i}"] for i in range(len(seqs))]
                for k in z.files if "|" in k}
    for kv in ("f16", "q8_0", "q4_0"):
        e = _engine(f, hp, kv, kv, 1024, threads)
        vals[f"minfer {kv}"] = [
            np.take_along_axis(e.forward_batch(Batch.single(s, 0, n_out=len(s))), i, 1)
            for s, i in zip(seqs, ids, strict=True)]
    pairs = [("minfer f16", "f16"), ("q8_0", "f16"), ("q8_0 norot", "f16"),
             ("minfer q8_0", "q8_0"), ("minfer q8_0", "minfer f16"), ("q4_0", "f16"),
             ("q4_0 norot", "f16"), ("minfer q4_0", "q4_0"), ("minfer q4_0", "minfer f16")]
    names = list(groups)
    print(f"vs llama.cpp ({Path(model).name}): |dlogit| over llama.cpp f16's top-10 at every "
          "position, max / mean; plain names are llama.cpp (flash attention on)")
    print("| A vs B | " + " | ".join(f"{g} ({sum(map(len, groups[g]))} pos)" for g in names)
          + " |")
    print("| --- |" + " ---: |" * len(names))
    for a, b in pairs:
        cells, at = [], 0
        for g in names:
            n = len(groups[g])
            d = np.concatenate([np.abs(x[:, :10] - y[:, :10]).ravel() for x, y in
                                zip(vals[a][at:at + n], vals[b][at:at + n], strict=True)])
            at += n
            cells.append(f"{d.max():.3f} / {d.mean():.3f}")
        print(f"| {a} vs {b} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/minfer/"
                                           "qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-fidelity", action="store_true")
    ap.add_argument("--vs-llamacpp", metavar="PYTHON",
                    help="only compare with llama.cpp's caches (an interpreter that has "
                         "llama-cpp-python)")
    args = ap.parse_args()
    f = GGUFFile.open(args.model)
    hp = HParams.from_gguf(f)
    if args.vs_llamacpp:
        vs_llamacpp(args.model, f, hp, args.vs_llamacpp, args.threads)
        return
    if not args.skip_fidelity:
        fidelity(f, hp, args.threads)
    if not args.skip_speed:
        speed(f, hp, args.depth, args.rounds, args.threads)


if __name__ == "__main__":
    main()
