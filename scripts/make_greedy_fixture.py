"""Record minfer's own greedy ids for the public reference prompts (tests/fixtures/greedy.json).

tests/test_greedy_pinned.py holds every later tree to these ids bit for bit: a refactor that
changes no arithmetic changes no id. The float parts of a step (attention, norms) are compiled
for the CPU's vector width, so ids are kept per instruction-set class (`isa_class`); run this on
a tree whose output is to be pinned (first: 6d6bbc0, before the one-engine-path refactor) to add
or refresh this CPU's class:

    .venv/bin/python scripts/make_greedy_fixture.py
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import llvmlite.binding as llvm

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "greedy_minfer.json"
N_TOKENS = 48


def isa_class() -> str:
    """The vector instruction set minfer's kernels are compiled for here (NUMBA_CPU_FEATURES,
    as .ci/run sets for its Haswell pass, else the host's)."""
    features = os.environ.get("NUMBA_CPU_FEATURES") or llvm.get_host_cpu_features().flatten()
    has = set(features.split(","))
    for name, flag in (("avx512-vnni", "+avx512vnni"), ("avx512", "+avx512f"),
                       ("avx-vnni", "+avxvnni"), ("avx2", "+avx2")):
        if flag in has:
            return name
    return "other"


def record() -> list[dict[str, Any]]:
    import minfer
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    cases = json.loads((FIXTURE.parent / "greedy.json").read_text())["cases"]
    model = minfer.load(None, n_ctx=1024, kv_type="f16", backend="cpu")
    out = []
    for case in cases:
        events = list(model.stream(case["prompt_ids"], max_tokens=N_TOKENS,
                                   sampling=SamplerParams(temp=0.0)))
        done = events[-1]
        assert isinstance(done, Finished)
        out.append({"prompt": case["prompt"], "ids": done.ids, "eot_id": done.eot_id})
    return out


def main() -> None:
    data = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {
        "about": "minfer's greedy ids on the development model (f16 KV, CPU backend, n_ctx "
                 "1024) per instruction-set class; made by scripts/make_greedy_fixture.py",
        "n_tokens": N_TOKENS, "by_isa": {}}
    key = isa_class()
    data["by_isa"][key] = {"cpu": platform.processor() or platform.machine(),
                           "cases": record()}
    FIXTURE.write_text(json.dumps(data, indent=1) + "\n")
    print(f"recorded {key} in {FIXTURE}")


if __name__ == "__main__":
    main()
