"""Gemma-3-270M's standing drift from llama.cpp (issue 63): the top-10 logits of the prompts
where minfer strayed furthest, against llama.cpp's (tests/fixtures/gemma3_drift.json, from
benchmarks/make_gemma_reference.py; flash attention off, f16 KV), held to 0.5.

Expected to fail: matching ggml's float order op by op does not get there. The first
difference is layer 0's Q5_0/Q8_0 q/k/v (same quantized activations and integer block sums,
another float order: ggml's eight lanes per row, `fma(d_w * d_x, lane_j, acc_j)` block after
block). benchmarks/gemma3_drift_probe.py swaps minfer's projection and attention binders for
numpy copies of ggml-cpu's arithmetic (those dots in ggml's lane order; attention with q in
f16, 16-lane f16 dots, ggml's exp, f16 probabilities: layer 0 and 1 then equal llama.cpp's bit
for bit) and measures the 18 prompts: the worst gap goes 1.129 -> 0.79-0.90 with every
combination tried, prompts over 0.5 from 5 to 4-9. The ulps left (the Q4_K output projection
in llama.cpp's repacked 8x8 order, Q6_K ffn_down, the norms and adds) become whole f16 / Q8
steps downstream, and the gap behaves as noise of 0.2-0.9 that any rounding change reshuffles
(llama.cpp's own flash-attention path is 0.17-0.93 from its non-flash path on the same
prompts). Only a bit-for-bit copy of every op's order (and ggml's repacked layouts) could
pass; the kernel cost of just the dots' lane order would be roughly 3-6x on batched Q5_0/Q8_0
rows (8 float accumulators per block instead of 1), and AMX cannot keep that order at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

REF = json.loads((Path(__file__).parent / "fixtures" / "gemma3_drift.json").read_text())
CASES = REF["cases"]
LOGIT_TOL = 0.5


@pytest.fixture(scope="module")
def engine() -> Engine:
    from minfer.store.download import pull

    f = GGUFFile.open(pull("gemma-3-270m", progress=False))
    return Engine(f, HParams.from_gguf(f), n_ctx=256)


@pytest.mark.xfail(reason="only a bit-for-bit copy of every ggml op would pass (docstring)",
                   strict=False)
@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:24] for c in CASES])
def test_top10_logits_within_half_a_logit(engine: Engine, case: dict[str, Any]) -> None:
    logits = engine.forward(case["prompt_ids"], 0)[0]
    ref = case["top10_last_prompt_pos"]
    diffs = [abs(float(logits[tok]) - val) for tok, val in ref]
    assert max(diffs) <= LOGIT_TOL, diffs
