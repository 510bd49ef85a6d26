"""Attention over quantized KV caches (q8_0 / q4_0, or one of them mixed with f16/f32).

`attention` dispatches here when K or V is quantized (see `attn.kv_formats` for the layouts). Each
cell's head slice is dequantized on the fly into an f32 row (`load_head`), then the per-token
kernel proceeds as `attn.attend._attention`: f32 scores, max-subtracted softmax with an f64 exp sum,
the value mix accumulated in f32. The result is therefore attention of the query as rounded
below over the dequantized cache, up to f32 summation order, and it is per query row (batch
invariant) like the f16 kernel.

The query is dotted as llama.cpp's CPU flash attention dots it: converted to K's vec_dot_type,
i.e. rounded through Q8_0 blocks (`quant.activations.quantize_q8_0`, the same per-row rounding
as ggml's quantize_row_q8_0) for a q8_0 / q4_0 K, after its rotation; f16 for an f16 K. The
scores are then llama.cpp's up to f32 summation order (its integer dot times d_k * d_q; here the
dequantized products). Dequantizing the cache rather than dotting in integers keeps one kernel
for every format: at decode the kernel is bound by the bytes it reads, which the quantized cache
already shrinks. Measured against llama.cpp 0.3.36's same cache on the dev model
(tests/fixtures/kv_quant_llamacpp.npz, 595 positions, mean / max |dlogit| over its f16 top-10):
q4_0 0.59 / 15.0 with the f32 query, 0.42 / 11.7 with the Q8_0 query (llama.cpp's own q4_0
departs from its f16 cache by 2.32 / 30.9); q8_0 0.086 / 2.66 -> 0.077 / 0.56 (its own 0.15 /
8.7).

Quantized rows are stored Hadamard-rotated as llama.cpp stores them (see `attn.kv_formats`): the
query is rotated by K's chunk before a rotated K is read, and the output by V's chunk after a
rotated V was mixed.

The blocked prefill kernel (`attn.blocked`) reads any format through the same `load_head`,
dequantizing each block's K/V slice into its f32 scratch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.attn.blocked import attention_blocked, blocked_available
from minfer.backends.cpu.kernels.attn.kv_formats import (
    QK,
    cache_type,
    check_query_heads,
    is_quant,
    kernel_view,
    load_head,
    rotate,
    rotations,
    row_width,
    sink_logits,
)
from minfer.backends.cpu.kernels.elementwise.arith import softmax_groups
from minfer.backends.cpu.kernels.quant.activations import dequantize_activation, quantize_q8_0


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _attention_q(q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale, sinks,
                 out):  # pragma: no cover - compiled
    nt = q.shape[0]
    group = n_head // n_head_kv
    for item in prange(nt * n_head_kv):
        t = item // n_head_kv
        kvh = item % n_head_kv
        s0 = kv_start[t]
        n = kv_end[t] - s0
        kb = kvh * head_dim
        qb = kvh * group * head_dim
        row = np.empty(head_dim, np.float32)
        scores = np.empty((group, max(n, 1)), np.float32)
        for c in range(n):  # each K row is dequantized once for the whole group
            load_head(k[s0 + c], kb, head_dim, row)
            for g in range(group):
                qh = q[t, qb + g * head_dim : qb + (g + 1) * head_dim]
                dot = np.float32(0.0)
                for j in range(head_dim):
                    dot += qh[j] * row[j]
                scores[g, c] = dot * scale
        inv = softmax_groups(scores, group, n, sinks, kvh * group)
        acc = np.zeros((group, head_dim), np.float32)
        for c in range(n):
            load_head(v[s0 + c], kb, head_dim, row)
            for g in range(group):
                p = scores[g, c]
                for j in range(head_dim):
                    acc[g, j] += p * row[j]
        for g in range(group):
            for j in range(head_dim):
                out[t, qb + g * head_dim + j] = acc[g, j] * inv[g]


def uses_quant(k_cache: np.ndarray, v_cache: np.ndarray) -> bool:
    """Whether attention over these caches is this module's (either one quantized)."""
    return is_quant(k_cache) or is_quant(v_cache)


