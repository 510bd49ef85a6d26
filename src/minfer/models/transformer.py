"""The decoder skeleton every supported family shares, as builder calls.

`build_decoder` lays out the graph inputs, the token embedding (optionally scaled; with
GraphParams.embd_input, given rows such as an image's replace it at the rows the EMBD_IDS input
names: data, not topology; Qwen3-VL's rows carry deepstack blocks, each added to an early
layer's output at the same rows), one block per layer (the family's `LayerFn`) and the output
head (final norm, projection tied to the embedding when `output.weight` is absent, optional
logit soft-capping). The pieces a block is made of live here too. With the context's `pooling`
set the graph ends at the final norm's hidden states instead of the logits (every row, their
mean per sequence, or the cls / last rows kept as the tail): a decoder's embeddings; "rank"
runs the file's classifier head (`cls.output`, softmaxed where llama.cpp does: Qwen3-Reranker)
on each input's last row. The pieces: `attention` (q/k/v projections with optional biases, or
one fused q|k|v projection sliced apart; optional per-head q/k norms; RoPE with the layer's
base / scaling / frequency factors (M-RoPE's four positions per row where the model has rope
sections), or none in the layers that skip it; KV store and load, attention with the layer's
sliding window, soft-cap and sink logits, output projection, optionally biased),
`gated_ffn` (gate/up, or one `ffn_up` holding both halves; SiLU or GELU gate, down; biased where
the file has Llama's mlp_bias, then never the fused gate/up), `moe_ffn` (router logits, routed
experts, optional gated shared expert: Qwen2/3-MoE; gpt-oss's biases, gating and clamped SwiGLU)
and `keep_tail` (a prefill keeps only its last `n_out` rows after the last layer's attention).
Which of the optional parts a model has is read from its HParams, never guessed from the
architecture name here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from minfer.errors import GraphError
from minfer.gguf.hparams import HParams
from minfer.graph import ir
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph, InputKind
from minfer.graph.params import GraphParams, GraphType


@dataclass(frozen=True)
class Layer:
    """What a block needs besides its input: the model, the graph params, the input leaves."""

    hp: HParams
    params: GraphParams
    pos: int
    cells: int
    start: int
    end: int
    tail: int  # -1 where every row is kept to the end (decode graphs, mean / no pooling)
    seq: int = -1  # each row's recurrent-state row (a model with recurrent layers), else -1
    per_layer: int = -1  # Gemma 4's per-layer inputs [nt, n_layer * n_embd_per_layer], else -1
    kv: dict[int, int] = field(default_factory=dict)  # layer -> its loaded KV (shared-KV reuse)
    # "every_row": a prefill's last layer output over every row besides its tail rows, where
    # GraphParams.hidden_out asks for every row's hidden state (`prenorm_layer`)
    rows: dict[str, int] = field(default_factory=dict)
    rope_pos: int = -1  # M-RoPE's [4 nt] t / h / w / e positions (HParams.rope_sections), else -1

    @property
    def prefill(self) -> bool:
        """Whether the last layer keeps only the tail rows."""
        return self.tail >= 0


LayerFn = Callable[[GraphBuilder, Layer, int, int], int]  # (b, ctx, layer, h) -> h


def build_decoder(hp: HParams, params: GraphParams, weight_shapes: Mapping[str, tuple[int, ...]],
                  *, layer: LayerFn, embd_scale: float = 1.0) -> ComputeGraph:
    b = GraphBuilder(weight_shapes)
    nt = params.n_tokens
    pooling = params.ctx.pooling
    if pooling not in ("", "none", "mean", "cls", "last", "rank"):
        raise GraphError(f"{hp.arch}: pooling {pooling!r} is not supported for a decoder "
                         "(none, mean, cls, last, rank)")
    if pooling == "rank" and not hp.n_cls_out:
        raise GraphError(f"{hp.arch}: rank pooling needs a classifier head (cls.output), which "
                         "this model lacks")
    if pooling == "none" and params.n_out != nt:
        raise GraphError(f"unpooled embeddings return every row: n_out={params.n_out} for {nt}")
    # mean pooling reads every row; cls / last keep the pooled rows as the tail
    prefill = params.gtype is GraphType.PREFILL and pooling != "mean"
    # Inputs first (even tail_ids, read only at the last layer): one leaf block, one split.
    ids = b.input(InputKind.TOKEN_IDS, nt)
    ctx = Layer(
        hp, params,
        pos=b.input(InputKind.POSITIONS, nt),
        cells=b.input(InputKind.KV_CELLS, nt),
        start=b.input(InputKind.KV_START, nt),
        end=b.input(InputKind.KV_END, nt),
        tail=b.input(InputKind.TAIL_IDS, params.n_out) if prefill else -1,
        seq=b.input(InputKind.STATE_SEQ, nt) if hp.recurrent else -1,
        rope_pos=b.input(InputKind.ROPE_POS, 4 * nt) if hp.rope_sections else -1,
    )
    if pooling == "mean":
        out_start = b.input(InputKind.OUT_START, params.n_out)
        out_end = b.input(InputKind.OUT_END, params.n_out)
    if params.embd_input:
        embd_ids = b.input(InputKind.EMBD_IDS, nt)
        embd = b.input_rows(InputKind.EMBD, nt, hp.n_embd * (1 + hp.n_deepstack))
    h = b.embedding("token_embd.weight", ids)  # [nt, n_embd]
    if embd_scale != 1.0:
        h = b.scale("inp_scaled", h, embd_scale)
    deep: list[int] = []
    if params.embd_input:  # given rows (an image's) as they are: unscaled, as llama.cpp's
        if hp.n_deepstack:  # Qwen3-VL: [main | deepstack 0 | ...], each n_embd wide
            zero = b.scale("deepstack_zero", h, 0.0)
            deep = [b.replace_rows(f"deepstack_rows.{k}", zero, embd_ids, b.slice(
                f"deepstack_in.{k}", embd, (k + 1) * hp.n_embd, hp.n_embd))
                for k in range(hp.n_deepstack)]
            embd = b.slice("inp_embd_main", embd, 0, hp.n_embd)
        h = b.replace_rows("inp_embd", h, embd_ids, embd)
    if hp.n_embd_per_layer:
        ctx = replace(ctx, per_layer=_per_layer_inputs(b, hp, ids, h))
    for il in range(hp.n_layer):
        h = layer(b, ctx, il, h)
        if il < len(deep):  # deepstack: the image rows' block il added to the layer's output
            h = b.add("deepstack_out", h, deep[il], layer=il)
    x = b.rms_norm("output_norm", h, hp.output_norm_name, hp.rms_eps)
    hidden = _every_row_hidden(b, ctx, x)
    if pooling == "rank":  # a reranker: its head on each input's last row, as llama.cpp's
        bias = "cls.output.bias" if "cls.output.bias" in weight_shapes else None
        x = b.matmul("cls_out", x, "cls.output.weight", bias=bias)
        if hp.rank_softmax:  # Qwen3-Reranker: P(yes), P(no)
            x = b.softmax("cls_softmax", x)
        b.output(x)
        return b.graph
    if pooling:  # embeddings: the normed hidden states, pooled (cls / last rows are the tail)
        b.output(b.pool("pooled", x, out_start, out_end, "mean") if pooling == "mean" else x)
        return b.graph
    out_weight = "token_embd.weight" if hp.tie_embeddings else "output.weight"
    # [n_out, n_vocab], or the first vocab_limit ids only (0: all; the Engine clears a limit
    # at or above n_vocab)
    logits = b.matmul("output", x, out_weight, rows=params.ctx.vocab_limit)
    if hp.final_softcap:
        logits = b.softcap("output_softcap", logits, hp.final_softcap)
    b.output(logits)
    if hidden >= 0:
        b.output(hidden)
    return b.graph


def _every_row_hidden(b: GraphBuilder, ctx: Layer, x: int) -> int:
    """Where GraphParams.hidden_out asks: every row's final normed hidden state (the normed
    rows x the logits are made of; in a prefill, the last layer's every-row output normed
    apart, its tail rows' logits made as without it); else -1."""
    if not ctx.params.hidden_out:
        return -1
    if not ctx.prefill:
        return x
    every = ctx.rows.get("every_row")
    if every is None:
        raise GraphError(f"{ctx.hp.arch}: this model's layers give no hidden state of every row")
    return b.rms_norm("hidden_norm", every, ctx.hp.output_norm_name, ctx.hp.rms_eps)


