"""benchmarks/greedy_vs_llamacpp.py's step-by-step comparison on scripted logits: where two
greedy runs part, each engine's top-2 and margin there, the drift up to it, the near-tie call,
and the table row a run gives (no model and no llama.cpp: the engine is a stand-in)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gv() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "greedy_vs_llamacpp", ROOT / "benchmarks" / "greedy_vs_llamacpp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Scripted:
    """An engine whose forward returns the next scripted row of logits (and records its calls)."""

    def __init__(self, rows: list[np.ndarray]) -> None:
        self.rows = rows
        self.calls: list[tuple[list[int], int]] = []

    def forward(self, tokens: list[int], start_pos: int, n_out: int = 1) -> np.ndarray:
        self.calls.append((list(tokens), start_pos))
        return self.rows[len(self.calls) - 1][None, :]


def _row(peaks: dict[int, float], vocab: int = 16) -> np.ndarray:
    row = np.zeros(vocab, np.float32)
    for tok, val in peaks.items():
        row[tok] = val
    return row


def test_equal_runs_report_the_drift_only(gv: ModuleType) -> None:
    ref = np.stack([_row({3: 5.0, 4: 2.0}), _row({7: 4.0, 1: 3.0})])
    mine = [ref[0] + 0.01, ref[1] - 0.02]
    r = gv.compare(Scripted(mine), [1, 2], ref, np.array([3, 7]), 0.1)
    assert r["equal"] == 2 and r["diverged"] is None
    assert r["minfer_ids"] == [3, 7]
    assert r["drift"] == pytest.approx(0.02) and r["drift10"] == pytest.approx(0.02)


def test_divergence_reports_both_top2_and_margins(gv: ModuleType) -> None:
    # step 0 agrees (drift 0.3 on token 9); step 1: llama.cpp 5 by 0.04, minfer 6 by 0.03
    ref = np.stack([_row({2: 6.0, 9: 1.0}), _row({5: 3.04, 6: 3.0}), _row({0: 1.0})])
    mine = [_row({2: 6.0, 9: 1.3}), _row({5: 3.0, 6: 3.03})]
    engine = Scripted(mine)
    r = gv.compare(engine, [10, 11, 12], ref, np.array([2, 5, 0]), 0.1)
    assert r["equal"] == 1
    d = r["diverged"]
    assert d["step"] == 1 and d["near_tie"]
    assert [t for t, _ in d["llama_top2"]] == [5, 6] and [t for t, _ in d["minfer_top2"]] == [6, 5]
    assert d["llama_margin"] == pytest.approx(0.04, abs=1e-6)
    assert d["minfer_margin"] == pytest.approx(0.03, abs=1e-6)
    # the two margins sum to how far the engines moved the two picks apart
    (lt_b, lt_a), (mt_b, mt_a) = d["llama_on_picks"], d["minfer_on_picks"]
    assert d["llama_margin"] + d["minfer_margin"] == pytest.approx((lt_a - mt_a) - (lt_b - mt_b))
    assert d["drift_before"] == pytest.approx(0.3) and d["drift_at"] == pytest.approx(0.04)
    # it stopped at the divergence: the prompt and step 0's pick were fed, nothing after
    assert engine.calls == [([10, 11, 12], 0), ([2], 3)]


def test_a_wide_divergence_is_no_near_tie_and_the_table_says_whose_spread(
        gv: ModuleType) -> None:
    ref = np.stack([_row({1: 4.0, 2: 3.5})])
    r = gv.compare(Scripted([_row({1: 3.6, 2: 3.9})]), [0], ref, np.array([1]), 0.1)
    d = r["diverged"]
    assert d["step"] == 0 and not d["near_tie"]
    d["llama_alt"] = {"ubatch1": {"drift10": 0.3, "drift": 0.3, "margin": 0.1},
                      "f32kv": {"drift10": 0.1, "drift": 0.1, "margin": 0.4}}
    assert gv.within_llama(d)  # 0.4 <= 1.5 x 0.3
    r["prompt"] = "code"
    res: dict[str, Any] = {"type": "Q2_K", "prompts": [r]}
    row = gv.table([res], 1).splitlines()[-1]
    assert row.startswith("| Q2_K | 0/1 | code: 0 | 0.500 / 0.300 (drift 0.40, llama.cpp's own")
    d["llama_alt"]["ubatch1"]["drift10"] = 0.2
    assert not gv.within_llama(d)
    assert "UNEXPLAINED" in gv.table([res], 1)
