"""Quantized / float matmul kernels: the integer decode path against the exact value of ggml's
integer dot, both paths against the f32 dequantized product, and the dispatch rules."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu.kernels import (
    QType,
    dequantize,
    matmul,
    matmul_prequant,
    matmul_sgemm,
    packable,
    prefill_min_tokens,
    quantize_activation,
    repack_weight,
)
from minfer.backends.cpu.kernels.linear.dispatch import activation_values
from minfer.backends.cpu.kernels.linear.float_rows import round_to_bf16
from minfer.backends.cpu.kernels.reference import ref_matmul_quant

from .test_kernels_dequant import QUANT_32, QUANT_K, make_weight

# weight shape per type (K-quants need n_in % 256 == 0; n_out not a multiple of the row chunk)
N_IN = {**{q: 896 for q in QUANT_32}, **{q: 768 for q in QUANT_K}}
N_OUT = 83


def _x(nt: int, n_in: int, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((nt, n_in)).astype(np.float32)


@pytest.mark.parametrize("qt", QUANT_32 + QUANT_K, ids=lambda q: q.name)
@pytest.mark.parametrize("nt", [1, 3])
def test_integer_path_equals_ggml_integer_dot(qt: QType, nt: int) -> None:
    n_in = N_IN[qt]
    w = make_weight(qt, N_OUT, n_in)
    x = _x(nt, n_in)
    out = np.empty((nt, N_OUT), np.float32)
    matmul(w, qt, x, out)
    ref, terms = ref_matmul_quant(w, qt, x)
    # integer sums are exact; only the f32 scale-and-sum order differs from the reference
    assert np.all(np.abs(out - ref) <= 1e-5 * terms + 1e-30)
    # and the whole thing approximates the f32 product of the dequantized weight
    f32 = x @ dequantize(w, qt, n_in).T
    assert np.abs(out - f32).max() <= 3e-2 * np.abs(f32).max()


@pytest.mark.parametrize("qt", QUANT_32, ids=lambda q: q.name)
@pytest.mark.parametrize("n_blocks", [1, 5, 13])  # the kernels' 8-, 4- and 1-block steps
def test_row_tails(qt: QType, n_blocks: int) -> None:
    n_in = 32 * n_blocks
    w = make_weight(qt, 17, n_in, seed=n_blocks)
    x = _x(2, n_in)
    out = np.empty((2, 17), np.float32)
    matmul(w, qt, x, out)
    ref, terms = ref_matmul_quant(w, qt, x)
    assert np.all(np.abs(out - ref) <= 1e-5 * terms + 1e-30)


@pytest.mark.parametrize("qt", [QType.Q5_0, QType.Q4_1, QType.Q4_K, QType.Q6_K, QType.Q2_K,
                                QType.Q3_K], ids=lambda q: q.name)
def test_prefill_sgemm_path_matches_dequantized_product(qt: QType) -> None:
    """The sgemm path multiplies the dequantized weight by the activation as the integer dots
    round it (its Q8 codes times their scales), as ggml's dots do."""
    n_in = N_IN[qt]
    w = make_weight(qt, 300, n_in, seed=7)  # several tiles plus a ragged last one
    x = _x(35, n_in)
    out = np.empty((x.shape[0], 300), np.float32)
    matmul_sgemm(w, qt, x, out)
    xr = activation_values(x, qt).astype(np.float64)
    assert np.abs(xr - x).max() > 1e-4  # the rounding is not a no-op
    ref = xr @ dequantize(w, qt, n_in).astype(np.float64).T
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qt", [QType.Q8_0, QType.Q4_K], ids=lambda q: q.name)
def test_sgemm_and_integer_paths_agree_to_float_rounding(qt: QType) -> None:
    """Both paths take the quantized activation: a row's results differ by float summation
    order only (they differed by the activation's quantization noise, ~1e-2, with f32 x)."""
    w = make_weight(qt, 64, 512)
    x = _x(70, 512)
    big = np.empty((x.shape[0], 64), np.float32)
    small = np.empty((1, 64), np.float32)
    matmul_sgemm(w, qt, x, big)
    matmul_prequant(w, qt, quantize_activation(x[5:6], qt), small)
    assert np.abs(big[5] - small[0]).max() < 1e-5 * np.abs(big[5]).max()


@pytest.mark.parametrize("qt", [QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.Q3_K,
                                QType.Q2_K], ids=lambda q: q.name)
def test_prefill_sized_batch_takes_a_path_that_matches_its_rows(qt: QType) -> None:
    """matmul on a prefill-sized batch: with AVX512-VNNI the integer path, whose rows are
    bitwise the one-row result; elsewhere the sgemm path, equal to float rounding."""
    n_in = N_IN[qt]
    w = make_weight(qt, 48, n_in, seed=3)
    x = _x(300, n_in)
    big = np.empty((300, 48), np.float32)
    matmul(w, qt, x, big)
    for t in (0, 7, 299):
        one = np.empty((1, 48), np.float32)
        matmul(w, qt, x[t:t + 1], one)
        if prefill_min_tokens(qt) > 300:
            np.testing.assert_array_equal(big[t], one[0])
        else:
            assert np.abs(big[t] - one[0]).max() < 2e-2 * np.abs(one[0]).max()


