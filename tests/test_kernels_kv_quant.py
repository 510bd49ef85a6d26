"""Quantized KV caches (q8_0 / q4_0): llama.cpp's Hadamard rotation, the ggml block writes,
reading back, and attention over them (per-token and blocked) against attention over the
dequantized cache."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends.cpu.kernels import attention, kv_store
from minfer.backends.cpu.kernels.attn.blocked import blocked_available
from minfer.backends.cpu.kernels.attn.kv_formats import (
    KV_TYPES,
    bytes_per_value,
    dequantize_rows,
    k_rotation,
    new_cache,
    rotate,
    row_width,
    store_rows,
    v_rotation,
)
from minfer.backends.cpu.kernels.reference import ref_attention

RNG = np.random.default_rng(7)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def ref_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d as f32, q int8 [.., 32]) per block, ggml-cpu's x86 quantize_row_q8_0 rule."""
    b = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    with np.errstate(divide="ignore"):
        idd = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * idd[:, None]).astype(np.int8)
    return _f16(amax / np.float32(127)), q


def ref_q4_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d as f32, nibble values 0..15 [.., 32]) per block, as quantize_row_q4_0_ref."""
    b = x.astype(np.float32).reshape(-1, 32)
    first_max = b[np.arange(b.shape[0]), np.abs(b).argmax(axis=1)]  # first of largest |x|
    d = (first_max / np.float32(-8)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idd = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.minimum(15, np.trunc(b * idd[:, None] + np.float32(8.5))).astype(np.int32)
    return _f16(d), q


def ggml_gen_hadamard(n: int) -> np.ndarray:
    """llama.cpp's rotation matrix (llama-kv-cache.cpp ggml_gen_hadamard), its loop as written."""
    data = np.zeros((n, n), np.float32)
    data[0, 0] = np.float32(1.0) / np.sqrt(np.float32(n))
    s = 1
    while s < n:
        for i in range(s):
            for j in range(s):
                val = data[i, j]
                data[i + s, j] = val
                data[i, j + s] = val
                data[i + s, j + s] = -val
        s *= 2
    return data


