"""Gate, up, SwiGLU and the down projection's activation quantize as one split step
(`fusion.fuse_gate_up_quant`, `kernels.linear.gate_up`, issue #66): the fused kernel gives the
separate steps' bits (whole and as any number of region parts), the fused engine its unfused
twin's (logits and KV, plain and batch-invariant), and a decode tape loses the SwiGLU and the
quantize steps of each layer."""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.backends.cpu.kernels import QType
from minfer.graph import ir
from minfer.graph.params import ContextParams
from tests.fused_runs import fused_against_unfused, fused_graph
from tests.test_kernels_dequant import make_weight


def _separate(wg: np.ndarray, gt: int, wu: np.ndarray, ut: int,
              xq: K.Q8Blocks | K.Q8KBlocks, out: np.ndarray,
              down: K.Q8Blocks | K.Q8KBlocks) -> None:
    """The unfused steps: gate, up, SwiGLU, the down activation's quantize."""
    gate, up = np.empty_like(out), np.empty_like(out)
    K.bind_prequant_into(wg, gt, xq, gate)()
    K.bind_prequant_into(wu, ut, xq, up)()
    K.bind_swiglu(gate, up, out)()
    K.bind_quantize(out, down)()


@pytest.mark.parametrize("types", [(QType.Q5_0,) * 2, (QType.Q8_0,) * 2, (QType.Q4_K,) * 2,
                                   (QType.Q6_K,) * 2, (QType.Q4_K, QType.Q5_K)],
                         ids=lambda t: "-".join(q.name for q in t))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("nt", [1, 3, 40])  # 40: past the expanded Q5_0 tiles' 32 tokens
@pytest.mark.parametrize("down_type", [QType.Q8_0, QType.Q6_K], ids=["q8_0", "q8_k"])
def test_the_fused_step_gives_the_separate_steps_bits(types: tuple[QType, QType], packed: bool,
                                                      nt: int, down_type: QType) -> None:
    n_ff, n_in = 768, 256  # 24 blocks of 32, 3 of 256
    (wg, gt), (wu, ut) = ((make_weight(qt, n_ff, n_in, seed=nt + k), qt)
                          for k, qt in enumerate(types))
    if packed:
        if not K.packable(gt, n_in, n_ff):
            pytest.skip("no repacked layout on this CPU (needs AVX2)")
        wg, gt = K.repack_weight(wg, gt)
        if K.packable(ut, n_in, n_ff):
            wu, ut = K.repack_weight(wu, ut)
    rng = np.random.default_rng(nt)
    x = rng.standard_normal((nt, n_in)).astype(np.float32) * 2
    xq = K.new_activation(nt, n_in, gt)
    assert xq is not None
    K.bind_quantize(x, xq)()
    want, want_q = np.empty((nt, n_ff), np.float32), K.new_activation(nt, n_ff, down_type)
    assert want_q is not None
    _separate(wg, gt, wu, ut, xq, want, want_q)
    out, down = np.empty_like(want), K.new_activation(nt, n_ff, down_type)
    assert down is not None
    step = K.bind_gate_up(wg, gt, wu, ut, xq, out, down)
    step()
    np.testing.assert_array_equal(out, want)
    for field in vars(down):
        np.testing.assert_array_equal(getattr(down, field), getattr(want_q, field))
    # a parallel region's parts: any number of threads (more than the column groups too), in
    # any order of arrival; each block quantized once all its parts are in, the counts reset
    assert isinstance(step, partial)
    part = sys.modules[step.func.py_func.__module__].gate_up_part
    arrivals = step.args[8]
    for n_parts in (2, 3, 5, 64):
        out[:] = np.nan
        for field in vars(down):
            getattr(down, field)[:] = 0
        order = range(n_parts) if n_parts % 2 else reversed(range(n_parts))
        for p in order:
            part(p, n_parts, *step.args)
        assert not arrivals.any()
        np.testing.assert_array_equal(out, want)
        for field in vars(down):
            np.testing.assert_array_equal(getattr(down, field), getattr(want_q, field))
    # counts left behind (a region's step that failed part-way): the whole step, which such a
    # region calls next, zeroes them first
    arrivals[:] = 7
    for field in vars(down):
        getattr(down, field)[:] = 0
    step()
    for field in vars(down):
        np.testing.assert_array_equal(getattr(down, field), getattr(want_q, field))
    with pytest.raises(ValueError, match="do not fit"):
        K.bind_gate_up(wg, gt, wu, ut, xq, out[:, :512].copy(), down)


def test_the_pass_marks_each_gate_up_read_by_down() -> None:
    ctx = ContextParams(n_ctx=128)
    graph = fused_graph(ctx, n_tokens=1)  # decode: the builder's FusedGateUp
    gate_ups = [n for n in graph.nodes if isinstance(n.op, ir.FusedGateUp)]
    assert len(gate_ups) == 3  # one a layer
    for n in gate_ups:
        (down,) = (graph.nodes[u] for u in graph.consumers()[n.id])
        assert n.op.quant_for == down.meta.weights[0] and "ffn_down" in n.op.quant_for
    plain = fused_graph(dataclasses.replace(ctx, fuse_gate_up=False), n_tokens=1)
    assert not any(isinstance(n.op, ir.FusedGateUp) for n in plain.nodes)
    torch = fused_graph(dataclasses.replace(ctx, backends=("torch", "cpu")), n_tokens=1)
    assert all(not n.op.quant_for for n in torch.nodes if isinstance(n.op, ir.FusedGateUp))


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("invariant", [False, True])
def test_fused_and_unfused_engines_give_the_same_bits(
        model: str, invariant: bool, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    steps, steps0, n_layer = fused_against_unfused(path, invariant, "fuse_gate_up")
    assert steps.count("gate_up") == n_layer
    # per layer: gate, up, SwiGLU and the down activation's quantize -> one step
    assert len(steps) == len(steps0) - 3 * n_layer
    assert "_swiglu" not in steps and steps0.count("_swiglu") == n_layer
