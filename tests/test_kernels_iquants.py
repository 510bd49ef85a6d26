"""The i-quants, TQ1_0 / TQ2_0 and MXFP4: dequantization bit-exact with gguf.quants, the
re-encoded copies the integer kernels run (exact, or IQ4_XS within its stated bound), and the
matmul paths against ggml's integer dot and the dequantized f32 product."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

from minfer.backends.cpu.kernels import (
    QType,
    dequantize,
    integer_weight,
    matmul,
    matmul_sgemm,
)
from minfer.backends.cpu.kernels.linear.dispatch import activation_values
from minfer.backends.cpu.kernels.quant import iq_grids
from minfer.backends.cpu.kernels.quant.types import BLOCK_LAYOUT
from minfer.backends.cpu.kernels.reference import (
    IQUANT_TYPES,
    random_iquant_blocks,
    ref_matmul_quant,
)

# the type each one runs as (at moderate scales: see test_tiny_scales_keep_exact_copies)
WIDENED = {QType.IQ2_XXS: QType.Q7_K, QType.IQ2_XS: QType.Q7_K, QType.IQ2_S: QType.Q7_K,
           QType.IQ3_XXS: QType.Q6_K, QType.IQ3_S: QType.Q6_K, QType.IQ1_S: QType.Q6_K,
           QType.IQ1_M: QType.Q6_K, QType.TQ1_0: QType.Q6_K, QType.TQ2_0: QType.Q6_K,
           QType.IQ4_XS: QType.Q8_0, QType.MXFP4: QType.Q8_0}
N_IN, N_OUT = 768, 83
IDS = {"ids": lambda q: q.name}


def _weight(qt: QType, n_out: int = N_OUT, n_in: int = N_IN, seed: int = 0,
            rms: float = 0.05) -> np.ndarray:
    return random_iquant_blocks(qt, n_out, n_in, np.random.default_rng(seed), rms=rms)


def _x(nt: int, n_in: int = N_IN, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((nt, n_in)).astype(np.float32)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def test_grids_are_ggmls() -> None:
    for cls, grid in ((gq.IQ2_XXS, iq_grids.IQ2XXS_GRID), (gq.IQ2_XS, iq_grids.IQ2XS_GRID),
                      (gq.IQ2_S, iq_grids.IQ2S_GRID), (gq.IQ3_XXS, iq_grids.IQ3XXS_GRID),
                      (gq.IQ3_S, iq_grids.IQ3S_GRID), (gq.IQ1_S, iq_grids.IQ1S_GRID)):
        cls.init_grid()
        assert cls.grid is not None
        np.testing.assert_array_equal(cls.grid.reshape(grid.shape), grid)
    np.testing.assert_array_equal(iq_grids.KSIGNS, np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8))


@pytest.mark.parametrize("qt", IQUANT_TYPES, **IDS)
def test_dequantize_matches_gguf_bitwise(qt: QType) -> None:
    w = _weight(qt, 19, 512, seed=int(qt))
    # every code and sub-scale at random, with one scale per block over a wide range
    nb = 512 // BLOCK_LAYOUT[qt][0]
    w2 = random_iquant_blocks(qt, 19, 512, np.random.default_rng(1),
                              rms=np.exp(np.random.default_rng(2).uniform(-12, 2, (19, nb))))
    for raw in (w, w2):
        want = gq.dequantize(raw, GT(int(qt))).astype(np.float32).reshape(19, 512)
        np.testing.assert_array_equal(_bits(dequantize(raw, qt, 512)), _bits(want))


@pytest.mark.parametrize("qt", [QType.TQ1_0, QType.TQ2_0, QType.MXFP4], **IDS)
def test_dequantize_matches_gguf_on_quantized_blocks(qt: QType) -> None:
    data = _x(7, 512, seed=3)
    raw = gq.quantize(data, GT(int(qt)))
    want = gq.dequantize(raw, GT(int(qt))).astype(np.float32)
    np.testing.assert_array_equal(_bits(dequantize(raw, qt, 512)), _bits(want))


@pytest.mark.parametrize("qt", IQUANT_TYPES, **IDS)
def test_widened_copy_holds_the_same_values(qt: QType) -> None:
    w = _weight(qt)
    wide, wt = integer_weight(w, qt)
    assert wt is WIDENED[qt]
    exact = dequantize(w, qt, N_IN)
    if wt is QType.Q7_K:  # read by its kernel only: its integer form, decoded here
        blocks = wide.reshape(N_OUT, -1, 276)
        q = blocks[:, :, :256].astype(np.int32) - 64
        sc = blocks[:, :, 256:272].copy().view(np.int8).astype(np.float32)
        d = blocks[:, :, 272:276].copy().view(np.float32)
        got = ((d * sc)[..., None] * q.reshape(N_OUT, -1, 16, 16)).reshape(N_OUT, N_IN)
    else:
        got = dequantize(wide, wt, N_IN)
    if qt is QType.IQ4_XS:  # d * (ls - 32) rounded to f16 (normal range here)
        assert np.all(np.abs(got - exact) <= 2.0 ** -11 * np.abs(exact))
        assert not np.array_equal(got, exact)
    else:
        np.testing.assert_array_equal(_bits(got), _bits(exact))


def test_tiny_scales_keep_exact_copies() -> None:
    """An IQ1_S weight whose d/8 is no f16 (d < 2^-11) runs as Q7_K (f32 d): still exact."""
    w = _weight(QType.IQ1_S, rms=2e-4)
    wt = integer_weight(w, QType.IQ1_S)[1]
    assert wt is QType.Q7_K
    x = _x(2)
    out = np.empty((2, N_OUT), np.float32)
    matmul(w, QType.IQ1_S, x, out)
    ref, terms = ref_matmul_quant(w, QType.IQ1_S, x)
    assert np.all(np.abs(out - ref) <= 1e-5 * terms + 1e-30)


def test_mxfp4_scale_beyond_f16_is_refused() -> None:
    from minfer.errors import ModelError

    w = _weight(QType.MXFP4)
    w.reshape(N_OUT, -1, 17)[3, 2, 0] = 150
    with pytest.raises(ModelError, match="2\\^15"):
        integer_weight(w, QType.MXFP4)


@pytest.mark.parametrize("qt", IQUANT_TYPES, **IDS)
@pytest.mark.parametrize("nt", [1, 3, 9, 64])  # decode (1), every token pass, a prefill batch
def test_integer_path_equals_ggml_integer_dot(qt: QType, nt: int) -> None:
    w = _weight(qt)
    x = _x(nt)
    out = np.empty((nt, N_OUT), np.float32)
    matmul(w, qt, x, out)
    # ggml's integer sums (IQ4_XS: with the Q8_0 activation it runs on), exactly, in float64
    ref, terms = ref_matmul_quant(w, qt, x)
    # exact integer sums: the f32 scale-and-sum order differs; IQ4_XS's f16 sub-block scales
    # add at most 2^-11 of the terms (`quant.reencode`)
    bound = (2.0 ** -11 if qt is QType.IQ4_XS else 0.0) + 1e-5
    assert np.all(np.abs(out - ref) <= bound * terms + 1e-30)
    f32 = x @ dequantize(w, qt, N_IN).T
    assert np.abs(out - f32).max() <= 3e-2 * np.abs(f32).max()


@pytest.mark.parametrize("qt", IQUANT_TYPES, **IDS)
def test_prefill_sgemm_path_matches_dequantized_product(qt: QType) -> None:
    """The sgemm path (taken on CPUs without AVX512-VNNI) on the file's blocks."""
    w = _weight(qt, 300, seed=7)
    x = _x(35)
    out = np.empty((35, 300), np.float32)
    matmul_sgemm(w, qt, x, out)
    ref = activation_values(x, qt).astype(np.float64) @ dequantize(w, qt, N_IN).astype(
        np.float64).T
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
