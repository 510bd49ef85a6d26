"""What `minfer quantize` is compared with llama.cpp on: synthetic sources, cases, digests, and
a runner for llama.cpp's quantizer in another interpreter (llama-cpp-python is not a minfer
dependency). Used by tests/test_quantize_*.py and scripts/make_quantize_fixtures.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType

from minfer.gguf.reader import GGUFFile
from minfer.tools.synth import write_tiny_model

FIXTURE = Path(__file__).parent / "fixtures" / "quantize_llamacpp.json"
LLAMA_PYTHON_ENV = "MINFER_REF_PYTHON"  # as every live llama.cpp comparison (refpython.py)

# Small (about 1M weights) yet every rule shows: 8 layers for use_more_bits' pattern; rows of
# 256 (K-quants), of 96 (ffn_down) and 64 (attn_output: head_dim 32 × 2 heads) where K-quant
# types fall back to 32-block ones.
SOURCES: dict[str, dict[str, Any]] = {
    "f32": {"n_layer": 8, "n_embd": 256, "n_head": 2, "n_head_kv": 1, "head_dim": 32,
            "n_ff": 96, "tied": False, "seed": 1, "weight_types": QType.F32},
    "f16_tied": {"n_layer": 3, "n_embd": 256, "n_head": 2, "n_head_kv": 1, "head_dim": 32,
                 "n_ff": 256, "tied": True, "seed": 2, "weight_types": QType.F16},
}

# id → (source, TYPE, options as the CLI names them)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    **{t: ("f32", t, {}) for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S",
                                   "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M",
                                   "Q6_K", "F16", "BF16", "IQ4_NL", "IQ4_XS")},
    "Q4_K_M-pure": ("f32", "Q4_K_M", {"pure": True}),
    "Q3_K_M-overrides": ("f32", "Q3_K_M", {"output_tensor_type": "Q8_0",
                                           "token_embedding_type": "Q4_0"}),
    "tied-Q4_K_M": ("f16_tied", "Q4_K_M", {}),
    "tied-Q2_K": ("f16_tied", "Q2_K", {}),
    "tied-IQ4_NL": ("f16_tied", "IQ4_NL", {}),
    "tied-IQ4_XS": ("f16_tied", "IQ4_XS", {}),
}

# id → (a committed fixture GGUF, TYPE): real converter output rather than a synthetic source
FILE_CASES: dict[str, tuple[Path, str]] = {
    "gptoss-MXFP4_MOE": (Path(__file__).parent / "fixtures" / "gptoss" / "gptoss.gguf",
                         "MXFP4_MOE"),
}
LLAMA_QUANTIZE_ENV = "MINFER_LLAMA_QUANTIZE"  # a llama-quantize binary, for the live CLI check
LLAMA_QUANTIZE_DEFAULT = Path("/tmp/llbuild/bin/llama-quantize")


def llama_quantize_exe() -> Path | None:
    """llama-quantize from $MINFER_LLAMA_QUANTIZE or /tmp/llbuild (None: neither exists)."""
    exe = Path(os.environ.get(LLAMA_QUANTIZE_ENV) or LLAMA_QUANTIZE_DEFAULT)
    return exe if exe.is_file() else None


def write_source(name: str, directory: Path) -> Path:
    path = directory / f"quant-src-{name}.gguf"
    if not path.exists():
        write_tiny_model(path, **SOURCES[name])
    return path


def sha256(data: bytes | memoryview | np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(data)).cast("B")).hexdigest()


def tensor_digests(path: Path) -> dict[str, str]:
    """name → "TYPE:<first 12 hex digits of the sha256 of its bytes>" in file order ("F32"
    alone for F32 tensors, which the quantizer copies unchanged)."""
    with GGUFFile.open(path) as f:
        return {n: t.type_name if t.type_name == "F32" else f"{t.type_name}:{sha256(f.raw(n))[:12]}"
                for n, t in f.tensors.items()}


def data_digest(path: Path) -> str:
    """One digest over every tensor's name, type and bytes (the source, metadata aside)."""
    return sha256(json.dumps(tensor_digests(path), sort_keys=True).encode())


