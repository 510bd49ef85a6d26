"""The graph builder: a pure, append-only factory of nodes.

Each method checks its sources' shapes, computes the output shape, appends one node and returns
its id. Nothing is computed, allocated or touched on a device: weights are known only by name and
shape (GGUF `ne` order). Because a node can only reference ids that already exist, the node list
is a topological order by construction.
"""

from __future__ import annotations

from collections.abc import Mapping

from minfer.errors import GraphError
from minfer.graph import ir
from minfer.graph.ir import ComputeGraph, DType, InputKind, Node, NodeMeta


class GraphBuilder:
    def __init__(self, weight_shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._weights = weight_shapes
        self.graph = ComputeGraph()

    # -- plumbing ---------------------------------------------------------------------------
    def _append(
        self,
        name: str,
        op: ir.Op,
        srcs: tuple[int, ...],
        shape: tuple[int, ...],
        *,
        dtype: DType = DType.F32,
        meta: NodeMeta | None = None,
    ) -> int:
        nodes = self.graph.nodes
        for src in srcs:
            if not 0 <= src < len(nodes):
                raise GraphError(f"{name}: source {src} does not exist yet")
        node_id = len(nodes)
        nodes.append(Node(node_id, name, op, srcs, shape, dtype, meta or NodeMeta()))
        return node_id

    def shape(self, node_id: int) -> tuple[int, ...]:
        if not 0 <= node_id < len(self.graph.nodes):
            raise GraphError(f"node {node_id} does not exist yet")
        return self.graph.nodes[node_id].shape

    def weight_shape(self, name: str) -> tuple[int, ...]:
        """A weight's shape (GGUF ne order)."""
        return self._weight(name)

    def _weight(self, name: str) -> tuple[int, ...]:
        try:
            return self._weights[name]
        except KeyError:
            raise GraphError(f"weight {name!r} is not in the model") from None

    def _same_shape(self, name: str, a: int, b: int) -> tuple[int, ...]:
        if self.shape(a) != self.shape(b):
            raise GraphError(f"{name}: shapes {self.shape(a)} and {self.shape(b)} differ")
        return self.shape(a)

    # -- leaves -----------------------------------------------------------------------------
    def input(self, kind: InputKind, n: int) -> int:
        node_id = self._append(kind.value, ir.Input(kind), (), (n,), dtype=DType.I32)
        self.graph.inputs[kind] = node_id
        return node_id

    def input_rows(self, kind: InputKind, n: int, width: int) -> int:
        """An f32 input of n rows of `width` (an image's unfolded patches)."""
        node_id = self._append(kind.value, ir.Input(kind), (), (n, width))
        self.graph.inputs[kind] = node_id
        return node_id

    def output(self, node_id: int) -> None:
        self.graph.outputs.append(node_id)

    # -- ops --------------------------------------------------------------------------------
    def embedding(self, weight: str, ids: int) -> int:
        return self.weight_rows("token_embd", weight, ids)

    def weight_rows(self, name: str, weight: str, ids: int) -> int:
        """Rows `ids` of a weight table (position or token-type embeddings)."""
        n_embd = self._weight(weight)[0]
        meta = NodeMeta(role=name, weights=(weight,))
        return self._append(name, ir.GetRows(), (ids,), (self.shape(ids)[0], n_embd), meta=meta)

    def get_rows(self, name: str, x: int, ids: int, *, layer: int = -1) -> int:
        shape = (self.shape(ids)[0], *self.shape(x)[1:])
        return self._append(name, ir.GetRows(), (x, ids), shape,
                            meta=NodeMeta(role=name, layer=layer))

    def replace_rows(self, name: str, x: int, ids: int, rows: int) -> int:
        if self.shape(rows)[1:] != self.shape(x)[1:]:
            raise GraphError(f"{name}: rows {self.shape(rows)} do not fit {self.shape(x)}")
        return self._append(name, ir.ReplaceRows(), (x, ids, rows), self.shape(x),
                            meta=NodeMeta(role=name))

    def rms_norm(self, name: str, x: int, weight: str, eps: float, *, layer: int = -1) -> int:
        if self._weight(weight) != (self.shape(x)[-1],):
            raise GraphError(f"{name}: norm weight {weight} does not match width {self.shape(x)}")
        meta = NodeMeta(role=name, layer=layer, weights=(weight,))
        return self._append(name, ir.RmsNorm(eps), (x,), self.shape(x), meta=meta)

    def layer_norm(self, name: str, x: int, weight: str, bias: str, eps: float, *,
                   layer: int = -1) -> int:
        width = (self.shape(x)[-1],)
        if self._weight(weight) != width or self._weight(bias) != width:
            raise GraphError(f"{name}: norm {weight} / {bias} do not match width {width[0]}")
        meta = NodeMeta(role=name, layer=layer, weights=(weight, bias))
        return self._append(name, ir.LayerNorm(eps), (x,), self.shape(x), meta=meta)

    def matmul(self, name: str, x: int, weight: str, *, bias: str | None = None,
               layer: int = -1, rows: int = 0) -> int:
        n_in, n_out = self._weight(weight)[:2]
        if rows and not 0 < rows <= n_out:
            raise GraphError(f"{name}: {rows} rows asked of {weight}'s {n_out}")
        if rows and bias is not None:
            raise GraphError(f"{name}: a row-limited projection takes no bias")
        n_out = rows or n_out
        if self.shape(x)[-1] != n_in:
            raise GraphError(f"{name}: input width {self.shape(x)[-1]} != {weight} in {n_in}")
        weights = (weight,) if bias is None else (weight, bias)
        if bias is not None and self._weight(bias) != (n_out,):
            raise GraphError(f"{name}: bias {bias} does not match {n_out}")
        meta = NodeMeta(role=name, layer=layer, weights=weights)
        return self._append(name, ir.MatMul(rows), (x,), (self.shape(x)[0], n_out), meta=meta)

    def fused_gate_up(self, name: str, x: int, gate: str, up: str, *, layer: int,
                      act: str = "silu") -> int:
        n_in, n_ff = self._weight(gate)[:2]
        if self._weight(up)[:2] != (n_in, n_ff) or self.shape(x)[-1] != n_in:
            raise GraphError(f"{name}: gate/up shapes do not match the input")
        if act not in ("silu", "gelu"):
            raise GraphError(f"{name}: unknown gate activation {act!r}")
        meta = NodeMeta(role=name, layer=layer, weights=(gate, up))
        return self._append(name, ir.FusedGateUp(act), (x,), (self.shape(x)[0], n_ff),
                            meta=meta)

    def moe(self, name: str, x: int, logits: int, weights: tuple[str, ...], op: ir.Moe) -> int:
        """The experts of `op` on x routed by `logits`; weights: the stacked gate, up and down
        tensors (GGUF ne [n_embd, n_ff, n_expert] and [n_ff, n_embd, n_expert]; with
        `op.fused_gate_up` gate and up name one [n_embd, 2 n_ff, n_expert] tensor), then with
        `op.biased` their stacked biases ([n_ff, n_expert] twice, [n_embd, n_expert]), then
        with `op.down_scale` the experts' output scales ([n_expert])."""
        n_embd = self.shape(x)[-1]
        if self.shape(logits) != (self.shape(x)[0], op.n_expert):
            raise GraphError(f"{name}: router logits {self.shape(logits)} are not "
                             f"[rows, {op.n_expert}]")
        if not 0 < op.n_used <= op.n_expert:
            raise GraphError(f"{name}: {op.n_used} experts used of {op.n_expert}")
        if op.act not in ("silu", "gelu", "swiglu_oai"):
            raise GraphError(f"{name}: unknown gate activation {op.act!r}")
        if op.gating not in ("softmax", "softmax_weight"):
            raise GraphError(f"{name}: unknown gating {op.gating!r}")
        n_bias = 3 if op.biased else 0
        if len(weights) != 3 + n_bias + op.down_scale:
            raise GraphError(f"{name}: {len(weights)} expert tensors named for "
                             f"{'biased' if op.biased else 'unbiased'} experts"
                             f"{' with output scales' if op.down_scale else ''}")
        if op.down_scale and _squeeze(self._weight(weights[-1])) != (op.n_expert,):
            raise GraphError(f"{name}: the experts' scales {weights[-1]} are not "
                             f"[{op.n_expert}]")
        gate, up, down = (self._weight(w) for w in weights[:3])
        if op.fused_gate_up:
            if weights[0] != weights[1] or len(gate) != 3 or gate[1] % 2:
                raise GraphError(f"{name}: a fused gate|up names one tensor of two halves")
            gate = up = (gate[0], gate[1] // 2, gate[2])
        n_ff = gate[1] if len(gate) == 3 else -1
        if gate != (n_embd, n_ff, op.n_expert) or up != gate or \
                down != (n_ff, n_embd, op.n_expert):
            raise GraphError(f"{name}: expert weights {gate}, {up}, {down} do not match "
                             f"{op.n_expert} experts over width {n_embd}")
        biases = [self._weight(w) for w in weights[3:3 + n_bias]]
        if biases and biases != [(n_ff, op.n_expert), (n_ff, op.n_expert),
                                 (n_embd, op.n_expert)]:
            raise GraphError(f"{name}: expert biases {biases} do not match the experts")
        meta = NodeMeta(role=name, layer=op.layer, weights=weights)
        return self._append(name, op, (x, logits), self.shape(x), meta=meta)

    def sigmoid_gate(self, name: str, x: int, h: int, weight: str, *, layer: int) -> int:
        # a vector; llama.cpp's converter writes it as ne [n_embd, 1]
        if self.shape(x)[0] != self.shape(h)[0] or \
                self._weight(weight) not in ((self.shape(h)[-1],), (self.shape(h)[-1], 1)):
            raise GraphError(f"{name}: gate {weight} does not match its input")
        meta = NodeMeta(role=name, layer=layer, weights=(weight,))
        return self._append(name, ir.SigmoidGate(), (x, h), self.shape(x), meta=meta)

    def slice(self, name: str, x: int, start: int, width: int, *, layer: int = -1,
              n_head: int = 1) -> int:
        """Columns [start, start + width) of each row of a 2-D x (of each of its n_head
        heads)."""
        shape = self.shape(x)
        if len(shape) != 2 or n_head < 1 or shape[1] % n_head:
            raise GraphError(f"{name}: {n_head} heads of {shape}")
        if start < 0 or width < 1 or start + width > shape[1] // n_head:
            raise GraphError(f"{name}: columns [{start}, {start + width}) of {shape}")
        return self._append(name, ir.Slice(start, width, n_head), (x,),
                            (shape[0], width * n_head), meta=NodeMeta(role=name, layer=layer))

    def concat(self, name: str, a: int, b: int, *, layer: int = -1) -> int:
        """[n, wa] and [n, wb] side by side: [n, wa + wb]."""
        sa, sb = self.shape(a), self.shape(b)
        if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[0]:
            raise GraphError(f"{name}: cannot join the rows of {sa} and {sb}")
        return self._append(name, ir.Concat(), (a, b), (sa[0], sa[1] + sb[1]),
                            meta=NodeMeta(role=name, layer=layer))

    def add(self, name: str, a: int, b: int, *, layer: int = -1) -> int:
        shape = self._same_shape(name, a, b)
        return self._append(name, ir.Add(), (a, b), shape, meta=NodeMeta(role=name, layer=layer))

    def mul(self, name: str, a: int, b: int, *, layer: int = -1) -> int:
        shape = self._same_shape(name, a, b)
        return self._append(name, ir.Mul(), (a, b), shape, meta=NodeMeta(role=name, layer=layer))

    def silu(self, name: str, x: int, *, layer: int = -1) -> int:
        return self._append(name, ir.Silu(), (x,), self.shape(x),
                            meta=NodeMeta(role=name, layer=layer))

    def gelu(self, name: str, x: int, *, layer: int = -1) -> int:
        return self._append(name, ir.Gelu(), (x,), self.shape(x),
                            meta=NodeMeta(role=name, layer=layer))

    def gelu_erf(self, name: str, x: int, *, layer: int = -1) -> int:
        return self._append(name, ir.GeluErf(), (x,), self.shape(x),
                            meta=NodeMeta(role=name, layer=layer))

    def tanh(self, name: str, x: int) -> int:
        return self._append(name, ir.Tanh(), (x,), self.shape(x), meta=NodeMeta(role=name))

    def softmax(self, name: str, x: int) -> int:
        if len(self.shape(x)) != 2:
            raise GraphError(f"{name}: softmax over rows needs a 2-D input")
        return self._append(name, ir.Softmax(), (x,), self.shape(x), meta=NodeMeta(role=name))

    def pool(self, name: str, x: int, start: int, end: int, kind: str) -> int:
        if kind not in ("mean", "cls", "last"):
            raise GraphError(f"{name}: unknown pooling {kind!r}")
        if self.shape(start) != self.shape(end):
            raise GraphError(f"{name}: pooling bounds differ in length")
        shape = (self.shape(start)[0], self.shape(x)[-1])
        return self._append(name, ir.Pool(kind), (x, start, end), shape,
                            meta=NodeMeta(role=name))

    def join_rows(self, name: str, x: int, group: int) -> int:
        shape = self.shape(x)
        if len(shape) != 2 or group < 1 or shape[0] % group:
            raise GraphError(f"{name}: rows of {shape} do not join in groups of {group}")
        return self._append(name, ir.JoinRows(group), (x,), (shape[0] // group,
                                                             shape[1] * group),
                            meta=NodeMeta(role=name))

    def round_f16(self, name: str, x: int) -> int:
        return self._append(name, ir.RoundF16(), (x,), self.shape(x), meta=NodeMeta(role=name))

    def seq_attn(self, q: int, k: int, v: int, start: int, end: int, op: ir.SeqAttn) -> int:
        if self.shape(q)[-1] != op.n_head * op.head_dim:
            raise GraphError(f"attn.{op.layer}: q width does not match the heads")
        kv_width = op.n_head_kv * op.head_dim
        if self.shape(k)[-1] != kv_width or self.shape(v) != self.shape(k):
            raise GraphError(f"attn.{op.layer}: K/V width does not match the heads")
        if op.n_head % op.n_head_kv:
            raise GraphError(f"attn.{op.layer}: {op.n_head} heads do not group over "
                             f"{op.n_head_kv} K/V heads")
        return self._append(f"attn.{op.layer}", op, (q, k, v, start, end), self.shape(q),
                            meta=NodeMeta(role="attn", layer=op.layer))

    def scale(self, name: str, x: int, factor: float, *, layer: int = -1) -> int:
        return self._append(name, ir.Scale(factor), (x,), self.shape(x),
                            meta=NodeMeta(role=name, layer=layer))

    def softcap(self, name: str, x: int, cap: float) -> int:
        if not cap > 0:
            raise GraphError(f"{name}: soft-cap must be positive, got {cap}")
        return self._append(name, ir.Softcap(cap), (x,), self.shape(x), meta=NodeMeta(role=name))

    def swiglu(self, name: str, gate: int, up: int, *, layer: int = -1) -> int:
        shape = self._same_shape(name, gate, up)
        return self._append(name, ir.SwiGLU(), (gate, up), shape,
                            meta=NodeMeta(role=name, layer=layer))

    def rope(self, name: str, x: int, positions: int, op: ir.Rope, *, layer: int,
             factors: str | None = None) -> int:
        """RoPE of x at positions; `factors` names a [rope_dim/2] weight dividing the angles."""
        if self.shape(x)[-1] != op.n_head * op.head_dim:
            raise GraphError(f"{name}: width {self.shape(x)[-1]} != heads x head_dim")
        if op.style not in ("neox", "norm"):
            raise GraphError(f"{name}: unknown rope style {op.style!r}")
        n_pos = 4 if op.mrope else 1
        if self.shape(positions) != (n_pos * self.shape(x)[0],):
            raise GraphError(f"{name}: {self.shape(positions)} positions for "
                             f"{self.shape(x)[0]} rows ({n_pos} each)")
        weights: tuple[str, ...] = ()
        if factors is not None:
            if self._weight(factors) != (op.rope_dim // 2,):
                raise GraphError(f"{name}: {factors} is not rope_dim/2 = {op.rope_dim // 2} long")
            weights = (factors,)
        return self._append(name, op, (x, positions), self.shape(x),
                            meta=NodeMeta(role=name, layer=layer, weights=weights))

    def qk_norm(self, name: str, x: int, weight: str | None, op: ir.QkNorm, *,
                layer: int) -> int:
        """Per-head RMSNorm of x's op.n_head heads, times the one-head-wide weight (none: 1)."""
        if self.shape(x)[-1] != op.n_head * op.head_dim:
            raise GraphError(f"{name}: rows are not {op.n_head} heads of {op.head_dim}")
        if weight is not None and self._weight(weight) != (op.head_dim,):
            raise GraphError(f"{name}: {weight} is not one head wide")
        meta = NodeMeta(role=name, layer=layer, weights=(weight,) if weight else ())
        return self._append(name, op, (x,), self.shape(x), meta=meta)

    def kv_store(self, layer: int, k: int, v: int, cells: int, *, head_dim: int) -> int:
        self._same_shape(f"kv_store.{layer}", k, v)
        if head_dim < 1 or self.shape(k)[-1] % head_dim:
            raise GraphError(f"kv_store.{layer}: rows are not whole heads of {head_dim}")
        return self._append(f"kv_store.{layer}", ir.KvcacheStore(layer, head_dim), (k, v, cells),
                            (), meta=NodeMeta(role="kv_store", layer=layer))

    def kv_load(self, layer: int, store: int, *, n_ctx: int, n_kv_embd: int) -> int:
        return self._append(f"kv_load.{layer}", ir.KvcacheLoad(layer), (store,),
                            (2, n_ctx, n_kv_embd), meta=NodeMeta(role="kv_load", layer=layer))

    def short_conv(self, bcx: int, positions: int, seq: int, taps: str,
                   op: ir.ShortConv) -> int:
        """LFM2's short convolution of layer op.layer (`ir.ShortConv`) -> [nt, n_embd]."""
        name = f"shortconv.{op.layer}"
        nt, width = self.shape(bcx)
        if width != 3 * op.n_embd:
            raise GraphError(f"{name}: input width {width} is not B | C | x of {op.n_embd}")
        if self._weight(taps) != (op.l_cache, op.n_embd) or op.l_cache < 2:
            raise GraphError(f"{name}: taps {taps} are not [{op.l_cache}, {op.n_embd}]")
        if self.shape(positions) != (nt,) or self.shape(seq) != (nt,):
            raise GraphError(f"{name}: positions and sequences must give each row one")
        meta = NodeMeta(role="shortconv", layer=op.layer, weights=(taps,))
        return self._append(name, op, (bcx, positions, seq), (nt, op.n_embd), meta=meta)

    def ssm_conv(self, x: int, positions: int, seq: int, taps: str, op: ir.SsmConv) -> int:
        """Qwen3.5's convolution of layer op.layer then SiLU (`ir.SsmConv`) -> [nt, channels]."""
        name = f"ssm_conv.{op.layer}"
        nt, width = self.shape(x)
        if width != op.channels:
            raise GraphError(f"{name}: input width {width} is not {op.channels} channels")
        if self._weight(taps) != (op.d_conv, op.channels) or op.d_conv < 2:
            raise GraphError(f"{name}: taps {taps} are not [{op.d_conv}, {op.channels}]")
        if self.shape(positions) != (nt,) or self.shape(seq) != (nt,):
            raise GraphError(f"{name}: positions and sequences must give each row one")
        meta = NodeMeta(role="ssm_conv", layer=op.layer, weights=(taps,))
        return self._append(name, op, (x, positions, seq), (nt, op.channels), meta=meta)

    def delta_net(self, qkv: int, alpha: int, beta: int, positions: int, seq: int,
                  weights: tuple[str, str], op: ir.DeltaNet) -> int:
        """Qwen3.5's gated delta rule of layer op.layer (`ir.DeltaNet`); weights: dt_bias, a
        -> [nt, n_v_heads * head_dim]."""
        name = f"delta_net.{op.layer}"
        nt, width = self.shape(qkv)
        if width != (2 * op.n_k_heads + op.n_v_heads) * op.head_dim or \
                op.n_v_heads % op.n_k_heads:
            raise GraphError(f"{name}: input width {width} is not q | k | v of the heads")
        if self.shape(alpha) != (nt, op.n_v_heads) or self.shape(beta) != (nt, op.n_v_heads):
            raise GraphError(f"{name}: alpha and beta must give each row each value head")
        if any(self._weight(w) != (op.n_v_heads,) for w in weights):
            raise GraphError(f"{name}: {weights} are not one value per value head")
        if self.shape(positions) != (nt,) or self.shape(seq) != (nt,):
            raise GraphError(f"{name}: positions and sequences must give each row one")
        meta = NodeMeta(role="delta_net", layer=op.layer, weights=weights)
        return self._append(name, op, (qkv, alpha, beta, positions, seq),
                            (nt, op.n_v_heads * op.head_dim), meta=meta)

    def sigmoid_mul(self, name: str, x: int, g: int, *, layer: int = -1) -> int:
        shape = self._same_shape(name, x, g)
        return self._append(name, ir.SigmoidMul(), (x, g), shape,
                            meta=NodeMeta(role=name, layer=layer))

    def attn(self, q: int, kv: int, start: int, end: int, op: ir.Attn, *,
             sinks: str | None = None) -> int:
        """Attention of q over the KV view; `sinks` names the [n_head] sink logits of an op
        with `sinks`."""
        if op.sinks != (sinks is not None):
            raise GraphError(f"attn.{op.layer}: sinks {sinks!r} for an op with sinks={op.sinks}")
        if sinks is not None and self._weight(sinks) != (op.n_head,):
            raise GraphError(f"attn.{op.layer}: {sinks} is not one logit per head")
        if self.shape(q)[-1] != op.n_head * op.head_dim:
            raise GraphError(f"attn.{op.layer}: q width does not match the heads")
        if self.shape(kv)[-1] != op.n_head_kv * op.head_dim:
            raise GraphError(f"attn.{op.layer}: KV width does not match the heads")
        if op.window < 0 or op.softcap < 0:
            raise GraphError(f"attn.{op.layer}: window and soft-cap must not be negative")
        return self._append(f"attn.{op.layer}", op, (q, kv, start, end), self.shape(q),
                            meta=NodeMeta(role="attn", layer=op.layer,
                                          weights=(sinks,) if sinks else ()))


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A GGUF ne shape without its trailing ones (a vector may be written [n, 1])."""
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape
