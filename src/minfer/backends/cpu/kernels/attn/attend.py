"""Causal / windowed multi-head attention over a KV cache, with grouped-query heads, and the
cache writes that feed it.

`attention`: query t attends to cache cells `[kv_start[t], kv_end[t])` (the window is data, so a
batch mixing sequences needs no new code path). Attention sinks (gpt-oss: one learned logit per
head) join each softmax's denominator after its sum (`arith.sink_inv`); without them (`sinks`
empty) every kernel computes the same bits as before they existed. Query head h reads KV head h //
(n_head / n_head_kv). Scores and softmax are f32 with max subtraction; the exp sum is accumulated
in f64 like ggml's `ggml_vec_soft_max_f32`; exp is the vectorisable `fast_exp` (ggml's SIMD softmax
uses a polynomial exp as well). With an f16 cache the query is rounded to f16 before the q.k dot,
as ggml does (its vec_dot type for F16 is F16); the value mix accumulates in f32. Work is split
over (token, KV head) so the K/V rows of a window are read once for the whole query-head group.
Scores and value mix run as vector IR where they can (`attn.vector_ir`: scores summed sixteen cells
at a time, the value mix's accumulators in registers). From `ROWS_MIN_TOKENS` rows on (a
batch-invariant prefill, a speculative verify) reading shared cells, with a work item for every
thread, the same arithmetic runs row-blocked (`_attention_rows`): each tile of K/V cells serves
ROWS (16) rows while it is in L1, and every value keeps its bits, so a row's result never depends
on which kernel computed it. One layer of a 4,096-row causal prefill on the development model's
shapes: 1,176 ms with numba's softmax loops, 690 with the softmax in vector IR, 590-640 row-blocked
(Intel Xeon, Sapphire Rapids, 2 threads).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import get_num_threads, njit, prange

from minfer.backends.cpu.kernels.attn import quantized_kv as kv_quant
from minfer.backends.cpu.kernels.attn.blocked import attention_blocked, blocked_available
from minfer.backends.cpu.kernels.attn.kv_formats import (
    bind_store_kv,
    check_query_heads,
    sink_logits,
)
from minfer.backends.cpu.kernels.attn.vector_ir import BLOCK as SCORE_BLOCK
from minfer.backends.cpu.kernels.attn.vector_ir import (
    COLUMNS,
    HAS_MIX,
    MAX_HEAD_DIM,
    k_columns,
    scores_from,
    value_mix,
    value_mix_on,
)
from minfer.backends.cpu.kernels.attn.vector_ir import scores as ir_scores
from minfer.backends.cpu.kernels.elementwise.arith import softmax_groups
from minfer.backends.cpu.kernels.quant.activations import (
    Q8Blocks,
    Q8KBlocks,
    bind_quantize_q8_0,
    bind_quantize_q8_k,
    quantize_q8_0_blocks,
    quantize_q8_k_blocks,
)
from minfer.backends.cpu.kernels.region.parts import share
from minfer.backends.cpu.kernels.simd.llvm import as_f32, f16_to_f32, f32_to_f16


@njit(inline="always")
def _attention_item(item, q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale,
                    softcap, sinks, out):
    """Query row item // n_head_kv, KV head item % n_head_kv (every query head of its group)."""
    group = n_head // n_head_kv
    t = item // n_head_kv
    kvh = item % n_head_kv
    s0 = kv_start[t]
    n = kv_end[t] - s0
    kb = kvh * head_dim
    qb = kvh * group * head_dim  # the group's query heads are adjacent
    scores = np.empty((group, max(n, 1)), np.float32)
    if HAS_MIX and head_dim % COLUMNS == 0 and head_dim <= MAX_HEAD_DIM:
        qg = np.empty((group, head_dim), np.float32)  # (q may be any 2-D view)
        for g in range(group):
            for j in range(head_dim):
                qg[g, j] = q[t, qb + g * head_dim + j]
        ir_scores(qg, k, v, s0, n, kb, scale, scores)
    else:
        for c in range(n):  # each K row is read once for the whole group
            krow = k[s0 + c, kb : kb + head_dim]
            for g in range(group):
                qh = q[t, qb + g * head_dim : qb + (g + 1) * head_dim]
                dot = np.float32(0.0)
                for j in range(head_dim):
                    dot += qh[j] * as_f32(krow[j])
                scores[g, c] = dot * scale
    if softcap > 0:
        for g in range(group):
            for c in range(n):
                scores[g, c] = np.tanh(scores[g, c] * (np.float32(1.0) / softcap)) * softcap
    inv = softmax_groups(scores, group, n, sinks, kvh * group)
    acc = np.zeros((group, head_dim), np.float32)
    if HAS_MIX and head_dim % COLUMNS == 0:  # the same sums, accumulators in registers
        value_mix(scores, v, s0, n, kb, acc)
    else:
        for c in range(n):
            vrow = v[s0 + c, kb : kb + head_dim]
            for g in range(group):
                p = scores[g, c]
                for j in range(head_dim):
                    acc[g, j] += p * as_f32(vrow[j])
    for g in range(group):
        for j in range(head_dim):
            out[t, qb + g * head_dim + j] = acc[g, j] * inv[g]


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _attention(q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale, softcap, sinks,
               out):
    for item in prange(q.shape[0] * n_head_kv):
        _attention_item(item, q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale,
                        softcap, sinks, out)


