"""The output projection's activation quantize in attention's step (`fusion.fuse_attn_quant`,
issue #66): each thread quantizes the heads it computed, the bits of the attention and a
quantize step after it (whole and as region parts), the fused engine gives its unfused twin's
bits (logits and KV, plain and batch-invariant), and a decode tape loses a quantize step a
layer."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.backends.cpu.kernels.attn import attend
from minfer.graph import ir
from minfer.graph.params import ContextParams
from tests.fused_runs import fused_against_unfused, fused_graph


@pytest.mark.parametrize("nt", [1, 3])
@pytest.mark.parametrize(("n_head", "n_head_kv", "head_dim", "qtype"), [
    (8, 2, 32, K.QType.Q8_0),  # a group of 4 heads: 4 Q8_0 blocks per item
    (8, 2, 64, K.QType.Q4_K),  # 256 values a group: one Q8_K block per item
    (6, 6, 16, K.QType.Q8_0),  # 16 values a group: a separate quantize step
])
def test_the_fused_step_gives_attention_and_quantize_bits(
        nt: int, n_head: int, n_head_kv: int, head_dim: int, qtype: int) -> None:
    rng = np.random.default_rng(nt)
    n_ctx = 40
    q = rng.standard_normal((nt, n_head * head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((n_ctx, n_head_kv * head_dim)).astype(np.float16)
            for _ in range(2))
    hi = np.arange(n_ctx - nt + 1, n_ctx + 1, dtype=np.int64)
    lo = np.zeros(nt, np.int64)
    kw = dict(n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, scale=0.125)
    want, out = (np.empty_like(q) for _ in range(2))
    want_q, xq = (K.new_activation(nt, q.shape[1], qtype) for _ in range(2))
    assert want_q is not None and xq is not None
    for s in K.bind_attention(q, k, v, lo, hi, out=want, **kw):
        s()
    K.bind_quantize(want, want_q)()
    steps = K.bind_attention(q, k, v, lo, hi, out=out, quant=xq, **kw)
    fused = n_head // n_head_kv * head_dim % (256 if qtype == K.QType.Q4_K else 32) == 0
    assert len(steps) == (2 if fused else 3)
    for s in steps:
        s()
    np.testing.assert_array_equal(out, want)
    for field in vars(xq):
        np.testing.assert_array_equal(getattr(xq, field), getattr(want_q, field))
    if not fused:
        return
    step = steps[1]
    assert isinstance(step, partial) and step.func is attend._attention_quant
    for n_parts in (2, 3):  # a parallel region's parts
        out[:] = np.nan
        for p in range(n_parts):
            attend._attention_quant_part(p, n_parts, *step.args)
        np.testing.assert_array_equal(out, want)
        for field in vars(xq):
            np.testing.assert_array_equal(getattr(xq, field), getattr(want_q, field))


def test_the_pass_marks_each_attention_read_by_its_projection() -> None:
    ctx = ContextParams(n_ctx=128)
    graph = fused_graph(ctx, n_tokens=1)
    attns = [n for n in graph.nodes if isinstance(n.op, ir.Attn)]
    assert len(attns) == 3
    for n in attns:
        (proj,) = (graph.nodes[u] for u in graph.consumers()[n.id])
        assert n.op.quant_for == proj.meta.weights[0] and "attn_output" in n.op.quant_for
    prefill = fused_graph(ctx, n_tokens=4)  # (its tail rows are selected after the o-proj)
    marked = [n.op.quant_for for n in prefill.nodes if isinstance(n.op, ir.Attn)]
    assert marked == [f"blk.{il}.attn_output.weight" for il in range(3)]
    for c in (dataclasses.replace(ctx, fuse_attn_quant=False),
              dataclasses.replace(ctx, backends=("torch", "cpu"))):
        assert not any(n.op.quant_for for n in fused_graph(c, n_tokens=1).nodes
                       if isinstance(n.op, ir.Attn))


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("invariant", [False, True])
def test_fused_and_unfused_engines_give_the_same_bits(
        model: str, invariant: bool, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    steps, steps0, n_layer = fused_against_unfused(path, invariant, "fuse_attn_quant")
    assert steps.count("_attention_quant") == n_layer
    assert len(steps) == len(steps0) - n_layer
