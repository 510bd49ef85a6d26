"""Blocked attention for many query rows (prefill): scores and value mix through BLAS sgemm.

The cells every row of the batch may see are converted to f32 once per call (any cache format
through `load_head`; V transposed, so both products are `A @ B^T`) and shared by all work
items. A work item is one KV head and a block of `_BLOCK` consecutive query rows; the group's
query heads are stacked as rows (row `i*group + g` is query row i, head g of the group). The
union of the block's windows is walked in tiles of `_TILE` cells with an online softmax, as
flash attention does: `S = Q_blk @ K_tile^T` is one sgemm, each row is masked to its own window
(cells outside it get probability exactly 0), scaled, and its exps taken against the running
maximum (a new maximum rescales the row's output and sum so far); `O += P @ V_tile` is a second
sgemm. The score tile (448 x 256 f32 for Qwen2.5's 7-head groups) stays in L2, where one
score matrix over the whole window (7 MB at 4,096 cells) went through memory on every pass.
The softmax's passes are vector IR (`attn.vector_ir.scale_max` / `exp_sum`), sums in f64; the
output is divided by the sum at the end (the sum with the head's sink logit, where the model
has attention sinks: `arith.sink_inv`). Queries are rounded to f16 first when the cache is f16,
at any row count, as ggml's non-flash attention does (K's f16 vec-dot type): llama-cpp-python's
default, which the reference fixtures use. ggml's flash attention (llama-server's and
llama-imatrix's default) keeps the query f32 from 64 rows on (`GGML_FA_TILE_Q`); following it
moved `minfer imatrix` 10% closer to llama-imatrix's default run (round 19) but away from the
references, so it was left.

The result equals `attention` up to f32 summation order, but that order depends on the block
and tile shapes, so this is only for contexts that are not batch invariant. Work items are
dealt to the workers of a numba parallel loop, each with one scratch buffer; every sgemm is
single-threaded on its numba worker (see `linear.sgemm`: two thread pools on the same cores spin
against each other). On the dev model (pp512, 2 threads) attention took 220-230 ms per prefill
with the per-token kernel and 86-93 ms with the first blocked kernel (one score matrix, numba's
softmax loops). At 4,096 causal rows, one layer's shapes, 2 threads (Intel Xeon, Sapphire
Rapids): 288 ms with that kernel, 190-235 ms with this one.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from minfer.backends.cpu.kernels.attn.kv_formats import NO_SINKS, load_head
from minfer.backends.cpu.kernels.attn.vector_ir import exp_sum, scale_max
from minfer.backends.cpu.kernels.elementwise.arith import fast_exp, sink_inv
from minfer.backends.cpu.kernels.linear.sgemm import SET_THREADS_LOCAL, SGEMM
from minfer.backends.cpu.kernels.simd.llvm import (
    call_int_fn,
    call_sgemm_rm_nt,
    f16_to_f32,
    f32_to_f16,
)

_BLOCK = 64  # query rows per work item (x group query heads = sgemm rows)
_TILE = 256  # KV cells per step of the online softmax (a 448 x 256 score tile sits in L2)
# From this many query rows on, `attention(..., blocked=True)` is used for prefill. Measured on
# 1 thread, causal from cell 0 (per-token vs blocked): nt=16 0.06/0.03 ms, 32 0.14/0.07,
# 128 0.95/0.55, 512 11.8/6.5; below 32 rows there are too few work items to spread over threads.
BLOCKED_MIN_TOKENS = 32


@njit(fastmath=True, cache=True, error_model="numpy")
def _tile_softmax(row, c0, c1, scale, softcap, m_old):
    """One query row's scores in one KV tile, for the online softmax: row[c0:c1] (its cells in
    the tile) become exp(s - m) with s = scale*score (soft-capped when softcap > 0) and m the
    running maximum including this tile, every other cell 0. Returns (m, the tile's sum of the
    exps in f64). The two passes over the cells are vector IR (`attn.vector_ir`)."""
    row[:c0] = np.float32(0.0)
    row[c1:] = np.float32(0.0)
    w = row[c0:c1]
    if softcap > 0:
        inv_cap = np.float32(1.0) / softcap
        for c in range(w.shape[0]):
            w[c] = np.tanh(w[c] * scale * inv_cap) * softcap
        mx = scale_max(w, w.shape[0], np.float32(1.0))
    else:
        mx = scale_max(w, w.shape[0], scale)
    mx = max(mx, m_old)
    return mx, exp_sum(w, w.shape[0], mx)


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
def _block(q, kf, vt, base, kv_start, kv_end, kvh, t0, nb, group, head_dim, scale, softcap,
           sinks, round_q, out, tile, sgemm, set_threads, scratch, total):
    """Query rows [t0, t0+nb) of KV head kvh's query group (one work item), over the KV cells
    of their windows in tiles of `tile` cells; `kf` / `vt` are the head's cells as f32 (V
    transposed) from cell `base` on. `scratch` / `total` are this worker's buffers."""
    lo, hi = _span(kv_start, kv_end, t0, nb, kf.shape[0] + base)
    qb = kvh * group * head_dim
    rows = nb * group
    n_used = vt.shape[1]
    o1 = rows * head_dim
    o2 = o1 + rows * tile
    o3 = o2 + rows * head_dim
    o4 = o3 + rows * head_dim
    qp = scratch[:o1].reshape((rows, head_dim))
    s = scratch[o1:o2].reshape((rows, tile))
    pv = scratch[o2:o3].reshape((rows, head_dim))
    o = scratch[o3:o4].reshape((rows, head_dim))
    m = scratch[o4 : o4 + rows]
    for i in range(nb):
        qr = q[t0 + i, qb : qb + group * head_dim]
        for g in range(group):
            r = i * group + g
            qpr = qp[r]
            for d in range(head_dim):
                x = qr[g * head_dim + d]
                qpr[d] = f16_to_f32(f32_to_f16(x)) if round_q else x
                o[r, d] = np.float32(0.0)
            m[r] = np.float32(-np.inf)
            total[r] = 0.0
    prev = call_int_fn(set_threads, 1)
    for c0 in range(lo, hi, tile):
        n = min(hi, c0 + tile) - c0
        call_sgemm_rm_nt(sgemm, rows, n, head_dim, qp.ctypes.data, head_dim,
                         kf[c0 - base :].ctypes.data, head_dim, s.ctypes.data, tile)
        for i in range(nb):
            a = min(max(kv_start[t0 + i] - c0, 0), n)
            b = min(max(kv_end[t0 + i] - c0, 0), n)
            for g in range(group):
                r = i * group + g
                if b <= a:  # none of this row's cells in the tile
                    sr = s[r, :n]
                    for c in range(n):
                        sr[c] = np.float32(0.0)
                    continue
                mx, part = _tile_softmax(s[r, :n], a, b, scale, softcap, m[r])
                corr = fast_exp(m[r] - mx) if m[r] > -np.inf else np.float32(0.0)
                if corr != np.float32(1.0):
                    orow = o[r]
                    for d in range(head_dim):
                        orow[d] *= corr
                total[r] = total[r] * corr + part
                m[r] = mx
        call_sgemm_rm_nt(sgemm, rows, head_dim, n, s.ctypes.data, tile,
                         vt[:, c0 - base :].ctypes.data, n_used, pv.ctypes.data, head_dim)
        for r in range(rows):
            orow, prow = o[r], pv[r]
            for d in range(head_dim):
                orow[d] += prow[d]
    call_int_fn(set_threads, prev)
    for i in range(nb):
        for g in range(group):
            r = i * group + g
            if total[r] <= 0:
                inv = np.float32(0.0)
            elif sinks.shape[0]:
                inv = sink_inv(total[r], m[r], sinks[kvh * group + g])
            else:
                inv = np.float32(1.0 / total[r])
            for d in range(head_dim):
                out[t0 + i, qb + g * head_dim + d] = o[r, d] * inv


