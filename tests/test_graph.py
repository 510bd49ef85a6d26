"""Graph machinery invariants (DESIGN.md §2) that need no weights and no kernels."""

from __future__ import annotations

import dataclasses

import pytest

from minfer.errors import GraphError, ModelError
from minfer.gguf.hparams import HParams
from minfer.graph import ir
from minfer.graph.alloc import plan_buffers
from minfer.graph.cache import GraphCache, PreparedGraph
from minfer.graph.export import dump_json, to_dot
from minfer.graph.fusion import fuse, live_nodes
from minfer.graph.ir import ComputeGraph, Node
from minfer.graph.params import ContextParams, GraphParams, GraphType
from minfer.graph.scheduler import make_splits
from minfer.models.qwen import build_qwen
from minfer.models.registry import graph_builder_for


def _hparams(qk_norm: bool = False) -> HParams:
    return HParams(
        arch="qwen3" if qk_norm else "qwen2", n_layer=3, n_embd=64, n_head=4, n_head_kv=2,
        head_dim=16, n_ff=96, n_vocab=300, n_ctx_train=1024, rms_eps=1e-6, rope_base=10000.0,
        rope_dim=16, tie_embeddings=True, has_qkv_bias=not qk_norm, has_qk_norm=qk_norm,
    )


def _shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    s: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (hp.n_embd, hp.n_vocab),
        "output_norm.weight": (hp.n_embd,),
    }
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        s |= {
            p + "attn_norm.weight": (hp.n_embd,), p + "ffn_norm.weight": (hp.n_embd,),
            p + "attn_q.weight": (hp.n_embd, q), p + "attn_k.weight": (hp.n_embd, kv),
            p + "attn_v.weight": (hp.n_embd, kv), p + "attn_output.weight": (q, hp.n_embd),
            p + "ffn_gate.weight": (hp.n_embd, hp.n_ff), p + "ffn_up.weight": (hp.n_embd, hp.n_ff),
            p + "ffn_down.weight": (hp.n_ff, hp.n_embd),
            p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
            p + "attn_q_norm.weight": (hp.head_dim,), p + "attn_k_norm.weight": (hp.head_dim,),
        }
    return s


CTX = ContextParams(n_ctx=128)


def _build(n_tokens: int, n_out: int, ctx: ContextParams = CTX, hp: HParams | None = None,
           version: int = 0) -> ComputeGraph:
    hp = hp or _hparams()
    params = GraphParams.for_batch(n_tokens, n_out, ctx, version)
    graph = build_qwen(hp, params, _shapes(hp))
    fuse(graph, params)
    return graph


def _prepare(params: GraphParams) -> PreparedGraph:
    graph = build_qwen(_hparams(), params, _shapes(_hparams()))
    fuse(graph, params)
    for node in graph.nodes:
        node.backend = "cpu"
    plan = plan_buffers(graph)
    return PreparedGraph(params, graph, plan, make_splits(graph, plan.live))


def test_topo_order_accepts_built_graph_and_rejects_cycles_and_dangling_ids() -> None:
    graph = _build(5, 1)
    assert graph.topo_order() == list(range(len(graph.nodes)))
    cyclic = _build(5, 1)
    cyclic.nodes[10].srcs = (cyclic.nodes[10].srcs[0], 12)
    with pytest.raises(GraphError, match="cycle"):
        cyclic.topo_order()
    dangling = _build(5, 1)
    dangling.nodes[7].srcs = (9999,)
    with pytest.raises(GraphError, match="dangling"):
        dangling.topo_order()


def test_builder_only_references_existing_nodes() -> None:
    from minfer.graph.builder import GraphBuilder

    b = GraphBuilder({"w": (4, 8)})
    with pytest.raises(GraphError):
        b.silu("x", 0)


def test_ops_compare_by_payload() -> None:
    assert ir.RmsNorm(1e-6) == ir.RmsNorm(1e-6)
    assert ir.RmsNorm(1e-6) != ir.RmsNorm(1e-5)
    assert ir.KvcacheStore(3, 64) != ir.KvcacheStore(4, 64)
    rope = ir.Rope("neox", 1e6, 14, 64, 64)
    assert rope == dataclasses.replace(rope) and rope != dataclasses.replace(rope, base=1e4)
    assert rope.payload()["base"] == 1e6


def test_builder_is_deterministic_node_by_node() -> None:
    cache = GraphCache(_prepare)
    for nt, n_out in [(7, 1), (1, 1), (7, 7), (4, 2)]:
        cache.verify_structural(GraphParams.for_batch(nt, n_out, CTX))


def test_structural_check_catches_a_difference() -> None:
    calls = {"n": 0}

    def flaky(params: GraphParams) -> PreparedGraph:
        calls["n"] += 1
        prepared = _prepare(params)
        if calls["n"] > 1:
            prepared.graph.nodes[5].op = ir.RmsNorm(0.5)
        return prepared

    with pytest.raises(GraphError, match="differs"):
        GraphCache(flaky).verify_structural(GraphParams.for_batch(3, 1, CTX))


