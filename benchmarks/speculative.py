"""Speculative decoding, side by side in one run: tokens/s with and without each proposer.

Not part of the test suite. Three greedy tasks on one target model:
  (a) edit: rewrite a given 40-line function with one change (the output copies the prompt);
      edit2..edit5: other edits (a multi-token rename in a class, quotes changed on every
      line, type hints inserted into every signature of a class, and of a function),
  (b) code: free generation of code,
  (c) prose: free generation of prose;
each with minfer plain, minfer prompt lookup (--lookup-ngram), minfer with a draft model
(--model-draft), minfer with both (draft+lookup), and llama.cpp plain and with its prompt
lookup
(`llama_cpp.llama_speculative.LlamaPromptLookupDecoding`, through llama-cpp-python in a separate
interpreter, `--ref-python`). The modes run in interleaved rounds; a ratio is the median over
rounds of rate / the same round's minfer plain rate. Rates are decode rates: the tokens after
the first over the time after the first token (prefill excluded, the same definition for both
engines). Each minfer mode also checks its ids against minfer's plain greedy ids.

    nice .venv/bin/python benchmarks/speculative.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct -t 2 --json /tmp/spec.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Any

from minfer.engine.speculative import DRAFT_VOCAB

FUNCTION = '''def summarize_orders(orders, currency="EUR", min_total=0.0):
    """Group orders by customer and return per-customer statistics."""
    by_customer = {}
    for order in orders:
        customer = order["customer"]
        total = 0.0
        for item in order["items"]:
            price = item["price"]
            quantity = item.get("quantity", 1)
            if item.get("discount"):
                price = price * (1.0 - item["discount"])
            total += price * quantity
        if order.get("currency", currency) != currency:
            rate = order.get("rate", 1.0)
            total = total * rate
        if total < min_total:
            continue
        stats = by_customer.setdefault(customer, {
            "orders": 0,
            "total": 0.0,
            "largest": 0.0,
            "items": 0,
        })
        stats["orders"] += 1
        stats["total"] += total
        stats["items"] += sum(i.get("quantity", 1) for i in order["items"])
        if total > stats["largest"]:
            stats["largest"] = total
    result = []
    for customer, stats in sorted(by_customer.items()):
        average = stats["total"] / stats["orders"]
        result.append({
            "customer": customer,
            "orders": stats["orders"],
            "total": round(stats["total"], 2),
            "average": round(average, 2),
            "largest": round(stats["largest"], 2),
            "items": stats["items"],
        })
    return result
'''

CLASS = '''class InventoryQueue:
    """A bounded queue of stock movements, flushed to a ledger in batches."""

    def __init__(self, ledger, capacity=64, flush_every=16):
        self.ledger = ledger
        self.capacity = capacity
        self.flush_every = flush_every
        self.items = []
        self.flushed = 0

    def push(self, sku, quantity, warehouse="main"):
        if quantity == 0:
            raise ValueError("quantity must not be zero")
        if len(self.items) >= self.capacity:
            self.flush()
        self.items.append({"sku": sku, "quantity": quantity, "warehouse": warehouse})
        if len(self.items) % self.flush_every == 0:
            self.flush()

    def flush(self):
        if not self.items:
            return 0
        count = len(self.items)
        for item in self.items:
            self.ledger.record(item["sku"], item["quantity"], item["warehouse"])
        self.items = []
        self.flushed += count
        return count

    def pending(self, sku=None):
        if sku is None:
            return len(self.items)
        return sum(1 for item in self.items if item["sku"] == sku)
'''

TASKS = {
    "edit": ("Rewrite this Python function with one change: rename the variable `stats` to "
             "`summary` everywhere. Output only the complete new function in a code block.\n\n"
             f"```python\n{FUNCTION}```"),
    # further edits of other shapes: a rename of multi-token names, quotes changed on every
    # line, new text inserted into each signature
    "edit2": ("Rewrite this Python class with one change: rename the attribute `items` to "
              "`pending_moves` everywhere. Output only the complete new class in a code block."
              f"\n\n```python\n{CLASS}```"),
    "edit3": ("Rewrite this Python function using single quotes instead of double quotes for "
              "every string. Output only the complete new function in a code block.\n\n"
              f"```python\n{FUNCTION}```"),
    "edit4": ("Add type hints to every method signature of this Python class (parameters and "
              "return types); change nothing else. Output only the complete new class in a "
              f"code block.\n\n```python\n{CLASS}```"),
    "edit5": ("Add type hints to every parameter and the return type of this Python function; "
              "change nothing else. Output only the complete new function in a code block.\n\n"
              f"```python\n{FUNCTION}```"),
    "code": ("Write a Python module implementing a small LRU cache class with get, put, "
             "delete and resize methods, with docstrings and type hints."),
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}

LLAMA_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    path, threads, n_ctx, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    lookup = sys.argv[5] == "lookup"
    prompt = json.loads(sys.stdin.read())
    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                draft_model=draft, logits_all=lookup, verbose=False)
    # logits_all: with a draft model llama-cpp-python keeps every row's logits but sizes its
    # score buffer from this argument (n_batch rows otherwise: a prompt past 512 tokens fails)
    llm.create_completion(prompt[:8], max_tokens=4, temperature=0.0)  # warm
    t0 = time.perf_counter(); first = None; count = 0
    for chunk in llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    print(json.dumps({"n": count, "decode_s": end - first, "prefill_s": first - t0}))
    """
)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def minfer_run(model: Any, ids: list[int], n: int, speculator: Any) -> dict[str, Any]:
    from minfer.engine.generate import Finished, Piece
    from minfer.sampling.params import SamplerParams

    first = None
    finished = None
    t0 = time.perf_counter()
    for event in model.stream(ids, max_tokens=n, sampling=SamplerParams.greedy(),
                              speculator=speculator):
        if isinstance(event, Piece) and first is None:
            first = time.perf_counter()
        elif isinstance(event, Finished):
            finished = event
    end = time.perf_counter()
    assert finished is not None and first is not None
    spec = finished.speculation
    return {"ids": finished.ids, "n": len(finished.ids), "decode_s": end - first,
            "prefill_s": first - t0,
            "acceptance": None if spec is None else round(spec.acceptance, 3),
            "drafted": None if spec is None else spec.drafted}


