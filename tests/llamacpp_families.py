"""llama.cpp's runs of the new families' tiny fixtures: which files, which prompts, how they are
run, shared by benchmarks/make_llamacpp_family_fixtures.py (which commits the result as
tests/fixtures/llamacpp_families.npz) and the live test that re-runs llama.cpp.

llama.cpp (llama-cpp-python 0.3.36) runs in its own interpreter, never in minfer's: a fresh
context for each prompt (n_ctx as listed, 2 threads, flash attention off, an f32 KV cache, the
prompt evaluated in one batch with logits_all=True), the last prompt position's logits kept
whole (320 floats), then N_NEW greedy steps, one token per eval, each keeping its argmax and
the margin between its top two logits (how near a tie that choice was).

Two fixtures are stored in a form llama.cpp 0.3.36 refuses for a reason that has nothing to do
with the architecture, so llama.cpp reads a copy whose metadata alone is changed (the tensors
are the same bytes; the prompts are token ids, so the vocabulary's text plays no part):
- Gemma 4 (`gemma4*`): the converter wrote the tiny SentencePiece vocabulary's 254 pieces for a
  320-row embedding, and llama.cpp checks `token_embd` against the vocabulary size: the copy's
  vocabulary is padded with unused `[PAD<i>]` pieces to 320.
- Phi-3 (`phi3*`): llama.cpp's vocabulary loader, for any file whose `general.name` contains
  "phi3", sets attributes on `<|endoftext|>`, which the tiny vocabulary lacks
  (`unordered_map::at`): the copy is named `tiny`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
OUT = FIXTURES / "llamacpp_families.npz"
REF_PYTHON_ENV = "MINFER_REF_PYTHON"
DEFAULT_REF_PYTHON = "/tmp/refvenv/bin/python"
N_NEW = 16
# Token ids, all below every fixture's 320 rows: make_llama_fixtures.py's 16 ids (the Gemma 4,
# SmolLM3, Phi-3 and gpt-oss fixtures' `ids`), the LFM2 / Qwen3.5 fixtures' 40, and a short one.
PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 17, 250, 33, 99, 5, 301, 42, 77, 128, 64, 200, 3, 150, 11, 290),
    (257, 27, 56, 75, 57, 254, 275, 184, 12, 29, 105, 137, 196, 151, 83, 50, 219, 232, 10, 36,
     143, 124, 281, 163, 133, 136, 211, 186, 54, 233, 239, 303, 249, 90, 101, 205, 206, 220,
     275, 92),
    (1, 45, 200, 7, 99),
)


@dataclass(frozen=True)
class Model:
    name: str  # the fixture's key prefix
    path: str  # under tests/fixtures
    n_ctx: int = 128
    quantized: bool = False  # a quantized file: compared with the quantized tolerance
    quantize: str | None = None  # run on llama.cpp's quantization of path to this type


# llama_ftype: 7 LLAMA_FTYPE_MOSTLY_Q8_0, 15 LLAMA_FTYPE_MOSTLY_Q4_K_M (its mix, with llama.cpp's
# fallbacks for rows narrower than a 256-value K-quant block)
LLAMA_FTYPES = {"Q8_0": 7, "Q4_K_M": 15}
_F32 = (("lfm2", "lfm2/lfm2.gguf"), ("qwen35", "qwen35/qwen35.gguf"),
        ("qwen35moe", "qwen35/qwen35moe.gguf"), ("gptoss", "gptoss/gptoss.gguf"),
        ("gemma4", "gemma4/gemma4.gguf"), ("gemma4_26b", "gemma4/gemma4_26b.gguf"),
        ("gemma4_31b", "gemma4/gemma4_31b.gguf"), ("smollm3", "families/smollm3.gguf"),
        ("phi3", "families/phi3.gguf"), ("phi3_longrope", "families/phi3_longrope.gguf"))
_Q8_TWINS = ("gptoss", "smollm3", "phi3", "phi3_longrope")  # `<dir>/<name>-q8_0.gguf`
MODELS: tuple[Model, ...] = (
    *(Model(name, path) for name, path in _F32),
    # the converter's q8_0 twins (the same tensors as llama.cpp's Q8_0 quantization of the f32
    # file: the same logits; only the metadata's order differs)
    *(Model(f"{name}-q8_0", path.replace(".gguf", "-q8_0.gguf"), quantized=True)
      for name, path in _F32 if name in _Q8_TWINS),
    # a context past the 256 original positions: LongRoPE's long factors, in both engines
    Model("phi3_longrope.long", "families/phi3_longrope.gguf", n_ctx=512),
    # llama.cpp's own quantizer on each f32 file (`minfer quantize` writes the same bytes)
    *(Model(f"{name}.{q.lower()}", path, quantized=True, quantize=q)
      for name, path in _F32 for q in LLAMA_FTYPES if not (q == "Q8_0" and name in _Q8_TWINS)),
)
# Architectures llama.cpp 0.3.36 cannot load (name -> why): none of these families today.
UNSUPPORTED: dict[str, str] = {}

_QUANTIZE = r"""
import ctypes, json, sys
import llama_cpp