def ref_rotate(x: np.ndarray, n: int) -> np.ndarray:
    """Each n-chunk of each row times that matrix, as ggml-cpu computes the Hadamard-hinted
    mul_mat (ops.cpp ggml_compute_forward_fwht_impl): scale by 1/sqrtf(n), then butterflies
    at strides 1, 2, ..., n/2, in f32."""
    if not n:
        return x.astype(np.float32)
    b = x.astype(np.float32).reshape(-1, n) * (np.float32(1.0) / np.sqrt(np.float32(n)))
    h = 1
    while h < n:
        v = b.reshape(-1, n // (2 * h), 2, h)
        lo, hi = v[:, :, 0, :].copy(), v[:, :, 1, :].copy()
        v[:, :, 0, :], v[:, :, 1, :] = lo + hi, lo - hi
        h *= 2
    return b.reshape(x.shape)


@pytest.mark.parametrize(("head_dim", "k_rot", "v_rot"),
                         [(32, 0, 0), (64, 64, 64), (96, 0, 0), (128, 128, 64),
                          (192, 64, 64), (256, 256, 64)])
def test_rotation_chunks_are_llamacpp_choice(head_dim: int, k_rot: int, v_rot: int) -> None:
    """Only a quantized cache, and only heads of a multiple of 64; K by the largest power of two
    from 64 up dividing head_dim, V by 64."""
    for kv_type in ("q8_0", "q4_0"):
        assert (k_rotation(kv_type, head_dim), v_rotation(kv_type, head_dim)) == (k_rot, v_rot)
    for kv_type in ("f16", "f32"):
        assert k_rotation(kv_type, head_dim) == v_rotation(kv_type, head_dim) == 0


@pytest.mark.parametrize("n", [64, 128, 256])
def test_the_rotation_is_llamacpp_hadamard_matrix_and_its_own_inverse(n: int) -> None:
    h = ggml_gen_hadamard(n)
    np.testing.assert_allclose(h.astype(np.float64) @ h.T, np.eye(n), atol=1e-6)  # orthonormal
    np.testing.assert_array_equal(h, h.T)
    x = RNG.standard_normal((20, 2 * n)).astype(np.float32)  # 20 rows: the parallel path
    # ggml_mul_mat(rot, x): out[i] = sum_k rot[i, k] x[k] per chunk
    want = (x.reshape(-1, n).astype(np.float64) @ h.T.astype(np.float64)).reshape(x.shape)
    for rows in (x, x[:3].copy()):
        y = rows.copy()
        rotate(y, n)
        np.testing.assert_array_equal(y, ref_rotate(rows, n))  # ggml-cpu's rounding, bit for bit
        np.testing.assert_allclose(y, want[: rows.shape[0]], rtol=0, atol=1e-5)
        rotate(y, n)
        np.testing.assert_allclose(y, rows, rtol=0, atol=1e-5)
    y = x.copy()
    rotate(y, 0)
    np.testing.assert_array_equal(y, x)
    with pytest.raises(ValueError, match="power of two"):
        rotate(x[:, :96].copy(), 96)


def ref_dequant(kv_type: str, x: np.ndarray, rot: int = 0) -> np.ndarray:
    """What a row of x reads back as after a store into a kv_type cache (quantized: rotated by
    rot-chunks, quantized, dequantized, rotated back)."""
    if kv_type == "f32":
        return x.astype(np.float32)
    if kv_type == "f16":
        return _f16(x)
    d, q = (ref_q8_0 if kv_type == "q8_0" else ref_q4_0)(ref_rotate(x, rot))
    off = 0 if kv_type == "q8_0" else 8
    return ref_rotate(((q.astype(np.float32) - off) * d[:, None]).astype(np.float32)
                      .reshape(x.shape), rot)


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_store_then_read_back_matches_ggml_rounding(kv_type: str, head_dim: int) -> None:
    """Rows of 256 values: 8 heads of 32 (not rotated) or 2 of 128 (K rotated by 128-chunks,
    V by 64-chunks), stored as llama.cpp stores them."""
    n, n_ctx = 256, 40
    rk, rv = k_rotation(kv_type, head_dim), v_rotation(kv_type, head_dim)
    x = RNG.standard_normal((24, n)).astype(np.float32) * 3
    x[0, :128] = 0  # all-zero blocks: d = 0
    x[1, 5] = -50.0  # the signed max of q4_0's block
    cells = RNG.permutation(n_ctx)[:24]
    k, v = new_cache(kv_type, n_ctx, n), new_cache(kv_type, n_ctx, n)
    kv_store(x, -x, k, v, cells, head_dim=head_dim)  # 24 rows: the parallel store path
    np.testing.assert_array_equal(dequantize_rows(k[cells], n, rot=rk),
                                  ref_dequant(kv_type, x, rk))
    np.testing.assert_array_equal(dequantize_rows(v[cells], n, rot=rv),
                                  ref_dequant(kv_type, -x, rv))
    # store_rows (the context shift's write) stores the same bytes as the K of kv_store
    k2 = new_cache(kv_type, n_ctx, n)
    store_rows(x, k2, cells, rot=rk)
    np.testing.assert_array_equal(k2, k)
    kv_store(x[:2], x[:2], k, v, np.array([0, 1]), head_dim=head_dim)  # 2 rows: serial path
    np.testing.assert_array_equal(dequantize_rows(k[:2], n, rot=rk),
                                  ref_dequant(kv_type, x[:2], rk))
    assert k.nbytes == n_ctx * n * bytes_per_value(kv_type)


def test_block_bytes_are_ggml_layout() -> None:
    x = np.linspace(-1, 2, 32, dtype=np.float32)[None]
    q8, q4 = new_cache("q8_0", 1, 32), new_cache("q4_0", 1, 32)
    kv_store(x, x, q8, q4, np.array([0]), head_dim=32)  # heads of 32: not rotated
    d8, qs8 = ref_q8_0(x)
    assert q8.view(np.uint8)[0, :2].view(np.float16)[0] == d8[0]
    np.testing.assert_array_equal(q8[0, 2:], qs8[0])
    d4, qs4 = ref_q4_0(x)
    assert q4[0, :2].view(np.float16)[0] == d4[0]
    np.testing.assert_array_equal(q4[0, 2:], (qs4[0, :16] | (qs4[0, 16:] << 4)).astype(np.uint8))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        row_width("q8_0", 48)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        row_width("q5_1", 64)
    cache = new_cache("q4_0", 4, 64)
    with pytest.raises(ValueError, match="do not fit"):
        kv_store(np.zeros((1, 32), np.float32), np.zeros((1, 32), np.float32), cache, cache,
                 np.array([0]), head_dim=32)
    row = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="needs the head_dim"):  # it sets the rotation
        kv_store(row, row, cache, cache, np.array([0]))
    with pytest.raises(ValueError, match="does not divide"):
        store_rows(row, cache, np.array([0]), rot=128)


