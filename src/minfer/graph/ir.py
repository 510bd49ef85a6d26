"""The graph IR: ops as value types, nodes, and the compute graph.

A forward pass is data. Every `Op` is a frozen dataclass that carries its full payload (eps, rope
base, layer, head counts), so two graphs compare node by node with `==` and a dump reads as the
forward pass itself. Nodes name the GGUF weights they read in `NodeMeta`; no node holds a pointer
to memory. Node ids equal list positions and sources always point backwards, so build order is a
topological order; `topo_order()` validates that instead of sorting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum

from minfer.errors import GraphError
from minfer.gguf.rope_scaling import NO_YARN, YarnRope


class DType(StrEnum):
    F32 = "f32"
    I32 = "i32"


class InputKind(StrEnum):
    """What an input leaf is filled with before every execution (data, never topology)."""

    TOKEN_IDS = "token_ids"  # [nt] token ids
    POSITIONS = "positions"  # [nt] RoPE position of each token (within its sequence)
    KV_CELLS = "kv_cells"  # [nt] KV cell each token's K/V row is written to
    KV_START = "kv_start"  # [nt] first KV cell the token's query may read
    KV_END = "kv_end"  # [nt] one past the last KV cell the token's query may read
    TAIL_IDS = "tail_ids"  # [n_out] rows kept after the last attention projection
    TOKEN_TYPES = "token_types"  # [nt] BERT's segment of each token (0: sentence A, 1: B)
    SEQ_START = "seq_start"  # [nt] first batch row of the token's sequence (encoder attention)
    SEQ_END = "seq_end"  # [nt] one past the last batch row of the token's sequence
    OUT_START = "out_start"  # [n_out] first batch row pooled into each output row
    OUT_END = "out_end"  # [n_out] one past the last batch row pooled into each output row
    STATE_SEQ = "state_seq"  # [nt] the recurrent-state row (sequence) each token reads and writes
    PIXELS = "pixels"  # [n_patches, 3 * patch^2] f32: an image's patches unfolded (c, y, x)
    POOL_ROWS = "pool_rows"  # [n_patches] batch rows in pooling order (each window contiguous)
    EMBD_IDS = "embd_ids"  # [nt] row of EMBD that replaces the token's embedding, -1: none
    EMBD = "embd"  # [nt, n_embd] f32: given embedding rows (an image's), the first ones used
    HIDDEN = "hidden"  # [nt, n_embd] f32: each row's hidden state from the target (an MTP head)
    ROPE_POS = "rope_pos"  # [4 nt] a multi-position rope's t / h / w / e positions, section-major
    POS_EMBD = "pos_embd"  # [n_patches, n_embd] f32: learned positions resized to the image's grid


class Op:
    """Marker base class; concrete ops are frozen dataclasses below."""

    @property
    def kind(self) -> str:
        return type(self).__name__

    def payload(self) -> dict[str, object]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Input(Op):
    input_kind: InputKind


@dataclass(frozen=True)
class GetRows(Op):
    """Rows of a weight table (embedding) or of an activation (tail selection)."""


@dataclass(frozen=True)
class ReplaceRows(Op):
    """x with row t replaced by rows[ids[t]] where ids[t] >= 0 (sources x, ids, rows): given
    embedding rows (an image's) in place of the token embedding at their positions."""


@dataclass(frozen=True)
class RmsNorm(Op):
    """RMSNorm of each row times a weight. quant_for: the weight of the first projection
    reading it, whose quantized activation the norm's step makes too (`fuse_norm_quant`)."""

    eps: float
    quant_for: str = ""


@dataclass(frozen=True)
class AddRmsNorm(Op):
    """RmsNorm(a + b) where the sum is read on (the residual stream): sources (a, b, total),
    the sum written into `total`'s buffer (a `Written` node), the normalised rows into its
    own; the fusion pass writes it in place of RmsNorm(Add(a, b)) (`fuse_add_norm`). quant_for
    as RmsNorm's."""

    eps: float
    quant_for: str = ""


@dataclass(frozen=True)
class Written(Op):
    """A buffer a later fused node writes (`AddRmsNorm`'s sum, a rope-storing KvcacheStore's
    q): no work of its own, its readers all after that node. What it replaced stays recorded
    in its name."""


@dataclass(frozen=True)
class LayerNorm(Op):
    """(x - mean) / sqrt(var + eps) * weight + bias over each row (BERT); weight and bias named
    in the node's meta."""

    eps: float


@dataclass(frozen=True)
class MatMul(Op):
    """y = x @ W.T (+ bias); W and bias named in the node's meta. rows > 0: only W's first
    `rows` output rows (a draft model's logits over the vocabulary's first ids). fused_bias:
    the bias added by the projection's kernel to the rows each thread computed (`fuse_bias`)."""

    rows: int = 0
    fused_bias: bool = False


@dataclass(frozen=True)
class Slice(Op):
    """Columns [start, start + width) of each row, copied out: one part of a fused
    projection's output (Phi-3's q | k | v, its gate | up), as llama.cpp's ggml_view_2d of
    it. With n_head > 1 the row is n_head equal heads and each gives its columns [start, start
    + width), concatenated (Qwen3.5's per-head query | gate, a ggml_view_3d)."""

    start: int
    width: int
    n_head: int = 1


@dataclass(frozen=True)
class Concat(Op):
    """Each row of the first source, then the same row of the second: [n, a] and [n, b] into
    [n, a + b] (an MTP head's embedding | hidden, llama.cpp's ggml_concat on dim 0)."""


@dataclass(frozen=True)
class Add(Op):
    pass


@dataclass(frozen=True)
class Mul(Op):
    pass


@dataclass(frozen=True)
class Silu(Op):
    pass


@dataclass(frozen=True)
class SwiGLU(Op):
    """silu(gate) * up; the fusion pass writes it in place of Mul(Silu(gate), up)."""


@dataclass(frozen=True)
class Gelu(Op):
    """GELU, tanh approximation (Gemma's FFN gate)."""


@dataclass(frozen=True)
class GeluErf(Op):
    """GELU as 0.5x(1 + erf(x / sqrt 2)), the exact form (BERT's FFN)."""


@dataclass(frozen=True)
class Tanh(Op):
    """tanh (a BERT classifier head's activation)."""


@dataclass(frozen=True)
class Softmax(Op):
    """Softmax over each row (ggml_soft_max without mask or scale: a decoder reranker's
    yes / no head, Qwen3-Reranker's as llama.cpp computes it)."""


@dataclass(frozen=True)
class GeGLU(Op):
    """gelu(gate) * up; the fusion pass writes it in place of Mul(Gelu(gate), up)."""


@dataclass(frozen=True)
class Scale(Op):
    """x * factor (Gemma scales its embeddings by sqrt(n_embd))."""

    factor: float


@dataclass(frozen=True)
class Softcap(Op):
    """cap * tanh(x / cap): Gemma-style soft-capping of the final logits."""

    cap: float


@dataclass(frozen=True)
class Rope(Op):
    """Rotary embedding. style "neox" rotates pairs (i, i + rope_dim/2) (Qwen, Gemma), "norm"
    adjacent pairs (2i, 2i+1) (Llama). theta_i = freq_scale * pos * base^(-2i/rope_dim) / f_i,
    with f_i from the node's weight (Llama 3.1's `rope_freqs`) when it names one, else 1.
    With YaRN (`yarn.ext_factor` != 0) each pair blends that angle with the unscaled one along
    the ramp from corr_low to corr_high, and cos / sin are multiplied by mscale
    (`minfer.gguf.rope_scaling`). With `mrope` ("imrope": Qwen3-VL's text, `sections` its
    t / h / w / e pairs; "vision": a 2-D rope over patches) the positions are four per row,
    section-major, each pair taking one of them (ggml's `ggml_rope_multi`,
    `kernels.elementwise.rope.mrope_pairs`)."""

    style: str  # "neox" | "norm"
    base: float
    n_head: int
    head_dim: int
    rope_dim: int
    freq_scale: float = 1.0
    yarn: YarnRope = NO_YARN
    mrope: str = ""  # "" (one position per row) | "imrope" | "vision"
    sections: tuple[int, ...] = ()


@dataclass(frozen=True)
class QkNorm(Op):
    """Per-head RMSNorm of Q or K (Qwen3), applied before RoPE."""

    eps: float
    n_head: int
    head_dim: int


@dataclass(frozen=True)
class KvcacheStore(Op):
    """Writes K and V rows into the layer's persistent KV region at the cells input (head_dim
    sets how a quantized region rotates its rows, as llama.cpp does). With rope_q / rope_k
    (`fuse_rope_store`) it ropes them too: sources (k, v, cells, q, positions, q_out), k roped
    by rope_k into the region, q by rope_q into q_out's buffer (a `Written` node), the rope
    factors (if any) named in the meta."""

    layer: int
    head_dim: int
    rope_q: Rope | None = None
    rope_k: Rope | None = None


@dataclass(frozen=True)
class KvcacheLoad(Op):
    """A view of the layer's persistent KV region; its source orders it after the store."""

    layer: int


@dataclass(frozen=True)
class ShortConv(Op):
    """LFM2's gated short convolution with carried state, as llama.cpp computes it. Source
    `bcx` [nt, 3 * n_embd] is B | C | x; per channel c, token t: bx = B * x; the output is
    C * sum_i window[i] * taps[c, i] over the window of the sequence's last `l_cache - 1` bx
    (its persistent state, in the layer's state region) then this bx, summed in f32 from
    i = 0 (oldest) up; the state then drops its oldest bx and keeps this one. A token at
    position 0 starts from a zero state. Sources: bcx, positions, state_seq (each token's
    sequence: its state row); the taps named in the meta. Rows are taken in batch order, each
    reading and writing only its own sequence's state."""

    layer: int
    n_embd: int
    l_cache: int


@dataclass(frozen=True)
class SsmConv(Op):
    """Qwen3.5's causal depthwise convolution with carried state, then SiLU (ggml's
    `ssm_conv` then `silu`): per channel c, token t, silu(sum_i window[i] * taps[c, i]) over the
    sequence's last `d_conv - 1` inputs (its persistent state, the layer's conv-state region)
    then this input, summed in f32 from i = 0 (oldest) up; the state then drops its oldest
    input and keeps this one. A token at position 0 starts from a zero state. Sources: x [nt,
    channels], positions, state_seq; the taps [d_conv, channels] named in the meta."""

    layer: int
    channels: int
    d_conv: int


@dataclass(frozen=True)
class DeltaNet(Op):
    """Qwen3.5's gated delta rule with a per-sequence f32 state matrix per value head (the
    layer's second state region), as ggml's `gated_delta_net` with a scalar gate: q and k of
    each key head L2-normalised (eps), value head h reading key head h % n_k_heads; g =
    softplus(alpha + dt_bias) * a, beta = sigmoid(beta_raw); S *= exp(g); S += k ((v - S^T k)
    * beta)^T; out = S^T q / sqrt(head_dim). A token at position 0 starts from a zero state.
    Sources: qkv [nt, (2 n_k_heads + n_v_heads) head_dim] = q | k | v, alpha, beta_raw [nt,
    n_v_heads], positions, state_seq; dt_bias and a named in the meta. Rows are taken in batch
    order, each reading and writing only its own sequence's state."""

    layer: int
    n_k_heads: int
    n_v_heads: int
    head_dim: int
    eps: float


@dataclass(frozen=True)
class SigmoidMul(Op):
    """x * sigmoid(g) elementwise (Qwen3.5's gated attention: the output times the sigmoid of
    the q projection's gate half). Sources: x, g."""


@dataclass(frozen=True)
class Attn(Op):
    """Query t reads cells [max(kv_start[t], kv_end[t] - window), kv_end[t]) (window 0: the
    whole [kv_start, kv_end) range; a sliding-window layer's window is part of its op, its
    bounds stay data). Scores are scale * q.k, soft-capped to softcap * tanh(s / softcap) when
    softcap > 0, then soft-maxed. With `sinks`, each head's learned logit (the [n_head] vector
    named in the meta, gpt-oss's `attn_sinks`) joins the softmax's max and sum as a cell
    without a value (ggml_soft_max_ext's sinks): the weights sum to less than 1. The cells are
    layer's own, or kv_layer's where that is set (Gemma 4's shared-KV layers read an earlier
    layer's). quant_for: the output projection's weight (`fusion.fuse_attn_quant`): the CPU
    backend then also quantizes the output as that weight's kernel reads it, in the same
    step."""

    layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    scale: float
    window: int = 0
    softcap: float = 0.0
    sinks: bool = False
    kv_layer: int = -1
    quant_for: str = ""

    @property
    def cache_layer(self) -> int:
        """The layer whose KV region the query reads."""
        return self.layer if self.kv_layer < 0 else self.kv_layer


@dataclass(frozen=True)
class SeqAttn(Op):
    """Attention without a KV cache (an encoder's): query t reads the keys and values of batch
    rows [seq_start[t], seq_end[t]), its whole sequence; the bounds are data, so packing inputs
    together changes no topology. Sources: q, k, v, seq_start, seq_end."""

    layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    scale: float


@dataclass(frozen=True)
class Pool(Op):
    """One row per sequence from batch rows [out_start[i], out_end[i]): their mean, the first
    ([CLS]) or the last. Sources: x, out_start, out_end."""

    mode: str  # "mean" | "cls" | "last"


@dataclass(frozen=True)
class JoinRows(Op):
    """Each `group` consecutive rows joined into one row, [n, w] -> [n / group, w * group] (a
    reshape of the row-major data: Idefics3's pixel shuffle after its window-order rows)."""

    group: int


@dataclass(frozen=True)
class RoundF16(Op):
    """Each value rounded to the nearest f16 (kept f32): the input ggml's mul_mat reads where
    its weight is f16 (and ggml_conv_2d's f16 im2col), as a vision encoder mirrors clip.cpp."""


@dataclass(frozen=True)
class FusedGateUp(Op):
    """Decode fusion: act(x @ Wg.T) * (x @ Wu.T) in one pass over one quantized input.
    quant_for: the down projection's weight (`fusion.fuse_gate_up_quant`): the CPU backend
    then also quantizes the result as that weight's kernel reads it, in the same step."""

    act: str = "silu"  # "silu" | "gelu"
    quant_for: str = ""


@dataclass(frozen=True)
class Moe(Op):
    """A mixture-of-experts FFN (llama.cpp's `build_moe_ffn` with soft-max gating): each row's
    router logits are soft-maxed, its `n_used` most probable experts chosen (ties: the lower
    expert id), their probabilities renormalised to sum 1 when `norm`, and the row's output is
    sum_s p_s * down_e(act(gate_e(x)) * up_e(x)) over its experts e in that order. `gating`
    "softmax_weight" (gpt-oss) chooses the `n_used` largest logits and soft-maxes those among
    themselves instead. act "silu" (SwiGLU), "gelu" (GeGLU) or "swiglu_oai" (gpt-oss's clamped
    SwiGLU: g = min(gate, 7), u = clamp(up, -7, 7), g * sigmoid(1.702 g) * (u + 1)). With
    `biased`, each expert's gate / up / down outputs add its own bias row (the stacked biases
    named in the meta after the weights). Sources: x, the router logits; the experts' stacked
    gate / up / down weights named in the meta. A row's routing and result depend on that row
    alone."""

    layer: int
    n_expert: int
    n_used: int
    norm: bool
    act: str = "silu"
    gating: str = "softmax"
    biased: bool = False
    # Gemma 4: one stacked tensor holds [gate | up] (the meta names it as both), and each
    # expert's output is scaled by its entry of a 4th weight, [n_expert]
    fused_gate_up: bool = False
    down_scale: bool = False


@dataclass(frozen=True)
class SigmoidGate(Op):
    """x * sigmoid(h . w) per row: a shared expert's output gated by its input h (Qwen2-MoE);
    the gate's weight vector w named in the meta. Sources: x, h."""


@dataclass(frozen=True)
class NodeMeta:
    """Where a node sits in the model, and which GGUF tensors it reads (by name)."""

    role: str = ""
    layer: int = -1
    weights: tuple[str, ...] = ()


@dataclass
class Node:
    id: int
    name: str
    op: Op
    srcs: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: DType = DType.F32
    meta: NodeMeta = field(default_factory=NodeMeta)
    backend: str | None = None  # set by backend assignment, never by the builder

    def structure(self) -> tuple[object, ...]:
        """Everything that defines this node, for node-by-node comparison."""
        return (self.id, self.name, self.op, self.srcs, self.shape, self.dtype, self.meta)


@dataclass
class ComputeGraph:
    nodes: list[Node] = field(default_factory=list)
    inputs: dict[InputKind, int] = field(default_factory=dict)
    outputs: list[int] = field(default_factory=list)
    uid: int = -1  # assigned when the graph enters the cache

    def topo_order(self) -> list[int]:
        """Validate ids, sources and acyclicity; return the (build) execution order."""
        for index, node in enumerate(self.nodes):
            if node.id != index:
                raise GraphError(f"node {node.name!r} has id {node.id} at position {index}")
            for src in node.srcs:
                if not 0 <= src < len(self.nodes):
                    raise GraphError(f"node {node.id} ({node.name}) reads dangling id {src}")
                if src >= node.id:
                    raise GraphError(
                        f"node {node.id} ({node.name}) reads node {src}: cycle or forward edge"
                    )
        for out in self.outputs:
            if not 0 <= out < len(self.nodes):
                raise GraphError(f"output id {out} does not exist")
        return list(range(len(self.nodes)))

    def consumers(self) -> list[list[int]]:
        users: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for src in node.srcs:
                users[src].append(node.id)
        return users

    def structure(self) -> list[tuple[object, ...]]:
        return [node.structure() for node in self.nodes]

    def by_name(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)
