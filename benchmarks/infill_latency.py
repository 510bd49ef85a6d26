"""Code completion at keystroke latency: `minfer serve`'s `/infill` against llama.cpp.

Not part of the test suite. An editor sends a fill-in-the-middle request per pause in typing: a
~1,500-token Python file, the cursor at 80% of it, and 20 successive requests as a typist makes
them (one to five characters typed at the cursor between requests, the suffix unchanged). Each
request asks for a 32-token greedy completion. Measured per request: time to the first content
chunk (TTFT) and to the whole completion, and the prompt tokens the server found in its cache.

minfer: `minfer serve MODEL -t T --slots 1` on 127.0.0.1, streaming `/infill`.
llama.cpp: `llama_cpp.server` has no `/infill`, so the identical token prompt (laid out as
llama.cpp's `format_prompt_infill`, checked token for token by tests/test_infill_real.py) is fed
to llama-cpp-python's `Llama.generate`, which reuses the longest common token prefix of its
previous prompt (its own prompt cache) and evaluates the rest, then decodes greedily; TTFT is
the time to its first token. With `--llama-server PATH` llama.cpp's own server answers the same
`/infill` requests instead (its layout, its prompt cache, n_batch 2048). The engines run one
after the other, alternating per `--rounds`. `--chunk N`: minfer serve's prompt tokens per step
(default: the server's own, 512 while nothing else decodes).

    .venv/bin/python benchmarks/infill_latency.py --ref-python /tmp/refvenv2/bin/python -t 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import HOST, free_port, stop, wait_ready

N_GEN = 32
TYPED = "total = sum(item.price * item.quantity for item in order.items if item.active)\n"

LLAMA_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from llama_cpp import Llama
    path, threads, n_ctx, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    prompts = json.loads(sys.stdin.read())
    llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, n_ubatch=512, verbose=False)
    out = []
    for ids in prompts:
        t0 = time.perf_counter(); ttft = None; n = 0
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0):
            n += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
            if n >= n_gen or llm.token_eos() == tok:
                break
        out.append({"ttft": ttft, "total": time.perf_counter() - t0, "tokens": n})
    print(json.dumps(out))
    """
)


def source_file(tokenize: object, n_tokens: int) -> str:
    """About n_tokens of plausible Python: a module of small functions and a class."""
    rng = random.Random(1234)
    names = ["price", "quantity", "order", "customer", "invoice", "discount", "tax", "item"]
    parts = ['"""Orders, invoices and their totals."""\n\nimport math\nfrom dataclasses '
             'import dataclass\n\n']
    i = 0
    while True:
        a, b = rng.sample(names, 2)
        parts.append(f"def {a}_{b}_{i}(values, scale={i % 7 + 1}):\n"
                     f"    \"\"\"Combine the {a} and {b} of each value.\"\"\"\n"
                     f"    result = 0\n    for v in values:\n"
                     f"        result += v.{a} * scale - v.{b}\n"
                     f"    return math.floor(result)\n\n\n")
        text = "".join(parts)
        if len(tokenize(text)) >= n_tokens:  # type: ignore[operator]
            return text
        i += 1


def keystrokes(text: str, n: int, at: float) -> list[tuple[str, str]]:
    """(prefix, suffix) of n successive requests: 1-5 characters of TYPED inserted each time."""
    rng = random.Random(7)
    cut = text.rfind("\n", 0, int(len(text) * at)) + 1
    prefix, suffix, typed = text[:cut], text[cut:], 0
    out = []
    for _ in range(n):
        k = rng.randint(1, 5)
        chunk = TYPED[typed:typed + k]
        typed += k
        prefix += chunk
        out.append((prefix, suffix))
    return out


def run_minfer(args: argparse.Namespace, requests: list[tuple[str, str]]) -> list[dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "minfer.cli.main", "serve", args.model, "--host", HOST,
           "--port", str(port), "-t", str(args.threads), "--slots", "1", "--n-ctx",
           str(args.n_ctx), *(["--chunk", str(args.chunk)] if args.chunk else [])]
    return run_server(cmd, port, requests)


def run_llama_server(args: argparse.Namespace, requests: list[tuple[str, str]]) -> list[dict]:
    """llama.cpp's own server and `/infill` (its prompt cache, its layout, n_batch 2048)."""
    port = free_port()
    cmd = [args.llama_server, "-m", args.model, "--host", HOST, "--port", str(port), "-t",
           str(args.threads), "-np", "1", "-c", str(args.n_ctx), "--no-webui"]
    return run_server(cmd, port, requests)


