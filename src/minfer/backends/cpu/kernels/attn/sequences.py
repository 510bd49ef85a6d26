"""Attention inside each sequence of a batch, without a KV cache: an encoder's self-attention.

Row t's query reads the keys and values of rows [seq_start[t], seq_end[t]) of the same batch:
the whole of its own sequence (bidirectional) when those bounds are its sequence's, so packing
several inputs into one forward changes only the bounds, which are data. Rows sharing their
bounds (a sequence) run together, each sequence and head on its own thread: the scores
scale * q.k are register tiles of the dense GEMM (`linear.dense.tile`) over K transposed, each
one fused multiply-add chain over the columns in order; they are soft-maxed with the row
maximum subtracted, and the values mixed the same way, one chain per column over the keys in
order, then divided by the row's sum. Which tile, thread or neighbour computes an element never
changes its chain, so a sequence's result is bitwise the same alone or packed with others.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.linear.dense import COLS, tile_rows
from minfer.backends.cpu.kernels.simd.llvm import bits_to_f32


@njit(cache=True, error_model="numpy", parallel=True)
def _transpose(k, kt):  # kt[:, :nt] = k.T (kt's pad columns left as they are)
    for c in prange(k.shape[1]):
        for j in range(k.shape[0]):
            kt[c, j] = k[j, c]


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_E = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                   4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))


@njit(inline="always", error_model="numpy", fastmath={"contract"})
def exp_f32(x):
    """e^x for x <= 0 (a soft-max's shifted scores) in f32, to an ulp or two: 2^n times a
    degree-6 polynomial of the remainder (the Cephes form); branch-free, so it vectorises.
    Below -87 it flushes to about 1e-38 where the true value is smaller still."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = _E[0]
    p = p * r + _E[1]
    p = p * r + _E[2]
    p = p * r + _E[3]
    p = p * r + _E[4]
    p = p * r + _E[5]
    p = p * r * r + r + np.float32(1.0)
    return p * bits_to_f32(np.uint32((np.int32(n) + np.int32(127)) << np.int32(23)))


@njit(cache=True, error_model="numpy", parallel=True, fastmath={"contract"})
def _attend_segments(q, kt, v, seg, n_head, n_head_kv, head_dim, scale, out):
    """Each (segment, head) on its own: query rows seg[g, 0]:seg[g, 1] read keys
    seg[g, 2]:seg[g, 3]; scores and the value mix as register tiles (`tile`)."""
    group = n_head // n_head_kv
    n_pairs = seg.shape[0] * n_head
    n_vt = head_dim // COLS
    for w in prange(n_pairs):
        g, h = w // n_head, w % n_head
        t0, t1, s, e = seg[g, 0], seg[g, 1], seg[g, 2], seg[g, 3]
        nq, n = t1 - t0, e - s
        qo, ko = h * head_dim, (h // group) * head_dim
        qv = q[t0:t1, qo:qo + head_dim]
        n_kt = (n + COLS - 1) // COLS
        sc = np.empty((nq, n_kt * COLS), np.float32)
        # scores, COLS keys a tile: one chain per key over the columns. The last tile runs
        # past the segment's keys into the next ones (or kt's pad columns): those scores are
        # never read, and no key's chain depends on its neighbours
        for jb in range(n_kt):
            wt = kt[ko:ko + head_dim, s + jb * COLS:s + (jb + 1) * COLS]
            tile_rows(qv, 0, nq, wt, sc, 0, jb * COLS)
        inv = np.empty(nq, np.float32)
        for i in range(nq):  # soft-max of each row, left unnormalised until the end
            top = np.float32(-np.inf)
            for j in range(n):
                sc[i, j] *= scale
                top = max(top, sc[i, j])
            total = np.float32(0.0)
            for j in range(n):
                sc[i, j] = exp_f32(sc[i, j] - top)
            for j in range(n):
                total += sc[i, j]
            inv[i] = np.float32(1.0) / total
        for cb in range(n_vt):  # the value mix, COLS columns a tile: one chain per column
            wt = v[s:e, ko + cb * COLS:ko + (cb + 1) * COLS]
            tile_rows(sc[:, :n], 0, nq, wt, out, t0, qo + cb * COLS)
        tail = head_dim - n_vt * COLS
        if tail:  # the last columns (SigLIP's head of 72: 8) through one zero-padded tile
            vt = np.zeros((n, COLS), np.float32)
            c0 = ko + n_vt * COLS
            for j in range(n):
                for c in range(tail):
                    vt[j, c] = v[s + j, c0 + c]
            ot = np.empty((nq, COLS), np.float32)
            tile_rows(sc[:, :n], 0, nq, vt, ot, 0, 0)
            for i in range(nq):
                for c in range(tail):
                    out[t0 + i, qo + n_vt * COLS + c] = ot[i, c]
        for i in range(nq):
            for c in range(head_dim):
                out[t0 + i, qo + c] *= inv[i]


def scratch_size(nt: int, kv_width: int) -> int:
    """f32 values of the scratch `bind_sequence_attention` needs for nt rows of K (kv_width
    columns): K transposed plus a tile's width of columns that the last score tile may read."""
    return kv_width * (nt + COLS)


def segments(seq_start: np.ndarray, seq_end: np.ndarray) -> np.ndarray:
    """`[n_seg, 4]` (first row, end row, first key, end key) of each run of rows that share
    their bounds."""
    change = np.flatnonzero((np.diff(seq_start) != 0) | (np.diff(seq_end) != 0)) + 1
    first = np.concatenate([[0], change])
    last = np.concatenate([change, [len(seq_start)]])
    return np.stack([first, last, seq_start[first], seq_end[first]], axis=1).astype(np.int64)


def bind_sequence_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_start: np.ndarray,
                            seq_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int,
                            scale: float, out: np.ndarray,
                            scratch: np.ndarray | None = None) -> Callable[[], None]:
    """out[t] = softmax(scale * q[t].k[s:e].T) @ v[s:e] per head, s:e = seq_start[t]:seq_end[t]
    (grouped-query: head h reads K/V head h // (n_head / n_head_kv)). The bounds are checked
    on every call: they are data. `scratch`: at least `scratch_size(nt, k.shape[1])` f32 values
    for K transposed (and a tile's width of pad columns), which calls that never run at the
    same time may share."""
    nt = q.shape[0]
    if q.shape != (nt, n_head * head_dim) or out.shape != q.shape:
        raise ValueError(f"q / out must be [{nt}, {n_head}*{head_dim}], got {q.shape} / "
                         f"{out.shape}")
    if k.shape != (nt, n_head_kv * head_dim) or v.shape != k.shape or n_head % n_head_kv:
        raise ValueError(f"k / v must be [{nt}, {n_head_kv}*{head_dim}], got {k.shape}")
    size = scratch_size(nt, k.shape[1])
    if scratch is None:
        scratch = np.empty(size, np.float32)
    kt = scratch[:size].reshape(k.shape[1], nt + COLS)
    rows = np.arange(nt)

    def call() -> None:
        if np.any(seq_start < 0) or np.any(seq_end > nt) or np.any(seq_start > rows) \
                or np.any(seq_end <= rows):
            raise ValueError("each row's sequence bounds must lie in the batch and hold the row")
        _transpose(k, kt)
        _attend_segments(q, kt, v, segments(seq_start, seq_end), n_head, n_head_kv, head_dim,
                         np.float32(scale), out)

    return call


def sequence_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_start: np.ndarray,
                       seq_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int,
                       scale: float, out: np.ndarray) -> None:
    bind_sequence_attention(q, k, v, seq_start, seq_end, n_head=n_head, n_head_kv=n_head_kv,
                            head_dim=head_dim, scale=scale, out=out)()
