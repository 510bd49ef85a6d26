"""Qwen3.5's MoE (`qwen35moe`): Qwen3.5's trunk (Gated DeltaNet x 3 | gated attention) with
every FFN a mixture of experts (soft-maxed router, top k renormalised, the shared expert behind
its sigmoid gate), against transformers.

tests/fixtures/qwen35/qwen35moe.gguf and logits_moe.npz come from
benchmarks/make_qwen35_fixtures.py: a tiny random `Qwen3_5MoeForCausalLM` (the dense fixture's
trunk; 8 experts of 32, top 2, a shared expert of 48) converted by llama.cpp 0.3.36's
`convert_hf_to_gguf.py --no-mtp` to f32, with transformers' float32 logits of 40 token ids.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph.params import ContextParams, GraphParams
from minfer.models.registry import graph_builder_for

FIXTURES = Path(__file__).parent / "fixtures" / "qwen35"
MODEL = FIXTURES / "qwen35moe.gguf"
REF = np.load(FIXTURES / "logits_moe.npz")
LONG = np.random.default_rng(7).integers(0, 300, 100).tolist()  # longer than 64-row chunks


def _model() -> tuple[GGUFFile, HParams]:
    f = GGUFFile.open(MODEL)
    return f, HParams.from_gguf(f)


def _engine(**kw: object) -> Engine:
    f, hp = _model()
    return Engine(f, hp, n_ctx=256, kv_type="f32", **kw)  # type: ignore[arg-type]


def test_experts_and_trunk_are_read_as_llamacpp_reads_them() -> None:
    _, hp = _model()
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff, hp.n_ff_shexp) == (8, 2, 32, 48)
    assert hp.expert_norm and hp.moe_gating == "softmax" and not hp.moe_bias
    assert hp.recurrent_layers == (True, True, True, False) and hp.attn_gated
    assert hp.ffn_norm_name == "post_attention_norm"


def test_graph_routes_every_layers_ffn_through_the_experts() -> None:
    f, hp = _model()
    shapes = {n: tuple(t.shape) for n, t in f.tensors.items()}
    g = graph_builder_for("qwen35moe")(hp, GraphParams.for_batch(5, 1, ContextParams(n_ctx=64)),
                                       shapes)
    kinds = {(type(n.op).__name__, n.meta.layer) for n in g.nodes}
    for il in range(4):
        assert ("Moe", il) in kinds
    assert ("DeltaNet", 0) in kinds and ("Attn", 3) in kinds and ("Attn", 0) not in kinds


def test_matches_transformers() -> None:
    ids = REF["ids"].tolist()
    got = _engine().forward(ids, 0, n_out=len(ids))
    ref = REF["hf"]
    assert float(np.abs(got[-1] - ref[-1]).max() / np.abs(ref[-1]).max()) < 1e-3
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3)


def test_prefill_chunks_are_bitwise_the_whole_prompt() -> None:
    """Chunked prefill at 1, 7 and 64 rows gives each row the bits of the whole prompt's."""
    e = _engine(batch_invariant=True)
    whole = e.forward(LONG, 0, n_out=len(LONG))
    for chunk in (1, 7, 64):
        rows = [e.forward(LONG[s:s + chunk], s, n_out=len(LONG[s:s + chunk]))
                for s in range(0, len(LONG), chunk)]
        assert np.array_equal(np.concatenate(rows), whole), chunk


def test_info_shows_total_and_active_parameters_and_the_layer_pattern(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from minfer.cli.main import main

    monkeypatch.setenv("COLUMNS", "200")  # each table row on one line

    f, hp = _model()
    total = sum(math.prod(t.shape) for t in f.tensors.values())
    # a token reads 2 of the 8 experts of its 4 layers' 3 expert tensors and 1 embedding row
    active = total - 4 * 3 * 64 * 32 * (8 - 2) - 64 * (hp.n_vocab - 1)
    assert hp.n_params() == (total, active)
    assert main(["info", str(MODEL)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 of 8 per token, each 32 wide (weights renormalised)" in out
    assert "48 wide, sigmoid-gated" in out
    assert f"{total / 1e6:.2f} M / {active / 1e6:.2f} M per token" in out
    assert "DDDA (D: Gated DeltaNet, 4 value heads of 16" in out
