"""The torch backend: prefill-shaped nodes as bf16 GEMMs (oneDNN on the CPU, cuBLAS on CUDA).

Which nodes it claims (`supports_op`) is a rule on the node's row count and a claim set:

- only nodes with at least `min_rows` rows: a decode step (one row) and the tail rows of a
  prefill stay on the compiled CPU kernels, which read the quantized blocks directly;
- `claim="matmul"`: MatMul and FusedGateUp only;
  `claim="dense"`: also the norms, RoPE and elementwise ops between them, so a layer's activations
  cross backends only around attention;
  `claim="all"` (host only): also KV store, attention and the embedding lookup, so a whole prefill
  runs in torch and crosses back only for the tail rows.

Matmuls run on bf16 operands with the product rounded to bf16 (see ops.py); weights come from
`TorchWeights` (scratch or resident bf16). Every value crosses between numpy and torch in
`boundary.py`, the single place that knows whether a crossing is free (host) or a copy (CUDA).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from minfer.backends.base import ExecContext
from minfer.backends.torch_backend import ops
from minfer.backends.torch_backend.boundary import DeviceIO, HostIO, TensorIO
from minfer.backends.torch_backend.device import numba_threads, sync_threads
from minfer.backends.torch_backend.rows import node_rows as _rows
from minfer.backends.torch_backend.weights import TorchWeights
from minfer.errors import GraphError
from minfer.graph import ir
from minfer.graph.ir import ComputeGraph, Node

MATMUL_OPS: tuple[type[ir.Op], ...] = (ir.MatMul, ir.FusedGateUp)
DENSE_OPS = (*MATMUL_OPS, ir.RmsNorm, ir.QkNorm, ir.Rope, ir.Add, ir.Mul, ir.Silu, ir.SwiGLU,
             ir.Gelu, ir.GeGLU, ir.Scale, ir.Softcap, ir.Slice)
HOST_ONLY_OPS = (ir.KvcacheStore, ir.KvcacheLoad, ir.Attn)  # the KV regions are numpy arrays
ALL_OPS = (*DENSE_OPS, *HOST_ONLY_OPS, ir.GetRows)
CLAIMS = {"matmul": MATMUL_OPS, "dense": DENSE_OPS, "all": ALL_OPS}

Srcs = list[np.ndarray | None]
_THREADS = "torch.threads"  # memo key: torch's pool was sized this forward
_BF16_INPUT = "torch.bf16"  # memo key: (source id, its bf16 conversion)


class TorchBackend:
    name = "torch"
    # KV formats its kv_store/attention read: with a quantized cache the scheduler leaves the
    # KV nodes to the CPU backend, whatever the claim (graph/scheduler.py assign_backends)
    kv_types = ("f32", "f16")

    def __init__(self, *, device: str = "cpu", min_rows: int = 64, claim: str = "all",
                 weights: str = "scratch", force_copies: bool = False) -> None:
        if claim not in CLAIMS:
            raise ValueError(f"claim {claim!r} not in {sorted(CLAIMS)}")
        self.device = torch.device(device)
        self.min_rows = min_rows
        self.weights_mode = weights
        on_host = self.device.type == "cpu" and not force_copies
        ops_ = CLAIMS[claim]
        self.claim = claim
        self._ops = ops_ if on_host else tuple(o for o in ops_ if o not in HOST_ONLY_OPS)
        self.io: TensorIO = HostIO() if on_host else DeviceIO(self.device, self._graph_of)
        self._graphs: list[weakref.ref[ComputeGraph]] = []
        self._weights: TorchWeights | None = None

    def describe(self) -> str:
        return (f"torch[{self.device.type}, claim={self.claim}, min_rows={self.min_rows}, "
                f"weights={self.weights_mode}]")

    # -- assignment ---------------------------------------------------------------------------
    def supports_op(self, node: Node, graph: ComputeGraph) -> bool:
        if not isinstance(node.op, self._ops) or _rows(node, graph) < self.min_rows:
            return False
        if isinstance(node.op, ir.MatMul) and node.op.rows:
            return False  # a row-limited head (a draft's) is small: the CPU runs it
        if isinstance(node.op, ir.Attn) and (node.op.softcap or node.op.sinks):
            return False  # SDPA has no soft-capped scores nor sinks: the CPU kernels run these
        if isinstance(node.op, ir.GetRows) and node.meta.weights and self.io.copies:
            return False  # embedding rows are gathered on the host; keep them there
        self._remember(graph)
        return True

    def _remember(self, graph: ComputeGraph) -> None:
        if not any(ref() is graph for ref in self._graphs):
            self._graphs = [r for r in self._graphs if r() is not None]
            self._graphs.append(weakref.ref(graph))

    def _graph_of(self, node: Node) -> ComputeGraph | None:
        for ref in self._graphs:
            graph = ref()
            if graph is not None and node.id < len(graph.nodes) and graph.nodes[node.id] is node:
                return graph
        return None

    # -- execution ----------------------------------------------------------------------------
    def bind_node(self, node: Node, srcs: Srcs, out: np.ndarray | None,
                  ctx: ExecContext) -> list[Callable[[], None]]:
        """The node's step of the op tape: its handler over these buffers (torch resolves its
        kernels per call; the weights' bf16 copies are cached in `TorchWeights`)."""
        handler = _HANDLERS.get(type(node.op))
        if handler is None:
            raise GraphError(f"torch backend has no kernel for {node.op.kind}")
        return [partial(self._run, handler, node, srcs, out, ctx)]

    def compose(self, steps: list[Callable[[], None]]) -> list[Callable[[], None]]:
        return list(steps)

    def _run(self, handler: Handler, node: Node, srcs: Srcs, out: np.ndarray | None,
             ctx: ExecContext) -> None:
        if _THREADS not in ctx.memo:  # once per forward: follow numba's thread count
            sync_threads(numba_threads())
            ctx.memo[_THREADS] = True
        with torch.inference_mode():
            handler(self, node, srcs, out, ctx)
        self.io.after(ctx.memo, node)

    def torch_weights(self, ctx: ExecContext) -> TorchWeights:
        if self._weights is None or self._weights.source is not ctx.weights:
            self._weights = TorchWeights(ctx.weights, device=self.device, mode=self.weights_mode)
        return self._weights

    def src(self, ctx: ExecContext, node: Node, i: int, srcs: Srcs) -> torch.Tensor:
        return self.io.read(ctx.memo, node.srcs[i], srcs[i])

    def src_bf16(self, ctx: ExecContext, node: Node, i: int, srcs: Srcs) -> torch.Tensor:
        """Source i as bf16. The matmuls that share an input (q/k/v, gate/up) run one after
        another, so one remembered conversion serves them all and memory stays one tensor."""
        src_id = node.srcs[i]
        hit = ctx.memo.get(_BF16_INPUT)
        if hit is None or hit[0] != src_id:
            hit = ctx.memo[_BF16_INPUT] = (src_id, self.src(ctx, node, i, srcs).to(torch.bfloat16))
        return hit[1]

    def run(self, ctx: ExecContext, node: Node, out: np.ndarray | None,
            compute: Callable[[torch.Tensor], Any]) -> None:
        dst = self.io.target(node, out)
        compute(dst)
        self.io.publish(ctx.memo, node, out, dst)


