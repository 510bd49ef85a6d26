"""Attention inside each sequence of a batch, without a KV cache: an encoder's self-attention.

Row t's query reads the keys and values of rows [seq_start[t], seq_end[t]) of the same batch:
the whole of its own sequence (bidirectional) when those bounds are its sequence's, so packing
several inputs into one forward changes only the bounds, which are data. Scores are
scale * q.k in f32, soft-maxed with the row maximum subtracted, and the values mixed in f32.
Each row runs the same loops in the same order whatever rows surround it, so a sequence's
result is bitwise the same alone or packed with others (no fast-math: nothing is reassociated).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange


@njit(cache=True, error_model="numpy", parallel=True)
def _attend_rows(q, k, v, seq_start, seq_end, n_head, n_head_kv, head_dim, scale, out):
    group = n_head // n_head_kv
    for t in prange(q.shape[0]):
        s, e = seq_start[t], seq_end[t]
        scores = np.empty(e - s, np.float32)
        acc = np.empty(head_dim, np.float32)
        for h in range(n_head):
            qo = h * head_dim
            ko = (h // group) * head_dim
            top = np.float32(-np.inf)
            for j in range(s, e):
                d = np.float32(0.0)
                for c in range(head_dim):
                    d += q[t, qo + c] * k[j, ko + c]
                d *= scale
                scores[j - s] = d
                top = max(top, d)
            total = np.float32(0.0)
            for j in range(e - s):
                p = np.exp(scores[j] - top)
                scores[j] = p
                total += p
            acc[:] = 0.0
            for j in range(s, e):
                p = scores[j - s]
                for c in range(head_dim):
                    acc[c] += p * v[j, ko + c]
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
    run = partial(_attend_rows, q, k, v, seq_start, seq_end, n_head, n_head_kv, head_dim,
                  np.float32(scale), out)

    def call() -> None:
        rows = np.arange(nt)
        if np.any(seq_start < 0) or np.any(seq_end > nt) or np.any(seq_start > rows) \
                or np.any(seq_end <= rows):
            raise ValueError("each row's sequence bounds must lie in the batch and hold the row")
        run()

    return call


def sequence_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_start: np.ndarray,
                       seq_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int,
                       scale: float, out: np.ndarray) -> None:
    bind_sequence_attention(q, k, v, seq_start, seq_end, n_head=n_head, n_head_kv=n_head_kv,
                            head_dim=head_dim, scale=scale, out=out)()
