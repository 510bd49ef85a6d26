"""Regenerate tests/fixtures/quantize_llamacpp.json from llama.cpp's quantizer.

    MINFER_REF_PYTHON=/path/to/python-with-llama_cpp PYTHONPATH=src:. python \
        scripts/make_quantize_fixtures.py

Records, for the synthetic sources and cases of tests/quantize_cases.py, what llama.cpp writes:
the sha256 of ggml_quantize_chunk's bytes per type on fixed rows, and per quantized model the
whole file's sha256 and every tensor's type and digest; the same for the committed fixture
files of FILE_CASES (the tiny gpt-oss's MXFP4_MOE). Never edit the JSON by hand.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from gguf import GGML_QUANT_SIZES
from tests import quantize_cases as qc

from minfer.tools.quantize import parse_ftype


def main() -> int:
    exe = qc.llama_python()
    if exe is None:
        print(f"set {qc.LLAMA_PYTHON_ENV} to a python that can import llama_cpp", file=sys.stderr)
        return 1
    version = __import__("subprocess").run(
        [exe, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
        text=True, check=True).stdout.strip()
    out: dict = {"llama_cpp_python": version, "rows": {}, "sources": {}, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        x = qc.row_inputs()
        for qt in qc.ROW_TYPES:
            block, size = GGML_QUANT_SIZES[qt]
            ref = qc.llama_quantize_rows(exe, x, qt, x.shape[1] // block * size, work)
            out["rows"][qt.name] = qc.sha256(ref)
        for name in qc.SOURCES:
            src = qc.write_source(name, work)
            out["sources"][name] = {"data": qc.data_digest(src),
                                    "file_sha256": qc.sha256(src.read_bytes())}
        for case, (source, type_name, opts) in qc.CASES.items():
            dst = work / f"{case}.gguf"
            qc.llama_quantize(exe, work / f"quant-src-{source}.gguf", dst,
                              int(parse_ftype(type_name)), opts)
            out["models"][case] = {"file_sha256": qc.sha256(dst.read_bytes()),
                                   "tensors": qc.tensor_digests(dst)}
            print(case, "done", file=sys.stderr)
        out["files"] = {}
        for case, (src, type_name) in qc.FILE_CASES.items():
            dst = work / f"{case}.gguf"
            qc.llama_quantize(exe, src, dst, int(parse_ftype(type_name)), {})
            out["files"][case] = {"source_sha256": qc.sha256(src.read_bytes()),
                                  "file_sha256": qc.sha256(dst.read_bytes()),
                                  "tensors": qc.tensor_digests(dst)}
            print(case, "done", file=sys.stderr)
    qc.FIXTURE.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {qc.FIXTURE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
