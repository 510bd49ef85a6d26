"""Blocked attention for many query rows (prefill): scores and value mix through BLAS sgemm.

For each KV head and block of `_BLOCK` consecutive query rows, the union of the rows' windows
`[lo, hi)` is taken as one contiguous slice of the cache; the K/V slice is converted to f32 once
(V transposed, so both products are `A @ B^T`). The group's query heads are stacked as rows
(row `i*group + g` is query row i, head g of the group), so one sgemm gives every score
`S = Q_blk @ K[lo:hi]^T`. Each row is then masked to its own window (cells outside it get
probability exactly 0), scaled, and soft-maxed in f32 with max subtraction and an f64 exp sum,
as `attention`; `O = P @ V[lo:hi]` is a second sgemm, scaled by 1/sum afterwards. Queries are
rounded to f16 first when the cache is f16 (by the caller, as `attention`).

The result equals `attention` up to f32 summation order, but that order depends on the block
shape, so this is only for contexts that are not batch invariant. Work items are
(KV head, query block), dealt to the workers of a numba parallel loop, each with one scratch
buffer; every sgemm is single-threaded on its numba worker (see `prefill`: two thread pools on
the same cores spin against each other). On the dev model (pp512, 2 threads) attention took
220-230 ms per prefill with the per-token kernel and 86-93 ms with this one.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from ._llvm import call_int_fn, call_sgemm_rm_nt, f16_to_f32, f32_to_f16
from .elementwise import fast_exp
from .kv_formats import load_head
from .prefill import SET_THREADS_LOCAL, SGEMM

_BLOCK = 64  # query rows per work item (x group query heads = sgemm rows)
# From this many query rows on, `attention(..., blocked=True)` is used for prefill. Measured on
# 1 thread, causal from cell 0 (per-token vs blocked): nt=16 0.06/0.03 ms, 32 0.14/0.07,
# 128 0.95/0.55, 512 11.8/6.5; below 32 rows there are too few work items to spread over threads.
BLOCKED_MIN_TOKENS = 32


@njit(fastmath=True, cache=True, error_model="numpy")
def _softmax_row(row, c0, c1, scale, softcap):
    """row[c0:c1] = exp(s - max) in place with s = scale*row (soft-capped when softcap > 0),
    zeros elsewhere; returns 1/sum (0 if empty).
    Loops run over slices from index 0, so no negative-index wraparound blocks vectorisation."""
    head = row[:c0]
    for c in range(head.shape[0]):
        head[c] = np.float32(0.0)
    tail = row[c1:]
    for c in range(tail.shape[0]):
        tail[c] = np.float32(0.0)
    w = row[c0:c1]
    mx = np.float32(-np.inf)
    if softcap > 0:
        inv_cap = np.float32(1.0) / softcap
        for c in range(w.shape[0]):
            w[c] = np.tanh(w[c] * scale * inv_cap) * softcap
    else:
        for c in range(w.shape[0]):
            w[c] = w[c] * scale
    for c in range(w.shape[0]):
        mx = max(mx, w[c])
    for c in range(w.shape[0]):
        w[c] = fast_exp(w[c] - mx)
    total = 0.0
    for c in range(w.shape[0]):
        total += w[c]
    return np.float32(1.0 / total) if w.shape[0] else np.float32(0.0)


@njit(fastmath=True, cache=True, error_model="numpy")
def _span(kv_start, kv_end, t0, nb, n_ctx):
    """The union [lo, hi) of the non-empty windows of rows [t0, t0+nb) (hi <= lo: none)."""
    lo = n_ctx
    hi = 0
    for i in range(nb):
        if kv_end[t0 + i] > kv_start[t0 + i]:
            lo = min(lo, kv_start[t0 + i])
            hi = max(hi, kv_end[t0 + i])
    return lo, hi


@njit(fastmath=True, cache=True, error_model="numpy")
def _block(q, k, v, kv_start, kv_end, kvh, t0, nb, group, head_dim, scale, softcap, round_q, out,
           sgemm, set_threads, scratch):
    """Query rows [t0, t0+nb) of KV head kvh's query group (one work item); `scratch` is this
    worker's f32 buffer, large enough for the item (see `_scratch_size`)."""
    lo, hi = _span(kv_start, kv_end, t0, nb, k.shape[0])
    n = max(hi - lo, 0)
    kb = kvh * head_dim
    qb = kvh * group * head_dim
    rows = nb * group
    if n == 0:
        for i in range(nb):
            for c in range(group * head_dim):
                out[t0 + i, qb + c] = np.float32(0.0)
        return
    o0 = n * head_dim
    o1 = o0 + n * head_dim
    o2 = o1 + rows * head_dim
    o3 = o2 + rows * n
    o4 = o3 + rows * head_dim
    kf = scratch[:o0].reshape((n, head_dim))
    vt = scratch[o0:o1].reshape((head_dim, n))
    qp = scratch[o1:o2].reshape((rows, head_dim))
    s = scratch[o2:o3].reshape((rows, n))
    o = scratch[o3:o4].reshape((rows, head_dim))
    inv = scratch[o4 : o4 + rows]
    for c in range(n):  # any cache format (f32, f16 bits, q8_0/q4_0 blocks) to f32
        load_head(k[lo + c], kb, head_dim, kf[c])
    for c in range(n):
        load_head(v[lo + c], kb, head_dim, vt[:, c])
    for i in range(nb):
        qr = q[t0 + i, qb : qb + group * head_dim]
        for g in range(group):
            qpr = qp[i * group + g]
            for d in range(head_dim):
                x = qr[g * head_dim + d]
                qpr[d] = f16_to_f32(f32_to_f16(x)) if round_q else x
    prev = call_int_fn(set_threads, 1)
    call_sgemm_rm_nt(sgemm, rows, n, head_dim, qp.ctypes.data, head_dim, kf.ctypes.data,
                     head_dim, s.ctypes.data, n)
    for i in range(nb):
        c0 = kv_start[t0 + i] - lo
        c1 = kv_end[t0 + i] - lo
        if c1 <= c0:
            c0 = 0
            c1 = 0
        for g in range(group):
            r = i * group + g
            inv[r] = _softmax_row(s[r], c0, c1, scale, softcap)
    call_sgemm_rm_nt(sgemm, rows, head_dim, n, s.ctypes.data, n, vt.ctypes.data, n,
                     o.ctypes.data, head_dim)
    call_int_fn(set_threads, prev)
    for i in range(nb):
        for g in range(group):
            r = i * group + g
            for d in range(head_dim):
                out[t0 + i, qb + g * head_dim + d] = o[r, d] * inv[r]