def _per_layer_inputs(b: GraphBuilder, hp: HParams, ids: int, h: int) -> int:
    """Gemma 4's per-layer inputs, every layer's at once: the token's per-layer embedding
    (scaled by sqrt(width)) plus the projected scaled token embedding (scaled by
    1/sqrt(n_embd), RMS-normed per layer), times 1/sqrt(2)."""
    npl = hp.n_embd_per_layer
    e = b.weight_rows("per_layer_embd", "per_layer_token_embd.weight", ids)
    e = b.scale("per_layer_embd_scaled", e, math.sqrt(npl))
    p = b.matmul("per_layer_proj", h, "per_layer_model_proj.weight")
    p = b.scale("per_layer_proj_scaled", p, 1.0 / math.sqrt(hp.n_embd))
    p = b.qk_norm("per_layer_proj_norm", p, "per_layer_proj_norm.weight",
                  ir.QkNorm(hp.rms_eps, hp.n_layer, npl), layer=-1)
    return b.scale("per_layer_inp", b.add("per_layer_sum", p, e), 1.0 / math.sqrt(2.0))


def per_layer_embd(b: GraphBuilder, ctx: Layer, il: int, h: int) -> int:
    """h + norm(proj(gelu(gate(h)) * the layer's per-layer input)): Gemma 4's per-layer
    embedding block (the input's tail rows only where the layer kept only those)."""
    hp, blk, npl = ctx.hp, f"blk.{il}.", ctx.hp.n_embd_per_layer
    inp = b.slice("per_layer_in", ctx.per_layer, il * npl, npl, layer=il)
    if ctx.prefill and il == hp.n_layer - 1:
        inp = b.get_rows("tail_per_layer_in", inp, ctx.tail, layer=il)
    g = b.gelu("per_layer_gelu", b.matmul("per_layer_gate", h, blk + "inp_gate.weight",
                                          layer=il), layer=il)
    p = b.matmul("per_layer_out", b.mul("per_layer_mul", g, inp, layer=il),
                 blk + "proj.weight", layer=il)
    p = b.rms_norm("per_layer_post_norm", p, blk + "post_norm.weight", hp.rms_eps, layer=il)
    return b.add("per_layer_resid", h, p, layer=il)


