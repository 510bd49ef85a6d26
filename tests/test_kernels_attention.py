"""Attention over a KV cache (windows, GQA, f16 cache) and the cache writes."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends.cpu.kernels import attention, kv_store
from minfer.backends.cpu.kernels.reference import ref_attention

RNG = np.random.default_rng(0)


def _setup(nt: int, n_head: int, n_kv: int, hd: int, n_ctx: int, dtype: type = np.float32
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = RNG.standard_normal((nt, n_head * hd)).astype(np.float32)
    k = RNG.standard_normal((n_ctx, n_kv * hd)).astype(dtype)
    v = RNG.standard_normal((n_ctx, n_kv * hd)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize(("n_head", "n_kv"), [(4, 4), (14, 2), (8, 1)])
def test_causal_attention_with_gqa(n_head: int, n_kv: int) -> None:
    nt, hd, n_ctx = 5, 64, 16
    q, k, v = _setup(nt, n_head, n_kv, hd, n_ctx)
    pos = np.arange(3, 3 + nt)  # three cells already in the cache, then the new tokens
    start, end = np.zeros(nt, np.int32), (pos + 1).astype(np.int32)
    out = np.empty_like(q)
    scale = 1 / np.sqrt(hd)
    attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=scale,
              out=out)
    ref = ref_attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd,
                        scale=scale)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


def test_windows_are_data_and_empty_windows_give_zero() -> None:
    nt, n_head, n_kv, hd = 4, 2, 1, 32
    q, k, v = _setup(nt, n_head, n_kv, hd, 12)
    start = np.array([0, 4, 8, 5], np.int32)  # e.g. two sequences packed in one batch
    end = np.array([3, 7, 12, 5], np.int32)  # the last row sees nothing
    out = np.empty_like(q)
    attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=0.2,
              out=out)
    ref = ref_attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd,
                        scale=0.2)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
    assert not out[3].any()
    # a single visible cell returns its value row exactly (softmax of one score is 1)
    one = np.empty_like(q[:1])
    attention(q[:1], k, v, np.array([6]), np.array([7]), n_head=n_head, n_head_kv=n_kv,
              head_dim=hd, scale=0.2, out=one)
    np.testing.assert_allclose(one[0, :hd], v[6, :hd], rtol=1e-6)


def test_f16_cache_rounds_the_query_like_ggml() -> None:
    nt, n_head, n_kv, hd, n_ctx = 3, 4, 2, 64, 20
    q, k, v = _setup(nt, n_head, n_kv, hd, n_ctx, np.float16)
    start, end = np.zeros(nt, np.int32), np.array([5, 13, 20], np.int32)
    out = np.empty_like(q)
    attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=0.125,
              out=out)
    q16 = q.astype(np.float16).astype(np.float32)
    ref = ref_attention(q16, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd,
                        scale=0.125)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kv_store_writes_rows_into_cells(dtype: type) -> None:
    kc = np.zeros((8, 16), dtype)
    vc = np.zeros((8, 16), dtype)
    k = RNG.standard_normal((2, 16)).astype(np.float32)
    v = RNG.standard_normal((2, 16)).astype(np.float32)
    kv_store(k, v, kc, vc, np.array([5, 2]))
    np.testing.assert_array_equal(kc[[5, 2]], k.astype(dtype))
    np.testing.assert_array_equal(vc[[5, 2]], v.astype(dtype))
    assert not kc[[0, 1, 3, 4, 6, 7]].any()
    with pytest.raises(ValueError):
        kv_store(k, v, kc, vc, np.array([8, 0]))


def test_bad_windows_are_refused() -> None:
    q, k, v = _setup(1, 2, 1, 32, 4)
    with pytest.raises(ValueError):
        attention(q, k, v, np.array([0]), np.array([5]), n_head=2, n_head_kv=1, head_dim=32,
                  scale=1.0, out=np.empty_like(q))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize(("dtype", "head_dim"), [(np.float16, 64), (np.float32, 64),
                                                 (np.float16, 128)])
def test_vector_value_mix_is_bitwise_the_loop(group: int, dtype: type, head_dim: int) -> None:
    """attention_ir.value_mix gives the very bits of the fused multiply-add loop it replaces
    (acc += p * v, cell by cell), for every way the heads are split (fours, a pair, one)."""
    from numba import njit

    from minfer.backends.cpu.kernels.attn.vector_ir import HAS_MIX, value_mix
    from minfer.backends.cpu.kernels.simd.llvm import as_f32

    if not HAS_MIX:
        pytest.skip("no FMA/F16C on this target: attention keeps its loop")

    @njit(fastmath=True, error_model="numpy")
    def loop(p, v, s0, n, col0, acc):  # attention._attention's value loop
        for c in range(n):
            row = v[s0 + c, col0 : col0 + acc.shape[1]]
            for g in range(acc.shape[0]):
                w = p[g, c]
                for j in range(acc.shape[1]):
                    acc[g, j] += w * as_f32(row[j])

    @njit
    def mixed(p, v, s0, n, col0, acc):
        value_mix(p, v, s0, n, col0, acc)

    rng = np.random.default_rng(group)
    cache = rng.standard_normal((200, 2 * head_dim)).astype(dtype)
    v = cache.view(np.uint16) if dtype == np.float16 else cache
    p = rng.random((group, 150), dtype=np.float32)
    for s0, n, col0 in ((0, 150, 0), (37, 113, head_dim), (5, 1, 0), (9, 0, head_dim)):
        want = np.zeros((group, head_dim), np.float32)
        got = np.zeros((group, head_dim), np.float32)
        loop(p, v, s0, n, col0, want)
        mixed(p, v, s0, n, col0, got)
        assert np.array_equal(got, want), (s0, n, col0)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100, 256])
def test_softmax_passes_in_ir_match_numpy(n: int) -> None:
    """attention_ir.scale_max / exp_sum (the blocked prefill's softmax): scaled values and their
    exact maximum, then exp(x - m) within a few ulp of f64's (as `fast_exp`) and its f64 sum."""
    from numba import njit

    from minfer.backends.cpu.kernels.attn.vector_ir import exp_sum, scale_max

    @njit
    def both(w, n, s):
        m = scale_max(w, n, s)
        return m, exp_sum(w, n, m)

    rng = np.random.default_rng(n)
    x = (5 * rng.standard_normal(n + 3)).astype(np.float32)
    w = x.copy()
    m, total = both(w, n, np.float32(0.3))
    scaled = x[:n] * np.float32(0.3)
    assert m == (scaled.max() if n else -np.inf)
    want = np.exp(scaled.astype(np.float64) - np.float64(m))
    np.testing.assert_allclose(w[:n], want, rtol=1e-6, atol=0)
    assert np.array_equal(w[n:], x[n:])  # cells past n untouched
    assert total == pytest.approx(want.sum(), rel=1e-6)


@pytest.mark.parametrize(("n_head", "n_kv", "head_dim", "dtype"),
                         [(14, 2, 64, np.float16), (8, 8, 64, np.float32), (8, 1, 128, np.float16),
                          (6, 2, 64, np.float32)])
@pytest.mark.parametrize(("softcap", "sinks"), [(0.0, False), (30.0, False), (0.0, True)])
def test_row_blocked_kernel_is_bitwise_the_per_row_kernel(n_head: int, n_kv: int, head_dim: int,
                                                          dtype: type, softcap: float,
                                                          sinks: bool) -> None:
    """`_attention_rows` (rows in blocks, cells in tiles) gives the per-row kernel's bits for
    every row, whatever the block and tile sizes: the batch-invariant path may take either
    (attention sinks included)."""
    import importlib

    from minfer.backends.cpu.kernels.attn.vector_ir import HAS_MIX

    mod = importlib.import_module("minfer.backends.cpu.kernels.attn.attend")
    if not HAS_MIX:
        pytest.skip("no FMA/F16C on this target: only the per-row loops run")
    rng = np.random.default_rng(head_dim + n_head)
    nt, n_ctx = 45, 300
    q = (2 * rng.standard_normal((nt, n_head * head_dim))).astype(np.float32)
    if dtype == np.float16:
        q = q.astype(np.float16).astype(np.float32)
    cache = [rng.standard_normal((n_ctx, n_kv * head_dim)).astype(dtype) for _ in range(2)]
    k, v = (c.view(np.uint16) if dtype == np.float16 else c for c in cache)
    # causal rows after a past, a packed second sequence, an empty window, a sliding window
    start = np.concatenate([np.zeros(20), np.full(20, 150), [9], 180 + np.arange(4)])
    end = np.concatenate([100 + np.arange(20), 151 + np.arange(20), [9], 230 + np.arange(4)])
    start, end = start.astype(np.int64), end.astype(np.int64)
    sink = (rng.standard_normal(n_head) * 3).astype(np.float32) if sinks else \
        np.zeros(0, np.float32)
    args = (n_head, n_kv, head_dim, np.float32(0.125), np.float32(softcap), sink)
    want = np.full_like(q, np.nan)
    mod._attention(q, k, v, start, end, *args, want)
    for rows, tile in ((8, 64), (3, 7), (1, 1), (16, 300)):
        got = np.full_like(q, np.nan)
        mod._attention_rows(q, k, v, start, end, *args, got, rows, tile, 2)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (rows, tile)


def test_row_blocking_serves_rows_that_share_cells_only() -> None:
    """The batch-invariant path takes the row-blocked kernel for rows reading common cells (a
    prefill's causal rows) and the per-row kernel for a server's decode rows, one per sequence
    in its own slot (blocking them would walk the cells between the slots); either way the
    same bits (test above)."""
    from minfer.backends.cpu.kernels.attn.attend import ROWS, _windows_shared

    slots = np.arange(32, dtype=np.int64) * 512
    assert not _windows_shared(slots, slots + 301, ROWS)  # decode rows of 32 sequences
    causal = np.arange(64, dtype=np.int64)
    assert _windows_shared(np.zeros(64, np.int64), causal + 1, ROWS)  # one prompt, causal
    assert _windows_shared(np.full(64, 100, np.int64), 200 + causal, ROWS)  # after a past
    assert not _windows_shared(np.zeros(16, np.int64), np.zeros(16, np.int64), ROWS)  # empty


def test_verify_rows_of_one_sequence_run_row_blocked() -> None:
    """A speculative verify (4 or more rows of one sequence past its context) takes the
    row-blocked kernel, which reads each cell once for all of them; 2-3 rows, a server's decode
    rows of separate sequences, or fewer work items than threads keep the per-row kernel."""
    from minfer.backends.cpu.kernels.attn.attend import takes_rows
    from minfer.backends.cpu.kernels.attn.vector_ir import HAS_MIX

    def verify(rows: int, depth: int = 500) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(rows, np.int64), depth + 1 + np.arange(rows, dtype=np.int64)

    assert takes_rows(*verify(8), 2, 128, 2) == HAS_MIX
    assert takes_rows(*verify(4), 2, 64, 2) == HAS_MIX
    assert not takes_rows(*verify(3), 2, 128, 2)
    assert not takes_rows(*verify(8), 1, 64, 2)  # one KV head: one item for two threads
    slots = np.arange(8, dtype=np.int64) * 512
    assert not takes_rows(slots, slots + 301, 2, 64, 2)  # decode rows of 8 sequences


@pytest.mark.parametrize("n", [1, 5, 16, 17, 40])
def test_k_columns_writes_every_lane_of_its_blocks(n: int) -> None:
    """The transposed K tile's blocks are written whole, lanes past the window repeating its
    last cell: the score dots read both 16-cell halves of a block, and a half left as it was
    (leftovers, likely subnormal) made a window of 16 cells or fewer 40x slower."""
    from numba import njit

    from minfer.backends.cpu.kernels.attn.vector_ir import BLOCK, HAS_MIX, k_columns

    if not HAS_MIX:
        pytest.skip("no FMA/F16C on this target: attention keeps its loop")

    @njit
    def columns(k, s0, n, col0, kt):
        k_columns(k, s0, n, col0, kt)

    rng = np.random.default_rng(n)
    k = rng.standard_normal((64, 128)).astype(np.float16)
    width = -(-n // BLOCK) * BLOCK
    kt = np.full((64, width), np.nan, np.float32)
    columns(k.view(np.uint16), 3, n, 64, kt)
    cells = np.minimum(np.arange(width), n - 1) + 3  # past n: the last cell again
    np.testing.assert_array_equal(kt, k[cells, 64:].T.astype(np.float32))
