"""Batch invariance of the integer-dot path: the value for (token t, output row r) is bitwise
the same whatever else is in the batch (the server's greedy results must not depend on it).
The kernels dot several activation rows per pass over a weight row; these tests pin that a
token's result equals its one-token result, for every batch size and position."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pytest

from minfer.backends.cpu.kernels import (
    QType,
    add,
    matmul_prequant,
    mul,
    quantize_activation,
    silu,
    swiglu,
)

from .test_kernels_dequant import QUANT_32, QUANT_K, make_weight


def _n_in(qt: QType) -> int:
    return 256 * 5 if qt in QUANT_K else 32 * 45  # main steps plus tail blocks


Run = Callable[[np.ndarray, np.ndarray], None]  # (activation rows, out rows): one kernel call


def _prequant(w: np.ndarray, qt: QType) -> Run:
    """The integer path: the rows quantized, then dotted with w."""
    return lambda x, out: matmul_prequant(w, qt, quantize_activation(x, qt), out)


def _alone(run: Run, x: np.ndarray, n_out: int) -> np.ndarray:
    """Each row of x through the kernel on its own (a one-token call)."""
    alone = np.empty((len(x), n_out), np.float32)
    for t in range(len(x)):
        run(x[t:t + 1], alone[t:t + 1])
    return alone


def _assert_batches_match(run: Run, x: np.ndarray, alone: np.ndarray,
                          sizes: Iterable[int]) -> None:
    """Batches of each size at the start, middle and end of x give every row its bits alone."""
    for nt in sizes:
        for start in sorted({0, len(x) - nt, (len(x) - nt) // 2}):
            out = np.empty((nt, alone.shape[1]), np.float32)
            run(x[start:start + nt], out)
            assert np.array_equal(out, alone[start:start + nt]), (nt, start)


@pytest.mark.parametrize("qt", QUANT_32 + QUANT_K, ids=lambda q: q.name)
def test_each_row_of_a_batch_equals_that_row_alone(qt: QType) -> None:
    n_in, n_out = _n_in(qt), 37
    w = make_weight(qt, n_out, n_in)
    x = np.random.default_rng(int(qt)).standard_normal((20, n_in)).astype(np.float32)
    x[3] *= 1e3  # rows of very different magnitude side by side
    x[7] *= 1e-3
    run = _prequant(w, qt)
    _assert_batches_match(run, x, _alone(run, x, n_out), range(1, 21))


@pytest.mark.parametrize("qt", [QType.Q4_0, QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K,
                                QType.Q7_K, QType.IQ4_NL, QType.MXFP4, QType.IQ4_XS],
                         ids=lambda q: q.name)
def test_interleaved_rows_batch_invariant_across_token_tiles(qt: QType) -> None:
    """The row-interleaved drivers run batches in tiles of 32 tokens (and Q4_0 / Q5_0 / IQ4_NL
    whole tiles through a Q8_0-form copy of each row group, `simd.interleaved.expand_rows`): every
    row of batches across tile edges keeps the bits it gets alone, on the repacked weight."""
    from minfer.backends.cpu.kernels.linear.dispatch import packable, repack_weight

    n_in, n_out = (256 * 3 if qt in (*QUANT_K, QType.Q7_K, QType.IQ4_XS) else 32 * 27), 48
    if not packable(qt, n_in, n_out):
        pytest.skip(f"{qt.name} has no interleaved layout on this CPU")
    if qt in (QType.IQ4_XS, QType.MXFP4):  # no gguf quantizer: random blocks
        from minfer.backends.cpu.kernels.reference import random_iquant_blocks

        raw = random_iquant_blocks(qt, n_out, n_in, np.random.default_rng(1), rms=0.05)
    else:
        raw = make_weight(qt, n_out, n_in)
    w, pq = repack_weight(raw, qt)
    x = np.random.default_rng(int(qt) + 7).standard_normal((70, n_in)).astype(np.float32)
    x[40] *= 1e3
    run = _prequant(w, pq)
    _assert_batches_match(run, x, _alone(run, x, n_out), (31, 32, 33, 45, 64, 70))


@pytest.mark.parametrize("qt", [QType.F32, QType.F16, QType.BF16], ids=lambda q: q.name)
def test_float_rows_batch_invariant(qt: QType) -> None:
    """The float drivers (`simd.floats`: one spelled-out order of fused multiply-adds, a scalar
    tail past the last 64 values) give every row of a batch the bits it gets alone, below the
    token count from which `matmul` takes the sgemm path."""
    from minfer.backends.cpu.kernels import matmul, prefill_min_tokens
    from minfer.backends.cpu.kernels.linear.float_rows import round_to_bf16

    n_in, n_out = 64 * 5 + 7, 23
    w = make_weight(QType.F16 if qt is QType.F16 else QType.F32, n_out, n_in, seed=4)
    if qt is QType.BF16:
        w = (round_to_bf16(w).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    n = min(15, prefill_min_tokens(qt) - 1)
    x = np.random.default_rng(11).standard_normal((n, n_in)).astype(np.float32)
    x[2] *= 1e3
    def run(xr: np.ndarray, out: np.ndarray) -> None:
        matmul(w, qt, xr, out)

    _assert_batches_match(run, x, _alone(run, x, n_out), range(2, n + 1))


@pytest.mark.parametrize("qt", [QType.Q8_0, QType.Q4_K], ids=lambda q: q.name)
def test_activation_quantization_is_per_row(qt: QType) -> None:
    x = np.random.default_rng(3).standard_normal((9, 1024)).astype(np.float32)
    whole = quantize_activation(x, qt)
    for t in range(9):
        one = quantize_activation(x[t:t + 1], qt)
        for field in ("qs", "d", "s", "isum", "bsums"):
            if hasattr(whole, field):
                assert np.array_equal(getattr(whole, field)[t], getattr(one, field)[0]), field


@pytest.mark.parametrize("qt", [QType.Q5_0, QType.Q8_0, QType.Q6_K], ids=lambda q: q.name)
def test_wide_rows_batch_invariant(qt: QType) -> None:
    # past ROWS8_MAX_IN inputs the kernels take passes of 4 rows instead of 8
    n_in, n_out = (256 * 9 if qt in QUANT_K else 32 * 70), 19
    w = make_weight(qt, n_out, n_in)
    x = np.random.default_rng(5).standard_normal((13, n_in)).astype(np.float32)
    alone = _alone(_prequant(w, qt), x, n_out)
    for nt in (2, 4, 5, 8, 9, 13):
        out = np.empty((nt, n_out), np.float32)
        matmul_prequant(w, qt, quantize_activation(x[:nt], qt), out)
        assert np.array_equal(out, alone[:nt]), nt


@pytest.mark.parametrize("name", ["silu", "swiglu", "add", "mul"])
def test_elementwise_values_do_not_depend_on_position_or_aliasing(name: str) -> None:
    """An element's result is bitwise the same whether it falls in the vectorised loop body, in
    the scalar tail, or in a call whose output aliases an input (numba's alias check then takes
    the scalar loop): the fused gate/up node writes swiglu in place, the unfused one does not.
    Found on Sapphire Rapids, where a vector division with `arcp` became a reciprocal estimate."""
    rng = np.random.default_rng(11)
    g = (rng.standard_normal(4864 + 13) * 4).astype(np.float32)  # a body and a tail
    u = rng.standard_normal(g.shape[0]).astype(np.float32)

    def call(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        if name == "silu":
            silu(a, out)
        else:
            {"swiglu": swiglu, "add": add, "mul": mul}[name](a, b, out)

    apart = np.empty_like(g)
    call(g, u, apart)
    in_place = u.copy()
    call(g, in_place, in_place)
    assert np.array_equal(in_place, apart)
    one = np.empty(1, np.float32)
    for i in range(0, g.shape[0], 7):  # each element alone: the scalar loop
        call(g[i:i + 1], u[i:i + 1], one)
        assert one[0] == apart[i], i


@pytest.mark.parametrize(("k_type", "v_type"),
                         [("f32", "f32"), ("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"),
                          ("q8_0", "f16")])
def test_attention_row_is_the_same_alone_and_in_a_batch(k_type: str, v_type: str) -> None:
    """The per-token attention kernel (decode, batch-invariant prefill) for every cache type:
    each query row's output, and each stored cache row, do not depend on the batch."""
    from minfer.backends.cpu.kernels import attention, kv_store
    from minfer.backends.cpu.kernels.attn.kv_formats import new_cache

    rng = np.random.default_rng(5)
    nt, n_head, n_kv, hd, n_ctx = 24, 4, 2, 64, 48
    rows = rng.standard_normal((2, n_ctx, n_kv * hd)).astype(np.float32)
    k, v = new_cache(k_type, n_ctx, n_kv * hd), new_cache(v_type, n_ctx, n_kv * hd)
    kv_store(rows[0], rows[1], k, v, np.arange(n_ctx), head_dim=hd)  # one batch of 48 rows
    k1, v1 = new_cache(k_type, n_ctx, n_kv * hd), new_cache(v_type, n_ctx, n_kv * hd)
    for c in range(n_ctx):  # one row at a time
        kv_store(rows[0, c:c + 1], rows[1, c:c + 1], k1, v1, np.array([c]), head_dim=hd)
    assert np.array_equal(k, k1) and np.array_equal(v, v1)
    q = rng.standard_normal((nt, n_head * hd)).astype(np.float32)
    start = np.arange(nt, dtype=np.int32) // 3
    end = np.arange(n_ctx - nt + 1, n_ctx + 1, dtype=np.int32)
    batch = np.empty_like(q)
    attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=0.125,
              out=batch)
    one = np.empty_like(q[:1])
    for t in range(nt):
        attention(q[t:t + 1], k, v, start[t:t + 1], end[t:t + 1], n_head=n_head,
                  n_head_kv=n_kv, head_dim=hd, scale=0.125, out=one)
        assert np.array_equal(one[0], batch[t]), t