Mixer = LayerFn  # (b, ctx, layer, normed x) -> the mixer's output [nt, n_embd]


def prenorm_layer(b: GraphBuilder, ctx: Layer, il: int, h: int, *,
                  recurrent: Mixer | None = None) -> int:
    """h + attn(norm(h)), then + ffn(norm(.)): Qwen's and Llama's block (SiLU gate; the FFN a
    mixture of experts where the model has them); LFM2's, with its short convolution in place
    of attention in the recurrent layers (`recurrent`: another model's recurrent mixer, as
    Qwen3.5's Gated DeltaNet)."""
    hp, blk = ctx.hp, f"blk.{il}."
    x = b.rms_norm("attn_norm", h, blk + "attn_norm.weight", hp.rms_eps, layer=il)
    mixer = (recurrent or short_conv) if hp.is_recurrent(il) else attention
    o = mixer(b, ctx, il, x)  # [nt, n_embd]
    if ctx.prefill and ctx.params.hidden_out and il == hp.n_layer - 1:
        # every row's output too (an MTP head reads each row's hidden state); the tail rows'
        # own branch below computes their logits exactly as without it
        ctx.rows["every_row"] = _prenorm_ffn(b, ctx, il, h, o)
    o, h = keep_tail(b, ctx, il, o, h)
    return _prenorm_ffn(b, ctx, il, h, o)


def _prenorm_ffn(b: GraphBuilder, ctx: Layer, il: int, h: int, o: int) -> int:
    """The rest of a pre-norm block after its mixer's output o: h + o, then + ffn(norm(.))."""
    hp, blk = ctx.hp, f"blk.{il}."
    h = b.add("attn_resid", h, o, layer=il)
    x = b.rms_norm("ffn_norm", h, f"{blk}{hp.ffn_norm_name}.weight", hp.rms_eps, layer=il)
    d = moe_ffn(b, ctx, il, x) if hp.n_expert else gated_ffn(b, ctx, il, x, act="silu")
    return b.add("ffn_resid", h, d, layer=il)


