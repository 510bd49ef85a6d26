"""The torch backend (bf16 prefill) on the development model against llama.cpp's reference.

Same yardstick as test_reference_llamacpp.py: top-1 at the last prompt position equal, each of
llama.cpp's top-10 logits within 0.5, and the greedy path equal or diverging only at a near-tie.
The threshold is forced to 2 rows so every prompt's prefill runs in torch (bf16 GEMMs); the
decode steps and the tail row stay on the CPU kernels. Run with `-s` to see the max logit
difference between the CPU backend and the torch backend per prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from minfer.backends.cpu.backend import CpuBackend  # noqa: E402
from minfer.backends.torch_backend.backend import TorchBackend  # noqa: E402
from minfer.engine.forward import Engine  # noqa: E402
from minfer.gguf.hparams import HParams  # noqa: E402
from minfer.gguf.reader import GGUFFile  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CASES = json.loads((Path(__file__).parent / "fixtures" / "greedy.json").read_text())["cases"]
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def engines(real_model_path: Path) -> dict[str, Engine]:
    f = GGUFFile.open(real_model_path)
    hp = HParams.from_gguf(f)
    return {
        "cpu": Engine(f, hp, n_ctx=256, backends=[CpuBackend()]),
        "torch": Engine(f, hp, n_ctx=256, backends=[TorchBackend(min_rows=2), CpuBackend()]),
    }


@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:20] for c in CASES])
def test_bf16_prefill_matches_llamacpp(engines: dict[str, Engine], case: dict[str, Any]) -> None:
    ids = case["prompt_ids"]
    logits = engines["torch"].forward(ids, 0)[0]
    graph = engines["torch"].cache.get(engines["torch"].params_for(len(ids), 1)).graph
    assert graph.by_name("attn_q").backend == "torch"
    ref = case["top10_last_prompt_pos"]
    assert int(np.argmax(logits)) == ref[0][0]
    diffs = [abs(float(logits[tok]) - val) for tok, val in ref]
    cpu = engines["cpu"].forward(ids, 0)[0]
    print(f"\n{case['prompt'][:30]!r}: max |torch - llama.cpp| top-10 {max(diffs):.3f}, "
          f"max |torch - cpu| all logits {float(np.abs(logits - cpu).max()):.3f}")
    assert max(diffs) < NEAR_TIE, diffs


@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:20] for c in CASES])
def test_greedy_after_bf16_prefill(engines: dict[str, Engine], case: dict[str, Any]) -> None:
    engine, ids, ref_ids = engines["torch"], case["prompt_ids"], case["greedy_ids"]
    logits = engine.forward(ids, 0)[0]
    for step, want in enumerate(ref_ids):
        got = int(np.argmax(logits))
        if got != want:
            top = case["steps"][step]["top5"]
            margin = top[0][1] - top[1][1]
            assert margin < NEAR_TIE, f"diverged at confident step {step} (margin {margin:.3f})"
            return
        logits = engine.forward([got], len(ids) + step)[0]