@pytest.mark.parametrize("qt", [QType.F32, QType.F16, QType.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("nt", [1, 2, 40])
def test_float_weights(qt: QType, nt: int) -> None:
    n_in = 200  # not a multiple of the 64-wide inner loop
    w = make_weight(qt, 37, n_in, seed=9)
    if qt is QType.BF16:
        w = make_weight(QType.F32, 37, n_in, seed=9)
        w = (round_to_bf16(w).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    x = _x(nt, n_in)
    out = np.empty((nt, 37), np.float32)
    matmul(w, qt, x, out)
    wf = dequantize(w, qt, n_in).astype(np.float64)
    if qt is not QType.F32:  # ggml rounds x to the weight type (both paths do too)
        x = x.astype(np.float16) if qt is QType.F16 else round_to_bf16(x)
    ref = x.astype(np.float64) @ wf.T
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_prequantized_activation_is_shared_across_weights() -> None:
    x = _x(1, 896)
    xq = quantize_activation(x, QType.Q5_0)  # Q8_0 blocks serve Q5_0 and Q8_0 weights
    for qt in (QType.Q5_0, QType.Q8_0):
        w = make_weight(qt, 40, 896, seed=int(qt))
        a, b = np.empty((1, 40), np.float32), np.empty((1, 40), np.float32)
        matmul_prequant(w, qt, xq, a)
        matmul(w, qt, x, b)
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError):  # a K-quant needs Q8_K blocks
        matmul_prequant(make_weight(QType.Q4_K, 4, 1024), QType.Q4_K,
                        quantize_activation(_x(1, 1024), QType.Q8_0), np.empty((1, 4), np.float32))


def test_shape_errors_are_loud() -> None:
    w = make_weight(QType.Q8_0, 8, 64)
    with pytest.raises(ValueError):
        matmul(w, QType.Q8_0, _x(1, 32), np.empty((1, 8), np.float32))
    with pytest.raises(ValueError):
        matmul(w, QType.Q8_0, _x(1, 64), np.empty((1, 9), np.float32))
    with pytest.raises(ValueError):
        matmul_sgemm(w.view(np.int8), QType.Q8_0, _x(1, 64), np.empty((1, 8), np.float32))


@pytest.mark.real_model
def test_real_weights_of_the_dev_model(real_model_path: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(real_model_path))
    seen = set()
    for t in reader.tensors:
        qt = QType(int(t.tensor_type))
        if qt in seen or qt not in (QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K):
            continue
        seen.add(qt)
        w = np.ascontiguousarray(t.data[:64])  # first 64 rows
        n_in = int(t.shape[0])
        x = _x(2, n_in, seed=11)
        out = np.empty((2, 64), np.float32)
        matmul(w, qt, x, out)
        ref, terms = ref_matmul_quant(w, qt, x)
        assert np.all(np.abs(out - ref) <= 1e-5 * terms), t.name
    assert seen == {QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K}


def _check_repacked(w: np.ndarray, qt: QType, n_in: int, nt: int, alone: Sequence[int],
                    atol: float) -> tuple[np.ndarray, QType]:
    """Repack w (rows of n_in values); nt tokens through it equal the plain rows' result within
    atol x its largest value, and each token in `alone` run by itself is bitwise its batched
    result."""
    wp, pqt = repack_weight(w, qt)
    n_out = w.shape[0]
    x = _x(nt, n_in)
    xq = quantize_activation(x, qt)
    plain = np.empty((nt, n_out), np.float32)
    packed = np.empty((nt, n_out), np.float32)
    matmul_prequant(w, qt, xq, plain)
    matmul_prequant(wp, pqt, xq, packed)
    np.testing.assert_allclose(packed, plain, rtol=0, atol=atol * np.abs(plain).max())
    for t in alone:
        one = np.empty((1, n_out), np.float32)
        matmul_prequant(wp, pqt, quantize_activation(x[t:t + 1], qt), one)
        np.testing.assert_array_equal(one[0], packed[t])
    return wp, pqt


@pytest.mark.parametrize("qt", [QType.Q4_0, QType.Q5_0, QType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n_blocks", [1, 3, 8, 28, 29, 152])
def test_interleaved_rows_match_the_plain_rows_and_are_batch_invariant(qt: QType,
                                                                       n_blocks: int) -> None:
    """Rows interleaved 16 at a time (`simd_rows`): the same exact block sums, folded block by
    block per row (another float order than the plain rows'); every token's result is bitwise
    its result alone, for each pass size (8, 4, 2, 1 tokens)."""
    n_in = 32 * n_blocks
    if not packable(qt, n_in, 48):
        pytest.skip("no repacked layout on this CPU (needs AVX2)")
    w = make_weight(qt, 48, n_in, seed=n_blocks)
    wp, pqt = _check_repacked(w, qt, n_in, 15, range(15), 2e-6)
    assert wp.shape == w.shape and wp.dtype == np.uint8 and not np.array_equal(wp, w)
    with pytest.raises(ValueError, match="integer path"):
        matmul_sgemm(wp, pqt, _x(2, n_in), np.empty((2, 48), np.float32))


def test_interleaved_q8_0_is_exact_at_the_extreme_codes() -> None:
    """Q8_0 codes -128 and 127 against activation codes of +-127 (the pairs that saturate
    AVX2's pmaddubsw in u8 form; the sign trick keeps them below 2^15): the interleaved rows
    give the exact block sums, as the plain rows do."""
    n_in, n_out, nt = 32 * 6, 32, 9
    if not packable(QType.Q8_0, n_in, n_out):
        pytest.skip("no repacked layout on this CPU (needs AVX2)")
    rng = np.random.default_rng(5)
    codes = rng.choice(np.array([-128, 127, -127, 1], np.int8), size=(n_out, n_in))
    blocks = np.zeros((n_out, n_in // 32, 34), np.uint8)
    blocks[:, :, :2] = np.array([0.5], np.float16).view(np.uint8)  # d = 0.5, every block
    blocks[:, :, 2:] = codes.reshape(n_out, n_in // 32, 32).view(np.uint8)
    w = blocks.reshape(n_out, -1)
    x = np.where(rng.random((nt, n_in)) < 0.5, -1.0, 1.0).astype(np.float32)  # codes +-127
    xq = quantize_activation(x, QType.Q8_0)
    wp, pqt = repack_weight(w, QType.Q8_0)
    packed = np.empty((nt, n_out), np.float32)
    matmul_prequant(wp, pqt, xq, packed)
    assert np.abs(xq.qs).min() == 127
    sums = np.einsum("tbi,rbi->trb", xq.qs.reshape(nt, -1, 32).astype(np.int64),
                     codes.reshape(n_out, -1, 32).astype(np.int64))  # exact block sums
    exact = (0.5 * xq.d.astype(np.float64)[:, None, :] * sums).sum(axis=2)
    np.testing.assert_allclose(packed, exact, rtol=1e-6, atol=2e-4)  # f32 folds; saturation: 1e2


@pytest.mark.parametrize("qt", [QType.Q4_K, QType.Q6_K, QType.Q7_K], ids=lambda q: q.name)
@pytest.mark.parametrize("n_super", [1, 2, 3, 6, 19])
def test_interleaved_kquant_rows_match_the_plain_rows_and_are_batch_invariant(
        qt: QType, n_super: int) -> None:
    """Q4_K / Q6_K / Q7_K (the IQ2 types' widened copy) rows interleaved 16 at a time
    (`simd_rows_k`): the same exact integer sums per super-block, folded in another float
    order; every token's result is bitwise its result alone, for each pass size (8, 4, 2, 1
    tokens)."""
    n_in = 256 * n_super
    if not packable(qt, n_in, 48):
        pytest.skip("no repacked layout on this CPU (needs AVX2)")
    w = make_weight(qt, 48, n_in, seed=n_super)
    wp, pqt = _check_repacked(w, qt, n_in, 15, range(15), 1e-5)
    assert wp.shape == w.shape and not np.array_equal(wp, w)
    with pytest.raises(ValueError, match="integer path"):
        matmul_sgemm(wp, pqt, _x(2, n_in), np.empty((2, 48), np.float32))


def test_only_some_types_of_whole_groups_are_packable() -> None:
    assert not packable(QType.Q4_1, 4864, 64) and not packable(QType.Q5_K, 4864, 64)
    from minfer.backends.cpu.kernels.simd.blocks import DOT4, HAS_VNNI

    # AVX2 and up interleave (Q8_0 without VNNI through the sign trick, for batched engines:
    # one row alone reads the file's rows faster there)
    assert packable(QType.Q5_0, 4864, 64) == DOT4 == packable(QType.Q5_0, 4864, 64, False)
    assert packable(QType.Q8_0, 4864, 64) == DOT4
    assert packable(QType.Q8_0, 4864, 64, batched=False) == (DOT4 and HAS_VNNI)
    assert packable(QType.Q7_K, 4864, 64) == DOT4 == packable(QType.Q7_K, 4864, 64, False)
    for qt in (QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.Q7_K):  # 16 rows at a time
        assert not packable(qt, 1024, 37)
    with pytest.raises(ValueError, match="no repacked layout"):
        repack_weight(make_weight(QType.Q6_K, 4, 512), QType.Q6_K)
