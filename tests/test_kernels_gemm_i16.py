"""The int16-activation x int8-weight GEMM (`linear.gemm_i16`) against a numpy reference that
takes the same steps (exact integer block sums, then one fused f32 multiply-add per block in
order), and its batch invariance: a row's bits alone and in a batch of 37 are the same."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends.cpu.kernels import (
    I16Weight,
    QType,
    bind_gemm_i16,
    dequantize,
    gemm_i16_scratch_size,
    i16_weight,
    int8_codes,
    q8_0_codes,
)

RNG = np.random.default_rng(11)


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """f32 a * b + c rounded once: the f32 product is exact in f64, and the f64 sum's rounding
    to f32 agrees with one rounding except at a double-rounding tie (none in this data)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _run(x: np.ndarray, wt: I16Weight, out: np.ndarray, bias: np.ndarray | None = None,
         scratch: np.ndarray | None = None) -> None:
    for step in bind_gemm_i16(x, wt, out, scratch, bias):
        step()


def _reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    nt, n_in = x.shape
    blocks = x.reshape(nt, n_in // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    d = amax / np.float32(32767)
    inv = np.divide(np.float32(32767), amax, out=np.zeros_like(d), where=amax > 0)
    xq = np.rint(blocks * inv[:, :, None]).astype(np.int64)
    wq = codes.astype(np.int64).reshape(codes.shape[0], n_in // 32, 32)
    acc = np.zeros((nt, codes.shape[0]), np.float32)
    for b in range(n_in // 32):
        sums = (xq[:, b] @ wq[:, b].T).astype(np.float32)  # f32(int), as sitofp
        acc = _fma32(sums, scales[None, :, b] * d[:, b, None], acc)
    return acc


@pytest.mark.parametrize(("n_in", "n_out"), [(384, 384), (64, 40), (96, 17), (32, 70)])
def test_gemm_i16_is_the_block_sums_reference_and_each_rows_bits_hold_in_any_batch(
        n_in: int, n_out: int) -> None:
    x = RNG.standard_normal((37, n_in)).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block: scale 0
    w = RNG.standard_normal((n_out, n_in)).astype(np.float32)
    codes, scales = int8_codes(w)
    bias = RNG.standard_normal(n_out).astype(np.float32)
    wt = i16_weight(codes, scales)
    out = np.empty((37, n_out), np.float32)
    _run(x, wt, out)
    np.testing.assert_array_equal(out, _reference(x, codes, scales))
    with_bias = np.empty_like(out)
    stale = np.full(gemm_i16_scratch_size(37, n_in) + 5, np.nan, np.float32)  # shared, used
    _run(x, wt, with_bias, bias, stale)
    np.testing.assert_array_equal(with_bias, out + bias)
    w_codes = (codes.reshape(n_out, -1, 32) * scales[:, :, None].astype(np.float64))
    ref64 = x.astype(np.float64) @ w_codes.reshape(n_out, n_in).T  # only x's rounding apart
    np.testing.assert_allclose(out, ref64, atol=2e-4 * np.sqrt(n_in), rtol=0)
    for i in (0, 5, 6, 36):
        alone = np.empty((1, n_out), np.float32)
        _run(np.ascontiguousarray(x[i:i + 1]), wt, alone)
        assert np.array_equal(alone[0], out[i]), i
    for nt in (7, 12, 13):
        part = np.empty((nt, n_out), np.float32)
        _run(np.ascontiguousarray(x[37 - nt:]), wt, part)
        assert np.array_equal(part, out[37 - nt:]), nt


def test_i16_weight_takes_codes_whose_k_is_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        i16_weight(np.zeros((4, 40), np.int8), np.ones((4, 1), np.float32))


def test_q8_0_codes_are_the_files_codes_and_scales() -> None:
    codes, scales = int8_codes(RNG.standard_normal((5, 64)).astype(np.float32))
    blocks = np.zeros((5, 2, 34), np.uint8)
    blocks[:, :, :2] = scales.astype(np.float16)[:, :, None].view(np.uint8)
    blocks[:, :, 2:] = codes.reshape(5, 2, 32).view(np.uint8)
    raw = blocks.reshape(5, 68)
    got_codes, got_scales = q8_0_codes(raw)
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_array_equal(got_scales, scales.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(
        (got_codes.reshape(5, 2, 32) * got_scales[:, :, None]).reshape(5, 64),
        dequantize(raw, QType.Q8_0, 64))
