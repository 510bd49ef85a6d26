"""Time to first token of a long (~4,000-token) chat prompt: minfer vs llama.cpp, side by side.

Not part of the test suite. Same model, same thread count, n_ctx 8192 for both, greedy, one run,
rounds interleaved (A B, then B A, ...) so machine drift hits both engines. Two surfaces:

- run: a fresh process per round and engine, doing what `minfer run` does (its parser, model
  load, chat template, tokenizer, `Model.stream`) against llama-cpp-python's
  `Llama(...).create_chat_completion(stream=True)` from a separate interpreter (`--ref-python`).
  Two figures: "load excluded" (prompt text ready → first content; the model loaded and its
  weights readied before the clock starts) and "whole command" (process spawned → first
  content, by the wall clock both processes share).
- serve: `minfer serve` (its defaults: batch-invariant attention, prefill chunks of 512 tokens
  while nothing else decodes) vs `python -m llama_cpp.server` (with `--logits_all False`: its
  default True computes every prompt token's logits; `--llama-logits-all` keeps it), one
  streamed /v1/chat/completions
  request per round, send → first content chunk. Servers start and stop as in serve_load.py
  (loopback, stopped by pid).

Every round's prompt is the same source text behind a different first word (both engines
cache prompt prefixes: a repeated prompt would skip its prefill), cut by the model's tokenizer
so the user message is `--prompt-tokens` tokens. The prompt tokens each engine counted are
reported (llama.cpp's and minfer serve's usage.prompt_tokens, from a follow-up non-streamed
request that reuses the cached prefix) and must agree: a mismatch is flagged. One untimed
warm-up round per surface comes first (kernel caches, page cache). Spread is half the range.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/ttft_long.py -t 2 --rounds 2 \\
        --ref-python /tmp/refvenv/bin/python --json /tmp/ttft.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, cast

import httpx
from serve_load import HOST, free_port, start_llama, start_minfer, stop, wait_ready
from vs_llamacpp import run_one

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path.home() / ".cache/minfer/qwen2.5-coder-0.5b-instruct.gguf"
# first words of the rounds' prompts: distinct first tokens, so no prompt cache reaches past
# the chat template's header
WORDS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India",
         "Juliet", "Kilo", "Lima", "Mike", "November", "Oscar", "Papa", "Quebec", "Romeo",
         "Sierra", "Tango", "Uniform", "Victor", "Whiskey", "Xray", "Yankee", "Zulu")
QUESTION = ("\n\nQuestion: in two sentences, what does the code above do, and which module "
            "would you read first?")

# argv: a JSON list of `minfer run` arguments, then the prompt file. The steps and their
# order are run_cmd.run's; the clock starts once the model is loaded and its weights ready.
MINFER_SCRIPT = textwrap.dedent(
    """
    import time
    wall_start = time.time()
    import json, sys
    from minfer.cli.common import load_announcing_cold_start, sampling_from_args
    from minfer.cli.main import build_parser, parse
    from minfer.engine.generate import Finished, Piece
    args = parse(build_parser("run"), ["run", *json.loads(sys.argv[1])])
    prompt = open(sys.argv[2], encoding="utf-8").read()
    model, progress = load_announcing_cold_start(args.positionals[0], args)
    if progress is None:
        model.engine().wait_ready()
    wall_ready, t0 = time.time(), time.perf_counter()
    text = model.render_chat([{"role": "user", "content": prompt}])
    ids = model.tokenizer.encode(text, special=not args.no_special)
    if progress is not None:  # cold kernel cache: compiled here, as `minfer run` would
        model.warm_up(len(ids), progress)
    ttft = wall_first = finished = None
    for ev in model.stream(ids, max_tokens=args.n_predict, seed=args.seed,
                           sampling=sampling_from_args(args)):
        if isinstance(ev, Piece) and ev.text and ttft is None:
            ttft, wall_first = time.perf_counter() - t0, time.time()
        elif isinstance(ev, Finished):
            finished = ev
    if ttft is None:  # no text at all: the end of the stream stands in
        ttft, wall_first = time.perf_counter() - t0, time.time()
    print(json.dumps({"ttft_s": ttft, "wall_start": wall_start, "wall_ready": wall_ready,
                      "wall_first": wall_first, "prompt_tokens": len(ids),
                      "prefill_s": finished.timings.prefill_s, "text": finished.text,
                      "cold": progress is not None, "threads": model.threads}))
    """
)

# argv: model, threads, n_ctx, max_tokens, prompt file.
LLAMA_SCRIPT = textwrap.dedent(
    """
    import time
    wall_start = time.time()
    import json, sys
    from llama_cpp import Llama
    path, threads, n_ctx, max_tokens = sys.argv[1], *map(int, sys.argv[2:5])
    prompt = open(sys.argv[5], encoding="utf-8").read()
    llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, n_ubatch=512, verbose=False)
    msgs = [{"role": "user", "content": prompt}]
    wall_ready, t0 = time.time(), time.perf_counter()
    ttft = wall_first = None
    text = []
    for chunk in llm.create_chat_completion(msgs, stream=True, max_tokens=max_tokens,
                                            temperature=0.0):
        piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if piece:
            text.append(piece)
            if ttft is None:
                ttft, wall_first = time.perf_counter() - t0, time.time()
    if ttft is None:
        ttft, wall_first = time.perf_counter() - t0, time.time()
    # the prompt's token count: the KV holds the prompt, so only its last token is evaluated
    usage = llm.create_chat_completion(msgs, max_tokens=1, temperature=0.0)["usage"]
    print(json.dumps({"ttft_s": ttft, "wall_start": wall_start, "wall_ready": wall_ready,
                      "wall_first": wall_first, "prompt_tokens": usage["prompt_tokens"],
                      "text": "".join(text), "threads": threads}))
    """
)


def build_prompts(model: str, n_tokens: int, count: int) -> list[str]:
    """`count` user messages of about n_tokens tokens: a distinct first word, this repository's
    Python sources cut by the model's tokenizer, a question at the end."""
    import minfer

    tok = minfer.load(model).tokenizer
    parts = [f"# file: {p.relative_to(REPO)}\n{p.read_text(encoding='utf-8')}"
             for p in sorted((REPO / "src" / "minfer").rglob("*.py"))]
    source = tok.encode("\n".join(parts), special=False)
    prompts = []
    for i in range(count):
        head = (f"{WORDS[i % len(WORDS)]} {i // len(WORDS) + 1}. Read these source files of a "
                "Python project, then answer the question at the end.\n\n")
        room = n_tokens - len(tok.encode(head + QUESTION, special=False))
        if room < 1:
            raise SystemExit(f"--prompt-tokens {n_tokens} leaves no room for source text")
        if room > len(source):
            raise SystemExit(f"the sources hold {len(source)} tokens, fewer than {room}")
        prompts.append(head + tok.decode(source[:room], special=False) + QUESTION)
    return prompts


