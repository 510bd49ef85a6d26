"""Norms, RoPE and element-wise kernels against float64 numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends.cpu.kernels import (
    add,
    head_rms_norm,
    mul,
    rms_norm,
    rope_neox,
    silu,
    swiglu,
)
from minfer.backends.cpu.kernels.reference import ref_rms_norm, ref_rope_neox

RNG = np.random.default_rng(0)


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_rms_norm_and_in_place() -> None:
    x, w = _rand(5, 896), _rand(896)
    out = np.empty_like(x)
    rms_norm(x, w, 1e-6, out)
    np.testing.assert_allclose(out, ref_rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    rms_norm(x, w, 1e-6, x)
    np.testing.assert_array_equal(x, out)


@pytest.mark.parametrize("width", [896, 1003])  # 1003: a tail past the eight-lane sums
def test_rms_norm_rows_are_batch_invariant_and_match_ggml_order(width: int) -> None:
    """Many rows (split across threads) give each row's one-row result bit for bit, and the
    lane-summed f64 mean rounds to the f32 of ggml's element-after-element sum."""
    from minfer.backends.cpu.kernels.elementwise.norm import PARALLEL_MIN_ROWS

    x, w = _rand(PARALLEL_MIN_ROWS + 3, width), _rand(width)
    out = np.empty_like(x)
    rms_norm(x, w, 1e-6, out)
    one = np.empty((1, width), np.float32)
    for t in (0, 7, PARALLEL_MIN_ROWS + 2):
        rms_norm(x[t:t + 1], w, 1e-6, one)
        np.testing.assert_array_equal(out[t], one[0])
    for t in range(x.shape[0]):
        ssum = 0.0
        for v in x[t]:
            ssum += float(np.float32(v * v))  # ggml: f32 square, f64 sum in element order
        mean = np.float32(ssum / width)
        scale = np.float32(1.0) / np.sqrt(mean + np.float32(1e-6))
        np.testing.assert_array_equal(out[t], (x[t] * scale) * w)


def test_head_rms_norm_normalises_each_head() -> None:
    x, w = _rand(3, 4 * 32), _rand(32)
    out = np.empty_like(x)
    head_rms_norm(x, w, n_head=4, head_dim=32, eps=1e-6, out=out)
    ref = ref_rms_norm(x.reshape(3, 4, 32), w, 1e-6).reshape(3, 128)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError):
        head_rms_norm(x, w, n_head=3, head_dim=32, eps=1e-6, out=out)


def _rope_like_ggml(x: np.ndarray, pos: np.ndarray, n_head: int, hd: int, rope_dim: int,
                    base: float) -> np.ndarray:
    """ggml's recipe in numpy: theta multiplied up in f32, f32 cos/sin."""
    half = rope_dim // 2
    ts = np.float32(base) ** np.float32(-2.0 / rope_dim)
    out = x.copy().reshape(x.shape[0], n_head, hd)
    for t, p in enumerate(pos):
        theta = np.float32(p)
        cos, sin = np.empty(half, np.float32), np.empty(half, np.float32)
        for i in range(half):
            cos[i], sin[i] = np.cos(theta), np.sin(theta)
            theta = np.float32(theta * ts)
        x0, x1 = out[t, :, :half].copy(), out[t, :, half:rope_dim].copy()
        out[t, :, :half] = x0 * cos - x1 * sin
        out[t, :, half:rope_dim] = x0 * sin + x1 * cos
    return out.reshape(x.shape)


@pytest.mark.parametrize("rope_dim", [64, 32])
def test_rope_neox(rope_dim: int) -> None:
    n_head, hd = 3, 64
    x = _rand(4, n_head * hd)
    pos = np.array([0, 1, 17, 3000])
    out = np.empty_like(x)
    rope_neox(x, pos, n_head=n_head, head_dim=hd, rope_dim=rope_dim, base=1e6, out=out)
    np.testing.assert_allclose(out, _rope_like_ggml(x, pos, n_head, hd, rope_dim, 1e6),
                               rtol=0, atol=2e-5)
    exact = ref_rope_neox(x, pos, n_head=n_head, head_dim=hd, rope_dim=rope_dim, base=1e6)
    np.testing.assert_allclose(out, exact, rtol=0, atol=5e-3)  # f32 theta at pos 3000
    np.testing.assert_allclose(out[:3], exact[:3], rtol=0, atol=2e-5)
    np.testing.assert_array_equal(out[0], x[0])  # position 0 is the identity
    if rope_dim < hd:  # the unrotated tail passes through
        np.testing.assert_array_equal(out.reshape(4, n_head, hd)[..., rope_dim:],
                                      x.reshape(4, n_head, hd)[..., rope_dim:])
    rope_neox(x, pos, n_head=n_head, head_dim=hd, rope_dim=rope_dim, base=1e6, out=x)
    np.testing.assert_array_equal(x, out)


def test_large_silu_swiglu_split_over_threads_give_the_serial_bits() -> None:
    """From PARALLEL_MIN elements on, chunks over the threads: bitwise the one-row results."""
    from minfer.backends.cpu.kernels.elementwise.arith import PARALLEL_MIN

    n = 301
    rows = -(-PARALLEL_MIN // n) + 3
    g, u = _rand(rows, n) * 4, _rand(rows, n)
    big, one = np.empty_like(g), np.empty((1, n), np.float32)
    swiglu(g, u, big)
    for r in (0, rows // 2, rows - 1):
        swiglu(g[r : r + 1], u[r : r + 1], one)
        assert np.array_equal(big[r], one[0])
    silu(g, big)
    for r in (0, rows // 2, rows - 1):
        silu(g[r : r + 1], one)
        assert np.array_equal(big[r], one[0])


def test_silu_swiglu_add_mul() -> None:
    g, u = _rand(3, 100) * 4, _rand(3, 100)
    out = np.empty_like(g)
    silu(g, out)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g.astype(np.float64))), rtol=1e-6,
                               atol=1e-6)
    swiglu(g, u, out)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g.astype(np.float64))) * u, rtol=1e-6,
                               atol=1e-6)
    add(g, u, out)
    np.testing.assert_array_equal(out, g + u)
    mul(g, u, out)
    np.testing.assert_array_equal(out, g * u)
    bias = _rand(100)
    add(g, bias, out)  # one row broadcast over the rows
    np.testing.assert_array_equal(out, g + bias)
    mul(g, bias, out)
    np.testing.assert_array_equal(out, g * bias)
    with pytest.raises(ValueError):
        add(g, _rand(7), out)
