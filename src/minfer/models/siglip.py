"""The SigLIP vision tower and its projectors (Gemma 3's, Idefics3's) as builder calls, after
llama.cpp's `tools/mtmd/models/siglip.cpp` and `clip_graph::build_vit`: one tower, the projector
a branch on `clip.projector_type` (`build_vision` also routes Qwen3-VL's `qwen3vl_merger` to its
own tower, `models.qwen3vl_vision`).

- Input: one image's patches unfolded to rows of 3 * patch^2 (channel, y, x), in row-major
  patch order; the patch embedding (a stride-patch convolution) is a matmul over them, with its
  bias, then the learned position embedding of each patch (positions 0..n_patches-1).
- Pre-norm blocks over all patches of the image at once (full bidirectional attention: the
  encoder attention BERT uses, bounds as data): h += out(attn(LN1(h))); h += down(gelu(up(
  LN2(h)))), every projection biased, GELU the tanh form (SigLIP's gelu_pytorch_tanh); then
  `v.post_ln`.
- Gemma 3's projector: the patch grid average-pooled n_merge x n_merge (the rows reordered so
  that each window is contiguous, `POOL_ROWS`, then a mean per window: both data), RMSNorm
  times `mm.soft_emb_norm`, and `mm.input_projection` to the text model's width.
- Idefics3's: pixel shuffle (`build_patch_merge_permute`: the same window order, each window's
  n_merge^2 rows joined into one, row-major within the window) and `mm.model.fc` (no bias).
- LFM2-VL's (`lfm2`, SigLIP2 NaFlex): an image of any n_patches (its grid is the encoder's),
  the learned position table resized to that grid given as data (`POS_EMBD`, computed by the
  encoder), the same pixel unshuffle, then LayerNorm (eps 1e-5, ggml_norm's, by
  `mm.input_norm`; none where the file has no such norm, as clip.cpp), `mm.1`, GELU
  (ggml_gelu's tanh form through its f16 table; transformers' has the erf form), `mm.2`.
- ggml's numbers: a matmul whose weight `f16_inputs` names reads its input rounded to f16
  (`RoundF16`), as ggml's mul_mat does for an f16 weight; so does the patch embedding, which
  clip.cpp runs as ggml_conv_2d over an f16 im2col (its kernel rounded too: `encoder`).
Older converters wrote SigLIP's fc1 / fc2 as ffn_down / ffn_up; as clip.cpp does, whichever
reads the tower's width is the up projection.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from minfer.gguf.clip import LFM2, QWEN3VL, ClipParams
from minfer.graph import ir
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import ComputeGraph, InputKind
from minfer.models.qwen3vl_vision import PATCH_EMBD, build_qwen3vl_vision

__all__ = ["INPUT_PROJ", "PATCH_EMBD", "build_vision"]
INPUT_PROJ = "mm.input_projection.weight"
LFM2_NORM_EPS = 1e-5  # clip.cpp's ggml_norm before LFM2-VL's projector (nn.LayerNorm's)


class _Builder(GraphBuilder):
    """A GraphBuilder whose matmuls round their input to f16 where ggml would."""

    def __init__(self, weight_shapes: Mapping[str, tuple[int, ...]],
                 f16_inputs: Collection[str]) -> None:
        super().__init__(weight_shapes)
        self.f16_inputs = f16_inputs
        self._rounded: dict[int, int] = {}  # node -> its f16-rounded copy (q, k, v share one)

    def matmul(self, name: str, x: int, weight: str, *, bias: str | None = None,
               layer: int = -1, rows: int = 0) -> int:
        if weight in self.f16_inputs:
            if x not in self._rounded:
                self._rounded[x] = self.round_f16(f"{name}_f16", x)
            x = self._rounded[x]
        return super().matmul(name, x, weight, bias=bias, layer=layer, rows=rows)


def build_vision(cp: ClipParams, weight_shapes: Mapping[str, tuple[int, ...]],
                 f16_inputs: Collection[str] = (), n_patches: int = 0) -> ComputeGraph:
    """The tower over one image (tile) of `image_size` (a dynamic-size family: of n_patches),
    then the file's projector; the matmuls over the weights `f16_inputs` names read their
    inputs rounded to f16 (the SigLIP towers; Qwen3-VL's reads them as stored)."""
    if cp.projector == QWEN3VL:
        return build_qwen3vl_vision(cp, weight_shapes, n_patches)
    b = _Builder(weight_shapes, f16_inputs)
    dynamic = cp.projector == LFM2
    n = n_patches if dynamic else cp.n_patches
    pixels = b.input_rows(InputKind.PIXELS, n, 3 * cp.patch_size ** 2)
    if dynamic:
        pos = b.input_rows(InputKind.POS_EMBD, n, cp.n_embd)
    else:
        pos = b.input(InputKind.POSITIONS, n)
    start = b.input(InputKind.SEQ_START, n)
    end = b.input(InputKind.SEQ_END, n)
    order = b.input(InputKind.POOL_ROWS, n)
    pooled = cp.projector == "gemma3"
    if pooled:  # inputs first: an input's buffer is live from the start (all filled at once)
        out_start = b.input(InputKind.OUT_START, cp.n_image_tokens)
        out_end = b.input(InputKind.OUT_END, cp.n_image_tokens)
    h = b.matmul("patch_embd", pixels, PATCH_EMBD, bias="v.patch_embd.bias")
    if not dynamic:
        pos = b.weight_rows("pos_rows", "v.position_embd.weight", pos)
    h = b.add("pos_embd", h, pos)
    for il in range(cp.n_layer):
        h = _block(b, cp, il, h, start, end)
    h = b.layer_norm("post_ln", h, "v.post_ln.weight", "v.post_ln.bias", cp.eps)
    h = b.get_rows("merge_order", h, order)  # each n_merge x n_merge window's rows together
    if not pooled:  # idefics3, lfm2
        h = b.join_rows("pixel_shuffle", h, cp.n_merge ** 2)
        b.output(_lfm2_projector(b, h, weight_shapes) if dynamic
                 else b.matmul("mm_fc", h, "mm.model.fc.weight"))
        return b.graph
    h = b.pool("pool", h, out_start, out_end, "mean")
    h = b.rms_norm("soft_emb_norm", h, "mm.soft_emb_norm.weight", cp.eps)
    b.output(b.matmul("input_projection", h, INPUT_PROJ))
    return b.graph


def _lfm2_projector(b: GraphBuilder, h: int, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """LayerNorm (where the file has mm.input_norm: clip.cpp normalizes only then), mm.1,
    GELU, mm.2 (clip.cpp's LFM2 branch)."""
    norm_w, norm_b = "mm.input_norm.weight", "mm.input_norm.bias"
    if norm_w in shapes or norm_b in shapes:
        h = b.layer_norm("mm_input_norm", h, norm_w, norm_b, LFM2_NORM_EPS)
    h = b.matmul("mm_1", h, "mm.1.weight", bias="mm.1.bias")
    h = b.gelu("mm_gelu", h)
    return b.matmul("mm_2", h, "mm.2.weight", bias="mm.2.bias")


def _block(b: GraphBuilder, cp: ClipParams, il: int, h: int, start: int, end: int) -> int:
    blk = f"v.blk.{il}."

    def proj(name: str, x: int, w: str) -> int:
        return b.matmul(name, x, f"{blk}{w}.weight", bias=f"{blk}{w}.bias", layer=il)

    x = b.layer_norm("ln1", h, blk + "ln1.weight", blk + "ln1.bias", cp.eps, layer=il)
    q, k, v = proj("attn_q", x, "attn_q"), proj("attn_k", x, "attn_k"), proj("attn_v", x, "attn_v")
    a = b.seq_attn(q, k, v, start, end, ir.SeqAttn(il, cp.n_head, cp.n_head, cp.head_dim,
                                                   cp.head_dim ** -0.5))
    h = b.add("attn_resid", h, proj("attn_out", a, "attn_out"), layer=il)
    x = b.layer_norm("ln2", h, blk + "ln2.weight", blk + "ln2.bias", cp.eps, layer=il)
    up, down = "ffn_up", "ffn_down"
    if b.weight_shape(f"{blk}ffn_down.weight")[0] == cp.n_embd:  # fc1 / fc2 swapped
        up, down = down, up
    f = b.gelu("ffn_gelu", proj("ffn_up", x, up), layer=il)
    return b.add("ffn_resid", h, proj("ffn_down", f, down), layer=il)

