"""The encoder's kernels against float64 numpy: the dense f32 GEMM (any row and column count,
with and without bias), the bf16 GEMM on AMX tiles (on hosts that have them), attention within
each packed sequence, LayerNorm, the erf GELU and pooling; and their batch invariance: a row's
bits do not depend on the rows around it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.backends.cpu.kernels import (
    amx_usable,
    amx_weight,
    bind_gemm,
    bind_gemm_amx,
    bind_pool,
    dense_weight,
    gelu_erf,
    gemm,
    layer_norm,
    sequence_attention,
)

RNG = np.random.default_rng(7)


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(("n_in", "n_out"), [(64, 40), (384, 1), (96, 48), (33, 17)])
def test_gemm_matches_float64_and_each_rows_bits_hold_in_any_batch(n_in: int,
                                                                   n_out: int) -> None:
    """Rows in groups of six, the rest one by one, columns in tiles of 16 and a scalar tail:
    every row equals its lone computation bitwise, at every batch size."""
    x, w, b = _rand(23, n_in), _rand(n_out, n_in), _rand(n_out)
    dw = dense_weight(w)
    out = np.empty((23, n_out), np.float32)
    bind_gemm(x, dw, out, bias=b)()
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b
    np.testing.assert_allclose(out, ref, atol=2e-5 * math.sqrt(n_in), rtol=0)
    for nt in (1, 5, 6, 7, 12, 23):
        part = np.empty((nt, n_out), np.float32)
        bind_gemm(np.ascontiguousarray(x[23 - nt:]), dw, part, bias=b)()
        assert np.array_equal(part, out[23 - nt:]), nt
    plain = np.empty_like(out)
    gemm(x, dw, plain)
    np.testing.assert_array_equal(plain + b, out)  # the bias is one add after the product


def _bf16(a: np.ndarray) -> np.ndarray:
    """f32 rounded to bf16 (nearest even), as f64."""
    b = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.skipif(not amx_usable(), reason="needs AMX tiles (amx_tile, amx_bf16) granted "
                                             "by the kernel: Intel Xeon Sapphire Rapids on")
@pytest.mark.parametrize(("n_in", "n_out"), [(384, 1536), (1536, 384), (40, 50), (64, 33)])
def test_amx_gemm_is_the_bf16_product_and_each_rows_bits_hold_in_any_batch(
        n_in: int, n_out: int) -> None:
    """The operands rounded to bf16, products summed in f32 onto the bias: within f32
    accumulation of the exact product of the rounded operands; rows in blocks of 32 (tails and
    pads included), and every row equal to its lone computation bitwise at every batch size
    and offset."""
    x, w, b = _rand(70, n_in), _rand(n_out, n_in), _rand(n_out)
    aw = amx_weight(w)
    out = np.empty((70, n_out), np.float32)
    bind_gemm_amx(x, aw, out, bias=b)()
    ref = _bf16(x) @ _bf16(w).T + b
    np.testing.assert_allclose(out, ref, atol=1e-6 * n_in, rtol=0)
    for lo, hi in ((0, 1), (69, 70), (3, 36), (31, 64), (1, 70)):
        part = np.empty((hi - lo, n_out), np.float32)
        bind_gemm_amx(np.ascontiguousarray(x[lo:hi]), aw, part, bias=b)()
        assert np.array_equal(part, out[lo:hi]), (lo, hi)


def _ref_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bounds: list[tuple[int, int]],
                   n_head: int, n_head_kv: int, head_dim: int) -> np.ndarray:
    out = np.zeros(q.shape)
    group = n_head // n_head_kv
    for s, e in bounds:
        for h in range(n_head):
            hk = h // group
            qh = q[s:e, h * head_dim:(h + 1) * head_dim].astype(np.float64)
            kh = k[s:e, hk * head_dim:(hk + 1) * head_dim].astype(np.float64)
            vh = v[s:e, hk * head_dim:(hk + 1) * head_dim].astype(np.float64)
            sc = qh @ kh.T / math.sqrt(head_dim)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            out[s:e, h * head_dim:(h + 1) * head_dim] = (p / p.sum(1, keepdims=True)) @ vh
    return out


@pytest.mark.parametrize("head_dim", [32, 40])
def test_sequence_attention_reads_only_its_sequence(head_dim: int) -> None:
    n_head, n_head_kv = 4, 2
    lens = [7, 1, 20, 13]
    nt = sum(lens)
    ends = np.cumsum(lens)
    bounds = [(int(e - n), int(e)) for n, e in zip(lens, ends, strict=True)]
    start = np.repeat(ends - lens, lens).astype(np.int32)
    end = np.repeat(ends, lens).astype(np.int32)
    q, k, v = _rand(nt, n_head * head_dim), _rand(nt, n_head_kv * head_dim), \
        _rand(nt, n_head_kv * head_dim)
    out = np.empty_like(q)
    args = dict(n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                scale=1.0 / math.sqrt(head_dim))
    sequence_attention(q, k, v, start, end, out=out, **args)  # type: ignore[arg-type]
    ref = _ref_attention(q, k, v, bounds, n_head, n_head_kv, head_dim)
    np.testing.assert_allclose(out, ref, atol=2e-6)
    s, e = bounds[2]  # the third sequence alone: the same bits
    alone = np.empty((e - s, q.shape[1]), np.float32)
    z = np.zeros(e - s, np.int32)
    sequence_attention(q[s:e].copy(), k[s:e].copy(), v[s:e].copy(), z, z + (e - s),
                       out=alone, **args)  # type: ignore[arg-type]
    assert np.array_equal(alone, out[s:e])
    with pytest.raises(ValueError, match="sequence bounds"):
        sequence_attention(q, k, v, start, end + 1, out=out, **args)  # type: ignore[arg-type]


def test_layer_norm_and_erf_gelu() -> None:
    x, w, b = _rand(70, 384), _rand(384), _rand(384)  # 70 rows: the threaded path
    out = np.empty_like(x)
    layer_norm(x, w, b, 1e-12, out)
    x64 = x.astype(np.float64)
    mu = x64.mean(1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(1, keepdims=True) + 1e-12) * w + b
    np.testing.assert_allclose(out, ref, atol=5e-6)
    one = np.empty((1, 384), np.float32)
    layer_norm(x[3:4].copy(), w, b, 1e-12, one)  # the single-row path: the same bits
    assert np.array_equal(one[0], out[3])
    g = np.linspace(-9, 9, 10001, dtype=np.float32)
    got = np.empty_like(g)
    gelu_erf(g, got)
    exact = np.array([0.5 * t * (1 + math.erf(t / math.sqrt(2))) for t in g.astype(np.float64)])
    np.testing.assert_allclose(got, exact, atol=2e-6)


@pytest.mark.parametrize(("mode", "pick"), [("mean", None), ("cls", 0), ("last", -1)])
def test_pool_rows_of_each_sequence(mode: str, pick: int | None) -> None:
    x = _rand(12, 8)
    start, end = np.array([0, 5, 6], np.int32), np.array([5, 6, 12], np.int32)
    out = np.empty((3, 8), np.float32)
    bind_pool(x, start, end, mode, out)()
    for i, (s, e) in enumerate(zip(start, end, strict=True)):
        rows = x[s:e].astype(np.float64)
        ref = rows.mean(0) if pick is None else rows[pick]
        np.testing.assert_allclose(out[i], ref, atol=1e-6)
    with pytest.raises(ValueError, match="non-empty"):
        bind_pool(x, start, start, mode, out)()
