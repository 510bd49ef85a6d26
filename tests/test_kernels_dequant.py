"""Dequantization and activation quantization kernels against gguf.quants / numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from minfer.backends.cpu.kernels import (
    QType,
    dequantize,
    dequantize_into,
    get_rows,
    quantize_q8_0,
    quantize_q8_k,
    row_bytes,
)
from minfer.backends.cpu.kernels.reference import (
    random_kquant_blocks,
    ref_quantize_q8_0,
    ref_quantize_q8_k,
)
from minfer.errors import ModelError

QUANT_32 = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.IQ4_NL]
QUANT_K = [QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q2_K, QType.Q3_K]


def make_weight(qt: QType, n_out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """Weight bytes (or a float array) of type qt, from random normal data (Q7_K: random
    IQ2_XXS blocks widened, as under MINFER_IQ_WIDEN)."""
    rng = np.random.default_rng(seed)
    if qt in QUANT_K:
        return random_kquant_blocks(qt, n_out, n_in, rng)
    if qt is QType.Q7_K:  # minfer's own (never in a file): an IQ2_XXS weight's widened copy
        from minfer.backends.cpu.kernels import integer_weight
        from minfer.backends.cpu.kernels.reference import random_iquant_blocks

        raw = random_iquant_blocks(QType.IQ2_XXS, n_out, n_in, rng, rms=0.05)
        with pytest.MonkeyPatch.context() as mp:  # by default its file's blocks are read
            mp.setenv("MINFER_IQ_WIDEN", "1")
            return integer_weight(raw, QType.IQ2_XXS)[0]
    data = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if qt is QType.F32:
        return data
    if qt is QType.F16:
        return data.astype(np.float16)
    if qt is QType.IQ4_NL:  # gguf.quants only dequantizes it; llama.cpp's exact quantizer
        from minfer.tools.quantize import quantize_rows

        return quantize_rows(data, GT.IQ4_NL)
    return gguf_quantize(data, GT(int(qt)))


@pytest.mark.parametrize("qt", [*QUANT_32, *QUANT_K, QType.F32, QType.F16, QType.BF16],
                         ids=lambda q: q.name)
def test_dequantize_matches_gguf_exactly(qt: QType) -> None:
    w = make_weight(qt, 19, 512)
    got = dequantize(w, qt, 512)
    want = gguf_dequantize(w, GT(int(qt))).astype(np.float32).reshape(19, 512)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qt", [*QUANT_32, *QUANT_K, QType.F32, QType.F16, QType.BF16],
                         ids=lambda q: q.name)
def test_dequantize_to_bf16_bits_rounds_the_f32_values_to_nearest_even(qt: QType) -> None:
    """A uint16 `out` gets bf16 bit patterns: torch's rounding of the exact f32 values."""
    torch = pytest.importorskip("torch")
    w = make_weight(qt, 19, 512, seed=3)
    rows = np.array([18, 0, 7])
    got = np.empty((3, 512), np.uint16)
    dequantize_into(w, qt, rows, got)
    f32 = dequantize(w, qt, 512)[rows]
    want = torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_bf16_bits_of_a_nan_stay_a_nan() -> None:
    w = np.array([[np.nan, -np.nan, np.inf, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]], np.float32)
    got = np.empty((1, 5), np.uint16)
    dequantize_into(w, QType.F32, np.array([0]), got)
    back = (got.astype(np.uint32) << np.uint32(16)).view(np.float32)
    assert np.isnan(back[0, :2]).all()
    assert back[0, 2] == np.inf
    assert list(back[0, 2:]) == [np.inf, 1.0, 1.0 + 2.0**-6]  # ties to even, both ways


@pytest.mark.parametrize("qt", [QType.Q5_0, QType.Q6_K, QType.Q2_K, QType.Q3_K, QType.F16],
                         ids=lambda q: q.name)
def test_get_rows_is_an_embedding_lookup(qt: QType) -> None:
    w = make_weight(qt, 40, 256, seed=1)
    ids = np.array([3, 0, 39, 3], dtype=np.int32)
    out = np.empty((4, 256), np.float32)
    get_rows(w, qt, ids, out)
    np.testing.assert_array_equal(out, dequantize(w, qt, 256)[ids])


def test_get_rows_refuses_out_of_range_ids() -> None:
    w = make_weight(QType.Q8_0, 4, 64)
    with pytest.raises(IndexError):
        get_rows(w, QType.Q8_0, np.array([4]), np.empty((1, 64), np.float32))


@pytest.mark.parametrize("qt", [QType.Q5_0, QType.Q4_K, QType.F16], ids=lambda q: q.name)
def test_bound_get_rows_reads_the_ids_each_call_and_refuses_bad_ones(qt: QType) -> None:
    from minfer.backends.cpu.kernels import bind_get_rows

    w = make_weight(qt, 40, 256, seed=2)
    ids = np.zeros(2, np.int32)
    out = np.empty((2, 256), np.float32)
    step = bind_get_rows(w, qt, ids, out)
    table = dequantize(w, qt, 256)
    for batch in ([1, 39], [7, 7]):  # the ids are data: filled in before each call
        ids[:] = batch
        step()
        np.testing.assert_array_equal(out, table[ids])
    for bad in ([0, 40], [-1, 0]):
        ids[:] = bad
        with pytest.raises(IndexError):
            step()


def test_unsupported_type_is_refused_by_name() -> None:
    with pytest.raises(ModelError, match="NVFP4"):
        dequantize(np.zeros((1, 144), np.uint8), int(GT.NVFP4), 256)
    assert row_bytes(QType.Q6_K, 4864) == 19 * 210


def test_quantize_q8_0_matches_reference() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4864)).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, 32:64] *= 1e-3
    got = quantize_q8_0(x)
    qs, d, s = ref_quantize_q8_0(x)
    np.testing.assert_array_equal(got.qs, qs)
    np.testing.assert_array_equal(got.d, d)
    np.testing.assert_array_equal(got.s, s)
    np.testing.assert_array_equal(got.isum, qs.reshape(3, -1, 32).astype(np.int32).sum(-1))


@pytest.mark.parametrize("nt", [2, 17])  # one thread, and rows split across threads
def test_quantize_q8_k_matches_reference(nt: int) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((nt, 1024)).astype(np.float32)
    x[0, :256] = 0.0
    x[1, 256:512] = -np.abs(x[1, 256:512])  # the extreme value is negative
    x[0, 512 + 3], x[0, 512 + 200] = 9.0, -9.0  # ties of magnitude: the first sets the sign
    x[1, 768 + 40], x[1, 768 + 41] = -9.0, 9.0
    got = quantize_q8_k(x)
    qs, d, bsums = ref_quantize_q8_k(x)
    np.testing.assert_array_equal(got.qs, qs)
    np.testing.assert_array_equal(got.d, d)
    np.testing.assert_array_equal(got.bsums, bsums)
