"""Qwen3-VL's vision tower and its mergers as builder calls, after llama.cpp's
`tools/mtmd/models/qwen3vl.cpp` (`clip.projector_type` qwen3vl_merger: a branch of
`models.siglip.build_vision`).

- Input: an image of gh x gw patches, its patch rows (channel, y, x) in merge-window order (each
  n_merge x n_merge window's patches together, row-major within it, windows row-major: the order
  of llama.cpp's spatial-merge permute and of transformers' pixel_values). The patch embedding is
  the Conv3d over the frame taken twice (temporal patch 2): one matmul by the sum of its two
  temporal kernels (`engine.vision.encoder` presents it so), with its bias.
- Plus the learned position table resized to the grid (bilinear, corners aligned) in the same
  order (`POS_EMBD`, computed by the encoder from the weight: data, not topology).
- Pre-norm blocks over all patches (full attention): LayerNorm, one biased q|k|v projection
  sliced apart, the 2-D rope (`ir.Rope(mrope="vision")`: the first quarter of each head's pairs
  at the patch's row, the next at its column, as ggml's GGML_ROPE_TYPE_VISION with positions
  y, x, y, x), attention scaled by head^-1/2, the biased output projection; LayerNorm, biased up,
  GELU (tanh form), biased down.
- After each layer `clip.vision.is_deepstack_layers` flags: the layer's output with each window's
  rows joined (n_merge^2 n_embd wide), LayerNorm (`v.deepstack.{il}.norm`), fc1, GELU, fc2.
- The merger: `v.post_ln` on each patch, windows joined, `mm.0`, GELU, `mm.2`.
Outputs: the merger's rows, then each deepstack merger's (the encoder joins them column-wise:
the text model's [main | deepstack...] rows). GELU is the erf form in the mergers (transformers'
nn.GELU; llama.cpp's ggml_gelu is the tanh form there, 1.1e-4 of the largest feature apart on
the tiny test fixture) and the tanh form in the blocks (gelu_pytorch_tanh in both).
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.gguf.clip import ClipParams
from minfer.graph import ir
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph, InputKind

PATCH_EMBD = "v.patch_embd.weight"
POS_TABLE = "v.position_embd.weight"


def build_qwen3vl_vision(cp: ClipParams, weight_shapes: Mapping[str, tuple[int, ...]],
                         n_patches: int) -> ComputeGraph:
    b = GraphBuilder(weight_shapes)
    n, m2 = n_patches, cp.n_merge ** 2
    pixels = b.input_rows(InputKind.PIXELS, n, 3 * cp.patch_size ** 2)
    pos_embd = b.input_rows(InputKind.POS_EMBD, n, cp.n_embd)
    rope_pos = b.input(InputKind.ROPE_POS, 4 * n)
    start = b.input(InputKind.SEQ_START, n)
    end = b.input(InputKind.SEQ_END, n)
    h = b.matmul("patch_embd", pixels, PATCH_EMBD, bias="v.patch_embd.bias")
    h = b.add("pos_embd", h, pos_embd)
    deep: list[int] = []
    for il in range(cp.n_layer):
        h = _block(b, cp, il, h, rope_pos, start, end)
        if il in cp.deepstack:
            blk = f"v.deepstack.{il}."
            f = b.join_rows(f"deepstack_join.{il}", h, m2)
            f = b.layer_norm("deepstack_norm", f, blk + "norm.weight", blk + "norm.bias", cp.eps,
                             layer=il)
            deep.append(_mlp(b, f, blk + "fc1", blk + "fc2", il, "deepstack"))
    h = b.layer_norm("post_ln", h, "v.post_ln.weight", "v.post_ln.bias", cp.eps)
    h = b.join_rows("merge", h, m2)
    b.output(_mlp(b, h, "mm.0", "mm.2", -1, "merger"))
    for d in deep:
        b.output(d)
    return b.graph


def _mlp(b: GraphBuilder, x: int, fc1: str, fc2: str, il: int, name: str) -> int:
    x = b.matmul(f"{name}_fc1", x, fc1 + ".weight", bias=fc1 + ".bias", layer=il)
    x = b.gelu_erf(f"{name}_gelu", x, layer=il)
    return b.matmul(f"{name}_fc2", x, fc2 + ".weight", bias=fc2 + ".bias", layer=il)


def _block(b: GraphBuilder, cp: ClipParams, il: int, h: int, rope_pos: int, start: int,
           end: int) -> int:
    blk, d, hd = f"v.blk.{il}.", cp.n_embd, cp.head_dim

    def proj(name: str, x: int, w: str) -> int:
        return b.matmul(name, x, f"{blk}{w}.weight", bias=f"{blk}{w}.bias", layer=il)

    x = b.layer_norm("ln1", h, blk + "ln1.weight", blk + "ln1.bias", cp.eps, layer=il)
    qkv = proj("attn_qkv", x, "attn_qkv")
    q, k, v = (b.slice(f"attn_{s}", qkv, i * d, d, layer=il) for i, s in enumerate("qkv"))
    rope = ir.Rope("neox", 10000.0, cp.n_head, hd, hd, mrope="vision")
    q = b.rope("rope_q", q, rope_pos, rope, layer=il)
    k = b.rope("rope_k", k, rope_pos, rope, layer=il)
    a = b.seq_attn(q, k, v, start, end, ir.SeqAttn(il, cp.n_head, cp.n_head, hd, hd ** -0.5))
    h = b.add("attn_resid", h, proj("attn_out", a, "attn_out"), layer=il)
    x = b.layer_norm("ln2", h, blk + "ln2.weight", blk + "ln2.bias", cp.eps, layer=il)
    f = b.gelu("ffn_gelu", proj("ffn_up", x, "ffn_up"), layer=il)
    return b.add("ffn_resid", h, proj("ffn_down", f, "ffn_down"), layer=il)
