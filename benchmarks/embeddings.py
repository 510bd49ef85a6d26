"""Embedding throughput: minfer against sentence-transformers (torch, CPU) and llama.cpp
(llama-cpp-python's `embed`) on the same texts, side by side, each in its own process.

    python benchmarks/embeddings.py --folder DIR --gguf F32.gguf [--gguf Q8.gguf]
        [--llama-python /path/to/venv/bin/python] [--texts 1000] [--threads 2] [--rounds 2]
        [--target native|avx2|avx512-vnni] [--f32-gemm-too] [--profile]

The texts are 10-60 words drawn with a fixed seed from a fixed word list. Every engine embeds
all of them once to warm up (compilation, caches), then the timed pass; rounds alternate the
engines so drift on a shared host hits each alike. Prints sentences per second (median of the
rounds) and each process's peak RSS, as a markdown table.

`--target avx2` / `avx512-vnni` runs minfer and sentence-transformers as on an older CPU
(`cpu_targets.py`: numba's target for minfer; ATen's, oneDNN's and MKL's ISA caps for torch):
an AMX host measures the two non-AMX kinds. llama.cpp keeps its interpreter's build.
`--f32-gemm-too`: each GGUF also under MINFER_ENCODER_F32 (the f32 GEMM, not the file's
integer or AMX path), in the same alternation. `--profile`: minfer's seconds per op:role over
its timed pass (MINFER_PROFILE), on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from typing import Any

from cpu_targets import TARGET_ENV, TORCH_ENV

_WORD_TEXT = ("the model runs on a local machine and answers every question about code data text "
         "search index vector query document retrieval small fast embedding sentence token "
         "python engine server client request memory cache layer weight quantized float "
         "batch thread core laptop user file folder network browser editor completion "
         "function class method return value error test build release version update "
         "morning evening coffee tea book garden river mountain city train music")
WORDS = _WORD_TEXT.split()

CHILD = r"""
import json, resource, sys, time
texts, kind, target, threads = json.loads(sys.stdin.read())
if kind == "st":
    import torch
    torch.set_num_threads(threads)
    from sentence_transformers import SentenceTransformer
    m = SentenceTransformer(target, device="cpu")
    run = lambda: m.encode(texts, batch_size=32, normalize_embeddings=True)
elif kind == "minfer":
    import minfer
    m = minfer.load(target, threads=threads)
    run = lambda: m.embed(texts)
else:
    from llama_cpp import Llama
    m = Llama(target, embedding=True, n_threads=threads, n_threads_batch=threads,
              verbose=False)
    run = lambda: m.embed(texts, normalize=True)
run()
profile = m.embedder().engine.profile if kind == "minfer" else None
if profile is not None:
    profile.clear()
t0 = time.perf_counter()
run()
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"rate": len(texts) / dt, "rss_mib": rss, "profile": profile or {}}))
"""


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60))) for _ in range(n)]


def run_child(python: str, texts: list[str], kind: str, target: str, threads: int,
              env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([python, "-c", CHILD], input=json.dumps([texts, kind, target, threads]),
                          capture_output=True, text=True, check=False,
                          env={**os.environ, **env})
    if proc.returncode:
        raise SystemExit(f"{kind} {target} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def child_env(kind: str, target: str, profile: bool) -> dict[str, str]:
    """The environment one engine's process runs in under the emulated target."""
    if kind == "st":
        return TORCH_ENV[target]
    if kind == "minfer":
        return {**TARGET_ENV[target], **({"MINFER_PROFILE": "1"} if profile else {})}
    return {}


def print_profile(name: str, profile: dict[str, float], n_texts: int) -> None:
    """minfer's ms per op:role over one timed pass, largest first, on stderr."""
    total = sum(profile.values())
    print(f"{name}: {total * 1e3:.0f} ms in the tape's ops over {n_texts} texts", file=sys.stderr)
    for key, sec in sorted(profile.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {key:40s} {sec * 1e3:8.1f} ms  {sec / total:5.1%}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", required=True, help="the sentence-transformers folder")
    ap.add_argument("--gguf", action="append", required=True, help="GGUF(s) of the same model")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", choices=sorted(TARGET_ENV), default="native",
                    help="run minfer and sentence-transformers as on this kind of CPU")
    ap.add_argument("--f32-gemm-too", action="store_true",
                    help="also each GGUF under MINFER_ENCODER_F32 (the f32 GEMM), alternating")
    ap.add_argument("--profile", action="store_true",
                    help="minfer's ms per op:role over each timed pass (stderr)")
    args = ap.parse_args()
    texts = make_texts(args.texts)
    runs: list[tuple[str, str, str, str, dict[str, str]]] = [
        ("sentence-transformers", sys.executable, "st", args.folder, {})]
    for g in args.gguf:
        runs.append((f"minfer {g}", sys.executable, "minfer", g, {}))
        if args.f32_gemm_too:
            runs.append((f"minfer {g} (f32 GEMM)", sys.executable, "minfer", g,
                         {"MINFER_ENCODER_F32": "1"}))
        if args.llama_python:
            runs.append((f"llama.cpp {g}", args.llama_python, "llama", g, {}))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in runs}
    for r in range(args.rounds):
        for name, python, kind, target, extra in runs:
            out = run_child(python, texts, kind, target, args.threads,
                            {**child_env(kind, args.target, args.profile), **extra})
            results[name].append(out)
            print(f"round {r + 1}: {name}: {out['rate']:.1f} sentences/s, "
                  f"peak RSS {out['rss_mib']:.0f} MiB", file=sys.stderr)
            if out.get("profile"):
                print_profile(name, out["profile"], len(texts))
    base = statistics.median(x["rate"] for x in results["sentence-transformers"])
    print(f"| engine ({args.texts} texts, {args.threads} threads, target {args.target}) | "
          "sentences/s | "
          "vs sentence-transformers | peak RSS |")
    print("| --- | ---: | ---: | ---: |")
    for name, outs in results.items():
        rate = statistics.median(x["rate"] for x in outs)
        rss = max(x["rss_mib"] for x in outs)
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {rss:.0f} MiB |")


if __name__ == "__main__":
    main()
