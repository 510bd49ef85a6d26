"""SmolLM3 (`smollm3`) and Phi-3 / Phi-4-mini (`phi3`) files written by llama.cpp's own
converter, against transformers on the same weights and token ids.

tests/fixtures/families/ comes from benchmarks/make_families_fixtures.py: tiny random
checkpoints (n_embd 64, GQA 4/2, norms away from 1) made with transformers 5.x's
SmolLM3ForCausalLM / Phi3ForCausalLM, converted with llama.cpp 0.3.36's `convert_hf_to_gguf.py`
to f32 and q8_0, with transformers' float64 logits. `smollm3` has 4 layers, so its 4th runs
without RoPE; `phi3` is Phi-4-mini's layout (fused q|k|v and gate|up, rotary on 12 of 16 head
dims, tied output); `phi3_longrope` Phi-3-mini-128k's (LongRoPE over 256 original positions
stretched to 1024, untied output). With f32 weights and an f32 KV cache minfer differs from
transformers by f32 rounding only (measured max |d| 1.4e-5 to 3.4e-5 on logits up to ~9; 2.8e-4
over the 300 tokens of the long run).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu.backend import CpuBackend
from minfer.engine.forward import Batch, Engine
from minfer.engine.kv_shift import shift_kv
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import ir
from minfer.graph.params import ContextParams, GraphParams
from minfer.models.registry import graph_builder_for

FIXTURES = Path(__file__).parent / "fixtures" / "families"
REF = np.load(FIXTURES / "logits.npz")
IDS = REF["ids"].tolist()
IDS_LONG = REF["ids_long"].tolist()  # 300 tokens: past phi3_longrope's 256 original positions
NAMES = ("smollm3", "phi3", "phi3_longrope")


def _model(name: str) -> tuple[GGUFFile, HParams]:
    f = GGUFFile.open(FIXTURES / f"{name}.gguf")
    return f, HParams.from_gguf(f)


def _engine(name: str, hp: HParams | None = None, **kw: object) -> Engine:
    f, read = _model(name)
    kw.setdefault("n_ctx", 256)
    kw.setdefault("kv_type", "f32")
    return Engine(f, hp or read, **kw)  # type: ignore[arg-type]


def _logits(e: Engine, ids: list[int]) -> np.ndarray:
    return e.forward(ids, 0, n_out=len(ids))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", NAMES)
def test_matches_transformers(name: str) -> None:
    got = _logits(_engine(name), IDS)
    ref = REF[f"{name}.hf"]
    assert _rel(got[-1], ref[-1]) < 1e-3  # the last position, as a prompt's next token reads
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
    f16 = _logits(_engine(name, kv_type="f16"), IDS)
    assert _rel(f16, ref) < 1e-2 and (f16.argmax(-1) == ref.argmax(-1)).all()


def test_longrope_long_factors_past_the_original_context() -> None:
    """A context longer than the 256 original positions runs on the long factors (llama.cpp
    picks them by the context's size, transformers by the sequence's length: with 300 tokens
    both pick them); the short factors there are far off."""
    ref = REF["phi3_longrope.hf_long"]
    got = _logits(_engine("phi3_longrope", n_ctx=512), IDS_LONG)
    assert _rel(got[-1], ref[-1]) < 1e-3
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3)
    _, hp = _model("phi3_longrope")
    short = replace(hp, longrope_ctx=1 << 20)  # never past the original context: short factors
    assert _rel(_logits(_engine("phi3_longrope", short, n_ctx=512), IDS_LONG), ref) > 0.01


def test_layouts_read_as_llamacpp_reads_them() -> None:
    _, smol = _model("smollm3")
    assert (smol.arch, smol.rope_style, smol.rope_dim, smol.tie_embeddings) == \
        ("smollm3", "norm", 16, True)
    assert [smol.layer_has_rope(il) for il in range(4)] == [True, True, True, False]
    assert not (smol.qkv_fused or smol.ffn_up_gate or smol.longrope_ctx)
    _, phi = _model("phi3")
    assert (phi.arch, phi.rope_style, phi.head_dim, phi.rope_dim) == ("phi3", "neox", 16, 12)
    assert (phi.qkv_fused, phi.ffn_up_gate, phi.tie_embeddings) == (True, True, True)
    assert (phi.longrope_ctx, phi.rope_attn_factor, phi.sliding_window) == (0, 1.0, 0)
    assert phi.rope_factors(4096) is None
    _, long = _model("phi3_longrope")
    assert (long.longrope_ctx, long.n_ctx_train, long.tie_embeddings) == (256, 1024, False)
    # the converter's LongRoPE magnitude: sqrt(1 + ln(1024 / 256) / ln 256)
    assert long.rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))
    assert long.layer_rope_yarn(0).mscale == pytest.approx(long.rope_attn_factor)
    # llama.cpp pads n_ctx to 256 cells, then takes the long factors past the original context
    assert [long.rope_factors(n) for n in (16, 256, 257, 512)] == [
        "rope_factors_short.weight", "rope_factors_short.weight",
        "rope_factors_long.weight", "rope_factors_long.weight"]
    real = replace(long, longrope_ctx=4096)  # Phi-3-mini-128k: 4096 original positions
    assert real.rope_factors(4096) == "rope_factors_short.weight"
    assert real.rope_factors(4097) == "rope_factors_long.weight"


def test_each_difference_shows_in_the_logits() -> None:
    """Without the NoPE layer, the LongRoPE magnitude or its factors the logits are far from
    transformers', so the comparisons above check each of them."""
    _, smol = _model("smollm3")
    ref = REF["smollm3.hf"]
    assert _rel(_logits(_engine("smollm3", replace(smol, no_rope_step=0)), IDS), ref) > 0.01
    _, long = _model("phi3_longrope")
    ref = REF["phi3_longrope.hf"]
    for wrong in (replace(long, rope_attn_factor=1.0), replace(long, longrope_ctx=0)):
        assert _rel(_logits(_engine("phi3_longrope", wrong), IDS), ref) > 0.01


