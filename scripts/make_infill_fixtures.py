"""Fill-in-the-middle cases made with llama.cpp, for tests/test_infill_real.py.

Runs under the reference interpreter (llama-cpp-python 0.3.36, the README's development
section), not minfer's: llama.cpp's own vocabulary finds the FIM tokens and tokenizes each piece,
the layout is `format_prompt_infill` of llama.cpp's tools/server/server-common.cpp step by step
(llama_cpp.server has no /infill), and llama.cpp decodes each prompt greedily, recording the top-2
margin of every step (a divergence is only acceptable at a near-tie):

    /tmp/refvenv2/bin/python scripts/make_infill_fixtures.py MODEL.gguf \
        > tests/fixtures/infill_llamacpp.json
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import Llama

N_CTX = 4096
N_GEN = 32
FILE = """import math


def area(radius: float) -> float:
    return math.pi * radius ** 2


def circumference(radius: float) -> float:
"""
CASES: list[dict[str, Any]] = [
    {"name": "plain", "input_prefix": "def add(a, b):\n    ",
     "input_suffix": "\n\nprint(add(2, 3))\n"},
    {"name": "file", "input_prefix": FILE + "    ",
     "input_suffix": "\n\n\nif __name__ == \"__main__\":\n    print(area(2.0))\n"},
    {"name": "extra", "input_prefix": "from util import clamp\n\nx = clamp(",
     "input_suffix": ")\nprint(x)\n",
     "input_extra": [{"filename": "util.py",
                      "text": "def clamp(v, lo, hi):\n    return max(lo, min(hi, v))\n"},
                     {"text": "# a second file without a name\nLIMIT = 10\n"}]},
    {"name": "prompt", "input_prefix": "def greet(name):\n", "input_suffix": "\n",
     "prompt": "    return "},
    {"name": "budget", "input_prefix": "# " + "filler line\n# " * 120 + "def last():\n    ",
     "input_suffix": "\n" + "# trailing comment\n" * 120, "n_batch": 256, "n_predict": 32,
     "n_ctx": 1024,
     "input_extra": [{"filename": "big.py", "text": "VALUE = 1\n" * 400}]},
]


def main() -> None:
    llm = Llama(model_path=sys.argv[1], n_ctx=N_CTX, n_threads=2, n_batch=512, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    fim = {name: int(getattr(llama_cpp, f"llama_vocab_fim_{name}")(vocab))
           for name in ("pre", "suf", "mid", "pad", "rep", "sep")}
    out = []
    for case in CASES:
        ids = layout(llm, vocab, fim, case)
        gen, margins = greedy(llm, vocab, ids)
        out.append({**case, "ids": ids, "greedy_ids": gen, "margins": margins})
    json.dump({"source": "llama.cpp via llama-cpp-python 0.3.36 "
                         f"({llama_cpp.llama_print_system_info().decode().strip()})",
               "fim": fim, "cases": out}, sys.stdout, indent=1)
    print()


def tok(llm: Llama, text: str) -> list[int]:
    return list(llm.tokenize(text.encode(), add_bos=False, special=False)) if text else []


def layout(llm: Llama, vocab: Any, fim: dict[str, int], case: dict[str, Any]) -> list[int]:
    n_batch, n_predict = case.get("n_batch", 2048), case.get("n_predict", -1)
    n_ctx = case.get("n_ctx", N_CTX)
    prompt = list(llm.tokenize(case.get("prompt", "").encode(), add_bos=False, special=True)) \
        if case.get("prompt") else []
    prefix, suffix = tok(llm, case["input_prefix"]), tok(llm, case["input_suffix"])
    extra: list[int] = []
    if fim["rep"] != -1:
        extra += [fim["rep"], *tok(llm, "myproject\n")]
    for chunk in case.get("input_extra", []):
        if fim["sep"] != -1:
            extra += [fim["sep"], *tok(llm, chunk.get("filename", "tmp") + "\n")]
        else:
            extra += tok(llm, "\n\n--- snippet ---\n\n")
        extra += tok(llm, chunk["text"])
    if fim["sep"] != -1:
        extra += [fim["sep"], *tok(llm, "filename\n")]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [fim["pre"], *prefix[len(prefix) - n_prefix:], *prompt]
    if llama_cpp.llama_vocab_get_add_bos(vocab):
        head.insert(0, int(llama_cpp.llama_vocab_bos(vocab)))
    return [*extra[len(extra) - n_extra:], *head, fim["suf"], *suffix[:n_suffix], fim["mid"]]


def greedy(llm: Llama, vocab: Any, ids: list[int]) -> tuple[list[int], list[float]]:
    llm.reset()
    llm.eval(ids)
    gen: list[int] = []
    margins: list[float] = []
    for _ in range(N_GEN):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                       shape=(llm.n_vocab(),)).copy()
        top2 = np.argsort(-logits)[:2]
        margins.append(round(float(logits[top2[0]] - logits[top2[1]]), 4))
        token = int(top2[0])
        gen.append(token)
        if llama_cpp.llama_vocab_is_eog(vocab, ctypes.c_int32(token)):
            break
        llm.eval([token])
    return gen, margins


if __name__ == "__main__":
    main()