def run_round(engine: str, prompt: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process of `engine` on `prompt`; its timings and counts."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8",
                                     delete=False) as f:
        f.write(prompt)
    try:
        if engine == "minfer":
            argv = [args.model, "-t", str(args.threads), "--n-ctx", str(args.n_ctx),
                    "-n", str(args.max_tokens), "--temp", "0", "--seed", "0"]
            spawned = time.time()
            raw = run_one(sys.executable, MINFER_SCRIPT, [json.dumps(argv), f.name])
        else:
            spawned = time.time()
            raw = run_one(args.ref_python, LLAMA_SCRIPT,
                          [args.model, str(args.threads), str(args.n_ctx),
                           str(args.max_tokens), f.name])
    finally:
        os.unlink(f.name)
    res = cast(dict[str, Any], raw)
    res["whole_s"] = float(res["wall_first"]) - spawned
    res["load_s"] = float(res["wall_ready"]) - spawned
    return res


def chat_body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}


def serve_round(base: str, prompt: str, args: argparse.Namespace) -> dict[str, Any]:
    """One streamed chat request (TTFT: send → first content chunk), then a non-streamed
    one-token request on the same prompt (a cached prefix) for usage.prompt_tokens."""
    ttft, text = None, []
    with httpx.Client(base_url=base, timeout=args.timeout) as client:
        t0 = time.perf_counter()
        with client.stream("POST", "/v1/chat/completions",
                           json=chat_body(prompt, args.max_tokens, True)) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for ch in json.loads(line[6:]).get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                        if ttft is None:
                            ttft = time.perf_counter() - t0
        if ttft is None:
            ttft = time.perf_counter() - t0
        r2 = client.post("/v1/chat/completions", json=chat_body(prompt, 1, False))
        r2.raise_for_status()
    return {"ttft_s": ttft, "prompt_tokens": r2.json()["usage"]["prompt_tokens"],
            "text": "".join(text)}


