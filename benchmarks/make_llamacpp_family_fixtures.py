"""Regenerate tests/fixtures/llamacpp_families.npz: llama.cpp's own runs of the new families'
tiny fixtures (LFM2, Qwen3.5 and its MoE, gpt-oss, Gemma 4 E2B-style / 26B MoE / 31B, SmolLM3,
Phi-3 and Phi-3 LongRoPE, with the converter's q8_0 twins and llama.cpp's own Q8_0 / Q4_K_M
quantizations of the f32 files), the second reference beside transformers' logits.npz files.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_llamacpp_family_fixtures.py \
        [--ref-python /tmp/refvenv/bin/python]

(llama-cpp-python 0.3.36 in its own interpreter: `--ref-python`, else $MINFER_REF_PYTHON, else
/tmp/refvenv's.) What is run and how, and the two fixtures read through a metadata-only copy
(Gemma 4's vocabulary padded to its embedding's rows, Phi-3's `general.name` changed), is
tests/llamacpp_families.py, which the live test shares. For each model and each of its three
prompts (token ids) the file holds `<name>.<p>.logits` (the last prompt position's 320
logits), `<name>.<p>.greedy` (16 greedy tokens) and `<name>.<p>.margins` (llama.cpp's top-2
margin at each of those steps, so a test can tell a near-tie), `<name>.sha256` (the GGUF the
run read: for a quantization, the bytes `minfer quantize` must reproduce), `prompt.<p>` and
`version`. Every architecture here loads in llama.cpp 0.3.36 (llamacpp_families.UNSUPPORTED is
empty); one that did not would be listed there with its reason and left out of the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import llamacpp_families as fam

    ap = argparse.ArgumentParser()
    ap.add_argument("--ref-python", default=fam.ref_python(),
                    help="python with llama-cpp-python 0.3.36")
    args = ap.parse_args()
    if not args.ref_python:
        sys.exit("no interpreter with llama-cpp-python: pass --ref-python")
    models = tuple(m for m in fam.MODELS if m.name not in fam.UNSUPPORTED)
    arrays = fam.run_llamacpp(args.ref_python, models)
    for p, ids in enumerate(fam.PROMPTS):
        arrays[f"prompt.{p}"] = np.array(ids, np.int32)
    for m in models:
        margins = [arrays[f"{m.name}.{p}.margins"] for p in range(len(fam.PROMPTS))]
        print(f"{m.name:20s} max |logit| "
              f"{max(np.abs(arrays[f'{m.name}.{p}.logits']).max() for p in range(3)):6.2f}, "
              f"smallest greedy top-2 margin {min(x.min() for x in margins):.4f}")
    np.savez_compressed(fam.OUT, **arrays)
    print(f"wrote {fam.OUT} ({fam.OUT.stat().st_size} bytes), llama-cpp-python "
          f"{arrays['version']}")


if __name__ == "__main__":
    main()