@njit(fastmath=True, cache=True, error_model="numpy")
def _attention_part(part, n_parts, q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim,
                    scale, softcap, sinks, out):
    """`_attention`'s items for part `part` of `n_parts` (a parallel region's thread)."""
    n = q.shape[0] * n_head_kv
    for item in range(*share(part, n_parts, n)):
        _attention_item(item, q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale,
                        softcap, sinks, out)


@njit(inline="always")
def _quantize_heads(item, n_head, n_head_kv, head_dim, out, qs, qd, qaux, qisum):
    """Quantize the output columns of `item` (its query row's group of heads; whole blocks,
    checked by `bind_attention`) into the output projection's activation: Q8_0 blocks of 32
    (qaux: Q8_1's sums) or, with qisum None, Q8_K blocks of 256 (qaux: bsums)."""
    width = n_head // n_head_kv * head_dim
    t, c0 = item // n_head_kv, item % n_head_kv * width
    if qisum is None:
        quantize_q8_k_blocks(out, qs, qd, qaux, t, c0 // 256, (c0 + width) // 256)
    else:
        quantize_q8_0_blocks(out, qs, qd, qaux, qisum, t, c0 // 32, (c0 + width) // 32)


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _attention_quant(q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale, softcap,
                     sinks, out, qs, qd, qaux, qisum):
    """`_attention`, each item's output then quantized by the thread that computed it
    (`fusion.fuse_attn_quant`): the bits of `_attention` and a quantize step after it."""
    for item in prange(q.shape[0] * n_head_kv):
        _attention_item(item, q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale,
                        softcap, sinks, out)
        _quantize_heads(item, n_head, n_head_kv, head_dim, out, qs, qd, qaux, qisum)


@njit(fastmath=True, cache=True, error_model="numpy")
def _attention_quant_part(part, n_parts, q, k, v, kv_start, kv_end, n_head, n_head_kv,
                          head_dim, scale, softcap, sinks, out, qs, qd, qaux, qisum):
    """`_attention_quant`'s items for part `part` of `n_parts` (a parallel region's thread)."""
    n = q.shape[0] * n_head_kv
    for item in range(*share(part, n_parts, n)):
        _attention_item(item, q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale,
                        softcap, sinks, out)
        _quantize_heads(item, n_head, n_head_kv, head_dim, out, qs, qd, qaux, qisum)


# The row-blocked form of `_attention` (`_attention_rows`), from this many query rows on: a work
# item is ROWS consecutive rows of one KV head, and the cells of their windows go in tiles of
# CELL_TILE, each tile's K and V rows used by every row of the item while they sit in L1, where
# the per-row form streams each row's whole window from L2/L3 on its own. 16 rows: each K tile
# transposed once for twice the rows of 8, and longer runs of (row, head) pairs; 4-8% faster
# than 8 at 32-512 rows and depths 0-6,000 (2 threads, Intel SPR), the scores scratch per worker
# 16 x group x window f32.
ROWS = 16
CELL_TILE = 64
# From 4 rows (was 16): a verify of 8 rows of one sequence at depth 500 (1.5B, 2 KV heads,
# 2 threads, Intel SPR) took 7.0 ms of attention a step per row, 6.1 ms row-blocked; 4 rows
# 4.5 / 4.3; at 2 rows the per-row kernel was as fast
ROWS_MIN_TOKENS = 4


@njit(inline="always")
def _in_tile(s0, e0, c0, c1):
    """The cells [a, e) of window [s0, e0) inside tile [c0, c1) (e <= a: none)."""
    return max(s0, c0), min(e0, c1)


@njit(inline="always")
def _row_run(kv_start, kv_end, t0, i, nb, c0, c1):
    """(a, e, j): the cells [a, e) of tile [c0, c1) in row i's window (e <= a: none), and the
    end j of the run of rows from i (< nb) whose windows hold those same cells from the same
    start."""
    s0 = kv_start[t0 + i]
    a, e = _in_tile(s0, kv_end[t0 + i], c0, c1)
    j = i + 1
    while j < nb and kv_start[t0 + j] == s0 and _in_tile(s0, kv_end[t0 + j], c0, c1) == (a, e):
        j += 1
    return a, e, j


@njit(fastmath=True, cache=True, error_model="numpy")
def _rows_item(q, k, v, kv_start, kv_end, kvh, t0, nb, group, head_dim, scale, softcap, sinks,
               out, tile, sc, qg, acc, kt):
    """Rows [t0, t0+nb) of KV head kvh: every value as `_attention` computes it, bit for bit.
    Each cell's score is a dot of a fixed order whichever call computes it (`scores_from` on
    the tile `k_columns` transposed, as `ir_scores` computes it per row), the
    softmax runs on each row's whole window, and the value mix carries its chain of fused
    multiply-adds from tile to tile in cell order (`value_mix_on`)."""
    kb = kvh * head_dim
    qb = kvh * group * head_dim
    lo, hi = k.shape[0], 0
    for i in range(nb):
        t = t0 + i
        if kv_end[t] > kv_start[t]:
            lo = min(lo, kv_start[t])
            hi = max(hi, kv_end[t])
        for g in range(group):
            for j in range(head_dim):
                qg[i, g, j] = q[t, qb + g * head_dim + j]
                acc[i, g, j] = np.float32(0.0)
    # (row, head) pairs as the rows of one matrix: a run of rows with the same cells in a tile
    # (every row of a sequence's chunk but on the diagonal tile) is one `scores_from` call and
    # one `value_mix_on` call, whose passes take four pairs at a time (7 heads per row alone:
    # passes of 4, 2 and 1 heads, the last two short of independent chains of fused
    # multiply-adds, and a V row widened three times per row). Alone on 1 thread (Intel SPR,
    # 315 rows at depth 1,212, 2 KV heads of 7): scores 9.2 -> 7.5 ms, value mix 7.8 -> 6.4 ms
    qp = qg.reshape(qg.shape[0] * group, head_dim)
    sp = sc.reshape(sc.shape[0] * group, sc.shape[2])
    for c0 in range(lo, hi, tile):
        c1 = min(hi, c0 + tile)
        k_columns(k, c0, c1 - c0, kb, kt)  # the tile's K rows as columns, once for every row
        i = 0
        while i < nb:
            a, e, j = _row_run(kv_start, kv_end, t0, i, nb, c0, c1)
            if e > a:
                scores_from(qp[i * group : j * group], kt, a - c0, e - a, scale,
                            sp[i * group : j * group, a - kv_start[t0 + i] :])
            i = j
    for i in range(nb):
        n = max(kv_end[t0 + i] - kv_start[t0 + i], 0)
        if softcap > 0:
            for g in range(group):
                for c in range(n):
                    sc[i, g, c] = np.tanh(sc[i, g, c] * (np.float32(1.0) / softcap)) * softcap
        inv = softmax_groups(sc[i], group, n, sinks, kvh * group)
        for g in range(group):
            qg[i, g, 0] = inv[g]  # the query row is spent: keep 1/sum there
    ap = acc.reshape(acc.shape[0] * group, head_dim)
    for c0 in range(lo, hi, tile):
        c1 = min(hi, c0 + tile)
        i = 0
        while i < nb:  # runs of rows as for the scores: four pairs' accumulators a pass
            a, e, j = _row_run(kv_start, kv_end, t0, i, nb, c0, c1)
            if e > a:
                value_mix_on(sp[i * group : j * group, a - kv_start[t0 + i] :], v, a, e - a, kb,
                             ap[i * group : j * group])
            i = j
    for i in range(nb):
        for g in range(group):
            for j in range(head_dim):
                out[t0 + i, qb + g * head_dim + j] = acc[i, g, j] * qg[i, g, 0]


@njit(inline="always")
def _rows_worker(w, n_workers, q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale,
                 softcap, sinks, out, rows, tile):
    """Worker w of n_workers (at most the work items) of `_attention_rows`: its items,
    dealt round-robin, on one scratch set."""
    nt = q.shape[0]
    group = n_head // n_head_kv
    width = 1
    for t in range(nt):
        width = max(width, kv_end[t] - kv_start[t])
    n_blocks = (nt + rows - 1) // rows
    n_items = n_blocks * n_head_kv
    sc = np.empty((rows, group, width), np.float32)
    qg = np.empty((rows, group, head_dim), np.float32)
    acc = np.empty((rows, group, head_dim), np.float32)
    kt = np.empty((head_dim, tile + SCORE_BLOCK), np.float32)
    for item in range(w, n_items, n_workers):
        kvh = item % n_head_kv
        j = item // n_head_kv  # zig-zag block order: cheap early and dear late causal rows
        b = j // 2 if j % 2 == 0 else n_blocks - 1 - j // 2
        t0 = b * rows
        _rows_item(q, k, v, kv_start, kv_end, kvh, t0, min(nt, t0 + rows) - t0, group,
                   head_dim, scale, softcap, sinks, out, tile, sc, qg, acc, kt)


@njit(parallel=True, cache=True)
def _attention_rows(q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim, scale, softcap,
                    sinks, out, rows, tile, n_workers):
    """`_attention` with the vector-IR kernels, ROWS query rows per work item; items are dealt
    to the workers round-robin, one scratch set per worker (see `_rows_item`)."""
    n_items = (q.shape[0] + rows - 1) // rows * n_head_kv
    n_workers = max(1, min(n_workers, n_items))
    for w in prange(n_workers):
        _rows_worker(w, n_workers, q, k, v, kv_start, kv_end, n_head, n_head_kv, head_dim,
                     scale, softcap, sinks, out, rows, tile)


def _rows_apply(nt: int, head_dim: int) -> bool:
    """Whether `_attention_rows` serves this call (else `_attention`): enough rows, and the
    head shape the vector-IR kernels take."""
    return (nt >= ROWS_MIN_TOKENS and HAS_MIX and head_dim % COLUMNS == 0
            and head_dim <= MAX_HEAD_DIM)


@njit(cache=True)
def _windows_shared(lo, hi, rows):  # pragma: no cover - compiled
    """Whether blocks of `rows` consecutive query rows share their KV cells: their windows
    add up to more than twice the cells they span (a prefill's causal rows: about `rows`
    times). A server's decode rows, one per sequence, each read their own slot's cells: the
    row-blocked kernel would only walk the gaps between them."""
    total, span = 0, 0
    for b0 in range(0, lo.shape[0], rows):
        a, e = hi[b0], lo[b0]
        for t in range(b0, min(lo.shape[0], b0 + rows)):
            if hi[t] > lo[t]:
                total += hi[t] - lo[t]
                a, e = min(a, lo[t]), max(e, hi[t])
        span += max(e - a, 0)
    return total > 2 * span


def takes_rows(lo: np.ndarray, hi: np.ndarray, n_head_kv: int, head_dim: int,
               n_threads: int) -> bool:
    """Whether the batch-invariant path runs these windows row-blocked: `_rows_apply`'s rows
    and head shape, a work item (ROWS rows of one KV head) for every thread, and rows that
    share their cells (`_windows_shared`: a prefill chunk's or a verify's rows of one sequence,
    not a server's decode rows of many)."""
    nt = lo.shape[0]
    return (_rows_apply(nt, head_dim) and (nt + ROWS - 1) // ROWS * n_head_kv >= n_threads
            and bool(_windows_shared(lo, hi, ROWS)))


def _per_token(q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               n_head: int, n_head_kv: int, head_dim: int, scale: np.float32,
               softcap: np.float32, sinks: np.ndarray, out: np.ndarray) -> None:
    """The batch-invariant kernel: row-blocked for many rows reading shared cells, per row
    otherwise (the same bits either way)."""
    n_threads = get_num_threads()
    if takes_rows(lo, hi, n_head_kv, head_dim, n_threads):
        _attention_rows(q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale, softcap, sinks,
                        out, ROWS, CELL_TILE, n_threads)
    else:
        _attention(q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale, softcap, sinks, out)


@njit(cache=True)
def _per_token_part(part, n_parts, q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale, softcap,
                    sinks, out):  # pragma: no cover - compiled
    """`_per_token` for part `part` of `n_parts` (a parallel region's thread): the same choice
    (`takes_rows` with the region's threads), then that kernel's share."""
    nt = q.shape[0]
    n_items = (nt + ROWS - 1) // ROWS * n_head_kv
    if n_items >= n_parts and _windows_shared(lo, hi, ROWS):
        if part < n_items:
            _rows_worker(part, min(n_parts, n_items), q, k, v, lo, hi, n_head, n_head_kv,
                         head_dim, scale, softcap, sinks, out, ROWS, CELL_TILE)
    else:
        _attention_part(part, n_parts, q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale,
                        softcap, sinks, out)


def _cache_view(cache: np.ndarray) -> np.ndarray:
    if cache.dtype == np.float16:
        return cache.view(np.uint16)
    if cache.dtype not in (np.float32, np.uint16):
        raise ValueError(f"KV cache must be f32 or f16, got {cache.dtype}")
    return cache


def _check_heads(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_head: int,
                 n_head_kv: int, head_dim: int, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    check_query_heads(q, out, n_head, n_head_kv, head_dim)
    k, v = _cache_view(k_cache), _cache_view(v_cache)
    if k.shape != v.shape or k.ndim != 2 or k.shape[1] != n_head_kv * head_dim:
        raise ValueError(f"caches {k_cache.shape} / {v_cache.shape} are not "
                         f"[n_ctx, {n_head_kv}*{head_dim}]")
    return k, v


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, kv_start: np.ndarray,
              kv_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int, scale: float,
              out: np.ndarray, blocked: bool = False, window: int = 0,
              softcap: float = 0.0, sinks: np.ndarray | None = None) -> None:
    """out[t, h*hd:(h+1)*hd] = softmax(scale * q_h . K[window]) @ V[window] for every token/head.

    `window` > 0 (a sliding-window layer) narrows each query's cells to the last `window` of
    [kv_start, kv_end): [max(kv_start, kv_end - window), kv_end). `softcap` > 0 maps each scaled
    score s to softcap * tanh(s / softcap) before the softmax (Gemma 2 style). `sinks` ([n_head]
    logits, gpt-oss's) join each head's softmax denominator as cells without a value.

    `blocked=True` takes the sgemm kernel of `attn.blocked` (from `BLOCKED_MIN_TOKENS` rows
    on it is faster; its rounding depends on the batch shape, so not for batch-invariant use).

    q, out: f32 `[nt, n_head*head_dim]`; caches: f32 or f16 `[n_ctx, n_head_kv*head_dim]`;
    kv_start/kv_end: int `[nt]` bounds of each query's window of cache cells.
    """
    if kv_quant.uses_quant(k_cache, v_cache):  # q8_0 / q4_0 caches
        kv_quant.attention(q, k_cache, v_cache, kv_start, kv_end, n_head=n_head,
                           n_head_kv=n_head_kv, head_dim=head_dim, scale=scale, out=out,
                           blocked=blocked, window=window, softcap=softcap, sinks=sinks)
        return
    sk = sink_logits(sinks, n_head)
    nt = q.shape[0]
    k, v = _check_heads(q, k_cache, v_cache, n_head, n_head_kv, head_dim, out)
    lo = np.ascontiguousarray(kv_start, dtype=np.int64).reshape(-1)
    hi = np.ascontiguousarray(kv_end, dtype=np.int64).reshape(-1)
    if lo.shape[0] != nt or hi.shape[0] != nt:
        raise ValueError("kv_start / kv_end need one entry per query row")
    if nt and (lo.min() < 0 or hi.max() > k.shape[0] or (hi < lo).any()):
        raise ValueError(f"KV window outside the cache of {k.shape[0]} cells")
    if window < 0 or softcap < 0:
        raise ValueError(f"window {window} and softcap {softcap} must not be negative")
    if window:
        lo = np.maximum(lo, hi - window)
    if blocked and nt and blocked_available():
        attention_blocked(q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale, out,
                          softcap=softcap, sinks=sk)
        return
    if k.dtype == np.uint16:
        q = q.astype(np.float16).astype(np.float32)
    _per_token(q, k, v, lo, hi, n_head, n_head_kv, head_dim, np.float32(scale),
               np.float32(softcap), sk, out)


def bind_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, kv_start: np.ndarray,
                   kv_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int,
                   scale: float, out: np.ndarray, blocked: bool = False, window: int = 0,
                   softcap: float = 0.0, sinks: np.ndarray | None = None,
                   quant: Q8Blocks | Q8KBlocks | None = None) -> list[Callable[[], None]]:
    """`attention` over fixed arrays (the op tape), as the calls to make in order: shapes
    checked once. The windows are data the batch fills in each time; their bounds are the
    caller's to check (the engine refuses a batch whose windows leave the context before it
    runs anything). With `quant`, out is also quantized into it: by the attention kernel's
    threads, each the heads it computed, where the per-row kernel runs and a KV head's group
    of query heads is whole blocks (`fusion.fuse_attn_quant`); else by a quantize step after."""
    def then_quantize(steps: list[Callable[[], None]]) -> list[Callable[[], None]]:
        if quant is None:
            return steps
        return [*steps, bind_quantize_q8_k(out, quant) if isinstance(quant, Q8KBlocks)
                else bind_quantize_q8_0(out, quant)]

    if kv_quant.uses_quant(k_cache, v_cache):  # q8_0 / q4_0 caches
        return then_quantize([kv_quant.bind_attention(
            q, k_cache, v_cache, kv_start, kv_end, n_head=n_head, n_head_kv=n_head_kv,
            head_dim=head_dim, scale=scale, out=out, blocked=blocked, window=window,
            softcap=softcap, sinks=sinks)])
    sk = sink_logits(sinks, n_head)
    nt = q.shape[0]
    k, v = _check_heads(q, k_cache, v_cache, n_head, n_head_kv, head_dim, out)
    if kv_start.shape != (nt,) or kv_end.shape != (nt,):
        raise ValueError("kv_start / kv_end need one entry per query row")
    if window < 0 or softcap < 0:
        raise ValueError(f"window {window} and softcap {softcap} must not be negative")

    def bounds() -> tuple[np.ndarray, np.ndarray]:
        lo, hi = kv_start.astype(np.int64), kv_end.astype(np.int64)
        return (np.maximum(lo, hi - window) if window else lo), hi

    if blocked and nt and blocked_available():
        def step_blocked() -> None:
            lo, hi = bounds()
            attention_blocked(q, k, v, lo, hi, n_head, n_head_kv, head_dim, scale, out,
                              softcap=softcap, sinks=sk)
        return then_quantize([step_blocked])
    f16 = k.dtype == np.uint16
    scale32, softcap32 = np.float32(scale), np.float32(softcap)
    lo, hi = np.empty(nt, np.int64), np.empty(nt, np.int64)
    if f16 and nt > HELD_QUERY_ROWS:
        def step_rounding() -> None:
            lo[:], hi[:] = bounds()
            qr = q.astype(np.float16).astype(np.float32)
            _per_token(qr, k, v, lo, hi, n_head, n_head_kv, head_dim, scale32, softcap32, sk,
                       out)
        return then_quantize([step_rounding])
    qr = np.empty_like(q) if f16 else q  # the query rounded to f16 (with an f16 cache)
    # `_per_token`'s choice is fixed by the shape; the row-blocked kernel reads the thread
    # count of each call, so it keeps the Python wrapper
    kernel = _per_token if _rows_apply(nt, head_dim) else _attention
    prepare = partial(_prepare, q, qr, f16, kv_start, kv_end, window, lo, hi)
    unit = 256 if isinstance(quant, Q8KBlocks) else 32
    if quant is not None and kernel is _attention and n_head // n_head_kv * head_dim % unit == 0:
        aux, isum = (quant.bsums, None) if isinstance(quant, Q8KBlocks) else (quant.s, quant.isum)
        return [prepare, partial(_attention_quant, qr, k, v, lo, hi, n_head, n_head_kv, head_dim,
                                 scale32, softcap32, sk, out, quant.qs, quant.d, aux, isum)]
    return then_quantize([prepare, partial(kernel, qr, k, v, lo, hi, n_head, n_head_kv,
                                           head_dim, scale32, softcap32, sk, out)])


# Up to this many query rows a bound attention holds its own buffer for the query rounded to
# f16 (decode, verify); a prefill's would add up over the layers, so it rounds per call.
HELD_QUERY_ROWS = 64


@njit(cache=True, error_model="numpy")
def _prepare(q, qr, round_f16, kv_start, kv_end, window, lo, hi):  # pragma: no cover - compiled
    """The per-call inputs of `_per_token` in one compiled call (a decode step's numpy calls
    here cost more than the kernel): each row's window, and the query rounded to f16 as
    numpy's astype rounds it, when round_f16."""
    for t in range(q.shape[0]):
        lo[t] = max(kv_start[t], kv_end[t] - window) if window else kv_start[t]
        hi[t] = kv_end[t]
        if round_f16:
            for j in range(q.shape[1]):
                qr[t, j] = f16_to_f32(f32_to_f16(q[t, j]))


def kv_store(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
             cells: np.ndarray, *, head_dim: int = 0) -> None:
    """Write rows k[t], v[t] (f32 `[nt, n_head_kv*head_dim]`) into cache cells[t] (f16 rounding
    to nearest even when the cache is f16, as ggml's f32->f16 copy; q8_0/q4_0 caches get ggml
    blocks, rotated as llama.cpp rotates them, which needs `head_dim`: see `attn.kv_formats`). A
    cell outside the cache is refused before anything is written."""
    cells = np.asarray(cells, dtype=np.int64).reshape(-1)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    bind_store_kv(k, v, k_cache, v_cache, cells, head_dim=head_dim)()