def test_graphs_slice_fused_projections_and_skip_rope() -> None:
    ctx = ContextParams(n_ctx=256)
    params = GraphParams.for_batch(4, 1, ctx)
    f, smol = _model("smollm3")
    g = graph_builder_for("smollm3")(smol, params, {n: tuple(t.shape)
                                                    for n, t in f.tensors.items()})
    roped = {n.meta.layer for n in g.nodes if isinstance(n.op, ir.Rope)}
    assert roped == {0, 1, 2}
    f, long = _model("phi3_longrope")
    shapes = {n: tuple(t.shape) for n, t in f.tensors.items()}
    for n_ctx, factors in ((256, "rope_factors_short.weight"), (512, "rope_factors_long.weight")):
        p = GraphParams.for_batch(4, 1, ContextParams(n_ctx=n_ctx))
        g = graph_builder_for("phi3")(long, p, shapes)
        ropes = [n for n in g.nodes if isinstance(n.op, ir.Rope)]
        assert {n.meta.weights for n in ropes} == {(factors,)}
        assert {n.op.yarn.mscale for n in ropes if isinstance(n.op, ir.Rope)} == \
            {long.rope_attn_factor}
        slices = [(n.name, n.op) for n in g.nodes if isinstance(n.op, ir.Slice)
                  and n.meta.layer == 0]
        assert slices == [("attn_q", ir.Slice(0, 64)), ("attn_k", ir.Slice(64, 32)),
                          ("attn_v", ir.Slice(96, 32)), ("ffn_gate", ir.Slice(0, 128)),
                          ("ffn_up", ir.Slice(128, 128))]