@njit(parallel=True, cache=True)
def _attention_blocked(q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale, softcap,
                       round_q, out, block, n_workers, sgemm, set_threads):
    nt = q.shape[0]
    group = n_head // n_head_kv
    n_blocks = (nt + block - 1) // block
    n_items = n_blocks * n_head_kv
    n_max = 0
    for b in range(n_blocks):
        lo, hi = _span(kv_start, kv_end, b * block, min(nt, b * block + block) - b * block,
                       k.shape[0])
        n_max = max(n_max, hi - lo)
    rows = block * group
    size = 2 * n_max * head_dim + rows * (2 * head_dim + n_max + 1)
    n_workers = max(1, min(n_workers, n_items))
    # one scratch buffer per worker (per-item allocations of ~1 MB went through mmap/munmap,
    # whose page faults and TLB shootdowns serialised the threads); items are dealt round-robin
    # in zig-zag block order (0, last, 1, last-1, ...) so cheap early and expensive late causal
    # blocks mix on every worker
    for w in prange(n_workers):
        scratch = np.empty(size, np.float32)
        for item in range(w, n_items, n_workers):
            kvh = item % n_head_kv
            j = item // n_head_kv
            b = j // 2 if j % 2 == 0 else n_blocks - 1 - j // 2
            t0 = b * block
            _block(q, k, v, kv_start, kv_end, kvh, t0, min(nt, t0 + block) - t0, group,
                   head_dim, scale, softcap, round_q, out, sgemm, set_threads, scratch)


def blocked_available() -> bool:
    """Whether a callable single-threaded BLAS sgemm was found (else only `attention` runs)."""
    return bool(SGEMM)


def attention_blocked(q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: np.ndarray,
                      hi: np.ndarray, n_head: int, n_head_kv: int, head_dim: int, scale: float,
                      out: np.ndarray, block: int = 0, softcap: float = 0.0) -> None:
    """The blocked kernel on arguments already checked and normalised by `attention` (caches as
    f32 or uint16 f16 bits; an f16 cache rounds the query to f16 here, on the fly)."""
    qc = np.ascontiguousarray(q, dtype=np.float32)
    if block <= 0:  # smaller blocks while there are fewer than two work items per thread
        block = _BLOCK
        while block > 16 and -(-q.shape[0] // block) * n_head_kv < 2 * get_num_threads():
            block //= 2
    _attention_blocked(qc, k, v, lo, hi, n_head, n_head_kv, head_dim, np.float32(scale),
                       np.float32(softcap), k.dtype == np.uint16, out, block, get_num_threads(),
                       SGEMM, SET_THREADS_LOCAL)
