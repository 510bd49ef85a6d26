"""Sampler cost per token on a Qwen-sized vocabulary (151,936 logits); not a test.

    .venv/bin/python benchmarks/sampler_bench.py [--n-vocab 151936] [--iters 300]

Logits are synthetic but shaped like a language model's: a Gumbel-ish bulk plus a few dozen
tokens well above it, so top-p / min-p cut where they would on real text. Each row runs the
chain on fresh logits (no cache effects from reusing one array) and reports the median and p95
microseconds of `Sampler.sample` alone.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from minfer.sampling import Sampler, SamplerParams

CASES: dict[str, dict[str, object]] = {
    "default (k40 p.95 m.05 t.8)": {},
    "greedy": {"temp": 0.0},
    "default + penalties": {
        "repeat_penalty": 1.1,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
    },
    "default + DRY 0.8": {"dry_multiplier": 0.8},
    "top-k off (top-p .95 over all)": {"top_k": 0},
    "typical .9": {"typical_p": 0.9},
    "mirostat 1": {"mirostat": 1},
    "mirostat 2": {"mirostat": 2},
}


def lm_like_logits(rng: np.random.Generator, n_vocab: int) -> np.ndarray:
    x = rng.gumbel(size=n_vocab).astype(np.float32) * 1.5
    hot = rng.choice(n_vocab, size=30, replace=False)
    x[hot] += rng.uniform(6.0, 14.0, size=30).astype(np.float32)
    return x


def bench(name: str, settings: dict[str, object], n_vocab: int, iters: int) -> None:
    rng = np.random.default_rng(0)
    texts = [f"t{i}" if i % 97 else "\n" for i in range(n_vocab)]
    s = Sampler(SamplerParams(**settings), n_vocab, seed=0, token_text=texts, n_ctx=4096)  # type: ignore[arg-type]
    s.reset(rng.integers(0, 2000, size=1000).tolist())
    pool = [lm_like_logits(rng, n_vocab) for _ in range(8)]
    s.sample(pool[0])  # warm-up (DRY reads the vocabulary once here)
    times = []
    for i in range(iters):
        x = pool[i % len(pool)]
        t0 = time.perf_counter()
        tok = s.sample(x)
        times.append(time.perf_counter() - t0)
        s.accept(tok)
    us = np.array(times) * 1e6
    print(f"| {name:<32} | {np.median(us):8.1f} | {np.percentile(us, 95):8.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-vocab", type=int, default=151_936)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    print(f"n_vocab = {args.n_vocab}, {args.iters} tokens per row")
    print(f"| {'chain':<32} | {'med µs':>8} | {'p95 µs':>8} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 10}|")
    for name, settings in CASES.items():
        bench(name, settings, args.n_vocab, args.iters)


if __name__ == "__main__":
    main()
