"""Regenerate tests/fixtures/gemma3_greedy.json: llama.cpp's reference on Gemma-3-270M.

Run with the interpreter that has llama-cpp-python (not minfer's venv), on the catalogue's
Gemma-3-270M Q4_K_M file (`minfer pull gemma-3-270m`):

    /tmp/refvenv/bin/python benchmarks/make_gemma_reference.py \
        ~/.cache/minfer/gemma-3-270m-it-Q4_K_M.gguf tests/fixtures/gemma3_greedy.json

For each prompt: the ids llama.cpp's own tokenizer gives (BOS added, as the vocabulary asks;
minfer's tests feed these ids directly, so they need no SentencePiece tokenizer), the top-10
logits at the last prompt position, a greedy continuation and each step's top-5 logits. The
same settings as tests/fixtures/greedy.json: n_ctx 4096, 2 threads, flash-attn off, f16 KV.

With a third argument (tests/fixtures/gemma3_drift.json) it also writes the top-10 logits of
DRIFT_PROMPTS, the prompts of the most distant top-10 logits between minfer and llama.cpp found
over 18 prose / code / chat prompts (issue 63's Gemma 3 drift, tests/test_gemma3_drift.py).
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
_CHAT = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
DRIFT_PROMPTS = [
    "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n    return e / e.sum()"
    "\n\ndef cross_entropy(logits, target):\n",
    "function debounce(fn, wait) {\n  let timer = null;\n  return function (...args) {\n",
    _CHAT.format("Summarize the plot of Romeo and Juliet in two sentences."),
    _CHAT.format("Why is the sky blue? Answer briefly for a ten year old child who keeps asking "
                 "questions about nature and science."),
]


def _top(row: np.ndarray, k: int) -> list[list[float]]:
    idx = np.argsort(row)[::-1][:k]
    return [[int(i), round(float(row[i]), 4)] for i in idx]


def drift(llm: object, model: str, out: str) -> None:
    """Each drift prompt's ids and llama.cpp's top-10 logits at its last position."""
    import llama_cpp

    cases = []
    for prompt in DRIFT_PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)  # type: ignore[attr-defined]
        llm.reset()  # type: ignore[attr-defined]
        llm.eval(ids)  # type: ignore[attr-defined]
        last = np.array(llm.scores[len(ids) - 1])  # type: ignore[attr-defined]
        cases.append({"prompt": prompt, "prompt_ids": ids, "top10_last_prompt_pos": _top(last, 10)})
    doc = {"source": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}, n_ctx 4096, "
                     "2 threads, flash_attn off, f16 KV cache",
           "model_sha256": hashlib.sha256(Path(model).read_bytes()).hexdigest(), "cases": cases}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


def main(model: str, out: str, drift_out: str | None = None) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=4096, n_threads=2, logits_all=True, flash_attn=False,
                          verbose=False)
    if drift_out:
        drift(llm, model, drift_out)
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
    main(*sys.argv[1:4])
