"""Q2_K and TQ2_0 on their vector row kernels (`simd.kquants`, kinds "q2" / "tq2"), reading the
file's blocks, and interleaved 16 rows at a time (Q2_K_PACKED / TQ2_0_PACKED,
`simd.interleaved_k`): ggml's integer sums exactly, the float steps within f32 rounding of the
float64 value, for random blocks with extreme scales, mins and block scales; the plain driver,
its parallel region's parts and its expert form give the same bits, and a row alone the same
bits as in any batch."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize

from minfer.backends.cpu.kernels import (
    QType,
    integer_weight,
    matmul,
    packable,
    quantize_activation,
    repack_weight,
)
from minfer.backends.cpu.kernels.linear import row_drivers
from minfer.backends.cpu.kernels.linear.dispatch import (
    _kernel_for,
    bind_experts_into,
    bind_prequant,
)
from minfer.backends.cpu.kernels.quant.types import PACKED_TYPES
from minfer.backends.cpu.kernels.reference import random_iquant_blocks, ref_quantize_q8_k

from .test_kernels_batch_invariance import _alone, _assert_batches_match, _prequant

TYPES = [QType.Q2_K, QType.TQ2_0]
IDS = {"ids": lambda q: q.name}
N_OUT = 37


def _weight(qt: QType, n_out: int, n_in: int, seed: int) -> np.ndarray:
    """Random blocks; per block a scale (Q2_K: d and dmin apart) over 2^-14 .. 2^3, and Q2_K
    rows whose 4-bit scales and mins sit at their ends (0 / 15, scale 15 with min 0 and the
    reverse)."""
    rng = np.random.default_rng(seed)
    nb = n_in // 256
    if qt is QType.TQ2_0:
        rms = np.exp2(rng.uniform(-14, 3, (n_out, nb)))
        return random_iquant_blocks(qt, n_out, n_in, rng, rms=rms)
    blocks = rng.integers(0, 256, (n_out, nb, 84), dtype=np.uint8)
    dd = np.exp2(rng.uniform(-14, 3, (n_out, nb, 2))).astype(np.float16)
    blocks[:, :, 80:84] = dd.view(np.uint8).reshape(n_out, nb, 4)
    for r, byte in enumerate((0x00, 0xFF, 0x0F, 0xF0)):
        blocks[r, :, :16] = byte
    blocks[4, :, 80:82] = 0  # d = 0: the mins alone
    return blocks.reshape(n_out, -1)


def _x(nt: int, n_in: int, seed: int = 5) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((nt, n_in)).astype(np.float32)
    x[nt // 2] *= 1e3  # rows of very different magnitude side by side
    x[-1] *= 1e-3
    if nt > 2:
        x[1] = 1.0  # every code 127: the largest 16-value sums
    return x


def _reference(w: np.ndarray, qt: QType, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's dot in float64 (the dequantized blocks times the Q8_K activation's values), and
    per output the sum of |each term| of its scale part and its min part apart: the scale of
    f32 rounding where the two cancel."""
    qs, d, _ = ref_quantize_q8_k(x)
    xd = (qs.astype(np.float64).reshape(len(x), -1, 256) * d[..., None]).reshape(x.shape)
    ref = xd @ gguf_dequantize(w, GT(int(qt))).astype(np.float64).T
    if qt is QType.TQ2_0:
        return ref, np.abs(xd) @ np.abs(gguf_dequantize(w, GT(int(qt))).astype(np.float64)).T
    parts = []
    for zero in (slice(82, 84), slice(80, 82)):  # dmin = 0: the scale part; d = 0: the mins
        b = w.reshape(len(w), -1, 84).copy()
        b[:, :, zero] = 0
        parts.append(np.abs(gguf_dequantize(b.reshape(w.shape), GT.Q2_K).astype(np.float64)))
    return ref, np.abs(xd) @ (parts[0] + parts[1]).T


