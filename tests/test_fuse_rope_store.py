"""Rope of q and k in the KV store's step (`fusion.fuse_rope_store`, issue #66): the fused kernel
gives the two ropes' and the store's bits (float and quantized caches), the fused engine its
unfused twin's (logits and KV, plain and batch-invariant), and a decode step's tape has one
step where it had three."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.backends.cpu.kernels.attn.kv_formats import new_cache
from minfer.graph import ir
from minfer.graph.fusion import live_nodes
from minfer.graph.params import ContextParams
from tests.fused_runs import fused_graph, run_engine, tape_kernels


@pytest.mark.parametrize("rows", [1, 5, 12])  # 12: rope's parallel rows
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("style", ["neox", "norm"])
def test_the_fused_kernel_gives_the_ropes_and_the_stores_bits(rows: int, kv: str,
                                                              style: str) -> None:
    rng = np.random.default_rng(rows)
    n_head, n_kv, hd = 4, 2, 64
    q = rng.standard_normal((rows, n_head * hd)).astype(np.float32)
    k, v = (rng.standard_normal((rows, n_kv * hd)).astype(np.float32) for _ in range(2))
    pos = (np.arange(rows) * 3 + 7).astype(np.int32)
    cells = np.arange(rows, dtype=np.int32)[::-1].copy() + 2
    rope = dict(head_dim=hd, rope_dim=hd, base=10000.0, style=style)
    q_out = np.empty_like(q)
    kc, vc = new_cache(kv, 32, n_kv * hd), new_cache(kv, 32, n_kv * hd)
    K.bind_rope_store(q, k, v, pos, q_out, kc, vc, cells, n_head=n_head, n_head_kv=n_kv,
                      **rope)()  # type: ignore[arg-type]
    want_q, want_k = np.empty_like(q), np.empty_like(k)
    wkc, wvc = new_cache(kv, 32, n_kv * hd), new_cache(kv, 32, n_kv * hd)
    K.bind_rope(q, pos, n_head=n_head, out=want_q, **rope)()  # type: ignore[arg-type]
    K.bind_rope(k, pos, n_head=n_kv, out=want_k, **rope)()  # type: ignore[arg-type]
    K.bind_store_kv(want_k, v, wkc, wvc, cells, head_dim=hd)()
    np.testing.assert_array_equal(q_out, want_q)
    np.testing.assert_array_equal(kc[cells], wkc[cells])
    np.testing.assert_array_equal(vc[cells], wvc[cells])
    with pytest.raises(ValueError, match="cell"):
        K.bind_rope_store(q, k, v, pos, q_out, kc, vc, cells + 40, n_head=n_head,
                          n_head_kv=n_kv, **rope)()  # type: ignore[arg-type]


def test_the_pass_ropes_q_and_k_in_each_store() -> None:
    ctx = ContextParams(n_ctx=128)
    graph = fused_graph(ctx)
    live = live_nodes(graph)
    stores = [n for n in graph.nodes if isinstance(n.op, ir.KvcacheStore)]
    assert len(stores) == 3 and all(s.op.rope_q and s.op.rope_k for s in stores)
    assert not any(isinstance(n.op, ir.Rope) and live[n.id] for n in graph.nodes)
    users = graph.consumers()
    for s in stores:
        q_out = graph.nodes[s.srcs[5]]
        assert isinstance(q_out.op, ir.Written) and q_out.name == "rope_q"
        assert all(u > s.id for u in users[q_out.id] if u != s.id)
    plain = fused_graph(dataclasses.replace(ctx, fuse_rope_store=False))
    assert sum(isinstance(n.op, ir.Rope) for n in plain.nodes) == 6
    torch = fused_graph(dataclasses.replace(ctx, backends=("torch", "cpu")))
    assert not any(isinstance(n.op, ir.KvcacheStore) and n.op.rope_k for n in torch.nodes)




@pytest.mark.parametrize("model,kv", [("tiny_qwen2", "f16"), ("tiny_qwen3", "f16"),
                                      ("tiny_qwen3", "q8_0")])  # head_dim 32: Q8_0 blocks
@pytest.mark.parametrize("invariant", [False, True])
def test_fused_and_unfused_engines_give_the_same_bits(
        model: str, kv: str, invariant: bool, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    fused, e = run_engine(path, kv_type=kv, batch_invariant=invariant)
    plain, e0 = run_engine(path, kv_type=kv, batch_invariant=invariant, fuse_rope_store=False)
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_array_equal(a, b)
    key = "tape-invariant" if invariant else "tape"
    steps, steps0 = tape_kernels(e, key), tape_kernels(e0, key)
    n_layer = e.hparams.n_layer
    assert steps.count("_rope_store") == n_layer and "_rope" not in steps
    assert len(steps) == len(steps0) - 2 * n_layer