def run_server(cmd: list[str], port: int, requests: list[tuple[str, str]]) -> list[dict]:
    """Send the requests to a server's streaming /infill one after the other."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://{HOST}:{port}"
    out = []
    try:
        wait_ready(proc, base, "/health", 600)
        # a new connection per request: llama-server's HTTP layer closes a kept-alive one
        # after five requests, which a pooled client only finds out by losing a request
        no_reuse = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=base, timeout=120, limits=no_reuse) as client:
            for prefix, suffix in requests:
                body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": N_GEN,
                        "temperature": 0.0, "top_k": 1, "stream": True}
                t0 = time.perf_counter()
                ttft, final = None, {}
                with client.stream("POST", "/infill", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        chunk = json.loads(line[6:])
                        if ttft is None and chunk.get("content"):
                            ttft = time.perf_counter() - t0
                        if chunk.get("stop"):
                            final = chunk
                total = time.perf_counter() - t0
                out.append({"ttft": ttft if ttft is not None else total, "total": total,
                            "tokens": final.get("tokens_predicted", 0),
                            "prompt": final.get("tokens_evaluated", 0),
                            "cached": final.get("tokens_cached", 0),
                            "prompt_ms": final.get("timings", {}).get("prompt_ms")})
    finally:
        stop(proc)
    return out


def run_llama(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    proc = subprocess.run([args.ref_python, "-c", LLAMA_SCRIPT, args.model, str(args.threads),
                           str(args.n_ctx), str(N_GEN)], input=json.dumps(prompts),
                          capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--ref-python", default="/tmp/refvenv2/bin/python")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--file-tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=None,
                    help="minfer serve's prompt tokens per step (-b; default: the server's)")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="llama.cpp's llama-server binary: time its own /infill instead of "
                         "llama-cpp-python's eval of the same tokens")
    args = ap.parse_args()
    import minfer
    from minfer.tokenizer.infill import Budget, infill_prompt

    model = minfer.load(args.model, n_ctx=args.n_ctx)
    args.model = str(model.path)
    tok = model.tokenizer
    text = source_file(lambda s: tok.encode(s, add_bos=False), args.file_tokens)
    requests = keystrokes(text, args.requests, 0.8)
    budget = Budget(n_batch=min(2048, args.n_ctx), n_ctx=args.n_ctx)
    prompts = [infill_prompt(tok, p, s, budget=budget) for p, s in requests]
    results: dict[str, list[list[dict]]] = {"minfer": [], "llama.cpp": []}
    for rnd in range(args.rounds):
        order = ["minfer", "llama.cpp"] if rnd % 2 == 0 else ["llama.cpp", "minfer"]
        for engine in order:
            if engine == "minfer":
                run = run_minfer(args, requests)
            elif args.llama_server:
                run = run_llama_server(args, requests)
            else:
                run = run_llama(args, prompts)
            results[engine].append(run)
    print(f"\nmodel {args.model}, {len(tok.encode(text, add_bos=False))}-token file, cursor at "
          f"80%, {args.requests} requests of {N_GEN} tokens, {args.threads} threads, "
          f"{args.rounds} round(s); prompt {len(prompts[0])}-{len(prompts[-1])} tokens\n")
    print("| engine | TTFT median (ms) | TTFT p90 | 32-token completion median (ms) |")
    print("| --- | ---: | ---: | ---: |")
    med: dict[str, float] = {}
    for engine, runs in results.items():
        ttft = sorted(r["ttft"] * 1e3 for run in runs for r in run[1:])  # first: cold cache
        total = [r["total"] * 1e3 for run in runs for r in run[1:]]
        med[engine] = statistics.median(ttft)
        print(f"| {engine} | {med[engine]:.0f} | {ttft[int(0.9 * (len(ttft) - 1))]:.0f} | "
              f"{statistics.median(total):.0f} |")
    print(f"\nTTFT ratio (llama.cpp / minfer, median): {med['llama.cpp'] / med['minfer']:.2f}x")
    for engine, runs in results.items():
        own = [r for r in runs[-1][1:] if r.get("prompt_ms") is not None]
        if own:  # the server's own prompt time: TTFT minus this is the overhead around it
            over = statistics.median(r["ttft"] * 1e3 - r["prompt_ms"] for r in own)
            print(f"{engine}: the server's own prompt eval median "
                  f"{statistics.median(r['prompt_ms'] for r in own):.0f} ms, TTFT beyond it "
                  f"{over:.0f} ms")
    last = results["minfer"][-1]
    uncached = [r["prompt"] - r["cached"] for r in last[1:]]
    print(f"minfer: prompt tokens not in the cache per request: median "
          f"{statistics.median(uncached):.0f} (min {min(uncached)}, max {max(uncached)}); "
          f"first request (cold) TTFT {last[0]['ttft'] * 1e3:.0f} ms for {last[0]['prompt']} "
          f"tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
