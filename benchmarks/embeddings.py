"""Embedding throughput: minfer against sentence-transformers (torch, CPU) and llama.cpp
(llama-cpp-python's `embed`) on the same texts, side by side, each in its own process.

    python benchmarks/embeddings.py --folder DIR --gguf F32.gguf [--gguf Q8.gguf]
        [--llama-python /path/to/venv/bin/python] [--texts 1000] [--threads 2] [--rounds 2]

The texts are 10-60 words drawn with a fixed seed from a fixed word list. Every engine embeds
all of them once to warm up (compilation, caches), then the timed pass; rounds alternate the
engines so drift on a shared host hits each alike. Prints sentences per second (median of the
rounds) and each process's peak RSS, as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys

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
t0 = time.perf_counter()
run()
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"rate": len(texts) / dt, "rss_mib": rss}))
"""


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60))) for _ in range(n)]


def run_child(python: str, texts: list[str], kind: str, target: str,
              threads: int) -> dict[str, float]:
    proc = subprocess.run([python, "-c", CHILD], input=json.dumps([texts, kind, target, threads]),
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{kind} {target} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", required=True, help="the sentence-transformers folder")
    ap.add_argument("--gguf", action="append", required=True, help="GGUF(s) of the same model")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    texts = make_texts(args.texts)
    runs: list[tuple[str, str, str, str]] = [("sentence-transformers", sys.executable, "st",
                                              args.folder)]
    for g in args.gguf:
        runs.append((f"minfer {g}", sys.executable, "minfer", g))
        if args.llama_python:
            runs.append((f"llama.cpp {g}", args.llama_python, "llama", g))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in runs}
    for r in range(args.rounds):
        for name, python, kind, target in runs:
            out = run_child(python, texts, kind, target, args.threads)
            results[name].append(out)
            print(f"round {r + 1}: {name}: {out['rate']:.1f} sentences/s, "
                  f"peak RSS {out['rss_mib']:.0f} MiB", file=sys.stderr)
    base = statistics.median(x["rate"] for x in results["sentence-transformers"])
    print(f"| engine ({args.texts} texts, {args.threads} threads) | sentences/s | "
          "vs sentence-transformers | peak RSS |")
    print("| --- | ---: | ---: | ---: |")
    for name, outs in results.items():
        rate = statistics.median(x["rate"] for x in outs)
        rss = max(x["rss_mib"] for x in outs)
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {rss:.0f} MiB |")


if __name__ == "__main__":
    main()
