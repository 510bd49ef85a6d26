"""The i-quants, TQ1_0 / TQ2_0 and MXFP4: dequantization bit-exact with gguf.quants, the
exact re-encoded copies the integer kernels run (none for IQ4_NL / IQ4_XS / MXFP4: their own
level-table kernels read the file's blocks; none for TQ1_0: `simd.ternary` reads its base-3
bytes), and the matmul paths against ggml's integer dot and the dequantized f32 product.

IQ2_XXS / IQ3_XXS run here as MINFER_IQ_WIDEN runs them, on their widened copies; their
default, the file's blocks, is test_kernels_iq_direct.py's."""

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
from minfer.backends.cpu.kernels.quant.activations import Q8KBlocks
from minfer.backends.cpu.kernels.quant.types import BLOCK_LAYOUT
from minfer.backends.cpu.kernels.reference import (
    IQUANT_TYPES,
    random_iquant_blocks,
    ref_matmul_quant,
)

# the type each one runs as (at moderate scales: see test_tiny_scales_keep_exact_copies)
WIDENED = {QType.IQ2_XXS: QType.Q7_K, QType.IQ2_XS: QType.Q7_K, QType.IQ2_S: QType.Q7_K,
           QType.IQ3_XXS: QType.Q6_K, QType.IQ3_S: QType.Q6_K, QType.IQ1_S: QType.Q6_K,
           QType.IQ1_M: QType.Q6_K, QType.TQ1_0: QType.TQ1_0, QType.TQ2_0: QType.TQ2_0,
           QType.IQ4_XS: QType.IQ4_XS, QType.MXFP4: QType.MXFP4}
# the 4-bit level-table types, dotted in the file's blocks
LUT_TYPES = [QType.IQ4_NL, QType.IQ4_XS, QType.MXFP4]
N_IN, N_OUT = 768, 83
IDS = {"ids": lambda q: q.name}


@pytest.fixture(autouse=True)
def _widen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINFER_IQ_WIDEN", "1")


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
    if wt is qt:  # no copy: the kernel reads the file's blocks
        assert wide is w
        return
    exact = dequantize(w, qt, N_IN)
    if wt is QType.Q7_K:  # read by its kernel only: its integer form, decoded here
        blocks = wide.reshape(N_OUT, -1, 276)
        q = blocks[:, :, :256].astype(np.int32) - 64
        sc = blocks[:, :, 256:272].copy().view(np.int8).astype(np.float32)
        d = blocks[:, :, 272:276].copy().view(np.float32)
        got = ((d * sc)[..., None] * q.reshape(N_OUT, -1, 16, 16)).reshape(N_OUT, N_IN)
    else:
        got = dequantize(wide, wt, N_IN)
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


def _lut_weight(qt: QType, n_out: int = N_OUT, n_in: int = N_IN, seed: int = 0) -> np.ndarray:
    """IQ4_NL as llama.cpp's quantizer makes it (`tools.quantize`), the others random blocks."""
    if qt is QType.IQ4_NL:
        from minfer.tools.quantize.rows import quantize_rows

        rng = np.random.default_rng(seed)
        return quantize_rows(0.05 * rng.standard_normal((n_out, n_in)).astype(np.float32), qt)
    return _weight(qt, n_out, n_in, seed)


def test_mxfp4_every_scale_exponent_is_exact() -> None:
    """E8M0 scales over the whole range, the subnormal e = 0 and 1 and scales far past f16's
    (where the widened Q8_0 copy refused the weight), read from the file's blocks."""
    w = _weight(QType.MXFP4)
    e = w.reshape(N_OUT, -1, 17)[:, :, 0]
    e[:] = np.random.default_rng(3).integers(0, 200, e.shape)
    e[0, :4] = (0, 1, 2, 199)
    x = _x(3)
    out = np.empty((3, N_OUT), np.float32)
    matmul(w, QType.MXFP4, x, out)
    ref, terms = ref_matmul_quant(w, QType.MXFP4, x)
    assert np.all(np.abs(out - ref) <= 1e-5 * terms + 1e-30)


