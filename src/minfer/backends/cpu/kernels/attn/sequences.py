"""Attention inside each sequence of a batch, without a KV cache: an encoder's self-attention.

Row t's query reads the keys and values of rows [seq_start[t], seq_end[t]) of the same batch:
the whole of its own sequence (bidirectional) when those bounds are its sequence's, so packing
several inputs into one forward changes only the bounds, which are data. Scores are
scale * q.k in f32 (K transposed first, so a row's dots run with the keys in the vector lanes,
each one fused multiply-add chain over the columns in order), soft-maxed with the row maximum
subtracted, and the values mixed in f32 key by key. Each row runs the same loops in the same
order whatever rows surround it, so a sequence's result is bitwise the same alone or packed
with others (only contraction into fused multiply-adds is allowed: nothing is reassociated).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange


@njit(cache=True, error_model="numpy", parallel=True)
def _transpose(k, kt):
    for c in prange(k.shape[1]):
        for j in range(k.shape[0]):
            kt[c, j] = k[j, c]


@njit(cache=True, error_model="numpy", parallel=True, fastmath={"contract"})
def _attend_rows(q, kt, v, seq_start, seq_end, n_head, n_head_kv, head_dim, scale, out):
    group = n_head // n_head_kv
    for t in prange(q.shape[0]):
        s, e = seq_start[t], seq_end[t]
        n = e - s
        scores = np.empty(n, np.float32)
        acc = np.empty(head_dim, np.float32)
        for h in range(n_head):
            qo = h * head_dim
            ko = (h // group) * head_dim
            # q . k for every key at once, the keys in the lanes: one chain per key over the
            # columns in order (K transposed, so the key loop is contiguous)
            scores[:] = 0.0
            for c in range(head_dim):
                qc = q[t, qo + c]
                kr = kt[ko + c, s:e]
                for j in range(n):
                    scores[j] += qc * kr[j]
            top = np.float32(-np.inf)
            for j in range(n):
                scores[j] *= scale
                top = max(top, scores[j])
            total = np.float32(0.0)
            for j in range(n):
                p = np.exp(scores[j] - top)
                scores[j] = p
                total += p
            acc[:] = 0.0
            for j in range(n):
                p = scores[j]
                vr = v[s + j, ko:ko + head_dim]
                for c in range(head_dim):
                    acc[c] += p * vr[c]
            inv = np.float32(1.0) / total
            for c in range(head_dim):
                out[t, qo + c] = acc[c] * inv


def bind_sequence_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_start: np.ndarray,
                            seq_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int,
                            scale: float, out: np.ndarray) -> Callable[[], None]:
    """out[t] = softmax(scale * q[t].k[s:e].T) @ v[s:e] per head, s:e = seq_start[t]:seq_end[t]
    (grouped-query: head h reads K/V head h // (n_head / n_head_kv)). The bounds are checked
    on every call: they are data."""
    nt = q.shape[0]
    if q.shape != (nt, n_head * head_dim) or out.shape != q.shape:
        raise ValueError(f"q / out must be [{nt}, {n_head}*{head_dim}], got {q.shape} / "
                         f"{out.shape}")
    if k.shape != (nt, n_head_kv * head_dim) or v.shape != k.shape or n_head % n_head_kv:
        raise ValueError(f"k / v must be [{nt}, {n_head_kv}*{head_dim}], got {k.shape}")
    kt = np.empty((k.shape[1], nt), np.float32)  # the tape's own scratch
    run = partial(_attend_rows, q, kt, v, seq_start, seq_end, n_head, n_head_kv, head_dim,
                  np.float32(scale), out)
    rows = np.arange(nt)

    def call() -> None:
        if np.any(seq_start < 0) or np.any(seq_end > nt) or np.any(seq_start > rows) \
                or np.any(seq_end <= rows):
            raise ValueError("each row's sequence bounds must lie in the batch and hold the row")
        _transpose(k, kt)
        run()

    return call


def sequence_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_start: np.ndarray,
                       seq_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int,
                       scale: float, out: np.ndarray) -> None:
    bind_sequence_attention(q, k, v, seq_start, seq_end, n_head=n_head, n_head_kv=n_head_kv,
                            head_dim=head_dim, scale=scale, out=out)()
