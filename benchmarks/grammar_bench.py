"""Grammar-mask cost per token against the forward pass; not a test.

    .venv/bin/python benchmarks/grammar_bench.py [--model /tmp/model.gguf] [-n 128] [--seeds 3]

For each JSON schema below, the development model generates with sampling on (temperature 0.8)
under the schema's mask. Every call into the mask (`is_stopped` computes the token mask,
`apply` writes -inf into the logits, `accept` advances the matcher) is timed and reported per
generated token next to the forward time per token from the loop's own timings; the ratio is
the slowdown the mask adds to decode. Each output is checked against its schema.

Without a working engine (the compiled kernels not built yet) `--replay` runs the same masks on
random walks over the real vocabulary, which gives the mask's cost alone. The "alone" column
replays each generated token sequence through a fresh mask with no forward pass in between: on a
loaded machine (or with the kernels' worker threads still spinning) the in-loop figure also
counts time the mask thread was not running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from minfer.sampling.grammar import GrammarMask, GrammarVocab, json_schema_grammar

SCHEMAS: dict[str, dict[str, object]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"},
                                              "maxItems": 5}},
        "required": ["name", "age", "email", "tags"], "additionalProperties": False},
    "order": {"$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}},
        "type": "object", "properties": {
            "id": {"type": "integer"}, "status": {"enum": ["new", "paid", "shipped"]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
                      "maxItems": 4}},
        "required": ["id", "status", "items"], "additionalProperties": False},
    "any_object": {"type": "object"},
}
PROMPT = "Reply with one JSON object describing {what}."
WHAT = {"person": "a fictional person", "order": "a web-shop order", "any_object": "a city"}


class TimedMask(GrammarMask):
    """A GrammarMask that adds up the wall time spent in it."""

    spent = 0.0

    def is_stopped(self) -> bool:
        t = time.perf_counter()
        try:
            return super().is_stopped()
        finally:
            self.spent += time.perf_counter() - t

    def apply(self, logits: np.ndarray) -> None:
        t = time.perf_counter()
        super().apply(logits)
        self.spent += time.perf_counter() - t

    def accept(self, token_id: int) -> None:
        t = time.perf_counter()
        super().accept(token_id)
        self.spent += time.perf_counter() - t


def run_model(path: Path, n: int, seeds: int) -> None:
    import jsonschema

    import minfer
    from minfer.engine.generate import Finished
    from minfer.sampling import SamplerParams

    model = minfer.load(path)
    t = time.perf_counter()
    model.grammar_mask(json_schema_grammar({"type": "object"}))
    print(f"vocabulary view: {1000 * (time.perf_counter() - t):.0f} ms (once per model)")
    print("| schema | seed | tokens | forward ms/tok | mask ms/tok | mask/forward | alone ms/tok "
          "| valid |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for name, schema in SCHEMAS.items():
        grammar = json_schema_grammar(schema)
        text = model.render_chat([{"role": "user", "content": PROMPT.format(what=WHAT[name])}])
        ids = model.tokenizer.encode(text)
        for seed in range(seeds):
            mask = TimedMask(model.grammar_mask(grammar).vocab, grammar)
            done = None
            for ev in model.stream(ids, max_tokens=n, seed=seed, logit_mask=mask,
                                   sampling=SamplerParams(temp=0.8)):
                if isinstance(ev, Finished):
                    done = ev
            assert done is not None
            steps = max(1, len(done.ids) + (done.eot_id is not None))
            fwd = 1000 * done.timings.decode_s / max(1, done.timings.decode_tokens)
            msk = 1000 * mask.spent / steps
            valid = "length"
            if done.reason == "eos":
                jsonschema.validate(json.loads(done.text), schema)
                valid = "yes"
            ratios.append(msk / fwd)
            alone = 1000 * replay(mask, done.ids) / steps
            print(f"| {name} | {seed} | {steps} | {fwd:.2f} | {msk:.3f} | {100 * msk / fwd:.2f} % "
                  f"| {alone:.3f} | {valid} |")
    print(f"\nmean mask/forward: {100 * statistics.mean(ratios):.2f} %")


def replay(mask: GrammarMask, ids: list[int]) -> float:
    """Seconds a fresh copy of `mask` spends on `ids` (mask, apply, accept per token)."""
    timed = TimedMask(mask.vocab, mask.grammar)
    logits = np.zeros(mask.vocab.n_vocab, np.float32)
    for token in ids:
        timed.is_stopped()
        timed.apply(logits)
        timed.accept(token)
    return timed.spent


def run_replay(path: Path, n: int, seeds: int) -> None:
    from minfer.gguf.reader import GGUFFile
    from minfer.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile.open(path))
    vocab = GrammarVocab.from_tokenizer(tok)
    eot = sorted(tok.eot_ids)
    print("| schema | seed | tokens | mask ms/tok |")
    print("|---|---|---|---|")
    for name, schema in SCHEMAS.items():
        grammar = json_schema_grammar(schema)
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            mask = TimedMask(vocab, grammar)
            steps = 0
            for steps in range(1, n + 1):
                logits = rng.standard_normal(vocab.n_vocab).astype(np.float32)
                if steps > n // 2:
                    logits[eot] += 50
                if mask.is_stopped():
                    break
                mask.apply(logits)
                token = int(np.argmax(logits))
                mask.accept(token)
                if token in tok.eot_ids:
                    break
            print(f"| {name} | {seed} | {steps} | {1000 * mask.spent / steps:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/model.gguf"))
    ap.add_argument("-n", type=int, default=128, help="max tokens per generation")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--replay", action="store_true", help="masks only, no model forward")
    args = ap.parse_args()
    if args.replay:
        run_replay(args.model, args.n, args.seeds)
    else:
        run_model(args.model, args.n, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