# -- handlers: (backend, node, srcs, out, ctx) -------------------------------------------------
Handler = Callable[[TorchBackend, Node, Srcs, "np.ndarray | None", ExecContext], None]


def _project(b: TorchBackend, ctx: ExecContext, x: torch.Tensor, weight: str,
             dst: torch.Tensor) -> None:
    """dst[nt, n_out] = x @ W.T, one bf16 GEMM per weight tile (one tile for layer matrices)."""
    for r0, r1, w in b.torch_weights(ctx).tiles(weight):
        product = ops.linear_bf16(x, w)  # [nt, r1 - r0] bf16
        (dst if r1 - r0 == dst.shape[1] else dst[:, r0:r1]).copy_(product)


def _matmul(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
            ctx: ExecContext) -> None:
    x = b.src_bf16(ctx, node, 0, srcs)

    def compute(dst: torch.Tensor) -> None:
        _project(b, ctx, x, node.meta.weights[0], dst)
        if len(node.meta.weights) > 1:
            dst += b.torch_weights(ctx).vector(node.meta.weights[1])

    b.run(ctx, node, out, compute)


def _fused_gate_up(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
                   ctx: ExecContext) -> None:
    op = node.op
    assert isinstance(op, ir.FusedGateUp)
    x = b.src_bf16(ctx, node, 0, srcs)

    def compute(dst: torch.Tensor) -> None:
        gate = torch.empty_like(dst)
        _project(b, ctx, x, node.meta.weights[0], gate)
        _project(b, ctx, x, node.meta.weights[1], dst)
        torch.mul(_ACTS[op.act](gate), dst, out=dst)

    b.run(ctx, node, out, compute)


def _rms_norm(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
              ctx: ExecContext) -> None:
    op = node.op
    assert isinstance(op, ir.RmsNorm)
    x, w = b.src(ctx, node, 0, srcs), b.torch_weights(ctx).vector(node.meta.weights[0])
    b.run(ctx, node, out, lambda dst: ops.rms_norm(x, w, op.eps, dst))


def _qk_norm(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
             ctx: ExecContext) -> None:
    op = node.op
    assert isinstance(op, ir.QkNorm)
    x = b.src(ctx, node, 0, srcs)
    w = b.torch_weights(ctx).vector(node.meta.weights[0]) if node.meta.weights \
        else torch.ones(op.head_dim, dtype=x.dtype, device=x.device)  # no weight: Gemma 4's V
    b.run(ctx, node, out, lambda dst: ops.head_rms_norm(
        x, w, n_head=op.n_head, head_dim=op.head_dim, eps=op.eps, out=dst))