@pytest.mark.parametrize("qt", LUT_TYPES, **IDS)
@pytest.mark.parametrize("nt", [1, 2, 3, 9, 20, 64])  # one row, every token pass, a prefill
def test_lut_kernels_equal_ggml_integer_dot(qt: QType, nt: int) -> None:
    """IQ4_NL / IQ4_XS / MXFP4 in their own blocks: ggml's integer sums (IQ4_NL / MXFP4 with
    the Q8_0 activation, IQ4_XS with Q8_K, as ggml's vec_dot_type) exactly, the block scales'
    float steps as ggml's (d_w * d_x times the block's sum): within f32 rounding of the float64
    value; and within the activation's quantization of the dequantized weights' product."""
    n_in = 256 * 3 + 32 * (0 if qt is QType.IQ4_XS else 13)  # 16-block steps and tail groups
    w = _lut_weight(qt, n_in=n_in)
    x = _x(nt, n_in)
    out = np.empty((nt, N_OUT), np.float32)
    matmul(w, qt, x, out)
    assert integer_weight(w, qt)[0] is w
    ref, terms = ref_matmul_quant(w, qt, x)
    assert np.all(np.abs(out - ref) <= 1e-6 * terms + 1e-30)
    exact = x.astype(np.float64) @ dequantize(w, qt, n_in).astype(np.float64).T
    xq = activation_values(x, qt).astype(np.float64)
    act_err = np.abs(xq - x) @ np.abs(dequantize(w, qt, n_in).astype(np.float64)).T
    assert np.all(np.abs(out - exact) <= act_err + 1e-5 * terms)


@pytest.mark.parametrize("qt", LUT_TYPES, **IDS)
def test_lut_kernels_are_batch_invariant(qt: QType) -> None:
    """A token's row is the same bits alone and in batches of 1..20 at any position."""
    from .test_kernels_batch_invariance import _alone, _assert_batches_match, _prequant

    n_in = 256 * 5 if qt is QType.IQ4_XS else 32 * 45
    w = _lut_weight(qt, 37, n_in, seed=2)
    x = np.random.default_rng(int(qt)).standard_normal((20, n_in)).astype(np.float32)
    x[3] *= 1e3
    x[7] *= 1e-3
    run = _prequant(w, qt)
    _assert_batches_match(run, x, _alone(run, x, 37), range(1, 21))


# the widened copies interleaved (`repack_weight` of `integer_weight`'s copy), and the scale of
# the test weight: IQ1_S's tiny one runs as Q7_K (see test_tiny_scales_keep_exact_copies)
WIDENED_PACKED = {QType.IQ2_XXS: (QType.Q7_K_PACKED, 0.05), QType.IQ2_S: (QType.Q7_K_PACKED, 0.05),
                  QType.IQ3_XXS: (QType.Q6_K_PACKED, 0.05), QType.IQ1_S: (QType.Q7_K_PACKED, 2e-4)}


