"""`minfer serve` with and without a draft model (`-md`), side by side in one run: one stream.

Not part of the test suite. Starts two servers on 127.0.0.1 with the same target, thread count
and one slot, one with `-md DRAFT`, and sends each task (benchmarks/speculative.py's edit / code /
prose prompts, greedy chat completions, streamed) to both, alternating server by server for
`--rounds` rounds so machine drift hits both. Decode rate = (completion tokens - 1) / time from
the first text chunk to the end (prefill, and the draft's catch-up on the prompt, excluded);
a ratio is the median over rounds of the draft server's rate / the same round's plain rate. The
texts must be equal; the draft server's /metrics gives the acceptance.

    nice python benchmarks/serve_draft.py --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct -t 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from speculative import TASKS, cpu_name

HOST = "127.0.0.1"


def start(target: str, port: int, threads: int, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "minfer.cli.main", "serve", target, "--host", HOST, "--port",
           str(port), "-t", str(threads), "--slots", "1", "--n-ctx", "2048", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(port: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{HOST}:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server on port {port} not ready")


def one_stream(port: int, prompt: str, n: int) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    text: list[str] = []
    first = None
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"http://{HOST}:{port}/v1/chat/completions", json=body,
                      timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    assert first is not None
    n_out = int(usage.get("completion_tokens", 0))
    return {"text": "".join(text), "n": n_out, "rate": (n_out - 1) / (end - first),
            "prefill_s": first - t0}


def draft_counts(port: int) -> tuple[float, float]:
    values = {}
    for line in httpx.get(f"http://{HOST}:{port}/metrics", timeout=5).text.splitlines():
        name, _, value = line.rpartition(" ")
        values[name] = value
    return (float(values.get("minfer_draft_tokens_total", 0)),
            float(values.get("minfer_draft_tokens_accepted_total", 0)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=96, help="tokens per generation (default 96)")
    ap.add_argument("--tasks", default="edit,code")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=18431)
    args = ap.parse_args()

    ports = {"plain": args.port, "draft": args.port + 1}
    procs = [start(args.target, ports["plain"], args.threads),
             start(args.target, ports["draft"], args.threads, "-md", args.draft)]
    try:
        for port in ports.values():
            wait_ready(port)
            one_stream(port, "hi", 16)  # build the decode and verify graphs, untimed
        print(f"CPU: {cpu_name()}; {args.threads} threads; target {args.target}, "
              f"draft {args.draft}; {args.n} tokens, {args.rounds} rounds")
        for task in args.tasks.split(","):
            runs: dict[str, list[dict[str, Any]]] = {"plain": [], "draft": []}
            before = draft_counts(ports["draft"])
            for _ in range(args.rounds):
                for name, port in ports.items():
                    runs[name].append(one_stream(port, TASKS[task], args.n))
            drafted, accepted = (a - b for a, b in zip(draft_counts(ports["draft"]), before,
                                                       strict=True))
            same = all(d["text"] == p["text"] for d, p in zip(runs["draft"], runs["plain"],
                                                               strict=True))
            ratio = statistics.median(d["rate"] / p["rate"] for d, p in zip(
                runs["draft"], runs["plain"], strict=True))
            plain_rate = statistics.median(r["rate"] for r in runs["plain"])
            draft_rate = statistics.median(r["rate"] for r in runs["draft"])
            print(f"{task:6s} plain {plain_rate:6.2f} tok/s  draft {draft_rate:6.2f} tok/s  "
                  f"ratio {ratio:.2f}x  acceptance {accepted / max(drafted, 1):.2f} "
                  f"({accepted:.0f}/{drafted:.0f})  same text: {same}", flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
