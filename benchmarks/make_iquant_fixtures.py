"""Regenerate tests/fixtures/iquant/: llama.cpp's i-quant files of two tiny models and its runs
of them (issue 65).

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_iquant_fixtures.py \
        [--ref-python /tmp/refvenv/bin/python] [--mix-only]

Needs llama.cpp's tools in /tmp/llbuild/bin (llama-imatrix, llama-quantize, built from
llama-cpp-python 0.3.36's vendored llama.cpp) and llama-cpp-python 0.3.36 in its own
interpreter (`--ref-python`, else $MINFER_REF_PYTHON, else /tmp/refvenv's). What the two models
are and how the tools run is tests/iquant_cases.py. Writes:
- imatrix-<source>.gguf: llama-imatrix's matrix of each source over kv_long_prompt.txt;
- llamacpp.json: each source's data digest; for mix8, llama-quantize --imatrix's file of each
  MIX_TYPES (file sha256, per-tensor type and digest) and its refusal without the matrix; for
  run2, the sha256 of each RUN_TYPES file;
- run2-<TYPE>.gguf: those files;
- logits.npz: llama.cpp on each file and prompt: `<TYPE>.<p>.logits` (the last prompt
  position's), `.greedy` (16 tokens) and `.margins` (its top-2 margin at each step), `version`.

--mix-only redoes llamacpp.json's "mix" entries alone (llama-quantize with the committed
imatrix-mix8.gguf), keeping the matrices, the run2 files and the logits as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tests import iquant_cases as ic
    from tests import llamacpp_families as fam
    from tests import quantize_cases as qc

    ap = argparse.ArgumentParser()
    ap.add_argument("--ref-python", default=fam.ref_python())
    ap.add_argument("--mix-only", action="store_true")
    args = ap.parse_args()
    if args.mix_only:
        out = json.loads(ic.DIGESTS.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            out["mix"] = _mix_entries(Path(tmp))
        ic.DIGESTS.write_text(json.dumps(out, indent=1) + "\n")
        return
    ic.DIR.mkdir(parents=True, exist_ok=True)
    out: dict = {"llama.cpp": "llama-imatrix / llama-quantize of llama-cpp-python 0.3.36 "
                              "(/tmp/llbuild)", "sources": {}, "mix": {}, "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ic.SOURCES:
            src = ic.write_source(name, work)
            out["sources"][name] = qc.data_digest(src)
            ic.llama_imatrix(src, ic.imatrix_file(name))
        out["mix"] = _mix_entries(work)
        src = work / "iq-src-run2.gguf"
        for t in ic.RUN_TYPES:
            r = ic.llama_quantize(src, ic.run_file(t), t, work, ic.imatrix_file("run2"))
            assert r.returncode == 0, r.stderr[-2000:]
            out["files"][t] = fam.sha256(ic.run_file(t))
    jobs = [{"path": str(ic.run_file(t)), "n_ctx": ic.N_CTX, "prompts": [list(p) for p in
                                                                         ic.PROMPTS],
             "n_new": fam.N_NEW} for t in ic.RUN_TYPES]
    res = json.loads(fam._subprocess(args.ref_python, fam._RUN, jobs))
    arrays: dict[str, np.ndarray] = {"version": np.array(res["version"])}
    for t, runs in zip(ic.RUN_TYPES, res["runs"], strict=True):
        for p, run in enumerate(runs):
            arrays[f"{t}.{p}.logits"] = np.array(run["logits"], np.float32)
            arrays[f"{t}.{p}.greedy"] = np.array(run["greedy"], np.int64)
            arrays[f"{t}.{p}.margins"] = np.array(run["margins"], np.float32)
    np.savez_compressed(ic.LOGITS, **arrays)
    ic.DIGESTS.write_text(json.dumps(out, indent=1) + "\n")


def _mix_entries(work: Path) -> dict:
    """llama-quantize --imatrix's file of mix8 for each MIX_TYPES, and its refusal without."""
    from tests import iquant_cases as ic
    from tests import quantize_cases as qc

    src = ic.write_source("mix8", work)
    mix: dict = {}
    for t in ic.MIX_TYPES:
        dst = work / f"mix8-{t}.gguf"
        r = ic.llama_quantize(src, dst, t, work, ic.imatrix_file("mix8"))
        assert r.returncode == 0, r.stderr[-2000:]
        refused = ic.llama_quantize(src, work / "x.gguf", t, work, None)
        mix[t] = {"file_sha256": qc.sha256(dst.read_bytes()),
                  "tensors": qc.tensor_digests(dst),
                  "refused_without_imatrix": refused.returncode != 0
                  and "requires an imatrix" in refused.stderr + refused.stdout}
    return mix


if __name__ == "__main__":
    main()