def attention(b: GraphBuilder, ctx: Layer, il: int, x: int) -> int:
    """Self-attention of layer il on the normed input x, through the output projection; where
    the q projection is doubled (Qwen3.5: each head's query | gate), the output times the
    sigmoid of the gate."""
    hp, blk, head_dim = ctx.hp, f"blk.{il}.", ctx.hp.layer_head_dim(il)
    n_head_kv = hp.layer_n_head_kv(il)
    own_kv = hp.kv_layer(il) == il  # else: only q, over an earlier layer's KV (Gemma 4)
    q, k, v = _qkv(b, hp, il, x, own_kv)
    gate = -1
    if hp.attn_gated:
        gate = b.slice("attn_gate", q, head_dim, head_dim, layer=il, n_head=hp.n_head)
        q = b.slice("attn_q_heads", q, 0, head_dim, layer=il, n_head=hp.n_head)
    if hp.has_qk_norm:
        q = b.qk_norm("attn_q_norm", q, blk + "attn_q_norm.weight",
                      ir.QkNorm(hp.rms_eps, hp.n_head, head_dim), layer=il)
        if own_kv:
            k = b.qk_norm("attn_k_norm", k, blk + "attn_k_norm.weight",
                          ir.QkNorm(hp.rms_eps, n_head_kv, head_dim), layer=il)
    if hp.v_norm and own_kv:
        v = b.qk_norm("attn_v_norm", v, None, ir.QkNorm(hp.rms_eps, n_head_kv, head_dim),
                      layer=il)
    if hp.layer_has_rope(il):
        # rope factors (Llama 3.1's, LongRoPE's, Gemma 4's) turn only the global layers
        factors = None if hp.is_swa(il) else hp.rope_factors(ctx.params.ctx.n_ctx)
        pos = ctx.rope_pos if hp.rope_sections else ctx.pos
        q = b.rope("rope_q", q, pos, _rope(hp, il, hp.n_head), layer=il, factors=factors)
        if own_kv:
            k = b.rope("rope_k", k, pos, _rope(hp, il, n_head_kv), layer=il, factors=factors)
    if own_kv:
        store = b.kv_store(il, k, v, ctx.cells, head_dim=head_dim)
        ctx.kv[il] = b.kv_load(il, store, n_ctx=ctx.params.ctx.n_ctx,
                               n_kv_embd=hp.layer_kv_embd(il))
    op = ir.Attn(il, hp.n_head, n_head_kv, head_dim, hp.kq_scale,
                 window=hp.layer_window(il), softcap=hp.attn_softcap, sinks=hp.attn_sinks,
                 kv_layer=-1 if own_kv else hp.kv_layer(il))
    a = b.attn(q, ctx.kv[hp.kv_layer(il)], ctx.start, ctx.end, op,
               sinks=blk + "attn_sinks.weight" if hp.attn_sinks else None)
    if gate >= 0:
        a = b.sigmoid_mul("attn_gated", a, gate, layer=il)
    return b.matmul("attn_output", a, blk + "attn_output.weight",
                    bias=blk + "attn_output.bias" if hp.has_out_bias else None, layer=il)


def short_conv(b: GraphBuilder, ctx: Layer, il: int, x: int) -> int:
    """LFM2's gated short convolution of layer il on the normed input x: B | C | x projected
    at once, the convolution over the sequence's carried state (`ir.ShortConv`), the output
    projection."""
    hp, blk = ctx.hp, f"blk.{il}."
    bcx = b.matmul("shortconv_in", x, blk + "shortconv.in_proj.weight", layer=il)
    y = b.short_conv(bcx, ctx.pos, ctx.seq, blk + "shortconv.conv.weight",
                     ir.ShortConv(il, hp.n_embd, hp.shortconv_l_cache))
    return b.matmul("shortconv_out", y, blk + "shortconv.out_proj.weight", layer=il)


def _qkv(b: GraphBuilder, hp: HParams, il: int, x: int,
         own_kv: bool = True) -> tuple[int, int, int]:
    """q, k and v of the normed input: three projections, or one fused `attn_qkv` projection
    whose output columns are q | k | v; q alone (k, v -1) where the layer reuses another's KV."""
    blk = f"blk.{il}."
    if not own_kv:
        return b.matmul("attn_q", x, blk + "attn_q.weight", layer=il), -1, -1
    if hp.layer_v_from_k(il):  # no attn_v: V is K's projection (Gemma 4's global layers)
        q, k = (b.matmul(f"attn_{w}", x, f"{blk}attn_{w}.weight", layer=il) for w in "qk")
        return q, k, k
    if not hp.qkv_fused:
        q, k, v = (b.matmul(f"attn_{w}", x, f"{blk}attn_{w}.weight",
                            bias=_bias(hp, f"{blk}attn_{w}"), layer=il) for w in "qkv")
        return q, k, v
    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    qkv = b.matmul("attn_qkv", x, blk + "attn_qkv.weight", bias=_bias(hp, blk + "attn_qkv"),
                   layer=il)
    return (b.slice("attn_q", qkv, 0, q_dim, layer=il),
            b.slice("attn_k", qkv, q_dim, kv_dim, layer=il),
            b.slice("attn_v", qkv, q_dim + kv_dim, kv_dim, layer=il))


