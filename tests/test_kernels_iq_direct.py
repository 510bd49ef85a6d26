"""The i-quants read direct (IQ2_XXS / IQ3_XXS / IQ3_S / IQ2_XS / IQ2_S, `reencode.READ_DIRECT`)
dotted from the file's blocks (`simd.iquants`, the default; under MINFER_IQ_WIDEN they are
widened, test_kernels_iquants.py): no widened copy held, ggml's
integer sums exactly against the dequantized reference, and one value per row whichever path
computes it: the plain rows (short calls, experts), the row groups expanded into a Q7_K_PACKED
scratch (long calls), a parallel region's parts. Run for the host's CPU and, in .ci/run's AVX2
subset, compiled for Haswell (pmaddubsw in place of vpdpbusd, ymm in place of zmm)."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends.cpu.kernels import QType, dequantize, integer_weight, packable
from minfer.backends.cpu.kernels.linear import row_drivers
from minfer.backends.cpu.kernels.linear.dispatch import (
    activation_values,
    bind_experts_into,
    prefill_min_tokens,
    quantize_activation,
)
from minfer.backends.cpu.kernels.reference import random_iquant_blocks, ref_matmul_quant
from minfer.backends.cpu.kernels.simd.iquants import EXPAND_MIN_TOKENS, EXPANDS

from .test_kernels_batch_invariance import _alone, _assert_batches_match, _prequant

DIRECT = [QType.IQ2_XXS, QType.IQ3_XXS, QType.IQ3_S, QType.IQ2_XS, QType.IQ2_S]
IDS = {"ids": lambda q: q.name}
N_IN = 256 * 3


@pytest.fixture(autouse=True)
def _direct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINFER_IQ_WIDEN", raising=False)  # the default, whatever the caller's


def _weight(qt: QType, n_out: int, seed: int = 4) -> np.ndarray:
    return random_iquant_blocks(qt, n_out, N_IN, np.random.default_rng(seed), rms=0.05)


def _x(nt: int, seed: int = 5) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((nt, N_IN)).astype(np.float32)
    x[min(5, nt - 1)] *= 1e3
    return x


@pytest.mark.parametrize("qt", DIRECT, **IDS)
def test_the_file_blocks_are_the_weight_held(qt: QType, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weight(qt, 48)
    held, ht = integer_weight(w, qt)
    assert held is w and ht is qt
    assert not packable(qt, N_IN, 48)  # no interleaved copy either
    # long calls expand row groups on the fly (never the sgemm path) where the CPU can
    assert prefill_min_tokens(qt) > 1 << 40 or not EXPANDS
    monkeypatch.setenv("MINFER_IQ_WIDEN", "1")  # speed over memory: the exact Q6_K / Q7_K copy
    wide, wt = integer_weight(w, qt)
    assert wt is not qt and wide.nbytes > 1.5 * w.nbytes  # IQ3_S -> Q6_K: 210 / 110 bytes


@pytest.mark.parametrize("qt", DIRECT, **IDS)
@pytest.mark.parametrize("n_out", [48, 83])  # row groups of 16 (expanded when long), or not
def test_rows_equal_ggml_integer_dot_alone_and_in_batches(qt: QType, n_out: int) -> None:
    """Every token pass (8, 4, 2, 1) and, from EXPAND_MIN_TOKENS tokens, the expanded row
    groups: ggml's integer sums exactly (float64 reference), within f32 rounding of the float
    steps; the dequantized f32 product close; a row's bits the same alone and in any batch."""
    w = _weight(qt, n_out)
    x = _x(40)
    run = _prequant(w, qt)
    alone = _alone(run, x, n_out)
    ref, terms = ref_matmul_quant(w, qt, x)
    assert np.all(np.abs(alone - ref) <= 1e-6 * terms + 1e-30)
    f64 = activation_values(x, qt).astype(np.float64) @ dequantize(w, qt, N_IN).astype(
        np.float64).T
    assert np.abs(alone - f64).max() <= 1e-5 * np.abs(f64).max()
    assert EXPAND_MIN_TOKENS <= 16
    _assert_batches_match(run, x, alone, (2, 3, 5, 8, 9, 16, 33, 40))


# d_w over ggml's f16 d (`quant.iquants.iq_form`)
_D_FACTOR = {QType.IQ2_XXS: 0.125, QType.IQ3_XXS: 0.5, QType.IQ3_S: 1.0, QType.IQ2_XS: 0.125,
             QType.IQ2_S: 0.125}