@pytest.mark.parametrize("qt", [*LUT_TYPES, *WIDENED_PACKED], **IDS)
def test_interleaved_rows_equal_ggml_integer_dot(qt: QType) -> None:
    """IQ4_NL / IQ4_XS / MXFP4 interleaved 16 rows at a time (`repack_weight`; the levels by
    vpshufb into Q8_0's codes), and the widened copies of the types below 4 bits interleaved
    (Q6_K_PACKED / Q7_K_PACKED, which replace the copy): ggml's integer sums exactly, within
    f32 rounding of its float steps, for one row, every token pass and across token tiles
    (MXFP4: E8M0 scales over the whole range); a row's bits the same alone and in batches."""
    from minfer.backends.cpu.kernels.linear.dispatch import packable, repack_weight

    from .test_kernels_batch_invariance import _alone, _assert_batches_match, _prequant

    n_in, n_out = (32 * 27 if qt in (QType.IQ4_NL, QType.MXFP4) else 256 * 3), 48
    if qt in WIDENED_PACKED:
        w = _weight(qt, n_out, n_in, seed=4, rms=WIDENED_PACKED[qt][1])
        wide, wt = integer_weight(w, qt)
    else:
        w = wide = _lut_weight(qt, n_out, n_in, seed=4)
        wt = qt
    if not packable(wt, n_in, n_out):
        pytest.skip(f"{qt.name} has no interleaved layout on this CPU")
    if qt is QType.MXFP4:
        e = w.reshape(n_out, -1, 17)[:, :, 0]
        e[:] = np.random.default_rng(3).integers(0, 200, e.shape)
        e[0, :4] = (0, 1, 2, 199)
    wp, pq = repack_weight(wide, wt)
    assert pq != wt and wp.shape == wide.shape
    if qt in WIDENED_PACKED:
        assert pq is WIDENED_PACKED[qt][0]
    x = _x(40, n_in)
    x[5] *= 1e3
    ref, terms = ref_matmul_quant(w, qt, x)
    out = np.empty((40, n_out), np.float32)
    matmul(wp, pq, x, out)
    assert np.all(np.abs(out - ref) <= 1e-6 * terms + 1e-30)
    run = _prequant(wp, pq)
    _assert_batches_match(run, x, _alone(run, x, n_out), (1, 2, 3, 5, 8, 9, 16, 33, 40))
    # a parallel region's parts (`<driver>_part`, one per thread) write the driver's bits
    from minfer.backends.cpu.kernels.linear import row_drivers
    from minfer.backends.cpu.kernels.linear.dispatch import _kernel_for, quantize_activation

    fn = _kernel_for(pq)[0]
    part = getattr(row_drivers._M, f"{fn.py_func.__name__}_part")
    xq = quantize_activation(x, pq)
    args = (wp, xq.qs, xq.d, xq.bsums if isinstance(xq, Q8KBlocks) else xq.s)
    parts = np.full_like(out, np.nan)
    for p in range(3):
        part(p, 3, *args, parts)
    fn(*args, out)
    assert np.array_equal(parts, out)


@pytest.mark.parametrize("qt", IQUANT_TYPES, **IDS)
@pytest.mark.parametrize("nt", [1, 3, 9, 64])  # decode (1), every token pass, a prefill batch
def test_integer_path_equals_ggml_integer_dot(qt: QType, nt: int) -> None:
    w = _weight(qt)
    x = _x(nt)
    out = np.empty((nt, N_OUT), np.float32)
    matmul(w, qt, x, out)
    # ggml's integer sums, exactly, in float64
    ref, terms = ref_matmul_quant(w, qt, x)
    # exact integer sums: the f32 scale-and-sum order differs
    assert np.all(np.abs(out - ref) <= 1e-5 * terms + 1e-30)
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


