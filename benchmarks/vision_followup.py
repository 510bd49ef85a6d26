"""A follow-up question about the same image: time to first token, minfer serve vs llama.cpp's
llama-server, both with the text GGUF and its `--mmproj` (issue 64's "a follow-up question
about the same image starts answering in under 1 s on the 0.5B-class text model").

Not part of the test suite. Both servers run one slot on loopback (started here, stopped by
pid) with the same files, thread count (-t), context (-c) and batch (-b: minfer's prefill
chunk, llama-server's -b and -ub), greedy, `ignore_eos`. Each round, for each engine (engines
interleaved: A B, then B A, ...), two requests streamed to /v1/chat/completions and timed
send → first streamed content chunk:

- q1: a user message with a new image (a `--image` W x H PNG of noise, its own each round, so
  the first question encodes it) and a question; its reply `--reply-tokens` long;
- q2: the follow-up: q1, that reply as the assistant's message, and a new user question.

Per question: median TTFT per engine, the prompt and cached tokens each server reports (minfer:
usage.prompt_tokens_details.cached_tokens; llama-server: timings.cache_n / prompt_n), the
tokens it prefilled (prompt - cached) and the tower runs it made, one per tile or overview
(minfer: its `minfer_image_chunks_encoded_total` gauge; llama-server does not report them:
it encodes an image chunk only when it prefills it, so a follow-up whose cached tokens cover the
image ran none). The follow-up should run no tower and prefill only what q1's prompt and
reply do not cover (`new`: its prompt less q1's prompt and reply). Every reply is steered to
repeat " the" (a logit bias), so the reply's text tokenizes back to the ids generated, as a
real model's reply does: random weights would pick unmergeable padding tokens.

    cmake --build /tmp/llbuild --target llama-server -j 2   # see docs/performance.md
    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/vision_followup.py -t 2 --rounds 3 \\
        --json /tmp/vision_followup.json

Without --model / --mmproj: a synthetic SmolVLM-500M (`minfer.tools.synth.mmproj`: the
idefics3 SigLIP-base tower in f16, SmolLM2-360M's llama shapes in Q8_0, random weights),
written once into ~/.cache/minfer/synthetic/smolvlm-500m.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from hybrid_ttft import case_summary, close_servers, open_server, over_llama, stream
from serve_load import HOST

from minfer.gguf.reader import GGUFFile
from minfer.tokenizer.tokenizer import Tokenizer

QUESTION = "What is in this picture? Describe it in one sentence."
FOLLOW_UP = "And what colour is the top left corner?"
QUESTIONS = ("q1", "q2")


def synthetic_files(directory: Path) -> tuple[Path, Path]:
    """The synthetic SmolVLM-500M's text GGUF and mmproj, written once."""
    from minfer.tools.synth.mmproj import write_idefics3_mmproj, write_text_like_smolvlm_500m

    directory.mkdir(parents=True, exist_ok=True)
    model, mmproj = directory / "model.gguf", directory / "mmproj.gguf"
    if not model.exists():
        write_text_like_smolvlm_500m(model.with_suffix(".part"))
        model.with_suffix(".part").rename(model)
    if not mmproj.exists():
        write_idefics3_mmproj(mmproj.with_suffix(".part"))
        mmproj.with_suffix(".part").rename(mmproj)
    return model, mmproj


def image_url(width: int, height: int, seed: int) -> str:
    """A PNG of smoothed noise (its own per seed) as a data: URL."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, height // 16), max(1, width // 16), 3), np.uint8)
    img = Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def start_minfer(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "minfer.cli.main", "serve", args.model, "--mmproj",
           args.mmproj, "--host", HOST, "--port", str(port), "-t", str(args.threads),
           "--slots", "1", "--n-ctx", str(args.n_ctx), "-b", str(args.batch)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_llama_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [args.llama_server, "-m", args.model, "--mmproj", args.mmproj, "--host", HOST,
           "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads),
           "-c", str(args.n_ctx), "-b", str(args.batch), "-ub", str(args.batch), "-np", "1",
           "--no-webui", *args.llama_extra]
    log = open(args.llama_log, "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, stdout=log, stderr=log)


class Towers:
    """How many tower runs an engine has made so far (None: it does not say)."""

    def __init__(self, engine: str, client: httpx.Client) -> None:
        self.engine, self.client = engine, client

    def count(self) -> int | None:
        if self.engine == "llama":
            return None
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith("minfer_image_chunks_encoded_total "):
                return int(float(line.split()[1]))
        raise RuntimeError("minfer's /metrics has no minfer_image_chunks_encoded_total")


def one_round(client: httpx.Client, towers: Towers, args: argparse.Namespace, url: str,
              bias: dict[str, float]) -> dict[str, dict[str, Any]]:
    """q1 with the round's image, then its follow-up q2, on one engine."""
    got: dict[str, dict[str, Any]] = {}
    q1 = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                       {"type": "text", "text": QUESTION}]}]
    before = towers.count()
    got["q1"] = stream(client, q1, args.reply_tokens, logit_bias=bias)
    got["q1"]["towers"] = _minus(towers.count(), before)
    q2 = [*q1, {"role": "assistant", "content": got["q1"]["reply"]},
          {"role": "user", "content": FOLLOW_UP}]
    before = towers.count()
    got["q2"] = stream(client, q2, args.max_tokens, logit_bias=bias)
    got["q2"]["towers"] = _minus(towers.count(), before)
    for r in got.values():
        r["prefilled"] = _minus(r["prompt_tokens"], r["cached_tokens"])
    got["q2"]["new"] = _minus(got["q2"]["prompt_tokens"], got["q1"]["prompt_tokens"],
                              args.reply_tokens)
    for r in got.values():
        r.pop("reply")
    return got