def order(rnd: int) -> tuple[str, str]:
    return ("minfer", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "minfer")


def bench_run(prompts: list[str], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"minfer": [], "llama.cpp": []}
    for engine in order(0):  # warm-up: kernel cache, page cache
        res = run_round(engine, prompts[0], args)
        print(f"run warm-up {engine}: TTFT {res['ttft_s']:.2f} s"
              + (" (compiled kernels)" if res.get("cold") else ""), file=sys.stderr, flush=True)
    for rnd in range(args.rounds):
        for engine in order(rnd):
            res = run_round(engine, prompts[rnd + 1], args)
            out[engine].append(res)
            print(f"run round {rnd + 1}/{args.rounds} {engine}: TTFT {res['ttft_s']:.2f} s, "
                  f"whole command {res['whole_s']:.2f} s, {res['prompt_tokens']} prompt tokens"
                  + (" COLD KERNEL CACHE" if res.get("cold") else ""),
                  file=sys.stderr, flush=True)
    return out


def bench_serve(prompts: list[str],
                args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    sargs = argparse.Namespace(model=args.model, threads=args.threads, n_ctx=args.n_ctx,
                               levels=[1], ref_python=args.ref_python)
    procs: list[subprocess.Popen[bytes]] = []
    bases: dict[str, str] = {}
    out: dict[str, list[dict[str, Any]]] = {"minfer": [], "llama.cpp": []}
    try:
        # llama_cpp.server keeps every prompt token's logits unless told (logits_all=True, a
        # vocabulary-sized matmul per token): off, as in Llama() and in llama.cpp's own server
        llama_extra = () if args.llama_logits_all else ("--logits_all", "False")
        for engine, path in (("minfer", "/health"), ("llama.cpp", "/v1/models")):
            port = free_port()
            procs.append(start_minfer(sargs, port) if engine == "minfer"
                         else start_llama(sargs, port, llama_extra))
            bases[engine] = f"http://{HOST}:{port}"
            wait_ready(procs[-1], bases[engine], path, args.load_timeout)
        for engine in order(0):
            res = serve_round(bases[engine], prompts[0], args)
            print(f"serve warm-up {engine}: TTFT {res['ttft_s']:.2f} s", file=sys.stderr,
                  flush=True)
        for rnd in range(args.rounds):
            for engine in order(rnd):
                res = serve_round(bases[engine], prompts[rnd + 1], args)
                out[engine].append(res)
                print(f"serve round {rnd + 1}/{args.rounds} {engine}: TTFT "
                      f"{res['ttft_s']:.2f} s, {res['prompt_tokens']} prompt tokens",
                      file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            stop(proc)
    return out


def summary(samples: list[float]) -> tuple[float, float]:
    """(median, half the range)."""
    return statistics.median(samples), (max(samples) - min(samples)) / 2


def report(results: dict[str, dict[str, list[dict[str, Any]]]],
           args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The table's rows and the prompt-token mismatches found."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    surfaces = [(s, key, label) for s in ("run", "serve") if s in results
                for key, label in ((("ttft_s", "run, load excluded"),
                                    ("whole_s", "run, whole command")) if s == "run"
                                   else (("ttft_s", "serve"),))]
    for surface, key, label in surfaces:
        med = {e: summary([float(r[key]) for r in results[surface][e]])
               for e in ("minfer", "llama.cpp")}
        for engine in ("llama.cpp", "minfer"):
            counts = sorted({int(r["prompt_tokens"]) for r in results[surface][engine]})
            rows.append({"engine": engine, "surface": label, "ttft_median_s": med[engine][0],
                         "ttft_spread_s": med[engine][1], "prompt_tokens": counts,
                         "ratio_llama_over_minfer": med["llama.cpp"][0] / med["minfer"][0]
                         if engine == "minfer" else None})
    # every round's prompt must count the same in both engines and on both surfaces
    for rnd in range(args.rounds):
        seen = {f"{e} {s}": int(results[s][e][rnd]["prompt_tokens"])
                for s in results for e in ("minfer", "llama.cpp")}
        if len(set(seen.values())) > 1:
            problems.append(f"round {rnd + 1}: prompt tokens differ: {seen}")
    return rows, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(DEFAULT_MODEL), help="GGUF path")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=4000,
                    help="tokens of the user message (the chat template adds a few)")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    ap.add_argument("--surfaces", default="run,serve", help="comma-separated: run, serve")
    ap.add_argument("--ref-python", default="/tmp/refvenv/bin/python",
                    help="python with llama-cpp-python[server] installed")
    ap.add_argument("--llama-logits-all", action="store_true",
                    help="serve: keep llama_cpp.server's default logits_all=True (every prompt "
                         "token's logits; off by default here)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--load-timeout", type=float, default=600, help="seconds a server may load")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    surfaces = [s.strip() for s in args.surfaces.split(",") if s.strip()]
    if not surfaces or set(surfaces) - {"run", "serve"}:
        ap.error("--surfaces takes run, serve or both")
    if args.rounds < 1 or args.threads < 1 or args.max_tokens < 1:
        ap.error("--rounds, -t and --max-tokens must be positive")
    if not Path(args.model).exists():
        ap.error(f"no model at {args.model}")
    if not Path(args.ref_python).exists():
        ap.error(f"no reference interpreter at {args.ref_python}")

    if args.prompt_tokens + 64 + args.max_tokens > args.n_ctx:
        ap.error(f"--n-ctx {args.n_ctx} cannot hold the prompt and the reply")
    prompts = build_prompts(args.model, args.prompt_tokens, args.rounds + 1)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        if "run" in surfaces:
            results["run"] = bench_run(prompts, args)
        if "serve" in surfaces:
            results["serve"] = bench_serve(prompts, args)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    rows, problems = report(results, args)

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"\nTTFT of a {args.prompt_tokens}-token user message, model {Path(args.model).name}, "
          f"{args.threads} threads, n_ctx {args.n_ctx}, {args.rounds} interleaved rounds, "
          f"{cpu}\n")
    print("| engine | surface | TTFT median ± spread (s) | prompt tokens | llama / minfer |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        ratio = row["ratio_llama_over_minfer"]
        print(f"| {row['engine']} | {row['surface']} | {row['ttft_median_s']:.2f} ± "
              f"{row['ttft_spread_s']:.2f} | {', '.join(map(str, row['prompt_tokens']))} | "
              f"{'' if ratio is None else f'{ratio:.2f}×'} |")
    for p in problems:
        print(f"\nWARNING: {p}")
    if args.json:
        args.json.write_text(json.dumps({
            "model": args.model, "threads": args.threads, "n_ctx": args.n_ctx,
            "prompt_tokens_requested": args.prompt_tokens, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "cpu": cpu, "ref_python": args.ref_python,
            "prompt_sha256": [hashlib.sha256(p.encode()).hexdigest() for p in prompts],
            "rows": rows, "problems": problems, "results": results,
        }, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