def llama_python() -> str | None:
    """The interpreter that has llama_cpp, from $MINFER_REF_PYTHON (None: not configured)."""
    exe = os.environ.get(LLAMA_PYTHON_ENV)
    if not exe:
        return None
    ok = subprocess.run([exe, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    return exe if ok else None


_QUANTIZE_SCRIPT = textwrap.dedent("""
    import ctypes, json, sys
    import llama_cpp
    src, dst, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llama_cpp.llama_backend_init()
    p = llama_cpp.llama_model_quantize_default_params()
    for key, value in opts.items():
        setattr(p, key, value)
    sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)))
""")


def llama_quantize(exe: str, src: Path, dst: Path, ftype: int, opts: dict[str, Any]) -> None:
    """Run llama.cpp's llama_model_quantize (options as CLI names, types as QType names)."""
    params: dict[str, Any] = {"ftype": ftype, "pure": bool(opts.get("pure", False)),
                              "allow_requantize": bool(opts.get("allow_requantize", False))}
    for key in ("output_tensor_type", "token_embedding_type"):
        if opts.get(key):
            params[key] = int(QType[opts[key]])
    r = subprocess.run([exe, "-c", _QUANTIZE_SCRIPT, str(src), str(dst), json.dumps(params)],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"llama_model_quantize failed: {r.stderr[-2000:]}")


_ROWS_SCRIPT = textwrap.dedent("""
    import ctypes, glob, os, sys
    import numpy as np
    import llama_cpp
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    lib = ctypes.CDLL(sorted(glob.glob(os.path.join(lib_dir, "libggml-base.*")))[0])
    f = lib.ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    x = np.load(sys.argv[1])
    out = np.zeros(int(sys.argv[3]) * x.shape[0], np.uint8)
    f(int(sys.argv[2]), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
    np.save(sys.argv[4], out.reshape(x.shape[0], -1))
""")


def llama_quantize_rows(exe: str, x: np.ndarray, qtype: QType, row_bytes: int,
                        work: Path) -> np.ndarray:
    """ggml_quantize_chunk(qtype, x) from the llama_cpp package's libggml-base."""
    np.save(work / "rows-in.npy", x)
    subprocess.run([exe, "-c", _ROWS_SCRIPT, str(work / "rows-in.npy"), str(int(qtype)),
                    str(row_bytes), str(work / "rows-out.npy")], check=True)
    return np.asarray(np.load(work / "rows-out.npy"))


def row_inputs() -> np.ndarray:
    """[96, 512] f32: normal, heavy-tailed, exact ties (integers), zeros, one-signed, tiny."""
    rng = np.random.default_rng(20261201)
    parts = [rng.standard_normal((32, 512)) * 0.05,
             rng.standard_t(3, (16, 512)) * 0.02,
             np.round(rng.standard_normal((16, 512)) * 4),
             np.zeros((4, 512)),
             rng.uniform(0.0, 1.0, (12, 512)),
             rng.standard_normal((16, 512)) * 1e-6]
    x = np.concatenate(parts).astype(np.float32)
    x[1, :37] = 0.0
    return x


ROW_TYPES = (QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1,
             QType.Q8_0, QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
             QType.IQ4_NL, QType.IQ4_XS, QType.MXFP4)


IMATRIX_FIXTURE = Path(__file__).parent / "fixtures" / "quantize_imatrix_ggml.json"
GGML_LIB_ENV = "MINFER_GGML_QUANTS_LIB"  # a shared library exporting ggml's quantize_<type>
IMATRIX_TYPES = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q2_K,
                 QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS,
                 QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ3_S, QType.IQ2_S,
                 QType.IQ2_XS, QType.IQ1_S, QType.IQ1_M)
# The lattice types' tables, which ggml_quantize_init builds before quantize_<type> may run.
_LATTICE_INIT = {QType.IQ2_XXS: ("iq2xs_init_impl", int(QType.IQ2_XXS)),
                 QType.IQ2_XS: ("iq2xs_init_impl", int(QType.IQ2_XS)),
                 QType.IQ1_S: ("iq2xs_init_impl", int(QType.IQ1_S)),
                 QType.IQ1_M: ("iq2xs_init_impl", int(QType.IQ1_M)),
                 QType.IQ2_S: ("iq2xs_init_impl", int(QType.IQ2_S)),
                 QType.IQ3_XXS: ("iq3xs_init_impl", 256),
                 QType.IQ3_S: ("iq3xs_init_impl", 512)}


def imatrix_weights() -> dict[str, np.ndarray]:
    """Importance vectors for row_inputs(): log-normal with 5% zero columns, and flat."""
    rng = np.random.default_rng(7)
    skewed = rng.lognormal(0.0, 1.5, 512).astype(np.float32)
    skewed[rng.random(512) < 0.05] = 0.0
    return {"skewed": skewed, "flat": np.full(512, 0.25, np.float32)}


def ggml_quantize(lib_path: str, x: np.ndarray, qtype: QType,
                  qw: np.ndarray | None) -> np.ndarray:
    """ggml's quantize_<type>(x, …, qw) from a library built from ggml-quants.c."""
    import ctypes

    from gguf import GGML_QUANT_SIZES

    lib = ctypes.CDLL(lib_path)
    if qtype in _LATTICE_INIT:
        init, arg = _LATTICE_INIT[qtype]
        getattr(lib, init)(ctypes.c_int(arg))
    fn = getattr(lib, "quantize_" + qtype.name.lower().replace("_k", "_K"))
    fn.restype = ctypes.c_size_t
    block, size = GGML_QUANT_SIZES[qtype]
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
    w = None if qw is None else np.ascontiguousarray(qw, np.float32)
    fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
       ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]),
       None if w is None else w.ctypes.data_as(ctypes.c_void_p))
    return out
