"""Prompt lookup replayed: greedy answers recorded once, then fed through the engine's own
`LookupProposer` and `DraftLength` with a verify cost model, in seconds instead of minutes.

Not part of the test suite. A change to the proposer or the length policy can be ranked on many
edits at once, deterministically, before the side-by-side run that decides
(`speculative.py`). Replays ranked the variants of the last round as the real runs did, but
put their ratios 0.05-0.2 below them: a real step also pays the sampler and the bookkeeping,
which make a verify relatively cheaper.

    # record the greedy answers of speculative.py's tasks (the target model runs once each)
    .venv/bin/python benchmarks/lookup_replay.py --record /tmp/answers.json
    # replay them (one proposer and one DraftLength for all, as one process serves them)
    .venv/bin/python benchmarks/lookup_replay.py /tmp/answers.json -n 160

Costs: a plain step 1, a verify of 2 / 4 / 8 / 16 rows `--costs` (default: the 1.5B Q4_K_M
target at depth 400, 2 threads, Intel Xeon SPR: 1.12 / 1.31 / 1.64 / 2.83); `--measure` times
the target's forwards on this host instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speculative import TASKS

from minfer.engine.core.policy import DraftLength
from minfer.engine.core.proposer import DraftAsk, LookupProposer

EDITS = [t for t in TASKS if t.startswith("edit")]


def record(target: str, tasks: list[str], n: int, threads: int) -> dict[str, Any]:
    import minfer
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    model = minfer.load(target, threads=threads)
    out: dict[str, Any] = {}
    for task in tasks:
        ids = model.tokenizer.encode(model.render_chat([{"role": "user",
                                                         "content": TASKS[task]}]))
        done = None
        for event in model.stream(ids, max_tokens=n, sampling=SamplerParams.greedy()):
            if isinstance(event, Finished):
                done = event
        assert done is not None
        out[task] = {"prompt": ids, "out": list(done.ids)}
        print(task, len(ids), len(done.ids), flush=True)
    return out


def measure(target: str, threads: int, depth: int = 400) -> dict[int, float]:
    """Each verify size's forward time over a plain step's, on this host."""
    import minfer

    engine = minfer.load(target, threads=threads).engine(depth + 64)
    ids = list(range(1000, 1000 + depth))
    engine.forward(ids, 0, 1)
    best: dict[int, float] = {}
    for _ in range(3):
        for rows in (1, 2, 4, 8, 16):
            engine.forward(ids[:rows], depth, rows)
            t = time.perf_counter()
            engine.forward(ids[:rows], depth, rows)
            best[rows] = min(best.get(rows, 1e9), time.perf_counter() - t)
    return {rows: s / best[1] for rows, s in best.items()}


def replay(prop: LookupProposer, length: DraftLength, prompt: list[int], out: list[int],
           seq_id: int, cost: dict[int, float]) -> float:
    """Tokens per unit of plain-step time for `out` after `prompt` (greedy: each step keeps the
    proposal's matching prefix and the target's next token)."""
    seq, i, spent = [*prompt, out[0]], 1, 0.0
    while i < len(out):
        k = length.choose(len(out) - i)
        draft: list[int] = []
        if k:
            proposal = prop.propose([DraftAsk(seq_id, 0, tuple(seq), k)])[seq_id]
            draft = proposal.tokens[:length.fit(proposal)]
        kept = 0
        while kept < len(draft) and i + kept < len(out) and draft[kept] == out[i + kept]:
            kept += 1
        step = cost[1 + len(draft)]
        if draft:
            length.record_verify(1 + len(draft), step)
            length.record_outcome(len(draft), kept)
        else:
            length.record_plain(step)
        spent += step
        seq += out[i:i + kept + 1]
        i += kept + 1
    return (len(out) - 1) / spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("answers", nargs="?", help="a JSON file of recorded answers to replay")
    ap.add_argument("--record", metavar="PATH", help="record the answers into PATH")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--tasks", default=",".join(EDITS))
    ap.add_argument("-n", type=int, default=160, help="tokens per answer (record: the most)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--lookup-ngram", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--costs", default="1.12,1.31,1.64,2.83",
                    help="verify of 2,4,8,16 rows in plain steps")
    ap.add_argument("--measure", action="store_true", help="time the target's verifies here")
    args = ap.parse_args()
    tasks = args.tasks.split(",")
    if args.record:
        Path(args.record).write_text(json.dumps(record(args.target, tasks, args.n,
                                                       args.threads)))
        return 0
    if not args.answers:
        ap.error("give a file of answers to replay, or --record PATH")
    cost = (measure(args.target, args.threads) if args.measure else
            dict(zip((2, 4, 8, 16), map(float, args.costs.split(",")), strict=True)))
    cost[1] = 1.0
    answers = json.loads(Path(args.answers).read_text())
    prop, length = LookupProposer(args.lookup_ngram), DraftLength(16)
    rates: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for j, task in enumerate(tasks):
            a = answers[task]
            rates.setdefault(task, []).append(
                replay(prop, length, a["prompt"], a["out"][:args.n], r * len(tasks) + j, cost))
    print("costs:", {k: round(v, 2) for k, v in sorted(cost.items())})
    print("| task | x plain, each round |")
    print("|---|---|")
    for task, xs in rates.items():
        print(f"| {task} | {' / '.join(f'{x:.2f}' for x in xs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