for src, dst, ftype in json.loads(sys.stdin.read()):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({src}) returned {rc}"
"""

_RUN = r"""
import json, sys
import numpy as np
import llama_cpp

jobs = json.loads(sys.stdin.read())
out = []
for job in jobs:
    runs = []
    for ids in job["prompts"]:
        m = llama_cpp.Llama(job["path"], n_ctx=job["n_ctx"], n_batch=512, logits_all=True,
                            verbose=False, n_threads=2, flash_attn=False, type_k=0, type_v=0,
                            seed=0)
        m.eval(ids)
        last = np.array(m.scores[m.n_tokens - 1], dtype=np.float32)
        logits, greedy, margins = last, [], []
        for _ in range(job["n_new"]):
            top2 = np.sort(logits)[-2:]
            greedy.append(int(np.argmax(logits)))
            margins.append(float(top2[1] - top2[0]))
            m.eval(greedy[-1:])
            logits = np.array(m.scores[m.n_tokens - 1], dtype=np.float32)
        runs.append({"logits": last.tolist(), "greedy": greedy, "margins": margins})
        del m
    out.append(runs)
print(json.dumps({"version": llama_cpp.__version__, "runs": out}))
"""


def ref_python() -> str | None:
    """The interpreter with llama-cpp-python: $MINFER_REF_PYTHON, else /tmp/refvenv's."""
    for exe in (os.environ.get(REF_PYTHON_ENV), DEFAULT_REF_PYTHON):
        if exe and Path(exe).exists():
            return exe
    return None


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def loadable_copy(src: Path, dst_dir: Path) -> Path:
    """The file itself, or a copy with only the metadata llama.cpp 0.3.36 refuses changed (the
    module's docstring): same tensors, byte for byte."""
    import gguf

    reader = gguf.GGUFReader(src)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    n_rows = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    name_field = reader.fields.get("general.name")
    name = str(name_field.contents()) if name_field is not None else ""
    pad = n_rows - len(tokens)
    rename = "phi3" in name.lower() or "phi-3" in name.lower()
    if pad <= 0 and not rename:
        return src
    arch = str(reader.fields["general.architecture"].contents())
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / src.name
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    padded: dict[str, list[Any]] = {
        "tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(len(tokens), n_rows)],
        "tokenizer.ggml.scores": [-1000.0] * pad,
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad}
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == "general.name" and rename:
            value = "tiny"
        if field.name in padded and pad > 0:
            value = list(value) + padded[field.name]
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def _subprocess(python: str, script: str, stdin: object) -> str:
    proc = subprocess.run([python, "-c", script], input=json.dumps(stdin), capture_output=True,
                          text=True, check=False, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp failed: {proc.stderr[-3000:]}")
    return proc.stdout


def run_llamacpp(python: str, models: tuple[Model, ...] = MODELS) -> dict[str, np.ndarray]:
    """llama.cpp's arrays for each model and prompt: `<name>.<p>.logits` (the last prompt
    position's), `<name>.<p>.greedy` and `<name>.<p>.margins` (N_NEW steps); `<name>.sha256`
    (the file it ran: the fixture, or llama.cpp's quantization of it), and `version`."""
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {m.name: FIXTURES / m.path for m in models}
        quant = [m for m in models if m.quantize]
        for m in quant:
            files[m.name] = Path(tmp) / f"{m.name}.gguf"
        if quant:
            _subprocess(python, _QUANTIZE, [[str(FIXTURES / m.path), str(files[m.name]),
                                             LLAMA_FTYPES[str(m.quantize)]] for m in quant])
        jobs = []
        for m in models:
            arrays[f"{m.name}.sha256"] = np.array(sha256(files[m.name]))
            path = loadable_copy(files[m.name], Path(tmp) / "loadable" / m.name)
            jobs.append({"path": str(path), "n_ctx": m.n_ctx, "n_new": N_NEW,
                         "prompts": [list(p) for p in PROMPTS]})
        res = json.loads(_subprocess(python, _RUN, jobs).strip().splitlines()[-1])
    arrays["version"] = np.array(res["version"])
    for m, runs in zip(models, res["runs"], strict=True):
        for p, run in enumerate(runs):
            arrays[f"{m.name}.{p}.logits"] = np.array(run["logits"], np.float32)
            arrays[f"{m.name}.{p}.greedy"] = np.array(run["greedy"], np.int32)
            arrays[f"{m.name}.{p}.margins"] = np.array(run["margins"], np.float32)
    return arrays
