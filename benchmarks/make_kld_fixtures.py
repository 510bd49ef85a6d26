"""Regenerate tests/fixtures/kld/: llama-perplexity's KL-divergence file and numbers, both ways.

Run with minfer's venv (it calls llama.cpp's `llama-perplexity` binary and, for llama.cpp's own
logits, llama-cpp-python's interpreter in a subprocess):

    python benchmarks/make_kld_fixtures.py [--llama-perplexity /tmp/llbuild/bin/llama-perplexity]
        [--ref-python /tmp/refvenv/bin/python]

The models are `write_tiny_model()` (qwen2, 331 tokens) in F32 (the base) and Q4_0 (the
quantization); the text tests/fixtures/kv_long_prompt.txt in 7 chunks of 32 tokens (105 scored
rows: llama-perplexity prints its closing tables from 100 on). Flash attention is off in both
llama.cpp runs (llama-perplexity's `auto` turns it on, llama-cpp-python's default is off: with
it off, the two give the same logits to the bit). Writes:

- base_llamacpp.kld: `llama-perplexity --kl-divergence-base` on the F32 model;
- base_minfer.kld: `minfer perplexity --kl-divergence-base` on the F32 model, same text;
- logits_llamacpp.npz: llama.cpp's (llama-cpp-python) f32 logits on the files' chunks, rows
  n_ctx/2 .. n_ctx-2 of each: `q4` every chunk's, `f32` the first two chunks';
- llamacpp_kld.json: llama-perplexity's --kl-divergence closing tables (text and parsed) on the
  Q4_0 model against each file, and minfer's own --kl-divergence statistics (minfer's logits)
  against each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from gguf import GGMLQuantizationType as QType

from minfer.bench.kld import parse_report
from minfer.tools.synth import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "kld"
TEXT = ROOT / "tests" / "fixtures" / "kv_long_prompt.txt"
N_CTX = 32
N_CHUNKS = 7
F32_CHUNKS = 2  # chunks of the base model's logits kept (the file writer's check)

DUMP = """
import sys
import numpy as np
from llama_cpp import Llama

base, out = sys.argv[1], sys.argv[2]
raw = open(base, "rb").read()
n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(raw[8:20], "<i4"))
tokens = np.frombuffer(raw[20:20 + 4 * n_ctx * n_chunk], "<i4")
first = n_ctx // 2
saved = {}
for name, model, n in zip(("q4", "f32"), sys.argv[3:5], (n_chunk, int(sys.argv[5]))):
    llm = Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
                n_threads=1, flash_attn=False)
    rows = []
    for c in range(n):
        chunk = [int(t) for t in tokens[c * n_ctx:(c + 1) * n_ctx]]
        if llm._model.add_bos_token():
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        rows.append(np.array(llm.scores[first:n_ctx - 1], np.float32))
    saved[name] = np.concatenate(rows)
np.savez_compressed(out, **saved)
"""


def write_models(where: Path) -> tuple[Path, Path]:
    """The base (F32) and quantized (Q4_0) tiny models: the same random weights."""
    return (write_tiny_model(where / "f32.gguf"),
            write_tiny_model(where / "q4_0.gguf", weight_types=QType.Q4_0))


def llama_perplexity(binary: str, *args: str) -> str:
    """Run llama-perplexity (one thread, flash attention off); its stdout."""
    cmd = [binary, "-t", "1", "-fa", "off", "-c", str(N_CTX), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def report_of(stdout: str) -> str:
    """The closing tables of a llama-perplexity --kl-divergence run."""
    return stdout[stdout.index("====== Perplexity statistics"):].split("\n\nllama_perf")[0].strip()


def minfer_cli(*args: str) -> str:
    cmd = [sys.executable, "-c", "import sys; from minfer.cli.main import main; "
           "sys.exit(main(sys.argv[1:]))", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-perplexity", default="/tmp/llbuild/bin/llama-perplexity")
    ap.add_argument("--ref-python", default="/tmp/refvenv/bin/python")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    base_ll, base_mf = OUT / "base_llamacpp.kld", OUT / "base_minfer.kld"
    with tempfile.TemporaryDirectory() as tmp:
        f32, q4 = write_models(Path(tmp))
        llama_perplexity(args.llama_perplexity, "-m", str(f32), "-f", str(TEXT), "--chunks",
                         str(N_CHUNKS), "--kl-divergence-base", str(base_ll))
        minfer_cli("perplexity", str(f32), "-f", str(TEXT), "-c", str(N_CTX), "--chunks",
                   str(N_CHUNKS), "-t", "1", "--json", "--kl-divergence-base", str(base_mf))
        runs = {}
        for name, base in (("llamacpp_base", base_ll), ("minfer_base", base_mf)):
            report = report_of(llama_perplexity(args.llama_perplexity, "-m", str(q4),
                                                "--kl-divergence-base", str(base),
                                                "--kl-divergence"))
            mine = json.loads(minfer_cli("perplexity", str(q4), "-t", "1", "--json",
                                         "--kl-divergence-base", str(base), "--kl-divergence"))
            runs[name] = {"llama_perplexity_report": report,
                          "llama_perplexity": parse_report(report), "minfer": mine}
        subprocess.run([args.ref_python, "-c", DUMP, str(base_ll), str(OUT / "logits_llamacpp"),
                        str(q4), str(f32), str(F32_CHUNKS)], check=True)
    version = subprocess.run([args.llama_perplexity, "--version"], capture_output=True,
                             text=True).stderr.strip().splitlines()[0]
    fixture = {
        "about": "benchmarks/make_kld_fixtures.py: write_tiny_model() F32 base, Q4_0 quantization",
        "llama_perplexity": version, "text": TEXT.name, "n_ctx": N_CTX, "n_chunk": N_CHUNKS,
        "f32_chunks": F32_CHUNKS,
        "sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (base_ll, base_mf)},
        **runs,
    }
    (OUT / "llamacpp_kld.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