def _filled(k_type: str, v_type: str, n_ctx: int, n: int, hd: int) -> tuple[np.ndarray, ...]:
    """K and V caches of random rows, and their values read back (the rotation undone)."""
    x = RNG.standard_normal((2, n_ctx, n)).astype(np.float32)
    k, v = new_cache(k_type, n_ctx, n), new_cache(v_type, n_ctx, n)
    kv_store(x[0], x[1], k, v, np.arange(n_ctx), head_dim=hd)
    return (k, v, dequantize_rows(k, n, rot=k_rotation(k_type, hd)),
            dequantize_rows(v, n, rot=v_rotation(v_type, hd)))


def _query_as_dotted(q: np.ndarray, k_type: str, hd: int) -> np.ndarray:
    """The query llama.cpp's CPU flash attention dots K with, in the unrotated basis: K's
    vec_dot_type, so f16 for an f16 K and, for a q8_0 / q4_0 K, the rotated query's Q8_0
    blocks (quantize_row_q8_0), rotated back."""
    if k_type == "f16":
        return _f16(q)
    if k_type not in ("q8_0", "q4_0"):
        return q
    rot = k_rotation(k_type, hd)
    d, codes = ref_q8_0(ref_rotate(q, rot))
    return ref_rotate((codes.astype(np.float32) * d[:, None]).reshape(q.shape), rot)


PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f32", "q4_0"), ("f16", "q8_0")]


@pytest.mark.parametrize(("k_type", "v_type"), PAIRS)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("hd", [64, 128, 96])
def test_attention_equals_attention_on_dequantized_cache(k_type: str, v_type: str,
                                                         blocked: bool, hd: int) -> None:
    """The stored rows are rotated (head_dim 64: K and V by 64-chunks; 128: K by 128, V by 64;
    96: not at all), the query and the output rotated to match: the result is attention over
    the values read back, unrotated, with the query as llama.cpp's flash attention dots it
    (`_query_as_dotted`): not the f32 query's."""
    if blocked and not blocked_available():
        pytest.skip("no BLAS sgemm for the blocked kernel")
    nt, n_head, n_kv, n_ctx = 40, 4, 2, 72
    k, v, kf, vf = _filled(k_type, v_type, n_ctx, n_kv * hd, hd)
    q = RNG.standard_normal((nt, n_head * hd)).astype(np.float32)
    start = np.zeros(nt, np.int32)
    end = np.arange(n_ctx - nt + 1, n_ctx + 1, dtype=np.int32)
    start[3], end[3] = 10, 10  # an empty window
    start[5:9] = 20  # a sliding window
    scale = 1 / np.sqrt(hd)
    out = np.empty_like(q)
    attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=scale,
              out=out, blocked=blocked)
    ref = ref_attention(_query_as_dotted(q, k_type, hd), kf, vf, start, end, n_head=n_head,
                        n_head_kv=n_kv, head_dim=hd, scale=scale)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)
    assert not out[3].any()
    if k_type in ("q8_0", "q4_0"):  # the query's Q8_0 rounding shows
        f32_query = ref_attention(q, kf, vf, start, end, n_head=n_head, n_head_kv=n_kv,
                                  head_dim=hd, scale=scale)
        assert np.abs(out - f32_query).max() > 1e-4


def test_attention_refuses_heads_off_block_boundaries() -> None:
    k = new_cache("q8_0", 8, 64)
    q = np.zeros((1, 4 * 16), np.float32)
    with pytest.raises(ValueError, match="head_dim a multiple of 32"):
        attention(q, k, k, np.array([0]), np.array([1]), n_head=4, n_head_kv=4, head_dim=16,
                  scale=1.0, out=np.empty_like(q))


def test_f16_k_beside_quantized_v_rounds_the_query_at_any_size() -> None:
    """An f16 K beside a q8_0 V dots the f16-rounded query at any batch size (ggml's non-flash
    path, K's vec-dot type), in the blocked kernel too (70 rows)."""
    if not blocked_available():
        pytest.skip("no BLAS sgemm for the blocked kernel")
    hd, nt, n_head, n_kv, n_ctx = 64, 70, 4, 2, 100
    k, v, kf, vf = _filled("f16", "q8_0", n_ctx, n_kv * hd, hd)
    q = RNG.standard_normal((nt, n_head * hd)).astype(np.float32)
    start = np.zeros(nt, np.int32)
    end = np.arange(n_ctx - nt + 1, n_ctx + 1, dtype=np.int32)
    out = np.empty_like(q)
    attention(q, k, v, start, end, n_head=n_head, n_head_kv=n_kv, head_dim=hd, scale=0.125,
              out=out, blocked=True)
    ref = ref_attention(_f16(q), kf, vf, start, end, n_head=n_head, n_head_kv=n_kv,
                        head_dim=hd, scale=0.125)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)
