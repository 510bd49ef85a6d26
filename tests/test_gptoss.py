"""gpt-oss (`gpt-oss`): attention sinks, the clamped SwiGLU and top-k soft-max routing against
float64 oracles, and a tiny checkpoint written by llama.cpp's own converter against
transformers on the same weights and token ids.

tests/fixtures/gptoss/ comes from benchmarks/make_gptoss_fixtures.py: a random
`GptOssForCausalLM` (transformers 5.x; n_embd 64, GQA 4/2 heads of 16, 2 layers -- the first
through a sliding window of 8 cells, the second global -- 16 experts of which 4 used, YaRN x4,
random sinks and biases, gate|up weights wide enough for the clamp to engage), converted by
llama.cpp 0.3.36's `convert_hf_to_gguf.py` to f32 and q8_0 (float experts: the released
files' MXFP4 experts are another engineer's weight type), with transformers' float32 logits
(eager attention, which applies the sinks as the reference computes them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.backends.cpu.kernels.elementwise.arith import bind_swiglu
from minfer.backends.cpu.kernels.linear import experts as X
from minfer.backends.cpu.kernels.reference import ref_attention
from minfer.engine.forward import Batch, Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import ir
from minfer.graph.params import ContextParams, GraphParams
from minfer.models.registry import graph_builder_for

FIXTURES = Path(__file__).parent / "fixtures" / "gptoss"
REF = np.load(FIXTURES / "logits.npz")
IDS = REF["ids"].tolist()


def _model(name: str = "gptoss") -> tuple[GGUFFile, HParams]:
    f = GGUFFile.open(FIXTURES / f"{name}.gguf")
    return f, HParams.from_gguf(f)


def _engine(name: str = "gptoss", hp: HParams | None = None, **kw: object) -> Engine:
    f, read = _model(name)
    kw.setdefault("n_ctx", 64)
    kw.setdefault("kv_type", "f32")
    return Engine(f, hp or read, **kw)  # type: ignore[arg-type]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


# -- oracles --------------------------------------------------------------------------------


def _attention_case(seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    n_head, n_kv, hd, n_ctx = 8, 2, 64, 96
    q = (2 * rng.standard_normal((40, n_head * hd))).astype(np.float32)
    k, v = (rng.standard_normal((n_ctx, n_kv * hd)).astype(np.float32) for _ in range(2))
    # causal rows after a past, a second sequence, an empty window
    start = np.concatenate([np.zeros(20), np.full(19, 50), [7]]).astype(np.int32)
    end = np.concatenate([40 + np.arange(20), 51 + np.arange(19), [7]]).astype(np.int32)
    # sinks below, among and far above the scores (|score| ~ 2 sqrt(64) / 8 = 2)
    sinks = np.array([-3.0, 0.0, 1.5, 4.0, 12.0, -30.0, 2.5, 100.0], np.float32)
    return q, k, v, start, end, sinks


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("window", [0, 5])
def test_sinks_match_the_float64_oracle(blocked: bool, window: int) -> None:
    """Per-row (batch-invariant) and blocked kernels take each head's sink logit into the
    softmax's max and sum as a cell without a value: the weights sum to less than 1 (to ~0
    where the sink dominates)."""
    q, k, v, start, end, sinks = _attention_case(1)
    args = {"n_head": 8, "n_head_kv": 2, "head_dim": 64, "scale": 0.125, "window": window}
    ref = ref_attention(q, k, v, start, end, sinks=sinks, **args)  # type: ignore[arg-type]
    out = np.full_like(q, np.nan)
    K.attention(q, k, v, start, end, out=out, blocked=blocked, sinks=sinks,
                **args)  # type: ignore[arg-type]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    plain = ref_attention(q, k, v, start, end, **args)  # type: ignore[arg-type]
    assert np.abs(plain - ref).max() > 0.1  # the sinks change the result
    assert np.abs(out[:, 7 * 64:]).max() < 1e-30  # a sink of 100 takes all the weight
    assert not out[-1].any()  # an empty window stays 0


def test_sinks_reach_quantized_caches_and_the_bound_tape() -> None:
    q, k, v, start, end, sinks = _attention_case(2)
    args = {"n_head": 8, "n_head_kv": 2, "head_dim": 64, "scale": 0.125}
    ref = ref_attention(q, k, v, start, end, sinks=sinks, **args)  # type: ignore[arg-type]
    out = np.full_like(q, np.nan)
    for step in K.bind_attention(q, k, v, start, end, out=out, sinks=sinks,
                                 **args):  # type: ignore[arg-type]
        step()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    from minfer.backends.cpu.kernels.attn.kv_formats import new_cache

    kq, vq = new_cache("q8_0", 96, 128), new_cache("q8_0", 96, 128)
    K.kv_store(k, v, kq, vq, np.arange(96), head_dim=64)
    K.attention(q, kq, vq, start, end, out=out, sinks=sinks, **args)  # type: ignore[arg-type]
    assert _rel(out, ref) < 0.05  # q8_0 keys and values


def test_sinks_far_below_leave_the_bits_of_attention_without_sinks() -> None:
    """A sink far below every score only adds exp(-inf) = 0 to the sum: the same bits as no
    sinks, on every kernel (the sink enters the denominator alone)."""
    q, k, v, start, end, _ = _attention_case(3)
    args = {"n_head": 8, "n_head_kv": 2, "head_dim": 64, "scale": 0.125}
    low = np.full(8, -1e30, np.float32)
    for blocked in (False, True):
        a, b = np.empty_like(q), np.empty_like(q)
        K.attention(q, k, v, start, end, out=a, blocked=blocked, **args)  # type: ignore[arg-type]
        K.attention(q, k, v, start, end, out=b, blocked=blocked, sinks=low,
                    **args)  # type: ignore[arg-type]
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), blocked


def test_clamped_swiglu_matches_the_float64_oracle() -> None:
    """ggml_swiglu_oai: x = min(gate, 7), y = clamp(up, -7, 7), x * sigmoid(1.702 x) * (y + 1),
    on both sides of the limit and in the chunked (parallel) form."""
    rng = np.random.default_rng(4)
    for n in (1000, 1 << 17):
        g = (rng.standard_normal(n) * 6).astype(np.float32)
        u = (rng.standard_normal(n) * 6).astype(np.float32)
        assert (g > 7).any() and (u < -7).any() and (u > 7).any()
        x = np.minimum(g.astype(np.float64), 7.0)
        y = np.clip(u.astype(np.float64), -7.0, 7.0)
        ref = x / (1.0 + np.exp(-1.702 * x)) * (y + 1.0)
        out = np.empty_like(g)
        bind_swiglu(g, u, out, oai=True)()
        np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-6)


def test_top_k_softmax_routing_matches_the_oracle() -> None:
    """"softmax_weight" gating: the n_used largest logits, soft-maxed among themselves (ties:
    the lower id), not renormalised probabilities of all experts."""
    rng = np.random.default_rng(5)
    nt, ne, k = 9, 16, 4
    logits = (3 * rng.standard_normal((nt, ne))).astype(np.float32)
    logits[0, [3, 9]] = 10.0  # a tie at the top
    ids = np.empty((nt, k), np.int32)
    wts = np.empty((nt, k), np.float32)
    bufs = (np.zeros((ne, 3), np.int64), np.zeros(1, np.int64), np.empty(nt * k, np.int64),
            np.empty(nt * k, np.int64), np.empty((nt * k, 2), np.float32))
    X.route_and_group(logits, np.zeros((nt, 2), np.float32), k, False, True, ids, wts, *bufs)
    want = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :k]
    assert np.array_equal(ids, want) and ids[0, :2].tolist() == [3, 9]
    top = np.take_along_axis(logits.astype(np.float64), want, 1)
    ref = np.exp(top - top.max(1, keepdims=True))
    np.testing.assert_allclose(wts, ref / ref.sum(1, keepdims=True), rtol=1e-6)


def test_biased_experts_match_the_float64_oracle() -> None:
    """A whole routed FFN as gpt-oss's: biased gate / up / down per expert, clamped SwiGLU,
    weights from the chosen logits, summed over each row's experts."""
    rng = np.random.default_rng(6)
    nt, n_embd, n_ff, ne, k = 7, 32, 32, 8, 3
    x = rng.standard_normal((nt, n_embd)).astype(np.float32)
    logits = rng.standard_normal((nt, ne)).astype(np.float32)
    w = [(rng.standard_normal((ne, n_out, n_in)) * 0.8).astype(np.float32)
         for n_out, n_in in ((n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff))]
    b = [rng.standard_normal((ne, n)).astype(np.float32) for n in (n_ff, n_ff, n_embd)]
    out = np.full_like(x, np.nan)

    def scratch(kind: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        return np.empty(shape, dtype)

    steps = X.bind_moe(x, logits, *(X.ExpertWeight(a, 0) for a in w), n_used=k, norm=False,
                       act="swiglu_oai", out=out, scratch=scratch,
                       activation=lambda kind, a, qtype: None, gating="softmax_weight",
                       biases=(b[0], b[1], b[2]))
    for step in steps:
        step()
    ref = np.zeros((nt, n_embd))
    for t in range(nt):
        top = np.argsort(-logits[t], kind="stable")[:k]
        p = np.exp(logits[t, top] - logits[t, top].max())
        for e, pe in zip(top, p / p.sum(), strict=True):
            gate = w[0][e].astype(np.float64) @ x[t] + b[0][e]
            up = w[1][e].astype(np.float64) @ x[t] + b[1][e]
            g = np.minimum(gate, 7.0)
            a = g / (1 + np.exp(-1.702 * g)) * (np.clip(up, -7.0, 7.0) + 1)
            ref[t] += pe * (w[2][e].astype(np.float64) @ a + b[2][e])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


# -- the converted checkpoint ---------------------------------------------------------------


def test_matches_transformers() -> None:
    got = _engine().forward(IDS, 0, n_out=len(IDS))
    ref = REF["hf"]
    assert _rel(got[-1], ref[-1]) < 1e-3  # the last position, as a prompt's next token reads
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
    q8 = _engine("gptoss-q8_0").forward(IDS, 0, n_out=1)[0]
    assert _rel(q8, ref[-1]) < 0.3  # sharp random weights: q8_0's noise, not a wrong model


def test_each_difference_shows_in_the_logits() -> None:
    """Without the sinks, the routing's top-k softmax, the sliding window or the scaled rope of
    the sliding-window layers the logits are far from transformers'."""
    _, hp = _model()
    ref = REF["hf"][-1]
    for wrong in (replace(hp, attn_sinks=False), replace(hp, moe_gating="softmax"),
                  replace(hp, swa_layers=()), replace(hp, rope_freq_scale_swa=1.0),
                  replace(hp, moe_act="silu")):
        assert _rel(_engine(hp=wrong).forward(IDS, 0, n_out=1)[0], ref) > 0.01, wrong


def test_layout_reads_as_llamacpp_reads_it() -> None:
    f, hp = _model()
    assert (hp.arch, hp.rope_style, hp.n_expert, hp.n_expert_used, hp.n_ff) == \
        ("gpt-oss", "neox", 16, 4, 64)
    assert (hp.sliding_window, hp.swa_layers) == (8, (True, False))  # even layers slide
    assert hp.rope_freq_scale == hp.rope_freq_scale_swa == 0.25 and hp.yarn is not None
    assert (hp.attn_sinks, hp.moe_bias, hp.expert_norm) == (True, True, False)
    assert (hp.has_qkv_bias, hp.has_out_bias, hp.ffn_norm_name) == \
        (True, True, "post_attention_norm")
    g = graph_builder_for("gpt-oss")(hp, GraphParams.for_batch(4, 1, ContextParams(n_ctx=64)),
                                     {n: tuple(t.shape) for n, t in f.tensors.items()})
    attn = [n for n in g.nodes if isinstance(n.op, ir.Attn)]
    assert [(n.op.window, n.op.sinks) for n in attn if isinstance(n.op, ir.Attn)] == \
        [(8, True), (0, True)]
    assert attn[0].meta.weights == ("blk.0.attn_sinks.weight",)
    moe = [n for n in g.nodes if isinstance(n.op, ir.Moe)]
    assert moe[0].op == ir.Moe(0, 16, 4, False, act="swiglu_oai", gating="softmax_weight",
                               biased=True)
    assert moe[0].meta.weights[3:] == ("blk.0.ffn_gate_exps.bias", "blk.0.ffn_up_exps.bias",
                                       "blk.0.ffn_down_exps.bias")
    assert g.by_name("ffn_moe_logits").meta.weights[1] == "blk.0.ffn_gate_inp.bias"


def test_real_20b_parameter_counts() -> None:
    """gpt-oss-20b's shapes: 20.9 B parameters, 3.6 B read per token (OpenAI's figures; llama.cpp
    prints the same total)."""
    _, tiny = _model()
    real = replace(tiny, n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
                   n_ff=2880, n_vocab=201088, n_expert=32, rope_dim=64, swa_layers=(True,) * 24)
    total, active = real.n_params()
    assert round(total / 1e9, 2) == 20.91 and round(active / 1e9, 2) == 3.61


@pytest.mark.parametrize("name", ["gptoss", "gptoss-q8_0"])
def test_batch_invariant_rows_do_not_depend_on_the_batch(name: str) -> None:
    """One token decoded alone = the same token beside another sequence's prefill = the last
    row of a chunked prefill = the last row of one prefill, bitwise (sinks, the window and the
    routed experts included)."""
    n = len(IDS)
    alone = _engine(name, batch_invariant=True)
    alone.forward(IDS[:-1], 0)
    ref = alone.forward([IDS[-1]], n - 1)[0]
    whole = _engine(name, batch_invariant=True).forward(IDS, 0)[0]
    chunked = _engine(name, batch_invariant=True)
    chunked.forward(IDS[:7], 0)
    chunked.forward(IDS[7:13], 7)
    assert np.array_equal(whole, ref)
    assert np.array_equal(chunked.forward(IDS[13:], 13)[0], ref)
    e = _engine(name, batch_invariant=True)
    e.forward(IDS[:-1], 0)
    other = IDS[:12]
    pos = np.array([n - 1, *range(len(other))], np.int32)
    cells = np.array([n - 1, *(32 + np.arange(len(other)))], np.int32)
    start = np.array([0] + [32] * len(other), np.int32)
    batch = Batch(np.array([IDS[-1], *other], np.int32), pos, cells, start, cells + 1,
                  np.array([0, len(other)], np.int32))
    assert np.array_equal(e.forward_batch(batch)[0], ref)


def test_torch_backend_leaves_sink_attention_to_the_cpu() -> None:
    pytest.importorskip("torch")
    from minfer.backends.torch_backend.backend import TorchBackend

    f, hp = _model()
    g = graph_builder_for("gpt-oss")(hp, GraphParams.for_batch(4, 1, ContextParams(n_ctx=64)),
                                     {n: tuple(t.shape) for n, t in f.tensors.items()})
    torch = TorchBackend(device="cpu", min_rows=1)
    attn = [n for n in g.nodes if isinstance(n.op, ir.Attn)]
    assert attn and not any(torch.supports_op(n, g) for n in attn)


def test_template_is_harmony_and_info_explains_the_family(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from minfer.cli.main import main
    from minfer.sampling.harmony import is_harmony

    monkeypatch.setenv("COLUMNS", "200")  # one table row a line
    f, _ = _model()
    assert is_harmony(str(f.metadata["tokenizer.chat_template"]))
    assert main(["info", str(FIXTURES / "gptoss.gguf")]) == 0
    out = capsys.readouterr().out
    for text in ("gpt-oss", "4 of 16 per token", "attention sinks", "clamped SwiGLU",
                 "soft-maxed among themselves", "0.47 M / 0.15 M per token",
                 "8 (1 layers; 1 global)"):
        assert text in out, text
