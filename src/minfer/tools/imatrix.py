"""`minfer imatrix`: an importance matrix collected as llama.cpp's `llama-imatrix` collects it.

The text's tokens (BOS first where the vocabulary adds one) are cut into whole chunks of n_ctx;
each chunk runs from position 0 (its first token BOS where the vocabulary adds one) in batches
of n_batch, every row asking for logits as llama-imatrix asks, so every layer sees every row.
For each matrix multiplication by a `blk.*` weight (and `output.weight` with
`process_output`; a shared expert's sigmoid gate `ffn_gate_inp_shexp` is one, a matmul in
llama.cpp) over at least 16 rows, the squares of its input rows are summed per column
in f32, row after row (`in_sum2`), and the rows counted (`counts`): llama-imatrix's
collect_imatrix. The engine exposes each matmul's input through its tracing hook: an
`ImatrixCollector` is the Engine's tracer (`StepTracer`), so the tape runs node by node and the
collector reads each MatMul's input buffer after the node ran (before a later node can reuse
it); an engine without one runs its forwards as before.

A mixture of experts' stacked `*_exps` tensors get one row of sums and one count per expert,
as llama-imatrix collects a MUL_MAT_ID (whatever the batch's size): for each slot of the
`n_used` and each row in turn, the row's input added to the sums of the expert it went to
(gate and up read the MoE node's input row, down the gated product that expert made, read from
the scratch the node's kernels left, `backends.cpu.backend.moe_routes`), and that expert's
count raised by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numba import njit

from minfer.backends.cpu.backend import moe_routes
from minfer.engine.forward import Batch, Engine
from minfer.engine.trace import StepTracer
from minfer.errors import MinferError
from minfer.graph import ir
from minfer.graph.cache import PreparedGraph
from minfer.graph.scheduler import Tape
from minfer.tools.quantize.imatrix_file import Entry, Imatrix

MIN_ROWS = 16  # llama-imatrix ignores smaller batches


@njit(cache=True, error_model="numpy")
def _add_squares(acc: np.ndarray, x: np.ndarray) -> None:  # pragma: no cover
    """acc[j] += x[r, j]^2 for each row r in order, in f32 (ggml's loop)."""
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            acc[j] += x[r, j] * x[r, j]


@njit(cache=True, error_model="numpy")
def _add_expert_squares(acc: np.ndarray, counts: np.ndarray, x: np.ndarray, ids: np.ndarray,
                        pos: np.ndarray) -> None:  # pragma: no cover
    """llama-imatrix's MUL_MAT_ID loop: slot by slot, row by row, acc[e] += x_row^2 and
    counts[e] += 1 for the row's expert e in that slot; x's row is pos[row * n_used + slot]
    (pos empty: the row itself, as gate and up broadcast one input over the slots)."""
    n_rows, n_used = ids.shape
    for s in range(n_used):
        for r in range(n_rows):
            e = ids[r, s]
            i = pos[r * n_used + s] if pos.shape[0] else r
            counts[e] += 1
            for j in range(x.shape[1]):
                acc[e, j] += x[i, j] * x[i, j]


class ImatrixCollector(StepTracer):
    """An Engine tracer that sums the squared inputs of the engine's matmuls, per weight."""

    def __init__(self, *, process_output: bool = False) -> None:
        super().__init__()
        self.process_output = process_output
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.expert_sums: dict[str, np.ndarray] = {}  # name -> [n_expert, n_in]
        self.expert_counts: dict[str, np.ndarray] = {}  # name -> [n_expert]

    def wanted(self, weight: str) -> bool:
        return weight.startswith("blk.") or (self.process_output and weight == "output.weight")

    def trace_forward(self, prepared: PreparedGraph, tape: Tape,
                      buffers: list[np.ndarray | None], batch: Batch, weights: Any) -> None:
        nodes = prepared.graph.nodes

        def observe(node_id: int, seconds: float) -> None:
            node = nodes[node_id]
            if isinstance(node.op, ir.Moe):
                self._experts(node, buffers, tape, weights)
                return
            # a shared expert's sigmoid gate is a 1-output matmul of its second source in llama.cpp;
            # a fused gate / up node is llama.cpp's two matmuls of one input
            if isinstance(node.op, ir.MatMul):
                src, names = nodes[node.srcs[0]], node.meta.weights[:1]
            elif isinstance(node.op, ir.FusedGateUp):
                src, names = nodes[node.srcs[0]], node.meta.weights[:2]
            elif isinstance(node.op, ir.SigmoidGate):
                src, names = nodes[node.srcs[1]], node.meta.weights[:1]
            else:
                return
            names = tuple(n for n in names if self.wanted(n))
            n_rows, n_in = src.shape[0], src.shape[-1]
            x = buffers[src.id]
            if not names or n_rows < MIN_ROWS or x is None:
                return
            x = np.ascontiguousarray(x.reshape(-1)[:n_rows * n_in].reshape(n_rows, n_in),
                                     np.float32)
            for name in names:
                acc = self.sums.setdefault(name, np.zeros(n_in, np.float32))
                _add_squares(acc, x)
                if not np.isfinite(acc).all():
                    raise MinferError(f"non-finite values detected in {name}")
                self.counts[name] = self.counts.get(name, 0) + n_rows

        tape.run_observed(observe)

    def _experts(self, node: ir.Node, buffers: list[np.ndarray | None], tape: Tape,
                 weights: Any) -> None:
        op = node.op
        assert isinstance(op, ir.Moe)
        src = buffers[node.srcs[0]]
        n_rows, n_in = node.shape[0], node.shape[-1]
        if src is None or n_rows == 0:
            return
        x = np.ascontiguousarray(src.reshape(-1)[:n_rows * n_in].reshape(n_rows, n_in),
                                 np.float32)
        gate, up, down = node.meta.weights[:3]
        n_ff = int(weights.file.tensors[down].shape[0])
        ids, pos, act = moe_routes(tape.ctx, n_rows, op.n_used, n_ff)
        no_pos = np.empty(0, np.int64)
        for name, rows, where in ((gate, x, no_pos), (up, x, no_pos), (down, act, pos)):
            if name == gate and op.fused_gate_up:
                continue  # one tensor [gate | up], one MUL_MAT_ID: collected once, as up
            acc = self.expert_sums.setdefault(name, np.zeros((op.n_expert, rows.shape[1]),
                                                             np.float32))
            counts = self.expert_counts.setdefault(name, np.zeros(op.n_expert, np.int64))
            _add_expert_squares(acc, counts, rows, ids, where)
            if not np.isfinite(acc[np.unique(ids)]).all():
                raise MinferError(f"non-finite values detected in {name}")

    def imatrix(self, *, datasets: Sequence[str], chunk_count: int, chunk_size: int) -> Imatrix:
        im = Imatrix(datasets=list(datasets), chunk_count=chunk_count, chunk_size=chunk_size)
        for name, acc in self.sums.items():
            im.entries[name] = Entry(acc.copy(), np.array([self.counts[name]], np.int64))
        for name, sums in self.expert_sums.items():
            im.entries[name] = Entry(sums.reshape(-1).copy(), self.expert_counts[name].copy())
        return im


def collect(engine: Engine, ids: Sequence[int], n_ctx: int, *, bos: int | None,
            batch_size: int = 512, max_chunks: int | None = None, process_output: bool = False,
            dataset: str = "", progress: Callable[[int, int], None] | None = None) -> Imatrix:
    """The importance matrix of the text's ids on this engine (see the module docstring)."""
    if len(ids) < 2 * n_ctx:
        raise MinferError(f"the text has {len(ids)} tokens: an importance matrix at a context of "
                          f"{n_ctx} needs at least {2 * n_ctx} (use a longer text or a smaller -c)")
    n_chunks = len(ids) // n_ctx if max_chunks is None else min(max_chunks, len(ids) // n_ctx)
    collector = ImatrixCollector(process_output=process_output)
    saved = engine.tracer
    engine.tracer = collector
    try:
        for i in range(n_chunks):
            chunk = list(ids[i * n_ctx:(i + 1) * n_ctx])
            if bos is not None:
                chunk[0] = bos
            for start in range(0, n_ctx, batch_size):
                part = chunk[start:start + batch_size]
                engine.forward(part, start, len(part))
            if progress is not None:
                progress(i + 1, n_chunks)
    finally:
        engine.tracer = saved
    return collector.imatrix(datasets=[dataset] if dataset else [], chunk_count=n_chunks,
                             chunk_size=n_ctx)
