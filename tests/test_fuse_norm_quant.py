"""The activation's Q8 quantization in the RMSNorm's step (`fusion.fuse_norm_quant`, issue #66):
the fused kernel gives the norm's and the quantization's bits, the fused engine its unfused
twin's (logits and KV, plain and batch-invariant), and a decode step's op tape loses the
quantize step of each fused norm."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.graph import ir
from minfer.graph.params import ContextParams
from tests.fused_runs import fused_graph, run_engine, tape_kernels


@pytest.mark.parametrize("rows", [1, 5, 20])  # 20: the parallel rows (PARALLEL_MIN_ROWS)
@pytest.mark.parametrize("qtype", [K.QType.Q8_0, K.QType.Q4_K])  # Q8_0 / Q8_K activations
@pytest.mark.parametrize("add", [True, False])
def test_the_fused_kernel_gives_the_norms_and_the_quantizations_bits(
        rows: int, qtype: int, add: bool) -> None:
    rng = np.random.default_rng(rows)
    n = 512
    a, b = (rng.standard_normal((rows, n)).astype(np.float32) * 3 for _ in range(2))
    a[0, :256] = 0.0  # an all-zero Q8_K block (and Q8_0 blocks)
    b[0, :256] = 0.0
    w = rng.standard_normal(n).astype(np.float32)
    total, out, xq = np.empty_like(a), np.empty_like(a), K.new_activation(rows, n, qtype)
    assert xq is not None
    K.bind_norm_quant(a, b if add else None, w, 1e-6, total if add else None, out, xq)()
    want_total, want, want_q = np.empty_like(a), np.empty_like(a), K.new_activation(rows, n,
                                                                                    qtype)
    assert want_q is not None
    if add:
        K.bind_add_rms_norm(a, b, w, 1e-6, want_total, want)()
        np.testing.assert_array_equal(total, want_total)
    else:
        K.bind_rms_norm(a, w, 1e-6, want)()
    K.bind_quantize(want, want_q)()
    np.testing.assert_array_equal(out, want)
    for field in vars(xq):
        np.testing.assert_array_equal(getattr(xq, field), getattr(want_q, field))
    with pytest.raises(ValueError, match="quantize"):
        K.bind_norm_quant(a, None, w, 1e-6, None, out, K.new_activation(rows, n // 2, qtype))


def test_the_pass_marks_each_norm_read_by_a_projection() -> None:
    ctx = ContextParams(n_ctx=128)
    for c in (ctx, dataclasses.replace(ctx, fuse_add_norm=False)):
        graph = fused_graph(c)
        norms = [n for n in graph.nodes if isinstance(n.op, ir.RmsNorm | ir.AddRmsNorm)
                 and graph.consumers()[n.id]]
        # 3 layers: attention and FFN norms, and the output norm
        assert len(norms) == 7
        for n in norms:
            first = graph.nodes[min(graph.consumers()[n.id])]
            assert n.op.quant_for == first.meta.weights[0]
            assert isinstance(first.op, ir.MatMul | ir.FusedGateUp)
    def marked(graph: ir.ComputeGraph) -> bool:
        return any(n.op.quant_for for n in graph.nodes
                   if isinstance(n.op, ir.RmsNorm | ir.AddRmsNorm))

    assert not marked(fused_graph(dataclasses.replace(ctx, fuse_norm_quant=False)))
    assert not marked(fused_graph(dataclasses.replace(ctx, backends=("torch", "cpu"))))




@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("add_norm", [True, False])
def test_fused_and_unfused_engines_give_the_same_bits(
        model: str, invariant: bool, add_norm: bool, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    fused, e = run_engine(path, batch_invariant=invariant, fuse_add_norm=add_norm)
    plain, e0 = run_engine(path, batch_invariant=invariant, fuse_add_norm=add_norm,
                     fuse_norm_quant=False)
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_array_equal(a, b)
    key = "tape-invariant" if invariant else "tape"
    steps, steps0 = tape_kernels(e, key), tape_kernels(e0, key)
    n_layer = e.hparams.n_layer
    # every layer's attention and FFN norms; the output norm too where its weight is quantized
    # (tiny_qwen2's output is its F16 embedding: no quantized activation)
    n_fused = 2 * n_layer + (model == "tiny_qwen3")
    assert steps.count("_norm_q8_rows") == n_fused
    assert len(steps) == len(steps0) - n_fused
    quantizes = [s for s in steps if s.startswith("_quantize_q8")]
    assert len(quantizes) == len([s for s in steps0 if s.startswith("_quantize_q8")]) - n_fused