def _check(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_head: int,
           n_head_kv: int, head_dim: int, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    check_query_heads(q, out, n_head, n_head_kv, head_dim)
    if head_dim % QK:
        raise ValueError(f"a quantized KV cache needs head_dim a multiple of {QK}, "
                         f"got {head_dim}")
    n = n_head_kv * head_dim
    for cache in (k_cache, v_cache):
        if cache.ndim != 2 or cache.shape[1] != row_width(cache_type(cache), n):
            raise ValueError(f"{cache_type(cache)} cache {cache.shape} does not hold rows of "
                             f"{n_head_kv}*{head_dim} values")
    if k_cache.shape[0] != v_cache.shape[0]:
        raise ValueError(f"K/V caches of {k_cache.shape[0]} / {v_cache.shape[0]} cells")
    return kernel_view(k_cache), kernel_view(v_cache)


def _run(q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray,
         n_head: int, n_head_kv: int, head_dim: int, scale: float, out: np.ndarray,
         blocked: bool, rot: tuple[int, int], sinks: np.ndarray) -> None:
    rot_k, rot_v = rot
    if rot_k:  # the keys are stored rotated: rotate the query alike (q.k is kept)
        q = np.array(q, dtype=np.float32, order="C")
        rotate(q, rot_k)
    if is_quant(k):  # llama.cpp dots a quantized K with the (rotated) query as Q8_0 blocks
        q = dequantize_activation(quantize_q8_0(q))
    if blocked and q.shape[0] and blocked_available():
        attention_blocked(q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale, out,
                          sinks=sinks)
    else:
        if k.dtype == np.uint16:  # f16 K: the query rounds to f16 as in the f16 kernel
            q = q.astype(np.float16).astype(np.float32)
        _attention_q(q, k, v, lo, hi, n_head, n_head_kv, head_dim, np.float32(scale), sinks,
                     out)
    rotate(out, rot_v)  # so were the values: the mix comes out rotated


def _window_softcap(window: int, softcap: float) -> None:
    if window < 0:
        raise ValueError(f"window {window} must not be negative")
    if softcap:
        raise ValueError("soft-capped attention does not run over a q8_0 / q4_0 KV cache here; "
                         "use an f16 or f32 cache (--cache-type-k/-v f16)")


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, kv_start: np.ndarray,
              kv_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int, scale: float,
              out: np.ndarray, blocked: bool = False, window: int = 0,
              softcap: float = 0.0, sinks: np.ndarray | None = None) -> None:
    """`attn.attend.attention` with K and/or V quantized (same contract; a sliding `window` narrows
    each query's cells the same way, `sinks` join the softmax alike; soft-capping is
    refused)."""
    _window_softcap(window, softcap)
    k, v = _check(q, k_cache, v_cache, n_head, n_head_kv, head_dim, out)
    nt = q.shape[0]
    lo = np.ascontiguousarray(kv_start, dtype=np.int64).reshape(-1)
    hi = np.ascontiguousarray(kv_end, dtype=np.int64).reshape(-1)
    if lo.shape[0] != nt or hi.shape[0] != nt:
        raise ValueError("kv_start / kv_end need one entry per query row")
    if nt and (lo.min() < 0 or hi.max() > k.shape[0] or (hi < lo).any()):
        raise ValueError(f"KV window outside the cache of {k.shape[0]} cells")
    if window:
        lo = np.maximum(lo, hi - window)
    _run(q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale, out, blocked,
         rotations(k, v, head_dim), sink_logits(sinks, n_head))


def bind_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   kv_start: np.ndarray, kv_end: np.ndarray, *, n_head: int, n_head_kv: int,
                   head_dim: int, scale: float, out: np.ndarray, blocked: bool = False,
                   window: int = 0, softcap: float = 0.0,
                   sinks: np.ndarray | None = None) -> Callable[[], None]:
    """`attention` over fixed arrays (the op tape), as one call (`attn.attend.bind_attention`
    lists it)."""
    _window_softcap(window, softcap)
    nt = q.shape[0]
    k, v = _check(q, k_cache, v_cache, n_head, n_head_kv, head_dim, out)
    if kv_start.shape != (nt,) or kv_end.shape != (nt,):
        raise ValueError("kv_start / kv_end need one entry per query row")
    rot = rotations(k, v, head_dim)
    sk = sink_logits(sinks, n_head)

    def step() -> None:
        lo, hi = kv_start.astype(np.int64), kv_end.astype(np.int64)
        if window:
            lo = np.maximum(lo, hi - window)
        _run(q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale, out, blocked, rot, sk)

    return step
