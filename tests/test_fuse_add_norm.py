"""The residual add and the RMSNorm after it as one node (`fusion.fuse_add_norm`, issue #66):
the fused graph gives the unfused twin's bits (logits and KV, plain and batch-invariant), and a
decode step's op tape has one step less per fused pair."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.backends.cpu.regions import RegionRun
from minfer.engine.trace import StepTracer
from minfer.graph import ir
from minfer.graph.alloc import plan_buffers
from minfer.graph.params import ContextParams
from tests.fused_runs import fused_graph, run_engine

TOKENS = [(7 * i + 3) % 50 for i in range(70)]


@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: the parallel rows (PARALLEL_MIN_ROWS)
def test_the_fused_kernel_gives_the_add_and_the_norms_bits(rows: int) -> None:
    rng = np.random.default_rng(rows)
    a, b = (rng.standard_normal((rows, 96)).astype(np.float32) * 3 for _ in range(2))
    w = rng.standard_normal(96).astype(np.float32)
    total, out = np.empty_like(a), np.empty_like(a)
    K.bind_add_rms_norm(a, b, w, 1e-6, total, out)()
    want_total, want = np.empty_like(a), np.empty_like(a)
    K.bind_add(a, b, want_total)()
    K.bind_rms_norm(want_total, w, 1e-6, want)()
    np.testing.assert_array_equal(total, want_total)
    np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match="add_rms_norm"):
        K.bind_add_rms_norm(a, b.reshape(-1), w, 1e-6, total, out)


def test_the_pass_fuses_each_residual_add_into_the_norm_reading_it() -> None:
    ctx = ContextParams(n_ctx=128)
    fused, plain = fused_graph(ctx), fused_graph(dataclasses.replace(ctx, fuse_add_norm=False))
    kinds = [n.op.kind for n in fused.nodes]
    # 3 layers: the ffn norm of each, the next layer's attention norm, the output norm (and
    # each layer's roped q, which its KV store writes: `fuse_rope_store`)
    assert kinds.count("AddRmsNorm") == 6 and kinds.count("Written") == 6 + 3
    assert [n.op.kind for n in plain.nodes].count("AddRmsNorm") == 0
    plan = plan_buffers(fused)
    for node in fused.nodes:
        if isinstance(node.op, ir.AddRmsNorm):
            total = fused.nodes[node.srcs[2]]
            assert isinstance(total.op, ir.Written) and plan.slot_of[total.id] >= 0
            later = [u for u in fused.consumers()[total.id] if u != node.id]
            assert all(u > node.id for u in later)
    # another backend in the graph: left unfused (only the CPU backend runs it)
    torch = fused_graph(dataclasses.replace(ctx, backends=("torch", "cpu")))
    assert "AddRmsNorm" not in [n.op.kind for n in torch.nodes]


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("invariant", [False, True])
def test_fused_and_unfused_engines_give_the_same_bits(
        model: str, invariant: bool, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    fused, e = run_engine(path, batch_invariant=invariant)
    plain, e0 = run_engine(path, batch_invariant=invariant, fuse_add_norm=False)
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_array_equal(a, b)
    key = "tape-invariant" if invariant else "tape"
    tape = e.cache.get(e.params_for(1, 1)).scratch[key][1]
    tape0 = e0.cache.get(e0.params_for(1, 1)).scratch[key][1]
    n_fused = [n.op.kind for n in e.cache.get(e.params_for(1, 1)).graph.nodes].count(
        "AddRmsNorm")
    assert n_fused == 2 * e.hparams.n_layer
    assert len(tape.steps) == len(tape0.steps) - n_fused
    if not invariant:
        assert any(isinstance(c, RegionRun) for c in tape.program)


def test_the_observed_walk_reads_each_sum_once_written(tiny_qwen2: Path) -> None:
    """Tracing reads every node's buffer after its steps: a `Written` node's is read after the
    fused norm that fills it, the unfused add's values (node ids are kept)."""
    seen = []
    for fuse_add_norm in (True, False):
        _, e = run_engine(tiny_qwen2, fuse_add_norm=fuse_add_norm)
        e.tracer = StepTracer(capture=True)
        e.forward([5], len(TOKENS))
        seen.append((e.cache.get(e.params_for(1, 1)).graph, e.tracer.steps[0]))
    (graph, fused), (_, plain) = seen
    written = [n.id for n in graph.nodes if isinstance(n.op, ir.Written)]
    assert written and fused.node_ids != plain.node_ids  # each sum after its writer
    assert sorted(fused.node_ids) == sorted(plain.node_ids)
    for i in written:  # (the writer: a fused norm, or a rope-storing KV store)
        assert fused.node_ids.index(i) > fused.node_ids.index(
            next(n.id for n in graph.nodes if n.srcs[-1:] == (i,)))
        np.testing.assert_array_equal(fused.outputs[i], plain.outputs[i])
