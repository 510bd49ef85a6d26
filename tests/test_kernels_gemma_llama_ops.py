"""The kernels Gemma 3 and Llama added: RoPE in normal mode with frequency factors and linear
scaling, GELU through ggml's f16 table (and its gated form), scale, soft-cap, and attention with
a sliding window and soft-capped scores (per-token and blocked kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends.cpu.kernels import attention, geglu, gelu, rope, scale, softcap
from minfer.backends.cpu.kernels.elementwise.gelu import gelu_f32
from minfer.backends.cpu.kernels.reference import ref_attention, ref_rope
from minfer.gguf.rope_scaling import NO_YARN, Yarn

RNG = np.random.default_rng(1)


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize(("freq_scale", "with_factors"), [(1.0, False), (0.25, True)])
def test_rope_styles_factors_and_scale(style: str, freq_scale: float, with_factors: bool) -> None:
    n_head, hd, rope_dim = 3, 32, 24
    x = RNG.standard_normal((5, n_head * hd)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 3000])
    factors = np.geomspace(1.0, 8.0, rope_dim // 2).astype(np.float32) if with_factors else None
    out = np.empty_like(x)
    kw = {"n_head": n_head, "head_dim": hd, "rope_dim": rope_dim, "base": 5e5, "style": style,
          "freq_scale": freq_scale, "factors": factors}
    rope(x, pos, out=out, **kw)  # type: ignore[arg-type]
    # f32 angles built by repeated multiplication (as ggml): error grows with the position
    np.testing.assert_allclose(out, ref_rope(x, pos, **kw), rtol=0, atol=2e-3)  # type: ignore[arg-type]
    np.testing.assert_array_equal(out[:, rope_dim:hd], x[:, rope_dim:hd])  # past rope_dim
    rope(x, pos, out=x, **kw)  # type: ignore[arg-type]
    np.testing.assert_array_equal(x, out)  # in place


@pytest.mark.parametrize("style", ["neox", "norm"])
def test_rope_yarn_blends_each_pair_and_scales_the_magnitude(style: str) -> None:
    # a Qwen-like layer stretched 4x from 64 trained positions: pairs below corr_low keep their
    # angle, those above corr_high are interpolated, the ones between blend along the ramp
    yarn = Yarn(factor=4.0, n_ctx_orig=64).layer(rope_dim=24, base=1e4, freq_scale=0.25)
    assert yarn.corr_high > 0.0 and yarn.mscale == pytest.approx(1.0 + 0.1 * np.log(4.0))
    n_head, hd, rope_dim = 2, 32, 24
    x = RNG.standard_normal((4, n_head * hd)).astype(np.float32)
    pos = np.array([0, 5, 90, 250])
    out = np.empty_like(x)
    kw = {"n_head": n_head, "head_dim": hd, "rope_dim": rope_dim, "base": 1e4, "style": style,
          "freq_scale": 0.25, "yarn": yarn}
    rope(x, pos, out=out, **kw)  # type: ignore[arg-type]
    np.testing.assert_allclose(out, ref_rope(x, pos, **kw), rtol=0, atol=2e-4)  # type: ignore[arg-type]
    plain = np.empty_like(x)
    rope(x, pos, out=plain, **{**kw, "yarn": NO_YARN})  # type: ignore[arg-type]
    assert np.abs(out - plain).max() > 0.1  # the ramp and magnitude show
    # the ramp's fast end keeps the trained angle: pair 0 turns by exactly pos radians
    first = (slice(0, 1), slice(rope_dim // 2, rope_dim // 2 + 1)) if style == "neox" else \
        (slice(0, 1), slice(1, 2))
    got = out[1, first[0]][0] / yarn.mscale, out[1, first[1]][0] / yarn.mscale
    a, b = x[1, first[0]][0], x[1, first[1]][0]
    np.testing.assert_allclose(got, (a * np.cos(5) - b * np.sin(5), a * np.sin(5) + b * np.cos(5)),
                               atol=1e-5)


def test_rope_norm_rotates_adjacent_pairs() -> None:
    x = np.zeros((1, 4), np.float32)
    x[0, 0] = 1.0
    out = np.empty_like(x)
    rope(x, np.array([1]), n_head=1, head_dim=4, rope_dim=4, base=1e4, style="norm", out=out)
    np.testing.assert_allclose(out[0], [np.cos(1), np.sin(1), 0, 0], atol=1e-6)


def test_gelu_follows_ggmls_f16_table() -> None:
    x = np.concatenate([np.linspace(-12, 12, 4001), [-10.0, 10.0, 0.0]]).astype(np.float32)
    out = np.empty_like(x)
    gelu(x, out)
    inside = np.abs(x) < 10
    table = gelu_f32(x.astype(np.float16).astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(out[inside], table[inside].astype(np.float32))
    np.testing.assert_array_equal(out[x >= 10], x[x >= 10])
    np.testing.assert_array_equal(out[x <= -10], 0.0)
    exact = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x.astype(np.float64)**3)))
    np.testing.assert_allclose(out, exact, rtol=2e-3, atol=2e-3)
    up = RNG.standard_normal(x.shape).astype(np.float32)
    gated = np.empty_like(x)
    geglu(x, up, gated)
    np.testing.assert_array_equal(gated, out * up)


def test_scale_and_softcap() -> None:
    x = RNG.standard_normal((3, 7)).astype(np.float32) * 40
    out = np.empty_like(x)
    scale(x, 25.3, out)
    np.testing.assert_array_equal(out, x * np.float32(25.3))
    softcap(x, 30.0, out)
    np.testing.assert_allclose(out, 30 * np.tanh(x / 30.0), rtol=1e-6, atol=1e-5)
    assert np.abs(out).max() < 30


# Entries of ggml's GELU table (f16 input bits -> f16 output bits) as llama.cpp's x86 build fills
# it (libm's tanhf; 1 + a*x*x contracted to a fused multiply-add), read out of its
# `ggml_table_gelu_f16`. Built with numpy's f32 tanh, 234 entries (all for x in (-10, -1.8))
# came out one to three f16 ulps off, these among them; 0xbfff (x = -1.999) is the one entry
# the fused multiply-add decides.
GGML_GELU_ENTRIES = {0xBF45: 0xAC06, 0xBFFF: 0xA9D3, 0xC37F: 0x8B3F, 0xC3D1: 0x8715,
                     0xC41F: 0x828D, 0xC4C9: 0x8011, 0xC50F: 0x8003, 0xC549: 0x8000}


def test_gelu_table_entries_are_ggmls() -> None:
    x = np.array(list(GGML_GELU_ENTRIES), np.uint16).view(np.float16).astype(np.float32)
    out = np.empty_like(x)
    gelu(x, out)
    got = out.astype(np.float16).view(np.uint16)
    assert [int(b) for b in got] == list(GGML_GELU_ENTRIES.values())


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attention_sliding_window_and_softcap(blocked: bool, dtype: type) -> None:
    nt, n_head, n_kv, hd, window = 40, 4, 1, 32, 9
    q = RNG.standard_normal((nt, n_head * hd)).astype(np.float32)
    k = RNG.standard_normal((64, n_kv * hd)).astype(dtype)
    v = RNG.standard_normal((64, n_kv * hd)).astype(dtype)
    start = np.zeros(nt, np.int32)
    start[20:] = 20  # a second sequence from cell 20
    end = np.arange(1, nt + 1, dtype=np.int32)
    results = {}
    for cap in (0.0, 2.0):
        out = np.empty_like(q)
        attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=0.3,
                  out=out, blocked=blocked, window=window, softcap=cap)
        qr = q.astype(np.float16).astype(np.float32) if dtype == np.float16 else q
        ref = ref_attention(qr, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd,
                            scale=0.3, window=window, softcap=cap)
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)
        results[cap] = out
    wide = np.empty_like(q)
    attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=0.3,
              out=wide, blocked=blocked)
    # rows whose window covers their whole sequence are unchanged; the others differ
    short = (end - start) <= window
    np.testing.assert_allclose(results[0.0][short], wide[short], rtol=0, atol=2e-6)
    assert np.abs(results[0.0][~short] - wide[~short]).max(axis=-1).min() > 1e-4


@pytest.mark.parametrize("style", ["neox", "norm"])
def test_rope_rows_across_threads_equal_rows_alone(style: str) -> None:
    """A prefill's many rows (split across the threads in chunks) rotate each row bit for bit
    as a one-row decode does, partial rope_dim and factors included, in place too."""
    from minfer.backends.cpu.kernels.elementwise.rope import PARALLEL_CHUNK, PARALLEL_MIN_ROWS

    n_head, hd, rope_dim = 2, 32, 24
    nt = PARALLEL_MIN_ROWS + PARALLEL_CHUNK // 2 + 1  # a last chunk that is not full
    x = RNG.standard_normal((nt, n_head * hd)).astype(np.float32)
    pos = RNG.integers(0, 5000, nt)
    kw = {"n_head": n_head, "head_dim": hd, "rope_dim": rope_dim, "base": 1e4, "style": style,
          "factors": np.geomspace(1.0, 4.0, rope_dim // 2).astype(np.float32)}
    out = np.empty_like(x)
    rope(x, pos, out=out, **kw)  # type: ignore[arg-type]
    one = np.empty((1, n_head * hd), np.float32)
    for t in range(nt):
        rope(x[t:t + 1], pos[t:t + 1], out=one, **kw)  # type: ignore[arg-type]
        np.testing.assert_array_equal(out[t], one[0])
    rope(x, pos, out=x, **kw)  # type: ignore[arg-type]
    np.testing.assert_array_equal(x, out)