def llama_run(python: str, path: str, prompt_ids: list[int], n: int, threads: int,
              mode: str) -> dict[str, Any]:
    proc = subprocess.run([python, "-c", LLAMA_SCRIPT, path, str(threads), "4096", str(n), mode],
                          input=json.dumps(prompt_ids), capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where two id lists differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def rate(r: dict[str, Any]) -> float:
    return (r["n"] - 1) / r["decode_s"] if r.get("decode_s") else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--ref-python", default="/tmp/refvenv/bin/python")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=160, help="tokens per generation (default 160)")
    ap.add_argument("--lookup-ngram", type=int, default=3)
    ap.add_argument("--draft-vocab", default=str(DRAFT_VOCAB),
                    help="comma-separated --draft-vocab values, one draft mode each (0: all; "
                         f"default {DRAFT_VOCAB}, the CLI's)")
    ap.add_argument("--tasks", default="edit,code,prose")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of every mode, interleaved (ratios: median over rounds)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--draft-quant", default="q4_0",
                    help="comma-separated --draft-quant values, one draft mode each (q4_0: the "
                         "draft narrowed to Q4_0 when wider, the CLI's default; keep)")
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model modes")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    import minfer
    from minfer.engine.speculative import SpecConfig
    from minfer.store import resolve_model

    model = minfer.load(args.target, threads=args.threads)
    lookup = model.speculator(SpecConfig(lookup_ngram=args.lookup_ngram))
    drafts = {("minfer draft" + ("" if v == DRAFT_VOCAB else f" v{v}")
               + ("" if q == "q4_0" else f" {q}")):
              model.speculator(SpecConfig(draft_vocab=v, draft_quant=q), draft=args.draft)
              for v in (int(x) for x in args.draft_vocab.split(","))
              for q in args.draft_quant.split(",")} if not args.no_draft else {}
    if not args.no_draft:  # both proposers at once (HybridProposer)
        drafts["minfer draft+lookup"] = model.speculator(
            SpecConfig(lookup_ngram=args.lookup_ngram), draft=args.draft)
    warm = model.tokenizer.encode(model.render_chat([{"role": "user", "content": "hi"}]))
    for spec in (None, lookup, *drafts.values()):  # compile kernels and build graphs, untimed
        minfer_run(model, warm, 24, spec)
    rows: list[dict[str, Any]] = []
    path = str(resolve_model(args.target))
    for task in args.tasks.split(","):
        ids = model.tokenizer.encode(model.render_chat([{"role": "user",
                                                         "content": TASKS[task]}]))
        runs: dict[str, list[dict[str, Any]]] = {}
        first_plain: list[int] | None = None
        for _ in range(args.rounds):  # modes alternate, so machine drift hits them all
            plain = minfer_run(model, ids, args.n, None)
            results = {"minfer plain": plain,
                       "minfer lookup": minfer_run(model, ids, args.n, lookup)}
            for name, spec in drafts.items():
                results[name] = minfer_run(model, ids, args.n, spec)
            if not args.no_llama:
                for mode in ("plain", "lookup"):
                    results[f"llama.cpp {mode}"] = llama_run(args.ref_python, path, ids, args.n,
                                                             args.threads, mode)
            first_plain = first_plain or plain["ids"]
            for name, r in results.items():
                r["same_ids"] = r["ids"] == plain["ids"] if "ids" in r else None
                if "ids" in r and not r["same_ids"]:  # which side moved: say where, loudly
                    print(f"{task} {name}: ids differ from this round's plain at "
                          f"{first_diff(r['ids'], plain['ids'])}, from round 1's plain at "
                          f"{first_diff(r['ids'], first_plain)}", file=sys.stderr, flush=True)
                r["ratio"] = rate(r) / rate(plain)
                runs.setdefault(name, []).append(r)
        for name, rs in runs.items():
            rows.append({"task": task, "mode": name, "tokens": rs[0].get("n"),
                         "tok_s": round(statistics.mean(rate(r) for r in rs), 2),
                         "vs_minfer_plain": round(statistics.median(r["ratio"] for r in rs), 2),
                         "acceptance": rs[-1].get("acceptance"), "drafted": rs[-1].get("drafted"),
                         "same_ids": all(r["same_ids"] for r in rs) if "ids" in rs[0] else None,
                         "error": rs[-1].get("error")})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nCPU: {cpu_name()}, {os.cpu_count()} cores, -t {args.threads}; target {args.target}, "
          f"draft {args.draft}, {args.n} tokens, greedy")
    print(f"{args.rounds} interleaved rounds; x minfer plain: median of per-round ratios")
    print("| task | mode | tok/s | x minfer plain | acceptance | ids = plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['mode']} | {r['tok_s']} | {r['vs_minfer_plain']} | "
              f"{r['acceptance'] if r['acceptance'] is not None else '-'} | "
              f"{r['same_ids'] if r['same_ids'] is not None else '-'} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cpu": cpu_name(), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
