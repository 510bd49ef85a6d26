"""Reasoning splits made by llama.cpp's server, for tests/test_reasoning_real.py.

Not minfer's code: llama-server (built from llama-cpp-python 0.3.36's vendored llama.cpp with
`cmake --build build --target llama-server`, CPU flags as in docs/performance.md) serves the
development model with `--jinja`, greedy. Each case is a conversation whose system prompt makes
the model think in `<think>` tags; it is asked with `reasoning_format` deepseek (llama.cpp's
`content` / `reasoning_content`), and the generated text of that same reply is read from its
logprobs (each token's bytes), under a chat template given by file
from tests/fixtures/templates: `qwen3-thinking` (Qwen3's template with the generation prompt of
the Qwen3 Thinking-2507 releases, which open `<think>` themselves), `r1-distill-qwen` (which does
too) and `qwen3` (the model must open the tag itself).

    python3 scripts/make_reasoning_fixtures.py /path/to/llama-server MODEL.gguf \
        > tests/fixtures/reasoning_llamacpp.json
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

TEMPLATES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "templates"
N_PREDICT = 160
SYSTEM = ("You are a careful assistant. First think briefly inside <think> and </think> tags "
          "(close the tag with </think> after two or three sentences), then give the final "
          "answer after the closing tag.")
QUESTIONS = [
    "What is 17 * 23?",
    "Is 91 a prime number?",
    "Write a Python one-liner that reverses a string.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ask(base: str, messages: list[dict[str, str]], fmt: str) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": N_PREDICT, "temperature": 0, "top_k": 1,
            "reasoning_format": fmt, "seed": 0, "logprobs": True, "top_logprobs": 1}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    generated = b"".join(bytes(t["bytes"]) for t in choice["logprobs"]["content"])
    return {"content": choice["message"].get("content"),
            "reasoning_content": choice["message"].get("reasoning_content"),
            "finish_reason": choice["finish_reason"],
            "generated": generated.decode("utf-8", errors="replace")}


def serve(server: str, model: str, template: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "2048",
           "-t", "2", "-np", "1", "--jinja", "--no-webui", "--reasoning-budget", "-1"]
    if template != "default":
        cmd += ["--chat-template-file", str(TEMPLATES / f"{template}.jinja")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server did not come up")


def main() -> None:
    server, model = sys.argv[1], sys.argv[2]
    cases = []
    for template in ("qwen3-thinking", "r1-distill-qwen", "qwen3"):
        proc, base = serve(server, model, template)
        try:
            for question in QUESTIONS:
                messages = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": question}]
                split = ask(base, messages, "deepseek")
                cases.append({"template": template, "messages": messages,
                              "generated": split.pop("generated"), "llamacpp": split})
        finally:
            proc.terminate()
            proc.wait(30)
    json.dump({"source": "llama-server (llama-cpp-python 0.3.36's llama.cpp), greedy, "
                         f"n_predict {N_PREDICT}", "cases": cases},
              sys.stdout, indent=1, ensure_ascii=False)
    print()


if __name__ == "__main__":
    main()