@pytest.mark.parametrize("qt", TYPES, **IDS)
@pytest.mark.parametrize("n_in", [256 * 3, 256 * 9])  # 8-token passes, and 4 past ROWS8_MAX_IN
def test_vector_kernel_equals_the_dequantized_dot(qt: QType, n_in: int) -> None:
    w = _weight(qt, N_OUT, n_in, seed=n_in)
    assert integer_weight(w, qt)[0] is w  # the file's blocks, no widened copy
    x = _x(20, n_in)
    ref, terms = _reference(w, qt, x)
    run = bind_prequant(w, qt)
    for nt in (1, 2, 3, 5, 9, 20):  # one row, then every token pass
        out = np.empty((nt, N_OUT), np.float32)
        run(quantize_activation(x[:nt], qt), out)
        assert np.all(np.abs(out - ref[:nt]) <= 1e-6 * terms[:nt] + 1e-30), nt


@pytest.mark.parametrize("qt", TYPES, **IDS)
def test_parts_and_expert_form_give_the_drivers_bits(qt: QType) -> None:
    """A parallel region's parts (`<driver>_part`, here 3) and the expert form (`_x`: groups of
    rows, each with its own expert's rows) write the plain driver's bits."""
    n_in, n_exp = 256 * 2, 3
    w = _weight(qt, N_OUT * n_exp, n_in, seed=1)
    x = _x(17, n_in)
    xq = quantize_activation(x, qt)
    fn = _kernel_for(qt)[0]
    assert fn.py_func.__name__ == f"mv_{qt.name.lower()}"
    args = (w, xq.qs, xq.d, xq.bsums)
    whole = np.empty((17, N_OUT * n_exp), np.float32)
    fn(*args, whole)
    parts = np.full_like(whole, np.nan)
    part = getattr(row_drivers._M, f"{fn.py_func.__name__}_part")
    for p in range(3):
        part(p, 3, *args, parts)
    assert np.array_equal(parts, whole)
    w3 = w.reshape(n_exp, N_OUT, -1)
    groups = np.array([(2, 0, 6), (0, 6, 7), (1, 7, 17)], np.int64)
    out = np.full((17, N_OUT), np.nan, np.float32)
    bind_experts_into(w3, qt, groups, np.array([3]), xq, x, out)()
    for e, t0, t1 in groups:
        one = np.empty((t1 - t0, N_OUT), np.float32)
        fn(np.ascontiguousarray(w3[e]), *(a[t0:t1] for a in args[1:]), one)
        assert np.array_equal(out[t0:t1], one), e
        assert np.array_equal(out[t0:t1], whole[t0:t1, e * N_OUT:(e + 1) * N_OUT]), e


@pytest.mark.parametrize("qt", TYPES, **IDS)
def test_rows_are_batch_invariant(qt: QType) -> None:
    """A token's row is the same bits alone and in batches of 1..20 at any position."""
    n_in = 256 * 5
    w = _weight(qt, N_OUT, n_in, seed=2)
    x = _x(20, n_in, seed=int(qt))
    run = _prequant(w, qt)
    _assert_batches_match(run, x, _alone(run, x, N_OUT), range(1, 21))


@pytest.mark.parametrize("qt", TYPES, **IDS)
def test_interleaved_rows_equal_the_dequantized_dot(qt: QType) -> None:
    """The rows interleaved 16 at a time (`repack_weight`): the same integer sums, within f32
    rounding of the float64 value, for one row, every token pass and across token tiles; a
    row's bits the same alone and in batches; a parallel region's parts the driver's bits."""
    n_in, n_out = 256 * 3, 48
    if not packable(qt, n_in, n_out):
        pytest.skip(f"{qt.name} has no interleaved layout on this CPU")
    w = _weight(qt, n_out, n_in, seed=4)
    wp, pq = repack_weight(w, qt)
    assert pq is PACKED_TYPES[qt] and wp.shape == w.shape
    x = _x(40, n_in)
    ref, terms = _reference(w, qt, x)
    out = np.empty((40, n_out), np.float32)
    matmul(wp, pq, x, out)
    assert np.all(np.abs(out - ref) <= 1e-6 * terms + 1e-30)
    run = _prequant(wp, pq)
    _assert_batches_match(run, x, _alone(run, x, n_out), (1, 2, 3, 5, 8, 9, 16, 33, 40))
    fn = _kernel_for(pq)[0]
    xq = quantize_activation(x, pq)
    args = (wp, xq.qs, xq.d, xq.bsums)
    parts = np.full_like(out, np.nan)
    part = getattr(row_drivers._M, f"{fn.py_func.__name__}_part")
    for p in range(3):
        part(p, 3, *args, parts)
    fn(*args, out)
    assert np.array_equal(parts, out)
