"""The BERT encoder (all-MiniLM, bge, e5, cross-encoders) as builder calls, after llama.cpp's
`src/models/bert.cpp`.

- Inputs: token ids, positions (from 0 in each input), token types (0 for sentence A, 1 for B),
  and each token's sequence bounds in the batch; several inputs are packed into one forward and
  attend only within themselves (`SeqAttn`: no KV cache, no causal mask).
- Embeddings: token + token type + learned position, then LayerNorm.
- Post-norm blocks: h = LN(h + attn(h)); h = LN(h + down(gelu(up(h)))), every projection with
  its bias, the exact (erf) GELU.
- Output by the context's pooling: every row ("none"), one row per input ("mean", "cls",
  "last"), or the classifier head's scores of the [CLS] row ("rank": dense + tanh when the file
  has `cls.weight`, then `cls.output`).
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.errors import GraphError
from minfer.gguf.hparams import HParams
from minfer.graph import ir
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph, InputKind
from minfer.graph.params import GraphParams


def build_bert(hp: HParams, params: GraphParams,
               weight_shapes: Mapping[str, tuple[int, ...]]) -> ComputeGraph:
    pooling = params.ctx.pooling
    if pooling in ("", "none") and params.n_out != params.n_tokens:
        raise GraphError(f"an unpooled encoder returns every row: n_out={params.n_out} for "
                         f"{params.n_tokens} tokens")
    if pooling == "rank" and not hp.n_cls_out:
        raise GraphError("rank pooling needs a classifier head (cls.output), which this model "
                         "lacks")
    b = GraphBuilder(weight_shapes)
    nt = params.n_tokens
    ids = b.input(InputKind.TOKEN_IDS, nt)
    pos = b.input(InputKind.POSITIONS, nt)
    types = b.input(InputKind.TOKEN_TYPES, nt) if hp.n_token_types else -1
    start = b.input(InputKind.SEQ_START, nt)
    end = b.input(InputKind.SEQ_END, nt)
    pooled = pooling not in ("", "none")
    if pooled:
        out_start = b.input(InputKind.OUT_START, params.n_out)
        out_end = b.input(InputKind.OUT_END, params.n_out)
    h = b.embedding("token_embd.weight", ids)
    if types >= 0:
        h = b.add("inp_types", h, b.weight_rows("type_embd", "token_types.weight", types))
    h = b.add("inp_pos", h, b.weight_rows("pos_embd", "position_embd.weight", pos))
    h = b.layer_norm("inp_norm", h, "token_embd_norm.weight", "token_embd_norm.bias", hp.rms_eps)
    for il in range(hp.n_layer):
        h = _block(b, hp, il, h, start, end)
    if not pooled:
        b.output(h)
        return b.graph
    kind = "cls" if pooling == "rank" else pooling
    x = b.pool("pooled", h, out_start, out_end, kind)
    if pooling == "rank":
        if hp.has_cls_dense:
            x = b.matmul("cls", x, "cls.weight", bias="cls.bias")
            x = b.tanh("cls_tanh", x)
        bias = "cls.output.bias" if "cls.output.bias" in weight_shapes else None
        x = b.matmul("cls_out", x, "cls.output.weight", bias=bias)
    b.output(x)
    return b.graph


def _block(b: GraphBuilder, hp: HParams, il: int, h: int, start: int, end: int) -> int:
    blk = f"blk.{il}."
    q = b.matmul("attn_q", h, blk + "attn_q.weight", bias=blk + "attn_q.bias", layer=il)
    k = b.matmul("attn_k", h, blk + "attn_k.weight", bias=blk + "attn_k.bias", layer=il)
    v = b.matmul("attn_v", h, blk + "attn_v.weight", bias=blk + "attn_v.bias", layer=il)
    a = b.seq_attn(q, k, v, start, end,
                   ir.SeqAttn(il, hp.n_head, hp.n_head_kv, hp.head_dim, hp.kq_scale))
    o = b.matmul("attn_output", a, blk + "attn_output.weight", bias=blk + "attn_output.bias",
                 layer=il)
    h = b.add("attn_resid", o, h, layer=il)
    h = b.layer_norm("attn_out_norm", h, blk + "attn_output_norm.weight",
                     blk + "attn_output_norm.bias", hp.rms_eps, layer=il)
    f = b.matmul("ffn_up", h, blk + "ffn_up.weight", bias=blk + "ffn_up.bias", layer=il)
    f = b.gelu_erf("ffn_gelu", f, layer=il)
    f = b.matmul("ffn_down", f, blk + "ffn_down.weight", bias=blk + "ffn_down.bias", layer=il)
    h = b.add("ffn_resid", f, h, layer=il)
    return b.layer_norm("layer_out_norm", h, blk + "layer_output_norm.weight",
                        blk + "layer_output_norm.bias", hp.rms_eps, layer=il)
