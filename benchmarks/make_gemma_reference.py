"""Regenerate tests/fixtures/gemma3_greedy.json: llama.cpp's reference on Gemma-3-270M.

Run with the interpreter that has llama-cpp-python (not minfer's venv), on the catalogue's
Gemma-3-270M Q4_K_M file (`minfer pull gemma-3-270m`):

    /tmp/refvenv/bin/python benchmarks/make_gemma_reference.py \
        ~/.cache/minfer/gemma-3-270m-it-Q4_K_M.gguf tests/fixtures/gemma3_greedy.json

For each prompt: the ids llama.cpp's own tokenizer gives (BOS added, as the vocabulary asks;
minfer's tests feed these ids directly, so they need no SentencePiece tokenizer), the top-10
logits at the last prompt position, a greedy continuation and each step's top-5 logits. The
same settings as tests/fixtures/greedy.json: n_ctx 4096, 2 threads, flash-attn off, f16 KV.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<start_of_turn>user\nWhat is the boiling point of water?<end_of_turn>\n<start_of_turn>model\n",
    "The three primary colors are",
    "Photosynthesis is the process by which",
]
N_GEN = 24


def _top(row: np.ndarray, k: int) -> list[list[float]]:
    idx = np.argsort(row)[::-1][:k]
    return [[int(i), round(float(row[i]), 4)] for i in idx]


def main(model: str, out: str) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=4096, n_threads=2, logits_all=True, flash_attn=False,
                          verbose=False)
    cases = []
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        last = np.array(llm.scores[len(ids) - 1])
        greedy: list[int] = []
        steps = []
        row = last
        for _ in range(N_GEN):
            tok = int(np.argmax(row))
            steps.append({"top5": _top(row, 5)})
            greedy.append(tok)
            if tok in (llm.token_eos(), 106):  # <eos>, <end_of_turn>
                break
            llm.eval([tok])
            row = np.array(llm.scores[llm.n_tokens - 1])
        cases.append({
            "prompt": prompt,
            "prompt_ids": ids,
            "top10_last_prompt_pos": _top(last, 10),
            "greedy_ids": greedy,
            "greedy_text": llm.detokenize(greedy).decode("utf-8", "replace"),
            "steps": steps,
        })
    digest = hashlib.sha256(Path(model).read_bytes()).hexdigest()
    doc = {
        "source": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}, n_ctx 4096, "
                  "2 threads, flash_attn off, f16 KV cache, greedy",
        "model_sha256": digest,
        "cases": cases,
    }
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
