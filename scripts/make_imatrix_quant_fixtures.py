"""Regenerate tests/fixtures/quantize_imatrix_ggml.json from ggml's weighted quantizers.

    cc -O3 -DNDEBUG -std=gnu11 -fPIC -shared -Iggml/include -Iggml/src \
        ggml/src/ggml-quants.c scripts/ggml_quants_stub.c -o libggmlq.so -lm
    MINFER_GGML_QUANTS_LIB=libggmlq.so PYTHONPATH=src:. python \
        scripts/make_imatrix_quant_fixtures.py

ggml-quants.c from llama-cpp-python 0.3.36's vendored llama.cpp, built as ggml-base is (plain
x86-64, no fast-math); scripts/ggml_quants_stub.c supplies the four ggml.c symbols it calls
(ggml_row_size, ggml_type_size, ggml_type_name, ggml_abort). Records the sha256 of
quantize_<type>'s bytes for tests/quantize_cases.row_inputs() with each of imatrix_weights()
as quant_weights (the lattice types after their tables' init), and checks that the
build writes the recorded unweighted bytes of quantize_llamacpp.json first (for the types
recorded there) (the same code as llama-cpp-python's library). Never edit the
JSON by hand. llama-cpp-python's own libggml-base.so (e.g. /tmp/refvenv's
site-packages/llama_cpp/lib/libggml-base.so, which exports quantize_<type> and the lattice
inits) serves as the library too and gives the same bytes.
"""

from __future__ import annotations

import json
import os
import sys

from tests import quantize_cases as qc


def main() -> int:
    lib = os.environ.get(qc.GGML_LIB_ENV)
    if not lib:
        print(f"set {qc.GGML_LIB_ENV} to the built library", file=sys.stderr)
        return 1
    x = qc.row_inputs()
    plain = json.loads(qc.FIXTURE.read_text())["rows"]
    out: dict = {"ggml": "ggml-quants.c of llama-cpp-python 0.3.36", "rows": {}}
    for qt in qc.IMATRIX_TYPES:
        if qt in plain and qc.sha256(qc.ggml_quantize(lib, x, qt, None)) != plain[qt.name]:
            print(f"{qt.name}: this build's unweighted bytes are not llama.cpp's", file=sys.stderr)
            return 1
        out["rows"][qt.name] = {name: qc.sha256(qc.ggml_quantize(lib, x, qt, w))
                                for name, w in qc.imatrix_weights().items()}
    qc.IMATRIX_FIXTURE.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