@pytest.mark.parametrize("qt", DIRECT, **IDS)
def test_rows_are_ggml_float_steps_bit_for_bit(qt: QType) -> None:
    """Per super-block the exact integer sum (the dequantized values over d_w are integers
    sc * q) and one float step acc = fma(d_w * d_x, float(sum), acc) in block order: emulated
    in 64-bit-mantissa long doubles (d_w d_x times a sum below 2^31 is exact there), the
    kernel's bits in short (plain rows) and long (expanded row groups) calls."""
    n_out, nb = 48, N_IN // 256
    w = _weight(qt, n_out, seed=10)
    x = _x(20, seed=11)
    xq = quantize_activation(x, qt)
    d16 = w.reshape(n_out, nb, -1)[:, :, :2].copy().view(np.float16)[..., 0]
    dw = d16.astype(np.float32) * np.float32(_D_FACTOR[qt])  # [n_out, nb]
    vals = dequantize(w, qt, N_IN).astype(np.float64).reshape(n_out, nb, 256)
    ints = np.rint(vals / np.where(dw == 0, 1, dw)[..., None].astype(np.float64))
    assert np.array_equal(ints * dw[..., None], vals)  # d_w * (sc * q) exactly
    acc = np.zeros((len(x), n_out), np.float32)
    xqs = xq.qs.astype(np.int64).reshape(len(x), nb, 256)
    for b in range(nb):
        isum = xqs[:, b] @ ints[:, b].astype(np.int64).T  # [nt, n_out]
        p = xq.d[:, b, None] * dw[None, :, b]  # f32 products
        acc = (p.astype(np.longdouble) * isum.astype(np.longdouble)
               + acc.astype(np.longdouble)).astype(np.float32)
    run = _prequant(w, qt)
    for t0, t1 in ((0, 3), (0, 20)):
        out = np.empty((t1 - t0, n_out), np.float32)
        run(x[t0:t1], out)
        assert np.array_equal(out, acc[t0:t1]), (t0, t1)


@pytest.mark.parametrize("qt", DIRECT, **IDS)
def test_region_parts_write_the_drivers_bits(qt: QType) -> None:
    """`<driver>_part` (one per thread of a parallel region), short and long calls."""
    w = _weight(qt, 80, seed=6)
    fn = getattr(row_drivers, f"mv_{qt.name.lower()}")
    part = getattr(row_drivers._M, f"mv_{qt.name.lower()}_part")
    for nt in (1, 3, 20):
        xq = quantize_activation(_x(nt, seed=nt), qt)
        args = (w, xq.qs, xq.d, xq.bsums)
        out = np.empty((nt, 80), np.float32)
        fn(*args, out)
        parts = np.full_like(out, np.nan)
        for p in range(3):
            part(p, 3, *args, parts)
        assert np.array_equal(parts, out), nt


@pytest.mark.parametrize("qt", DIRECT, **IDS)
def test_bias_in_the_epilogue_is_the_separate_add(qt: QType) -> None:
    """`graph.fusion.fuse_bias`: the bias added by the driver (short calls and expanded row
    groups, whole and in region parts) gives the bits of the add after it."""
    w = _weight(qt, 48, seed=8)
    bias = np.random.default_rng(9).standard_normal(48).astype(np.float32)
    fn = getattr(row_drivers, f"mv_{qt.name.lower()}")
    part = getattr(row_drivers._M, f"mv_{qt.name.lower()}_part")
    for nt in (1, 3, 20):
        xq = quantize_activation(_x(nt, seed=nt), qt)
        args = (w, xq.qs, xq.d, xq.bsums)
        plain = np.empty((nt, 48), np.float32)
        fn(*args, plain, None)
        fused = np.empty_like(plain)
        fn(*args, fused, bias)
        assert np.array_equal(fused, plain + bias), nt
        parts = np.full_like(plain, np.nan)
        for p in range(2):
            part(p, 2, *args, parts, bias)
        assert np.array_equal(parts, fused), nt


@pytest.mark.parametrize("qt", DIRECT, **IDS)
def test_expert_form_writes_the_dense_bits(qt: QType) -> None:
    """Stacked experts (the plain rows' passes) against the dense driver on each expert's rows
    (a group long enough to expand there)."""
    n_exp, n_out = 3, 32
    w3 = _weight(qt, n_exp * n_out, seed=7).reshape(n_exp, n_out, -1)
    sizes = [2, 19, 5]  # experts 1, 2, 0
    x = _x(sum(sizes), seed=8)
    groups = np.zeros((n_exp, 3), np.int64)
    start = 0
    for g, (e, n) in enumerate(zip([1, 2, 0], sizes, strict=True)):
        groups[g] = (e, start, start + n)
        start += n
    xq = quantize_activation(x, qt)
    out = np.full((len(x), n_out), np.nan, np.float32)
    bind_experts_into(w3, qt, groups, np.array([n_exp]), xq, x, out)()
    for e, t0, t1 in groups:
        ref = np.empty((t1 - t0, n_out), np.float32)
        _prequant(np.ascontiguousarray(w3[e]), qt)(x[t0:t1], ref)
        assert np.array_equal(out[t0:t1], ref), e