def _tq1_weight(n_out: int, n_in: int, seed: int) -> np.ndarray:
    """TQ1_0 rows: half of them as gguf.quants quantizes (the file's encodings), half random
    bytes (every byte value, digits ggml's reading gives any byte), at spread-out scales."""
    rng = np.random.default_rng(seed)
    quantized = gq.quantize(rng.standard_normal((n_out // 2, n_in)).astype(np.float32),
                            GT.TQ1_0)
    nb = n_in // 256
    rand = random_iquant_blocks(QType.TQ1_0, n_out - n_out // 2, n_in, rng,
                                rms=np.exp(rng.uniform(-6, 1, (n_out - n_out // 2, nb))))
    return np.ascontiguousarray(np.concatenate([quantized, rand]))


@pytest.mark.parametrize("nt", [1, 2, 3, 4, 7, 8, 9, 20, 64])  # every token pass, a prefill
def test_tq1_0_kernel_reads_its_own_blocks(nt: int) -> None:
    """TQ1_0 dotted in the file's 54-byte blocks (`simd.ternary`, no widened copy): ggml's
    integer sums (`ggml_vec_dot_tq1_0_q8_K`) exactly, the float steps as ggml's (d_w * d_x
    times the block's sum): within f32 rounding of the float64 value, and within the
    activation's quantization of the dequantized weight's product."""
    n_in, n_out = 256 * 5, 37
    w = _tq1_weight(n_out, n_in, seed=nt)
    assert integer_weight(w, QType.TQ1_0)[0] is w
    x = _x(nt, n_in)
    if nt > 3:
        x[2] *= 1e3
    out = np.empty((nt, n_out), np.float32)
    matmul(w, QType.TQ1_0, x, out)
    ref, terms = ref_matmul_quant(w, QType.TQ1_0, x)
    assert np.all(np.abs(out - ref) <= 1e-6 * terms + 1e-30)
    exact = x.astype(np.float64) @ dequantize(w, QType.TQ1_0, n_in).astype(np.float64).T
    act_err = (np.abs(activation_values(x, QType.TQ1_0).astype(np.float64) - x)
               @ np.abs(dequantize(w, QType.TQ1_0, n_in).astype(np.float64)).T)
    assert np.all(np.abs(out - exact) <= act_err + 1e-5 * terms)


def test_tq1_0_activation_form() -> None:
    """The activation side of the TQ1_0 dot (`linear.dots_tq1`): y_v = x_v - 3 x of the value
    holding the same byte's next digit (none after a byte's last), qh's 16 in the kernel's
    slot order; -sum(x) per block."""
    from minfer.backends.cpu.kernels.linear.dots_tq1 import tq1_activation
    from minfer.backends.cpu.kernels.quant.activations import quantize_q8_k
    from minfer.backends.cpu.kernels.simd.ternary import QH_SLOTS

    xq = quantize_q8_k(_x(3, 512))
    y, neg = tq1_activation(xq.qs, xq.bsums)
    x = xq.qs.astype(np.int32).reshape(3, 2, 256)
    nxt = np.zeros_like(x)
    nxt[..., 0:128] = x[..., 32:160]
    nxt[..., 160:224] = x[..., 176:240]
    nxt[..., 240:252] = x[..., 244:256]
    want = x - 3 * nxt
    want[..., 240:] = want[..., [240 + 4 * k + m for m, k in QH_SLOTS]]
    np.testing.assert_array_equal(y.reshape(3, 2, 256), want)
    np.testing.assert_array_equal(neg, -x.sum(-1))


def test_tq1_0_kernel_is_batch_invariant_and_its_forms_agree() -> None:
    """A token's row is the same bits alone and in batches of 1..20 at any position; a
    parallel region's parts (`mv_tq1_0_part`) and the experts' form (`mv_tq1_0_x`) write the
    dense driver's bits."""
    from minfer.backends.cpu.kernels.linear import row_drivers
    from minfer.backends.cpu.kernels.linear.dispatch import quantize_activation

    from .test_kernels_batch_invariance import _alone, _assert_batches_match, _prequant

    n_in, n_out = 256 * 5, 37
    w = _tq1_weight(n_out, n_in, seed=11)
    x = np.random.default_rng(3).standard_normal((20, n_in)).astype(np.float32)
    x[3] *= 1e3
    x[7] *= 1e-3
    run = _prequant(w, QType.TQ1_0)
    _assert_batches_match(run, x, _alone(run, x, n_out), range(1, 21))
    xq = quantize_activation(x, QType.TQ1_0)
    args = (xq.qs, xq.d, xq.bsums)
    out = np.empty((20, n_out), np.float32)
    row_drivers.mv_tq1_0(w, *args, out)
    parts = np.full_like(out, np.nan)
    for p in range(3):
        row_drivers._M.mv_tq1_0_part(p, 3, w, *args, parts)
    assert np.array_equal(parts, out)
    # the rows split over 3 stacked experts (of 37 rows: w and two others), groups in any order
    others = [_tq1_weight(n_out, n_in, seed=s) for s in (12, 13)]
    w3 = np.ascontiguousarray(np.stack([others[0], w, others[1]]))
    groups = np.array([[1, 0, 9], [0, 9, 12], [1, 12, 20]], np.int64)
    got = np.full_like(out, np.nan)
    row_drivers.expert_form(row_drivers.mv_tq1_0)(w3, groups, np.array([3]), *args, got)
    assert np.array_equal(got[:9], out[:9]) and np.array_equal(got[12:], out[12:])
    alone = np.empty((3, n_out), np.float32)
    row_drivers.mv_tq1_0(others[0], xq.qs[9:12], xq.d[9:12], xq.bsums[9:12], alone)
    assert np.array_equal(got[9:12], alone)
