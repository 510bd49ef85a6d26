"""Regenerate tests/fixtures/perplexity_llamacpp.json: llama.cpp's perplexity of a text.

Run with the interpreter that has llama-cpp-python (not minfer's venv), one model at a time:

    /tmp/refvenv/bin/python benchmarks/make_perplexity_reference.py \
        ~/.cache/minfer/qwen2.5-coder-0.5b-instruct.gguf tests/fixtures/kv_long_prompt.txt 128

llama-cpp-python ships no `llama-perplexity`, so its method is followed on llama.cpp's own
logits (`logits_all`): the text tokenized with BOS where the vocabulary adds one, whole chunks of
n_ctx tokens each evaluated from position 0 (first token BOS where added), the second half of
each chunk scored, PPL = exp(mean NLL). Prints one JSON case; paste it into the fixture's
`cases`. An optional fourth argument caps the chunks.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def main() -> None:
    model, path, n_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
    max_chunks = int(sys.argv[4]) if len(sys.argv) > 4 else None
    llm = Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
                n_threads=2)
    ids = llm.tokenize(Path(path).read_bytes(), add_bos=True, special=False)
    add_bos = bool(llm._model.add_bos_token())
    n_chunks = len(ids) // n_ctx if max_chunks is None else min(max_chunks, len(ids) // n_ctx)
    first = n_ctx // 2
    nll = 0.0
    count = 0
    running = []
    for i in range(n_chunks):
        chunk = ids[i * n_ctx:(i + 1) * n_ctx]
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        x = np.array(llm.scores[:n_ctx], dtype=np.float64)
        for j in range(first, n_ctx - 1):
            row = x[j]
            m = row.max()
            nll -= row[chunk[j + 1]] - (m + math.log(np.exp(row - m).sum()))
            count += 1
        running.append(math.exp(nll / count))
    print(json.dumps({"model": Path(model).stem, "n_ctx": n_ctx, "n_tokens": len(ids),
                      "ppl": running[-1], "running": running}))


if __name__ == "__main__":
    main()