def keep_tail(b: GraphBuilder, ctx: Layer, il: int, o: int, h: int) -> tuple[int, int]:
    """At a prefill's last layer, keep only the rows whose logits are wanted (of the attention
    output o and the residual h); elsewhere both pass unchanged."""
    if not ctx.prefill or il != ctx.hp.n_layer - 1:
        return o, h
    o = b.get_rows("tail_attn_out", o, ctx.tail, layer=il)  # [n_out, n_embd]
    h = b.get_rows("tail_resid", h, ctx.tail, layer=il)
    return o, h


def gated_ffn(b: GraphBuilder, ctx: Layer, il: int, x: int, *, act: str,
              kind: str = "") -> int:
    """down(act(gate(x)) * up(x)); act "silu" (SwiGLU) or "gelu" (GeGLU, tanh GELU); kind
    "_shexp": a MoE block's shared expert (`ffn_gate_shexp` ...). Where `ffn_up` holds both
    (Phi-3), gate and up are the first and second halves of its output."""
    blk = f"blk.{il}."
    gate_w, up_w = f"{blk}ffn_gate{kind}.weight", f"{blk}ffn_up{kind}.weight"
    biased = ctx.hp.has_ffn_bias and not kind  # Llama's mlp_bias (a shared expert has none)
    halves = ctx.hp.ffn_up_gate and not kind

    def bias(name: str) -> str | None:
        return f"{blk}{name}.bias" if biased else None

    if ctx.params.ctx.fuse_gate_up and ctx.params.gtype is GraphType.DECODE and not biased \
            and not halves:
        f = b.fused_gate_up(f"ffn_gate_up{kind}", x, gate_w, up_w, layer=il, act=act)
    else:
        if halves:
            both = b.matmul("ffn_up_gate", x, up_w, layer=il)
            n_ff = ctx.hp.n_ff
            gate = b.slice("ffn_gate", both, 0, n_ff, layer=il)
            up = b.slice("ffn_up", both, n_ff, n_ff, layer=il)
        else:
            gate = b.matmul(f"ffn_gate{kind}", x, gate_w, bias=bias("ffn_gate"), layer=il)
            up = b.matmul(f"ffn_up{kind}", x, up_w, bias=bias("ffn_up"), layer=il)
        # Written unfused; the fusion pass rewrites Mul(act(gate), up) when enabled.
        g = b.silu(f"ffn_silu{kind}", gate, layer=il) if act == "silu" else \
            b.gelu(f"ffn_gelu{kind}", gate, layer=il)
        f = b.mul(f"ffn_act{kind}", g, up, layer=il)
    return b.matmul(f"ffn_down{kind}", f, f"{blk}ffn_down{kind}.weight",
                    bias=bias("ffn_down"), layer=il)


def moe_ffn(b: GraphBuilder, ctx: Layer, il: int, x: int) -> int:
    """A mixture-of-experts FFN on the normed input x: the router's logits, the routed experts
    (`ir.Moe`), plus the shared expert gated by sigmoid(x . w) where the model has one."""
    hp, blk = ctx.hp, f"blk.{il}."
    logits = b.matmul("ffn_moe_logits", x, blk + "ffn_gate_inp.weight",
                      bias=blk + "ffn_gate_inp.bias" if hp.moe_bias else None, layer=il)
    op = ir.Moe(il, hp.n_expert, hp.n_expert_used, hp.expert_norm, act=hp.moe_act,
                gating=hp.moe_gating, biased=hp.moe_bias)
    kinds = ("weight", "bias") if hp.moe_bias else ("weight",)
    weights = tuple(f"{blk}ffn_{w}_exps.{kind}" for kind in kinds for w in ("gate", "up", "down"))
    y = b.moe("ffn_moe", x, logits, weights, op)
    if not hp.n_ff_shexp:
        return y
    s = gated_ffn(b, ctx, il, x, act="silu", kind="_shexp")
    s = b.sigmoid_gate("ffn_shexp_gated", s, x, blk + "ffn_gate_inp_shexp.weight", layer=il)
    return b.add("ffn_moe_out", y, s, layer=il)


def _rope(hp: HParams, il: int, n_head: int) -> ir.Rope:
    return ir.Rope(hp.rope_style, hp.layer_rope_base(il), n_head, hp.layer_head_dim(il),
                   hp.layer_rope_dim(il), freq_scale=hp.layer_rope_freq_scale(il),
                   yarn=hp.layer_rope_yarn(il), mrope="imrope" if hp.rope_sections else "",
                   sections=hp.rope_sections)


def _bias(hp: HParams, prefix: str) -> str | None:
    return prefix + ".bias" if hp.has_qkv_bias else None
