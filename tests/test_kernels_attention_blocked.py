"""The blocked (sgemm) prefill attention equals the per-token kernel within f32 rounding.

Outputs are O(1) (softmax averages of N(0,1) values), so the bound is 1e-5 of that scale: BLAS
sums each 64-term score in one FMA chain where the per-token kernel keeps vector partial sums,
so against an f64 reference the blocked kernel is off by up to ~6e-6 where the per-token one is
off by ~2e-6 (scores of std 4 here, sharper than a real model's).
"""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends.cpu.kernels import ATTN_BLOCKED_MIN_TOKENS, attention
from minfer.backends.cpu.kernels.attn.attend import _cache_view
from minfer.backends.cpu.kernels.attn.blocked import attention_blocked, blocked_available

pytestmark = pytest.mark.skipif(not blocked_available(), reason="no callable OpenBLAS sgemm")
RNG = np.random.default_rng(1)


def _both(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: np.ndarray, end: np.ndarray,
          n_head: int, n_kv: int, hd: int, scale: float = 0.125
          ) -> tuple[np.ndarray, np.ndarray]:
    ref, out = np.empty_like(q), np.full_like(q, np.nan)
    kw = dict(n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=scale)
    attention(q, k, v, start, end, out=ref, **kw)  # type: ignore[arg-type]
    attention(q, k, v, start, end, out=out, blocked=True, **kw)  # type: ignore[arg-type]
    return ref, out


def _qkv(nt: int, n_head: int, n_kv: int, hd: int, n_ctx: int, dtype: type
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = (2 * RNG.standard_normal((nt, n_head * hd))).astype(np.float32)
    k = (2 * RNG.standard_normal((n_ctx, n_kv * hd))).astype(dtype)
    v = RNG.standard_normal((n_ctx, n_kv * hd)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("nt", "n_head", "n_kv", "past"),
                         [(200, 14, 2, 0), (77, 14, 2, 300), (33, 4, 4, 5), (130, 8, 1, 64)])
def test_causal_prefill_matches_per_token(dtype: type, nt: int, n_head: int, n_kv: int,
                                          past: int) -> None:
    hd = 64
    q, k, v = _qkv(nt, n_head, n_kv, hd, past + nt + 7, dtype)
    start = np.zeros(nt, np.int32)
    end = (past + 1 + np.arange(nt)).astype(np.int32)
    ref, out = _both(q, k, v, start, end, n_head, n_kv, hd)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_packed_sequences_sliding_and_empty_windows(dtype: type) -> None:
    """Several sequences with disjoint cell ranges in one batch, rows whose windows differ in
    start (a sliding window), a row that sees nothing, and windows out of row order."""
    n_head, n_kv, hd = 14, 2, 64
    # sequence A: cells [0, 50) (40 past + 10 new), B: cells [100, 190) causal from 100,
    # C: sliding window of 16 over cells [200, 260)
    a_end = 41 + np.arange(10)
    b_end = 101 + np.arange(90)
    c_end = 201 + np.arange(60)
    start = np.concatenate([np.zeros(10), np.full(90, 100), np.maximum(200, c_end - 16), [7]])
    end = np.concatenate([a_end, b_end, c_end, [7]])
    perm = RNG.permutation(start.shape[0])  # rows of one block need not be related at all
    start, end = start[perm].astype(np.int64), end[perm].astype(np.int64)
    q, k, v = _qkv(start.shape[0], n_head, n_kv, hd, 300, dtype)
    ref, out = _both(q, k, v, start, end, n_head, n_kv, hd, scale=0.2)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not out[np.flatnonzero(start == end)].any()


@pytest.mark.parametrize("block", [1, 16, 64, 128])
def test_block_shape_changes_rounding_only(block: int) -> None:
    n_head, n_kv, hd, nt = 14, 2, 64, 150
    q, k, v = _qkv(nt, n_head, n_kv, hd, nt, np.float16)
    start, end = np.zeros(nt, np.int64), np.arange(1, nt + 1, dtype=np.int64)
    ref, _ = _both(q, k, v, start, end, n_head, n_kv, hd)
    out = np.full_like(q, np.nan)
    attention_blocked(q, _cache_view(k), _cache_view(v), start, end, n_head, n_kv, hd, 0.125,
                      out, block=block)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [1, 7, 16, 64])
def test_kv_tiles_change_rounding_only(tile: int) -> None:
    """The online softmax over KV tiles: scores that keep rising from tile to tile (each new
    maximum rescales what was summed before) and windows that start and end inside tiles."""
    n_head, n_kv, hd, nt = 8, 2, 64, 90
    q, k, v = _qkv(nt, n_head, n_kv, hd, 160, np.float16)
    k = (k.astype(np.float32) + np.linspace(0, 3, 160, dtype=np.float32)[:, None]).astype(
        np.float16)
    start = np.arange(nt, dtype=np.int64) % 13
    end = 70 + np.arange(nt, dtype=np.int64)
    ref, _ = _both(q, k, v, start, end, n_head, n_kv, hd)
    out = np.full_like(q, np.nan)
    attention_blocked(q, _cache_view(k), _cache_view(v), start, end, n_head, n_kv, hd, 0.125,
                      out, tile=tile)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_all_windows_empty_and_one_cell() -> None:
    n_head, n_kv, hd, nt = 4, 2, 32, 40
    q, k, v = _qkv(nt, n_head, n_kv, hd, 64, np.float32)
    ref, out = _both(q, k, v, np.full(nt, 9), np.full(nt, 9), n_head, n_kv, hd)
    assert not out.any() and not ref.any()
    ref, out = _both(q, k, v, np.arange(nt), np.arange(1, nt + 1), n_head, n_kv, hd)
    np.testing.assert_allclose(out[:, :hd], v[:nt, :hd], rtol=1e-6)  # softmax of one score is 1
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_threshold_is_a_prefill_size() -> None:
    assert 1 < ATTN_BLOCKED_MIN_TOKENS <= 64
