"""One-off check: minfer's tokenizer against llama.cpp's on a GGUF, over varied and random texts.

Run with a Python that has llama-cpp-python (the reference); minfer runs as its own CLI
(`minfer tokenize MODEL --jsonl`, one model load for all texts) under MINFER_PYTHON:

    /tmp/refvenv/bin/python benchmarks/tokenizer_vs_llamacpp.py MODEL.gguf [MODEL2.gguf ...]
        [--random N] [--seed S] [--extra FILE.inp ...]

Compares ids with special tokens parsed and not parsed (`--no-special`), BOS per the file's
metadata, and prints every mismatch (first 10 per file) with both id lists. Exit 1 on any.
Reference data only: nothing here is part of minfer's engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

VARIED = [
    "", " ", "  ", "\n", "\n\n\n", "\t\tx", "Hello world", " Hello world", "Hello  world  ",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    '{"key": [1, 2.5e-3, null, "\\u00e9"], "x": {}}',
    "    indented\n        more\n\n\n\tmixed \t tabs",
    "naïve café — “quotes” and ‘single’ … ½ ¾ ™ © 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Привет, мир! Γειά σου Κόσμε! שלום עולם مرحبا بالعالم नमस्ते दुनिया",
    "日本語のテキストと中文文本，한국어 텍스트도 있습니다。",
    "emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🦙.cpp ✅ ❤️",
    "I'm sure it's fine, they'll've done it; we'D SAY 'quoted'.",
    "1234567890 3.14159 1,000,000 0x1F 1e-9 ١٢٣",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk><mask> </s> <s> <|im_start|> [INST] <<SYS>>",
    "<div class=\"x\"><span>text</span></div><br/>",
    "trailing spaces   \n   leading spaces",
    "a\u00a0b\u2003c\u3000d\u200be\ufeff",
    "\u0301\u0300 combining first, then e\u0301 and Å",
    "\x00\x01\x1f control chars \x7f",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "    " * 20 + "deep",
    "The quick brown fox jumps over the lazy dog. " * 20,
]

ALPHABET = [*"abcdefghijklmnopqrstuvwxyzABCXYZ0123456789",
            *" \n\t.,;:!?'\"()[]{}<>-_=+*/\\|&^%$#@~`",
            "  ", "   ", "\n\n", "é", "ß", "ñ", "Ж", "я", "λ", "中", "文", "한", "ー", "😀", "👍🏽",
            "\u200d", "\u00a0", "\u3000", "\u0301", "ﬁ", "①", "½", "’", "—", "…", "<s>", "</s>",
            "<bos>", "<start_of_turn>", "▁", "'s", "'LL", "1234", "\r\n"]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def suite_texts(path: Path) -> list[str]:
    raw = path.read_text(encoding="utf-8")
    return [t for t in raw.split("\n__ggml_vocab_test__\n") if t]


def minfer_ids(model: Path, texts: list[str], special: bool) -> list[list[int]]:
    python = os.environ.get("MINFER_PYTHON", "/work/main/.venv/bin/python")
    argv = [python, "-m", "minfer.cli.main", "tokenize", str(model), "--jsonl"]
    if not special:
        argv.append("--no-special")
    stdin = "".join(json.dumps(t) + "\n" for t in texts)
    out = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True).stdout
    return [json.loads(line)["ids"] for line in out.splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--random", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", nargs="*", type=Path, default=[])
    args = ap.parse_args()
    import llama_cpp

    extra = [t for p in args.extra for t in suite_texts(p)]
    bad_total = 0
    for model in args.models:
        texts = VARIED + extra + random_texts(args.random, args.seed)
        inp = model.with_name(model.name + ".inp")
        if inp.is_file():
            texts += suite_texts(inp)
        ref = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
        for special in (True, False):
            t0 = time.perf_counter()
            ours = minfer_ids(model, texts, special)
            t_ours = time.perf_counter() - t0
            theirs = [ref.tokenize(t.encode("utf-8"), add_bos=True, special=special)
                      for t in texts]
            bad = [(t, a, b) for t, a, b in zip(texts, theirs, ours, strict=True) if a != b]
            bad_total += len(bad)
            print(f"{model.name}: special={special}: {len(texts) - len(bad)}/{len(texts)} texts "
                  f"agree ({sum(map(len, theirs))} tokens; minfer CLI incl. load {t_ours:.1f} s)")
            for t, a, b in bad[:10]:
                print(f"  {t!r}\n    llama.cpp {a}\n    minfer    {b}")
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
