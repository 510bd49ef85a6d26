"""Warm start: the wall time of a whole `minfer run -n 4 "Say hi"`, side by side with llama.cpp.

Not part of the test suite. A warm start is a run after the first: kernels compiled and cached,
repacked weights on disk, the model file in the page cache. One untimed run of each command
comes first to make it so. Then `--rounds` rounds, each timing every command once, the order
alternating between rounds so machine drift hits all alike. Each command is a fresh process,
timed from spawn to exit by the wall clock (what a user waits for); its output is discarded.

Commands:
- minfer: the console script of this checkout (`.venv/bin/minfer`), greedy, 4 tokens, 2 threads.
- minfer@REV (`--rev REV`, repeatable): the same command from a git worktree of REV, made once
  under /tmp (its own kernel cache folder applies: the sources differ), for a before/after.
- llama.cpp (`--ref-python`): llama-cpp-python in that interpreter, the same model, chat template,
  2 threads, 4 tokens (`Llama(...).create_chat_completion`).

    .venv/bin/python benchmarks/startup.py --rounds 8 --ref-python /tmp/refvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path.home() / ".cache/minfer/qwen2.5-coder-0.5b-instruct.gguf"
PROMPT = "Say hi"

LLAMA_SCRIPT = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=4096, n_threads=2, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=4,
                                 temperature=0)
print(out["choices"][0]["message"]["content"])
"""


def minfer_command(root: Path, model: Path) -> list[str]:
    return [str(root / ".venv/bin/minfer"), "run", str(model), "-n", "4", "--temp", "0",
            "-t", "2", PROMPT]


def worktree(rev: str) -> Path:
    """A checkout of rev under /tmp with this checkout's venv linked in (an editable install
    would point at this tree: the worktree's sources go first on PYTHONPATH instead)."""
    path = Path("/tmp") / f"minfer-startup-{rev.replace('/', '_')}"
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
                       check=True, capture_output=True)
    return path


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rev", action="append", default=[], help="also time this git revision")
    ap.add_argument("--ref-python", help="an interpreter with llama-cpp-python")
    ap.add_argument("--json", type=Path, help="write the timings here")
    args = ap.parse_args()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    commands: dict[str, tuple[list[str], dict[str, str]]] = {
        "minfer": (minfer_command(REPO, args.model), env)}
    for rev in args.rev:
        tree = worktree(rev)
        rev_env = {**env, "PYTHONPATH": str(tree / "src")}
        commands[f"minfer@{rev}"] = ([str(REPO / ".venv/bin/python"), "-c",
                                      "import sys; from minfer.cli.main import entry; "
                                      "sys.argv[0] = 'minfer'; entry()",
                                      *minfer_command(REPO, args.model)[1:]], rev_env)
    if args.ref_python:
        commands["llama.cpp"] = ([args.ref_python, "-c", LLAMA_SCRIPT, str(args.model), PROMPT],
                                 env)
    names = list(commands)
    for name in names:  # untimed: caches, page cache, repacked weights
        timed(*commands[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(timed(*commands[name]))
    load = os.getloadavg()[0]
    print(f"{args.rounds} rounds, load average {load:.2f} after; seconds from spawn to exit")
    for name in names:
        ts = sorted(times[name])
        print(f"  {name:24s} median {statistics.median(ts):.2f}  min {ts[0]:.2f}  "
              f"max {ts[-1]:.2f}  all {' '.join(f'{t:.2f}' for t in times[name])}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "seconds": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