@njit(parallel=True, cache=True)
def _load_kv(k, v, base, n_used, n_head_kv, head_dim):
    """Cells [base, base + n_used) of every KV head as f32: K [kvh, cell, d], V^T [kvh, d, cell]
    (any cache format through `load_head`), once per call for every work item to share."""
    kf = np.empty((n_head_kv, n_used, head_dim), np.float32)
    vt = np.empty((n_head_kv, head_dim, n_used), np.float32)
    for c in prange(n_used):
        for h in range(n_head_kv):
            load_head(k[base + c], h * head_dim, head_dim, kf[h, c])
            load_head(v[base + c], h * head_dim, head_dim, vt[h, :, c])
    return kf, vt


@njit(parallel=True, cache=True)
def _attention_blocked(q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale, softcap,
                       sinks, round_q, out, block, tile, n_workers, sgemm, set_threads):
    nt = q.shape[0]
    group = n_head // n_head_kv
    base, end = _span(kv_start, kv_end, 0, nt, k.shape[0])
    if end <= base:
        base, end = 0, 0
    kf, vt = _load_kv(k, v, base, end - base, n_head_kv, head_dim)
    n_blocks = (nt + block - 1) // block
    n_items = n_blocks * n_head_kv
    rows = block * group
    size = rows * (3 * head_dim + tile + 1)
    n_workers = max(1, min(n_workers, n_items))
    # one scratch buffer per worker (per-item allocations of ~1 MB went through mmap/munmap,
    # whose page faults and TLB shootdowns serialised the threads); items are dealt round-robin
    # in zig-zag block order (0, last, 1, last-1, ...) so cheap early and expensive late causal
    # blocks mix on every worker
    for w in prange(n_workers):
        scratch = np.empty(size, np.float32)
        total = np.empty(rows, np.float64)
        for item in range(w, n_items, n_workers):
            kvh = item % n_head_kv
            j = item // n_head_kv
            b = j // 2 if j % 2 == 0 else n_blocks - 1 - j // 2
            t0 = b * block
            _block(q, kf[kvh], vt[kvh], base, kv_start, kv_end, kvh, t0,
                   min(nt, t0 + block) - t0, group, head_dim, scale, softcap, sinks, round_q,
                   out, tile, sgemm, set_threads, scratch, total)


def blocked_available() -> bool:
    """Whether a callable single-threaded BLAS sgemm was found (else only `attention` runs)."""
    return bool(SGEMM)


def attention_blocked(q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: np.ndarray,
                      hi: np.ndarray, n_head: int, n_head_kv: int, head_dim: int, scale: float,
                      out: np.ndarray, block: int = 0, softcap: float = 0.0,
                      tile: int = _TILE, sinks: np.ndarray = NO_SINKS) -> None:
    """The blocked kernel on arguments already checked and normalised by `attention` (caches as
    f32 or uint16 f16 bits; an f16 cache rounds the query to f16 here, on the fly; `sinks`:
    f32 [n_head] sink logits, or empty)."""
    qc = np.ascontiguousarray(q, dtype=np.float32)
    if block <= 0:  # smaller blocks while there are fewer than two work items per thread
        block = _BLOCK
        while block > 16 and -(-q.shape[0] // block) * n_head_kv < 2 * get_num_threads():
            block //= 2
    _attention_blocked(qc, k, v, lo, hi, n_head, n_head_kv, head_dim, np.float32(scale),
                       np.float32(softcap), sinks, k.dtype == np.uint16, out, block, tile,
                       get_num_threads(), SGEMM, SET_THREADS_LOCAL)
