"""llama.cpp's i-quant files of two tiny models: what they are, how llama.cpp's tools make and
run them. Shared by benchmarks/make_iquant_fixtures.py (which commits tests/fixtures/iquant/)
and tests/test_iquant_llamacpp.py.

- `mix8` (8 layers, so llama.cpp's per-layer rules all show): llama-imatrix's importance matrix
  of it (committed), and llama-quantize's file of each i-quant mix (IQ1_S .. IQ3_M) with it, kept
  as sha256 digests (file and per tensor), which `minfer quantize --imatrix` must reproduce.
- `run2` (2 layers): llama-quantize's file of each i-quant type with llama-imatrix's matrix
  (committed: tests/fixtures/iquant/run2-<TYPE>.gguf), and llama.cpp's logits, greedy
  continuation and top-2 margins on each (tests/fixtures/iquant/logits.npz), which minfer must
  match on the same files.

Every row of every matrix is a multiple of 256 values (n_embd 256, n_ff 512 / 256, 4 heads of
64), so
no tensor falls back from its 256-block type. The tools are llama.cpp's, built from
llama-cpp-python 0.3.36's vendored sources into /tmp/llbuild (llama-imatrix, llama-quantize);
they run with the importance matrix named by a relative path (the file's
quantize.imatrix.file entry is that string).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as QType

from minfer.tools.synth import write_tiny_model

DIR = Path(__file__).parent / "fixtures" / "iquant"
DIGESTS = DIR / "llamacpp.json"
LOGITS = DIR / "logits.npz"
TEXT = Path(__file__).parent / "fixtures" / "kv_long_prompt.txt"
LLBUILD = Path("/tmp/llbuild/bin")
IMATRIX_NAME = "imatrix.gguf"  # as llama-quantize and minfer are given it (cwd: its folder)

_COMMON: dict[str, Any] = {"arch": "llama", "n_embd": 256, "n_head": 4, "n_head_kv": 2,
                           "head_dim": 64, "n_ff": 512, "tied": False,
                           "weight_types": QType.F32}
SOURCES: dict[str, dict[str, Any]] = {"mix8": {**_COMMON, "n_layer": 8, "seed": 65},
                                      "run2": {**_COMMON, "n_layer": 2, "n_ff": 256,
                                               "seed": 66}}
# the file types minfer writes byte for byte (from mix8)
MIX_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S",
             "IQ3_M")
# every i-quant type llama-quantize writes (run2's files)
RUN_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS",
             "IQ4_NL", "TQ1_0", "TQ2_0")
PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 17, 250, 33, 99, 5, 301, 42, 77, 128, 64, 200, 3, 150, 11, 290),
    (257, 27, 56, 75, 57, 254, 275, 184, 12, 29, 105, 137, 196, 151, 83, 50, 219, 232, 10, 36),
)
N_CTX = 64


def write_source(name: str, directory: Path) -> Path:
    path = directory / f"iq-src-{name}.gguf"
    if not path.exists():
        write_tiny_model(path, **SOURCES[name])
    return path


def run_file(type_name: str) -> Path:
    return DIR / f"run2-{type_name}.gguf"


def imatrix_file(source: str) -> Path:
    return DIR / f"imatrix-{source}.gguf"


def llama_imatrix(src: Path, out: Path) -> None:
    subprocess.run([str(LLBUILD / "llama-imatrix"), "-m", str(src), "-f", str(TEXT), "-o",
                    str(out), "-c", "128", "-b", "128", "-t", "2", "--chunks", "4", "--no-ppl"],
                   check=True, capture_output=True)


def llama_quantize(src: Path, dst: Path, type_name: str, work: Path,
                   imatrix: Path | None) -> subprocess.CompletedProcess[str]:
    """llama-quantize [--imatrix imatrix.gguf] src dst TYPE 2, run in `work` (where imatrix is
    copied to its relative name)."""
    args = [str(LLBUILD / "llama-quantize")]
    if imatrix is not None:
        (work / IMATRIX_NAME).write_bytes(imatrix.read_bytes())
        args += ["--imatrix", IMATRIX_NAME]
    return subprocess.run([*args, str(src), str(dst), type_name, "2"], cwd=work,
                          capture_output=True, text=True)
