"""Regenerate tests/fixtures/rerank/: a tiny random Qwen3-Reranker converted by llama.cpp, with
llama.cpp's scores for a few (query, document) pairs.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/make_rerank_fixture.py \
        --llama-cpp-dir /path/to/llama.cpp --ref-python /tmp/refvenv/bin/python

The checkpoint is transformers' Qwen3ForCausalLM (random weights, seed 0, 2 layers, n_embd 64,
tied output) in a folder named `qwen3-reranker-tiny`, with a byte-level BPE tokenizer trained
here (tests/hf_tiny.py) plus "yes" and "no" as tokens: llama.cpp's converter takes it for a
Qwen3-Reranker by its name and writes rank pooling, the `rerank` prompt template and the head
`cls.output` (the output projection's "yes" and "no" rows). llama.cpp scores each pair the way
its server's /v1/rerank does: the template with `{query}` / `{document}` replaced, tokenized
with special tokens parsed and nothing added (llama-cpp-python's `embed` would add neither
parsing), its rank pooling (the last token through the head, softmaxed), f32 KV; the score is
the first output, P(yes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "rerank"
PAIRS = [
    ["what is a fox", "The quick brown fox jumps over the lazy dog."],
    ["what is a fox", "In the morning there is nothing better than tea and a good book."],
    ["def main", "def main(): return 42"],
    ["numbers", "0123456789 and words"],
]

_LLAMACPP = """
import json, sys, llama_cpp
m = llama_cpp.Llama(sys.argv[1], embedding=True, pooling_type=4, n_ctx=512, verbose=False,
                    n_threads=2, type_k=0, type_v=0, flash_attn=False)
tokenize = m.tokenize
m.tokenize = lambda text, add_bos=True, special=False: tokenize(text, add_bos=False, special=True)
template = m.metadata["tokenizer.chat_template.rerank"]
out = []
for query, doc in json.loads(sys.argv[2]):
    e = m.embed(template.replace("{query}", query).replace("{document}", doc), normalize=False)
    out.append([float(x) for x in e[:2]])
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-dir", required=True,
                    help="holds convert_hf_to_gguf.py, conversion/ and gguf-py/")
    ap.add_argument("--ref-python", required=True, help="python with llama-cpp-python")
    args = ap.parse_args()
    os.environ["MINFER_LLAMA_CPP_DIR"] = args.llama_cpp_dir
    from tests.hf_tiny import write_reranker_checkpoint
    from tests.llama_convert import reference_convert

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_reranker_checkpoint(Path(tmp) / "qwen3-reranker-tiny")
        gguf_path = OUT / "qwen3_reranker.gguf"
        gguf_path.unlink(missing_ok=True)
        reference_convert([(hf, gguf_path, "f32", "qwen2")])
    proc = subprocess.run([args.ref_python, "-c", _LLAMACPP, str(gguf_path), json.dumps(PAIRS)],
                          capture_output=True, text=True, check=True)
    scores = json.loads(proc.stdout)
    (OUT / "scores_llamacpp.json").write_text(json.dumps({"pairs": PAIRS, "llamacpp": scores},
                                                         indent=1) + "\n")
    print(scores, file=sys.stderr)


if __name__ == "__main__":
    main()