def _minus(a: int | None, *b: int | None) -> int | None:
    return None if a is None or None in b else a - sum(x or 0 for x in b)


def summarize(rounds: dict[str, list[dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {e: {q: case_summary(rs, q, (
        "prompt_tokens", "cached_tokens", "prefilled", "towers", "new")) for q in QUESTIONS}
        for e, rs in rounds.items()}
    if len(rounds) == 2:
        out["minfer_over_llama"] = over_llama(rounds, QUESTIONS)
    return out


def report(summary: dict[str, Any], engines: list[str]) -> None:
    print(f"\n{'':<4}" + "".join(f"{e + ' TTFT ms':>18}{'cached/prompt':>15}{'prefill':>8}"
                                  f"{'towers':>7}" for e in engines)
          + (f"{'minfer/llama':>14}" if len(engines) == 2 else ""))
    for q in QUESTIONS:
        row = f"{q:<4}"
        for e in engines:
            c = summary[e][q]
            mark = "" if c["content"] else "*"
            row += f"{c['ttft_s'] * 1e3:.0f}{mark} ±{c['spread_s'] * 1e3:.0f}".rjust(18)
            row += f"{c['cached_tokens'][-1]}/{c['prompt_tokens'][-1]}".rjust(15)
            most = None if None in c["towers"] else max(c["towers"])
            row += f"{c['prefilled'][-1]}".rjust(8) + f"{most}".rjust(7)
        if len(engines) == 2:
            row += f"{summary['minfer_over_llama'][q]:>14.2f}"
        print(row)
    for e in engines:
        print(f"{e}: the follow-up's new tokens (its prompt less q1's and the reply) "
              f"{summary[e]['q2']['new'][-1]}, prefilled {summary[e]['q2']['prefilled'][-1]}")
    print("(* no content chunk came: the time is to the stream's end; towers: the most tower "
          "runs of a round: one per tile or overview)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="the text GGUF (default: the synthetic SmolVLM-500M's)")
    p.add_argument("--mmproj", help="its mmproj (default: the synthetic SmolVLM-500M's)")
    p.add_argument("--dir", default=str(Path.home() / ".cache/minfer/synthetic/smolvlm-500m"),
                   help="where the synthetic files are written once")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-c", "--n-ctx", type=int, default=4096)
    p.add_argument("-b", "--batch", type=int, default=512,
                   help="prefill chunk (minfer -b; llama-server -b and -ub)")
    p.add_argument("--image", default="1024x768", help="the image's W x H (default 1024x768)")
    p.add_argument("--llama-server", default="/tmp/llbuild/bin/llama-server")
    p.add_argument("--llama-extra", nargs="*", default=[], metavar="ARG",
                   help="more llama-server arguments")
    p.add_argument("--llama-log", default="/tmp/vision_followup_llama.log",
                   help="llama-server's output")
    p.add_argument("--engines", default="minfer,llama")
    p.add_argument("--reply-tokens", type=int, default=16, help="q1's reply")
    p.add_argument("--max-tokens", type=int, default=4, help="q2's reply")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engines = args.engines.split(",")
    if args.model is None or args.mmproj is None:
        model, mmproj = synthetic_files(Path(args.dir))
        args.model, args.mmproj = args.model or str(model), args.mmproj or str(mmproj)
    width, height = (int(x) for x in args.image.lower().split("x"))
    tok = Tokenizer.from_gguf(GGUFFile.open(args.model))
    (the,) = tok.encode(" the", special=False, add_bos=False)
    bias = {str(the): 100.0}
    starters = {"minfer": start_minfer, "llama": start_llama_server}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    clients: dict[str, httpx.Client] = {}
    towers: dict[str, Towers] = {}
    rounds: dict[str, list[dict[str, dict[str, Any]]]] = {e: [] for e in engines}
    try:
        for e in engines:
            clients[e] = open_server(starters[e], args, procs, e)
            towers[e] = Towers(e, clients[e])
            one_round(clients[e], towers[e], args, image_url(width, height, 10_000), bias)  # warm
        for i in range(args.rounds):
            url = image_url(width, height, i)
            for e in engines if i % 2 == 0 else engines[::-1]:
                got = one_round(clients[e], towers[e], args, url, bias)
                rounds[e].append(got)
                print(f"round {i} {e}: " + "  ".join(
                    f"{q} {got[q]['ttft'] * 1e3:.0f} ms ({got[q]['cached_tokens']}/"
                    f"{got[q]['prompt_tokens']}, towers {got[q]['towers']})"
                    for q in QUESTIONS), flush=True)
    finally:
        close_servers(clients, procs)
    summary = summarize(rounds)
    report(summary, engines)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "mmproj": args.mmproj, "threads": args.threads,
             "n_ctx": args.n_ctx, "batch": args.batch, "image": args.image,
             "llama_server": args.llama_server, "llama_extra": args.llama_extra,
             "reply_tokens": args.reply_tokens, "max_tokens": args.max_tokens,
             "rounds": rounds, "summary": summary, "host_cpus": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