def _rope(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
          ctx: ExecContext) -> None:
    op = node.op
    assert isinstance(op, ir.Rope)
    key = ("torch.rope", node.srcs[1], op.base, op.rope_dim, op.freq_scale, op.yarn,
           node.meta.weights, op.mrope, op.sections)
    tables = ctx.memo.get(key)
    if tables is None:  # cos/sin once per forward, shared by q and k of every layer
        factors = (b.torch_weights(ctx).vector(node.meta.weights[0]) if node.meta.weights
                   else None)
        tables = ctx.memo[key] = ops.rope_tables(b.src(ctx, node, 1, srcs), base=op.base,
                                                 rope_dim=op.rope_dim, freq_scale=op.freq_scale,
                                                 factors=factors, yarn=op.yarn,
                                                 mrope=op.mrope, sections=op.sections)
    x = b.src(ctx, node, 0, srcs)
    rotate = ops.rope_neox if op.style == "neox" else ops.rope_norm
    b.run(ctx, node, out, lambda dst: rotate(
        x, *tables, n_head=op.n_head, head_dim=op.head_dim, rope_dim=op.rope_dim, out=dst))


def _binary(fn: Callable[..., Any]) -> Handler:
    def handler(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
                ctx: ExecContext) -> None:
        x, y = b.src(ctx, node, 0, srcs), b.src(ctx, node, 1, srcs)
        b.run(ctx, node, out, lambda dst: fn(x, y, out=dst))

    return handler


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": _gelu_tanh}


def _swiglu(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor) -> None:
    torch.mul(F.silu(gate), up, out=out)


def _geglu(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor) -> None:
    torch.mul(_gelu_tanh(gate), up, out=out)


def _unary(fn: Callable[[Node, torch.Tensor], torch.Tensor]) -> Handler:
    def handler(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
                ctx: ExecContext) -> None:
        x = b.src(ctx, node, 0, srcs)
        b.run(ctx, node, out, lambda dst: dst.copy_(fn(node, x)))

    return handler


def _scale(node: Node, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(node.op, ir.Scale)
    return x * node.op.factor


def _slice(node: Node, x: torch.Tensor) -> torch.Tensor:
    op = node.op
    assert isinstance(op, ir.Slice)
    if op.n_head > 1:  # each head's columns (Qwen3.5's query | gate)
        heads = x.reshape(x.shape[0], op.n_head, -1)[:, :, op.start:op.start + op.width]
        return heads.reshape(x.shape[0], -1)
    return x[:, op.start:op.start + op.width]


def _softcap(node: Node, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(node.op, ir.Softcap)
    return torch.tanh(x * (1.0 / node.op.cap)) * node.op.cap


def _kv_store(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
              ctx: ExecContext) -> None:
    assert isinstance(node.op, ir.KvcacheStore)
    layer = node.op.layer
    k, v, cells = (b.src(ctx, node, i, srcs) for i in range(3))
    ops.kv_store(k, v, torch.from_numpy(ctx.kv.k[layer]), torch.from_numpy(ctx.kv.v[layer]),
                 cells)


def _kv_load(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
             ctx: ExecContext) -> None:
    return None  # a view of the persistent region; attention reads it through ctx.kv


def _attn(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
          ctx: ExecContext) -> None:
    op = node.op
    assert isinstance(op, ir.Attn)
    q, start, end = (b.src(ctx, node, i, srcs) for i in (0, 2, 3))
    k_cache = torch.from_numpy(ctx.kv.k[op.cache_layer])
    v_cache = torch.from_numpy(ctx.kv.v[op.cache_layer])
    b.run(ctx, node, out, lambda dst: ops.attention(
        q, k_cache, v_cache, start, end, n_head=op.n_head, n_head_kv=op.n_head_kv,
        head_dim=op.head_dim, scale=op.scale, window=op.window, out=dst))


def _get_rows(b: TorchBackend, node: Node, srcs: Srcs, out: np.ndarray | None,
              ctx: ExecContext) -> None:
    if node.meta.weights:  # embedding: dequantize just the rows asked for
        assert srcs[0] is not None
        rows = b.torch_weights(ctx).rows(node.meta.weights[0], srcs[0])
        b.run(ctx, node, out, lambda dst: dst.copy_(rows))
        return
    x, ids = b.src(ctx, node, 0, srcs), b.src(ctx, node, 1, srcs)
    b.run(ctx, node, out, lambda dst: torch.index_select(x, 0, ids.long(), out=dst))


_HANDLERS: dict[type[ir.Op], Handler] = {
    ir.MatMul: _matmul,
    ir.FusedGateUp: _fused_gate_up,
    ir.RmsNorm: _rms_norm,
    ir.QkNorm: _qk_norm,
    ir.Rope: _rope,
    ir.Add: _binary(torch.add),
    ir.Mul: _binary(torch.mul),
    ir.SwiGLU: _binary(_swiglu),
    ir.GeGLU: _binary(_geglu),
    ir.Silu: _unary(lambda node, x: F.silu(x)),
    ir.Gelu: _unary(lambda node, x: _gelu_tanh(x)),
    ir.Scale: _unary(_scale),
    ir.Softcap: _unary(_softcap),
    ir.Slice: _unary(_slice),
    ir.KvcacheStore: _kv_store,
    ir.KvcacheLoad: _kv_load,
    ir.Attn: _attn,
    ir.GetRows: _get_rows,
}