@pytest.mark.parametrize(
    "change",
    [
        {"n_tokens": 9},
        {"n_out": 2},
        {"ctx": dataclasses.replace(CTX, n_ctx=256)},
        {"ctx": dataclasses.replace(CTX, k_type="f32")},
        {"ctx": dataclasses.replace(CTX, fuse_swiglu=False)},
        {"ctx": dataclasses.replace(CTX, fuse_gate_up=False)},
        {"ctx": dataclasses.replace(CTX, fuse_add_norm=False)},
        {"ctx": dataclasses.replace(CTX, fuse_norm_quant=False)},
        {"ctx": dataclasses.replace(CTX, fuse_bias=False)},
        {"ctx": dataclasses.replace(CTX, backends=("torch", "cpu"))},
        {"ctx": dataclasses.replace(CTX, window="per_seq")},
        {"weights_version": 1},
        {"gtype": GraphType.DECODE, "n_out": 8, "n_tokens": 8},
    ],
)
def test_every_params_field_forces_a_rebuild(change: dict[str, object]) -> None:
    cache = GraphCache(_prepare)
    base = GraphParams.for_batch(8, 1, CTX)
    cache.get(base)
    cache.get(dataclasses.replace(base, **change))  # type: ignore[arg-type]
    assert cache.rebuilds == 2 and cache.reuses == 0


def test_new_positions_reuse_the_graph() -> None:
    # n_past is not a field of GraphParams: a decode step at any position is the same params.
    cache = GraphCache(_prepare)
    for _ in range(5):
        cache.get(GraphParams.for_batch(1, 1, CTX))
    assert (cache.rebuilds, cache.reuses) == (1, 4)
    assert not hasattr(GraphParams, "n_past")


def test_cache_is_a_bounded_mru() -> None:
    cache = GraphCache(_prepare, capacity=3)
    for nt in [2, 3, 4, 2, 5]:
        cache.get(GraphParams.for_batch(nt, 1, CTX))
    assert len(cache) == 3 and cache.rebuilds == 4 and cache.reuses == 1
    cache.get(GraphParams.for_batch(3, 1, CTX))  # evicted: least recently used
    assert cache.rebuilds == 5


def test_liveness_never_hands_a_live_buffer_to_another_node() -> None:
    for nt, n_out in [(6, 1), (1, 1), (4, 4)]:
        graph = _build(nt, n_out)
        plan = plan_buffers(graph)
        intervals = plan.intervals(graph)
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, first, last in intervals:
            for a, b in by_slot.get(slot, []):
                # a slot is handed on only after its previous holder's last reader has run
                assert first > b or last < a, (slot, (first, last), (a, b))
            by_slot.setdefault(slot, []).append((first, last))
        # buffers are actually shared: far fewer slots than nodes
        assert len(plan.slot_sizes) < len(intervals) // 3


def test_orphans_and_kv_nodes_get_no_buffer() -> None:
    graph = _build(6, 1)
    plan = plan_buffers(graph)
    live = live_nodes(graph)
    for node in graph.nodes:
        if isinstance(node.op, ir.Silu):
            assert not live[node.id] and plan.slot_of[node.id] == -1
        if isinstance(node.op, ir.KvcacheStore | ir.KvcacheLoad):
            assert plan.slot_of[node.id] == -1 and live[node.id]


def test_fusion_rewrites_mul_silu_into_swiglu_and_unfused_twin_stays() -> None:
    fused = _build(6, 1)
    unfused = _build(6, 1, dataclasses.replace(CTX, fuse_swiglu=False))
    kinds = [n.op.kind for n in fused.nodes]
    assert kinds.count("SwiGLU") == 3 and kinds.count("Mul") == 0
    assert [n.op.kind for n in unfused.nodes].count("Mul") == 3
    assert len(fused.nodes) == len(unfused.nodes)  # orphans stay in the list


def test_tail_rows_only_in_prefill_graphs() -> None:
    prefill = _build(6, 2)
    decode = _build(1, 1)
    batch_decode = _build(4, 4)
    assert [n.name for n in prefill.nodes].count("tail_attn_out") == 1
    assert ir.InputKind.TAIL_IDS in prefill.inputs
    for graph in (decode, batch_decode):
        assert "tail_attn_out" not in [n.name for n in graph.nodes]
    out = prefill.nodes[prefill.outputs[0]]
    assert out.shape == (2, 300)
    # everything after the tail selection runs on n_out rows
    tail = prefill.by_name("tail_attn_out").id
    assert all(n.shape[0] == 2 for n in prefill.nodes[tail:] if n.shape and n.op.kind != "Input")


def test_qwen3_graph_has_qk_norm_and_no_bias() -> None:
    graph = _build(3, 1, hp=_hparams(qk_norm=True))
    kinds = [n.op.kind for n in graph.nodes]
    assert kinds.count("QkNorm") == 6
    q = graph.by_name("attn_q")
    assert len(q.meta.weights) == 1


def test_unknown_architecture_is_refused_by_name() -> None:
    with pytest.raises(ModelError, match="mamba"):
        graph_builder_for("mamba")


def test_exports_name_params_and_nodes() -> None:
    params = GraphParams.for_batch(4, 1, CTX)
    graph = _build(4, 1)
    dot = to_dot(graph, params)
    assert dot.startswith("digraph") and "invhouse" in dot
    assert "RmsNorm(eps=1e-06, quant_for=blk.0.attn_q.weight)" in dot
    import json

    data = json.loads(dump_json(graph, params))
    assert data["params"]["n_tokens"] == 4 and len(data["nodes"]) == len(graph.nodes)
    assert any(n["op"] == "Attn" and n["payload"]["n_head_kv"] == 2 for n in data["nodes"])


def test_decode_node_count_is_small() -> None:
    graph = _build(1, 1)
    live = sum(live_nodes(graph))
    # per layer: norm, q, k, v, rope q (written by the store), store (ropes k), load, attn, o,
    # add, norm, gate_up, down, add
    assert live == 5 + 1 + 3 * 14 + 2
    assert isinstance(graph.nodes[0], Node)
