"""Time to first token on a hybrid recurrent model (Qwen3.5, LFM2) when a prompt repeats most of
an earlier one: minfer serve vs llama.cpp's own llama-server (its context checkpoints), issue 62.

Not part of the test suite. Both servers run one slot on loopback (started here, stopped by
pid) with the same file, thread count (-t), context (-c) and batch (-b: minfer's prefill chunk,
llama-server's -b and -ub), greedy, `ignore_eos`. Each round, for each engine (engines
interleaved: A B, then B A, ...), every request streamed to /v1/chat/completions and timed send
→ first streamed content chunk:

- a1: a `--conv-tokens` user message (a 2,000-token conversation), its reply `--reply-tokens`
  long; a2: its second turn (that reply appended as the assistant's, plus a new user message);
- b1: a `--long-tokens` user message; b2: the same with a few words inserted `--edit-back`
  tokens before its end (an edit near the end);
- c: b2 again (a /regen);
- da / db: a2's and b2's prompts behind another first word, so nothing past the chat
  template's header is cached: the full re-prefill each of a2 and b2 / c is compared with.

Each round's prompts start with their own word (no cache reaches across rounds). Per case:
median TTFT per engine, the prompt tokens and the cached tokens each server reports (minfer:
usage.prompt_tokens_details.cached_tokens; llama-server: timings.cache_n / prompt_n), each
engine's speedup over its full re-prefill (da / a2, db / b2, db / c; the issue's bar is 5x)
and minfer's TTFT over llama-server's. Spread is half the range over the rounds.

    cmake --build /tmp/llbuild --target llama-server -j 2   # see docs/performance.md
    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/hybrid_ttft.py MODEL.gguf -t 2 \\
        --llama-server /tmp/llbuild/bin/llama-server --rounds 3 --json /tmp/hybrid_ttft.json

Without MODEL: the synthetic Qwen3.5-0.8B-shaped Q4_K_M file of `vs_llamacpp.py --synthetic
qwen35-0.8b` (written once into ~/.cache/minfer/synthetic).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from serve_load import HOST, free_port, stop, wait_ready
from vs_llamacpp import synthetic_model

from minfer.gguf.reader import GGUFFile
from minfer.tokenizer.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
WORDS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India",
         "Juliet", "Kilo", "Lima", "Mike", "November", "Oscar", "Papa")
FOLLOW_UP = "Thanks. Now list the three modules you would read first, one line each."
EDIT = " (note: this paragraph was revised) "
CASES = ("a1", "a2", "b1", "b2", "c", "da", "db")
# (case, its full re-prefill): the speedups reported
VERSUS = (("a2", "da"), ("b2", "db"), ("c", "db"))


def source_text(tok: Tokenizer, n: int, folder: str, pattern: str) -> str:
    """The repository's files `folder/pattern` one after another, cut to n tokens of the
    model's tokenizer (repeated where they hold fewer)."""
    text = "\n\n".join(p.read_text() for p in sorted((REPO / folder).glob(pattern)))
    ids = tok.encode(text, special=False, add_bos=False)
    ids = ids * (n // len(ids) + 1)
    return tok.decode(ids[:n], special=False)


def cut_at(tok: Tokenizer, text: str, back: int) -> tuple[str, str]:
    """text split `back` tokens before its end."""
    ids = tok.encode(text, special=False, add_bos=False)
    cut = len(ids) - back
    return tok.decode(ids[:cut], special=False), tok.decode(ids[cut:], special=False)


def start_minfer(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "minfer.cli.main", "serve", args.model, "--host", HOST,
           "--port", str(port), "-t", str(args.threads), "--slots", "1", "--n-ctx",
           str(args.n_ctx), "-b", str(args.batch), "--state-checkpoints",
           str(args.checkpoints)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_llama_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [args.llama_server, "-m", args.model, "--host", HOST, "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.n_ctx),
           "-b", str(args.batch), "-ub", str(args.batch), "-np", "1", "--no-webui",
           "--ctx-checkpoints", str(args.llama_checkpoints), *args.llama_extra]
    log = open(args.llama_log, "wb") if args.llama_log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=log)


def stream(client: httpx.Client, messages: list[dict[str, Any]],
           max_tokens: int, **extra: Any) -> dict[str, Any]:
    """One streamed chat request (extra: more body fields): seconds to the first content
    chunk, the reply, the prompt and cached tokens the server reports."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    chunks = 0  # the content chunks: fewer than the reply's tokens where a server held some
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or ""
                if piece:
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    cached = timings.get("cache_n", details.get("cached_tokens"))
    prompt = usage.get("prompt_tokens")
    if "prompt_n" in timings:  # llama-server: prompt_n counts only the tokens it prefilled
        prompt = timings["prompt_n"] + timings.get("cache_n", 0)
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "content": ttft is not None, "chunks": chunks, "reply": "".join(text),
            "prompt_tokens": prompt,
            "cached_tokens": cached}


def one_round(client: httpx.Client, tok: Tokenizer, args: argparse.Namespace,
              word: str, conv: str, long_head: str, long_tail: str) -> dict[str, dict[str, Any]]:
    """The round's requests, in order, on one engine."""
    got: dict[str, dict[str, Any]] = {}
    turn1 = [{"role": "user", "content": f"{word}. {conv}"}]
    got["a1"] = stream(client, turn1, args.reply_tokens)
    turn2 = [*turn1, {"role": "assistant", "content": got["a1"]["reply"]},
             {"role": "user", "content": FOLLOW_UP}]
    got["a2"] = stream(client, turn2, args.max_tokens)
    got["b1"] = stream(client, [{"role": "user", "content": f"{word}. {long_head}{long_tail}"}],
                       args.max_tokens)
    edited = [{"role": "user", "content": f"{word}. {long_head}{EDIT}{long_tail}"}]
    got["b2"] = stream(client, edited, args.max_tokens)
    got["c"] = stream(client, edited, args.max_tokens)
    other = f"{word}{word}"
    got["da"] = stream(client, [{"role": "user", "content": f"{other}. {conv}"}, *turn2[1:]],
                       args.max_tokens)
    got["db"] = stream(client, [{"role": "user",
                                 "content": f"{other}. {long_head}{EDIT}{long_tail}"}],
                       args.max_tokens)
    for r in got.values():
        r.pop("reply")
    return got


def open_server(start: Callable[[argparse.Namespace, int], subprocess.Popen[bytes]],
                args: argparse.Namespace, procs: dict[str, subprocess.Popen[bytes]],
                name: str) -> httpx.Client:
    """Start engine `name`'s server on a free port (its process in `procs` before the wait, so
    a failed start is still stopped) and wait for /health: a client that opens a fresh
    connection per request (llama-server may close an idle kept-alive one)."""
    port = free_port()
    procs[name] = start(args, port)
    base = f"http://{HOST}:{port}"
    wait_ready(procs[name], base, "/health", 600)
    return httpx.Client(base_url=base, timeout=600,
                        limits=httpx.Limits(max_keepalive_connections=0))


def close_servers(clients: dict[str, httpx.Client],
                  procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for c in clients.values():
        c.close()
    for proc in procs.values():
        stop(proc)


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / 2 if len(xs) > 1 else 0.0


def case_summary(rs: list[dict[str, dict[str, Any]]], case: str,
                 lists: tuple[str, ...]) -> dict[str, Any]:
    """One case over an engine's rounds: the median time to first token and its spread, the
    `lists` fields round by round, whether every round streamed content."""
    ts = [r[case]["ttft"] for r in rs]
    return {"ttft_s": statistics.median(ts), "spread_s": spread(ts),
            **{k: [r[case].get(k) for r in rs] for k in lists},
            "content": all(r[case]["content"] for r in rs)}


def over_llama(rounds: dict[str, list[dict[str, dict[str, Any]]]],
               cases: Sequence[str]) -> dict[str, float]:
    """Per case, the median of minfer's / llama-server's time to first token, round by round."""
    return {case: statistics.median(
        m[case]["ttft"] / ref[case]["ttft"]
        for m, ref in zip(rounds["minfer"], rounds["llama"], strict=True)) for case in cases}


def summarize(rounds: dict[str, list[dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for engine, rs in rounds.items():
        cases = {case: {**case_summary(rs, case, ("prompt_tokens", "cached_tokens")),
                        "chunks": min(r[case]["chunks"] for r in rs)} for case in CASES}
        speedup = {f"{full}/{case}": statistics.median(
            r[full]["ttft"] / r[case]["ttft"] for r in rs) for case, full in VERSUS}
        out[engine] = {"cases": cases, "speedup_vs_full": speedup}
    if len(rounds) == 2:
        out["minfer_over_llama"] = over_llama(rounds, CASES)
    return out


def default_model() -> str:
    """The synthetic Qwen3.5-0.8B-shaped Q4_K_M file vs_llamacpp.py --synthetic writes."""
    return str(synthetic_model("qwen35-0.8b", Path.home() / ".cache" / "minfer" / "synthetic"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="a hybrid GGUF (Qwen3.5, LFM2)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-c", "--n-ctx", type=int, default=8192)
    p.add_argument("-b", "--batch", type=int, default=512,
                   help="prefill chunk (minfer -b; llama-server -b and -ub)")
    p.add_argument("--llama-server", default="/tmp/llbuild/bin/llama-server")
    p.add_argument("--llama-checkpoints", type=int, default=32,
                   help="llama-server --ctx-checkpoints (its default 32)")
    p.add_argument("--llama-extra", nargs="*", default=[], metavar="ARG",
                   help="more llama-server arguments (e.g. --cache-ram 0)")
    p.add_argument("--llama-log", default=None, help="llama-server's output to this file")
    p.add_argument("--checkpoints", type=int, default=4, help="minfer --state-checkpoints")
    p.add_argument("--engines", default="minfer,llama")
    p.add_argument("--conv-tokens", type=int, default=2000)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--long-tokens", type=int, default=4000)
    p.add_argument("--edit-back", type=int, default=48,
                   help="the edit goes this many tokens before the long prompt's end")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens of each timed reply")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engines = args.engines.split(",")
    if args.model is None:
        args.model = default_model()
    tok = Tokenizer.from_gguf(GGUFFile.open(args.model))
    # the conversation's text and the long prompt's differ from their first token on
    conv = source_text(tok, args.conv_tokens, "docs", "*.md")
    long_head, long_tail = cut_at(tok, source_text(tok, args.long_tokens,
                                                   "src/minfer/engine/core", "*.py"),
                                  args.edit_back)
    starters = {"minfer": start_minfer, "llama": start_llama_server}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    clients: dict[str, httpx.Client] = {}
    rounds: dict[str, list[dict[str, dict[str, Any]]]] = {e: [] for e in engines}
    try:
        for e in engines:
            clients[e] = open_server(starters[e], args, procs, e)
            stream(clients[e], [{"role": "user", "content": conv[:400]}], 4)  # warm-up
        for i in range(args.rounds):
            order = engines if i % 2 == 0 else engines[::-1]
            for e in order:
                got = one_round(clients[e], tok, args, WORDS[i % len(WORDS)] + str(i), conv,
                                long_head, long_tail)
                rounds[e].append(got)
                print(f"round {i} {e}: " + "  ".join(
                    f"{c} {got[c]['ttft'] * 1e3:.0f} ms ({got[c]['cached_tokens']}/"
                    f"{got[c]['prompt_tokens']})" for c in CASES), flush=True)
    finally:
        close_servers(clients, procs)
    summary = summarize(rounds)
    report(summary, engines)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "threads": args.threads, "n_ctx": args.n_ctx,
             "batch": args.batch, "llama_server": args.llama_server,
             "llama_checkpoints": args.llama_checkpoints, "llama_extra": args.llama_extra,
             "minfer_checkpoints": args.checkpoints, "conv_tokens": args.conv_tokens,
             "reply_tokens": args.reply_tokens, "long_tokens": args.long_tokens,
             "edit_back": args.edit_back, "rounds": rounds, "summary": summary,
             "host_cpus": os.cpu_count()}, indent=1))
    return 0


def report(summary: dict[str, Any], engines: list[str]) -> None:
    print(f"\n{'case':<5}" + "".join(f"{e + ' TTFT ms':>16}{'cached/prompt':>16}"
                                     for e in engines) + (
        f"{'minfer/llama':>14}" if len(engines) == 2 else ""))
    for case in CASES:
        row = f"{case:<5}"
        for e in engines:
            c = summary[e]["cases"][case]
            mark = "" if c["content"] else "*"
            ttft = f"{c['ttft_s'] * 1e3:.0f}{mark} ±{c['spread_s'] * 1e3:.0f}"
            row += f"{ttft:>16}"
            row += f"{str(c['cached_tokens'][-1]) + '/' + str(c['prompt_tokens'][-1]):>15}"
        if len(engines) == 2:
            row += f"{summary['minfer_over_llama'][case]:>14.2f}"
        print(row)
    for e in engines:
        print(f"{e} speedup over its full re-prefill: " + ", ".join(
            f"{k} {v:.1f}x" for k, v in summary[e]["speedup_vs_full"].items()))
    print("(* no content chunk came: the time is to the stream's end)")
    for e in engines:  # a server that holds text back streams fewer chunks than tokens
        print(f"{e} content chunks per reply (fewest; of up to --max-tokens): " + ", ".join(
            f"{case} {summary[e]['cases'][case]['chunks']}" for case in CASES))


if __name__ == "__main__":
    raise SystemExit(main())
