"""A mixture-of-experts FFN on the CPU: routing, grouping rows by expert, the expert matmuls.

llama.cpp's `build_moe_ffn` (soft-max gating) as one bound sequence of compiled calls:

1. `route_and_group`: per row, the router logits soft-maxed (f32 exp, f64 sum, as ggml), the
   `n_used` most probable experts (ties: the lower id; a NaN row still picks valid ids), their
   probabilities renormalised when asked (the sum clamped below at 2^-14, as llama.cpp) --
   or, with "softmax_weight" gating (gpt-oss), the `n_used` largest logits, soft-maxed among
   themselves; then the (row, slot) pairs counted into groups by expert (a counting sort:
   within a group by row, then slot) and the input rows gathered in that order;
2. per expert group, the gate / up / down projections of the expert's own rows (the row
   drivers' `_x` forms, `dispatch.bind_experts_into`), each plus the expert's bias row where
   the model has expert biases (gpt-oss): each expert's weights stream once per batch, and a
   decode step touches only its `n_used` experts' bytes; between them the gate (SwiGLU,
   GeGLU, or gpt-oss's clamped SwiGLU);
3. `combine`: each row's output = sum over its slots, in slot order, of p_s * y_s.

Every step is row-wise: a row's routing, its projections (the integer dots give a row the same
bits in any batch) and its weighted sum never read another row, so the result is batch
invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.elementwise.arith import bind_swiglu
from minfer.backends.cpu.kernels.elementwise.gelu import geglu
from minfer.backends.cpu.kernels.linear.dispatch import bind_experts_into, bind_quantize
from minfer.backends.cpu.kernels.quant.activations import Q8Blocks, Q8KBlocks

_WEIGHTS_SUM_MIN = np.float32(6.103515625e-5)  # llama.cpp's clamp of the top-k weights' sum


@njit(inline="always")
def _softmax_into(x: np.ndarray, p: np.ndarray) -> None:
    """p = softmax(x) as ggml_soft_max: exp(x - max) in f32, their sum in f64, times 1/sum."""
    mx = x[0]
    for e in range(1, x.shape[0]):
        mx = max(mx, x[e])
    s = 0.0
    for e in range(x.shape[0]):
        p[e] = np.exp(x[e] - mx)
        s += p[e]
    inv = np.float32(1.0 / s)
    for e in range(x.shape[0]):
        p[e] *= inv


@njit(cache=True)
def _route(logits: np.ndarray, n_used: int, norm: bool, top_softmax: bool, ids: np.ndarray,
           wts: np.ndarray) -> None:
    """Each row's experts and weights; `top_softmax`: chosen by logit, weights the soft-max of
    the chosen logits (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)."""
    nt, ne = logits.shape
    p = np.empty(ne, np.float32)
    taken = np.empty(ne, np.bool_)
    for t in range(nt):
        if top_softmax:
            p[:] = logits[t]
        else:
            _softmax_into(logits[t], p)
        taken[:] = False
        total = np.float32(0.0)
        for k in range(n_used):
            best = -1
            for e in range(ne):  # strictly greater: the lower id wins a tie
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            ids[t, k] = best
            wts[t, k] = p[best]
            total += p[best]
        if top_softmax:
            _softmax_into(wts[t].copy(), wts[t])
        elif norm:
            total = max(total, _WEIGHTS_SUM_MIN)
            for k in range(n_used):
                wts[t, k] = wts[t, k] / total


@njit(cache=True)
def _group(ids: np.ndarray, n_expert: int, groups: np.ndarray, n_groups: np.ndarray,
           order: np.ndarray, pos: np.ndarray) -> None:
    nt, k = ids.shape
    start = np.zeros(n_expert + 1, np.int64)
    for t in range(nt):
        for s in range(k):
            start[ids[t, s] + 1] += 1
    ng = 0
    for e in range(n_expert):
        if start[e + 1]:
            groups[ng, 0] = e
            groups[ng, 1] = start[e]
            groups[ng, 2] = start[e] + start[e + 1]
            ng += 1
        start[e + 1] += start[e]
    n_groups[0] = ng
    for t in range(nt):
        for s in range(k):
            e = ids[t, s]
            i = start[e]
            start[e] += 1
            order[i] = t
            pos[t * k + s] = i


@njit(parallel=True, cache=True)
def _gather(x: np.ndarray, order: np.ndarray, xs: np.ndarray) -> None:
    for i in prange(order.shape[0]):
        xs[i] = x[order[i]]


@njit(cache=True)
def _route_group(logits: np.ndarray, n_used: int, norm: bool, top_softmax: bool,
                 ids: np.ndarray, wts: np.ndarray, groups: np.ndarray, n_groups: np.ndarray,
                 order: np.ndarray, pos: np.ndarray) -> None:
    _route(logits, n_used, norm, top_softmax, ids, wts)
    _group(ids, logits.shape[1], groups, n_groups, order, pos)


@njit(cache=True)
def _route_and_group_small(logits: np.ndarray, x: np.ndarray, n_used: int, norm: bool,
                           top_softmax: bool, ids: np.ndarray, wts: np.ndarray,
                           groups: np.ndarray, n_groups: np.ndarray, order: np.ndarray,
                           pos: np.ndarray, xs: np.ndarray) -> None:
    """`route_and_group` in one serial call (a decode step's few rows)."""
    _route_group(logits, n_used, norm, top_softmax, ids, wts, groups, n_groups, order, pos)
    for i in range(order.shape[0]):
        xs[i] = x[order[i]]


def route_and_group(logits: np.ndarray, x: np.ndarray, n_used: int, norm: bool,
                    top_softmax: bool, ids: np.ndarray, wts: np.ndarray, groups: np.ndarray,
                    n_groups: np.ndarray, order: np.ndarray, pos: np.ndarray,
                    xs: np.ndarray) -> None:
    """Routing and grouping of every row (see the module's docstring), the rows gathered by
    the threads."""
    _route_group(logits, n_used, norm, top_softmax, ids, wts, groups, n_groups, order, pos)
    _gather(x, order, xs)


@njit(cache=True)
def add_expert_bias(y: np.ndarray, groups: np.ndarray, n_groups: np.ndarray,
                    bias: np.ndarray) -> None:
    """y[i] += bias[e] for every row i of expert e's group (llama.cpp's ggml_add_id)."""
    for g in range(n_groups[0]):
        b = bias[groups[g, 0]]
        for i in range(groups[g, 1], groups[g, 2]):
            for j in range(y.shape[1]):
                y[i, j] += b[j]


_SERIAL_MAX_PAIRS = 64  # up to this many (row, slot) pairs, one serial call does it all


@njit(inline="always")
def _combine_row(ys: np.ndarray, pos: np.ndarray, wts: np.ndarray, out: np.ndarray,
                 t: int) -> None:
    k = wts.shape[1]
    y0 = ys[pos[t * k]]
    w0 = wts[t, 0]
    for j in range(out.shape[1]):
        out[t, j] = w0 * y0[j]
    for s in range(1, k):
        y = ys[pos[t * k + s]]
        w = wts[t, s]
        for j in range(out.shape[1]):
            out[t, j] += w * y[j]


@njit(parallel=True, cache=True)
def combine(ys: np.ndarray, pos: np.ndarray, wts: np.ndarray, out: np.ndarray) -> None:
    """out[t] = sum over slots s in order of wts[t, s] * ys[pos[t * k + s]]."""
    for t in prange(wts.shape[0]):
        _combine_row(ys, pos, wts, out, t)


@njit(cache=True)
def _combine_small(ys: np.ndarray, pos: np.ndarray, wts: np.ndarray, out: np.ndarray) -> None:
    for t in range(wts.shape[0]):
        _combine_row(ys, pos, wts, out, t)


@njit(cache=True)
def _scale_routes(wts: np.ndarray, ids: np.ndarray, scale: np.ndarray) -> None:
    """Each routing weight times its expert's output scale."""
    for t in range(wts.shape[0]):
        for s in range(wts.shape[1]):
            wts[t, s] *= scale[ids[t, s]]


@dataclass(frozen=True)
class ExpertWeight:
    """One stacked expert tensor as the integer / float drivers read it: `w3[n_expert, n_out,
    ...]` (a repacked copy, or the file's blocks) and its type."""

    w3: np.ndarray
    qtype: int


Activation = Q8Blocks | Q8KBlocks | None
# scratch(kind, shape, dtype) -> a buffer the caller may share between MoE nodes
Scratch = Callable[[str, tuple[int, ...], type], np.ndarray]
# activation(kind, x, qtype) -> a quantized buffer for x's rows in qtype's form (None: a float
# weight's, rounded per call)
ActivationBuffer = Callable[[str, np.ndarray, int], Activation]


def bind_moe(x: np.ndarray, logits: np.ndarray, gate: ExpertWeight, up: ExpertWeight,
             down: ExpertWeight, *, n_used: int, norm: bool, act: str, out: np.ndarray,
             scratch: Scratch, activation: ActivationBuffer, gating: str = "softmax",
             biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
             expert_scale: np.ndarray | None = None) -> list[Callable[[], None]]:
    """The calls of one MoE node over fixed buffers: x [nt, n_embd], logits [nt, n_expert],
    out [nt, n_embd]; the gate / up / down experts' stacked weights, and their stacked biases
    ([n_expert, n_ff] twice, [n_expert, n_embd]) where the experts have them. gating
    "softmax" or "softmax_weight", act "silu", "gelu" or "swiglu_oai" (`ir.Moe`);
    expert_scale [n_expert] (Gemma 4): each expert's output times its entry, folded into the
    routing weights."""
    if gating not in ("softmax", "softmax_weight") or act not in ("silu", "gelu", "swiglu_oai"):
        raise ValueError(f"unknown gating {gating!r} or activation {act!r}")
    nt, n_embd = x.shape
    n_expert = logits.shape[1]
    n_ff = gate.w3.shape[1]
    pairs = nt * n_used
    ids = scratch("moe-ids", (nt, n_used), np.int32)
    wts = scratch("moe-wts", (nt, n_used), np.float32)
    groups = scratch("moe-groups", (n_expert, 3), np.int64)
    n_groups = scratch("moe-ngroups", (1,), np.int64)
    order = scratch("moe-order", (pairs,), np.int64)
    pos = scratch("moe-pos", (pairs,), np.int64)
    xs = scratch("moe-xs", (pairs, n_embd), np.float32)
    g = scratch("moe-gate", (pairs, n_ff), np.float32)
    u = scratch("moe-up", (pairs, n_ff), np.float32)
    a = scratch("moe-act", (pairs, n_ff), np.float32)
    ys = scratch("moe-ys", (pairs, n_embd), np.float32)
    small = pairs <= _SERIAL_MAX_PAIRS
    route = _route_and_group_small if small else route_and_group
    def biased(i: int, y: np.ndarray) -> list[Callable[[], None]]:
        """Expert bias i (gate, up, down) added to the group rows of y, where there is one."""
        if biases is None:
            return []
        b = np.ascontiguousarray(biases[i], np.float32).reshape(n_expert, y.shape[1])
        return [partial(add_expert_bias, y, groups, n_groups, b)]

    steps: list[Callable[[], None]] = [
        partial(route, logits, x, n_used, norm, gating == "softmax_weight", ids, wts, groups,
                n_groups, order, pos, xs)]
    if expert_scale is not None:
        steps.append(partial(_scale_routes, wts, ids, expert_scale))
    quantized: dict[type, Activation] = {}  # gate and up read one quantization of xs
    for i, (w, y) in enumerate(((gate, g), (up, u))):
        xq = activation("moe-xs-q", xs, w.qtype)
        if xq is not None:
            if type(xq) in quantized:
                xq = quantized[type(xq)]
            else:
                quantized[type(xq)] = xq
                steps.append(bind_quantize(xs, xq))
        steps.append(bind_experts_into(w.w3, w.qtype, groups, n_groups, xq, xs, y))
        steps += biased(i, y)
    steps.append(partial(geglu, g, u, a) if act == "gelu" else
                 bind_swiglu(g, u, a, oai=act == "swiglu_oai"))
    aq = activation("moe-act-q", a, down.qtype)
    if aq is not None:
        steps.append(bind_quantize(a, aq))
    steps.append(bind_experts_into(down.w3, down.qtype, groups, n_groups, aq, a, ys))
    steps += biased(2, ys)
    steps.append(partial(_combine_small if small else combine, ys, pos, wts, out))
    return steps
