"""Gemma-3-270M's standing drift from llama.cpp (issue 63): the top-10 logits of the prompts
where minfer strayed furthest, against llama.cpp's (tests/fixtures/gemma3_drift.json, from
benchmarks/make_gemma_reference.py; flash attention off, f16 KV), held to 0.5.

Expected to fail until minfer's quantized dots sum as ggml's do. Measured per layer against
llama.cpp's intermediate tensors (its eval callback) on the softmax prompt, the first difference is
the layer-0 q/k/v projections (Q5_0 / Q8_0 weights): the same quantized activations, the same
integer block sums, but another float order (ggml: eight lanes per row, lane j the sum of codes
4j..4j+3 of each block, `fma(d_w * d_x, lane, acc_j)` block after block, then
((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)); minfer: one exact sum per block into two accumulators).
A numpy emulation of ggml's order reproduces llama.cpp's Qcur-0 / Kcur-0 / Vcur-0 bit for bit,
where minfer differs in the last bits of 74-82% of the values. Those ulps become whole f16
steps where K and V are rounded into the cache and whole Q8 steps where activations are
quantized, and grow to 1-3% of each tensor's range by layer 2 (up to 8% by the last): the
top-10 gap is then noise of 0.2-1.1 that any change of rounding reshuffles (llama.cpp's own
flash-attention path is 0.17-0.93 from its non-flash path on the same 18 prompts). The value
mix's probabilities, which ggml rounds to f16 over an f16 V cache and minfer keeps in f32 (the
one op that computes differently on the same inputs), were tried rounded as ggml's: the gaps on
these prompts moved and did not shrink (max 1.129 -> 1.052, 5 -> 7 prompts over 0.5), so
that change was not kept.
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


@pytest.mark.xfail(reason="ggml's quantized dot order not matched yet (module docstring)",
                   strict=False)
@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:24] for c in CASES])
def test_top10_logits_within_half_a_logit(engine: Engine, case: dict[str, Any]) -> None:
    logits = engine.forward(case["prompt_ids"], 0)[0]
    ref = case["top10_last_prompt_pos"]
    diffs = [abs(float(logits[tok]) - val) for tok, val in ref]
    assert max(diffs) <= LOGIT_TOL, diffs