@pytest.mark.parametrize("name", NAMES)
def test_q8_0_greedy_continuation_follows_f32(name: str) -> None:
    """The q8_0 conversion continues the prompt greedily as the f32 file does wherever the
    f32 model's choice is not a near tie (measured: the only differing choices had margins
    under 2 % of the largest logit), and its logits stay within q8_0's noise. These random
    weights (std 0.3) make sharp, chaotic models: 8-bit weights and activations move their
    logits by 2-20 % of the largest (mean ~7 %) at each of these steps."""
    f32, q8 = _engine(name), _engine(f"{name}-q8_0")
    a, b = _logits(f32, IDS)[-1], _logits(q8, IDS)[-1]
    errors = []
    for i in range(24):
        errors.append(_rel(b, a))
        top2 = np.sort(a)[-2:]
        if top2[1] - top2[0] > 0.03 * np.abs(a).max():
            assert b.argmax() == a.argmax(), i
        tok = int(a.argmax())  # both follow the f32 model's path
        pos = len(IDS) + i
        a, b = f32.forward([tok], pos, n_out=1)[0], q8.forward([tok], pos, n_out=1)[0]
    assert np.mean(errors) < 0.1 and max(errors) < 0.3


@pytest.mark.parametrize("name", ["smollm3", "phi3_longrope"])
def test_batch_invariant_rows_do_not_depend_on_the_batch(name: str) -> None:
    """A decode row beside another sequence's prefill is bitwise the row alone (the fused
    projections' slices and the NoPE layer included)."""
    a, b = IDS[:4], IDS[4:]
    alone = _engine(f"{name}-q8_0", n_ctx=64, batch_invariant=True)
    alone.forward(a[:3], 0)
    ref = alone.forward([a[3]], 3)[0]
    e = _engine(f"{name}-q8_0", n_ctx=64, batch_invariant=True)
    e.forward(a[:3], 0)
    nb = len(b)
    pos = np.array([3, *range(nb)], np.int32)
    cells = np.array([3, *(32 + np.arange(nb))], np.int32)
    start = np.array([0] + [32] * nb, np.int32)
    batch = Batch(np.array([a[3], *b], np.int32), pos, cells, start, cells + 1,
                  np.array([0, nb], np.int32))
    got = e.forward_batch(batch)
    assert np.array_equal(got[0], ref)


@pytest.mark.parametrize("name", ["smollm3", "phi3_longrope"])
def test_shifted_block_equals_the_block_prefilled_at_its_new_place(name: str) -> None:
    """The context shift re-rotates keys with the factors the context uses and leaves a NoPE
    layer's keys as they are."""
    src, dst, n = 50, 6, len(IDS)

    def block(start: int) -> Batch:  # tokens at cells start.. reading only their own block
        b = Batch.single(IDS, start, 1)
        return Batch(b.tokens, b.positions, b.cells, np.full(n, start, np.int32), b.kv_end,
                     b.out_rows)

    moved, fresh = _engine(name, n_ctx=128), _engine(name, n_ctx=128)
    moved.forward_batch(block(src))
    shift_kv(moved, src_start=src, src_end=src + n, dst_start=dst)
    fresh.forward_batch(block(dst))
    for layer in range(moved.hparams.n_layer):
        got, want = moved.kv.k[layer][dst:dst + n], fresh.kv.k[layer][dst:dst + n]
        assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max(), layer


def test_torch_backend_runs_the_new_ops() -> None:
    """The torch backend takes the slices of the fused projections too (bf16 products: within
    a few per cent of the CPU backend's logits)."""
    pytest.importorskip("torch")
    from minfer.backends.torch_backend.backend import TorchBackend

    ref = _logits(_engine("phi3"), IDS)
    e = _engine("phi3", backends=[TorchBackend(device="cpu", min_rows=1), CpuBackend()])
    got = _logits(e, IDS)
    assert _rel(got, ref) < 0.05
    ran = {(type(n.op), n.backend) for pg in e.cache._entries.values() for n in pg.graph.nodes}
    assert {(ir.Slice, "torch"), (ir.Rope, "torch")} <= ran


def test_info_explains_the_families(capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    assert main(["info", str(FIXTURES / "phi3_longrope.gguf")]) == 0
    out = capsys.readouterr().out
    for text in ("phi3", "fused q|k|v", "fused gate|up", "LongRoPE", "256"):
        assert text in out
    assert main(["info", str(FIXTURES / "smollm3.gguf")]) == 0
    out = capsys.readouterr().out
    assert "smollm3" in out and "NoPE" in out
