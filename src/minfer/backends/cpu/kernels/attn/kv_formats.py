"""KV cache formats: how a cache row is laid out, written (quantized) and read back as f32.

A cache is one 2-D numpy array `[n_ctx, row]` per layer and per K/V; its dtype names the format:

- f32: float32 `[n_ctx, n]`; f16: float16 `[n_ctx, n]` (the kernels read it as uint16 bits);
- q8_0: int8 `[n_ctx, n/32*34]`, each row a run of GGML Q8_0 blocks (f16 d, then 32 int8 q;
  value = q * d);
- q4_0: uint8 `[n_ctx, n/32*18]`, GGML Q4_0 blocks (f16 d, then 16 bytes: byte j holds value j in
  its low and value j+16 in its high nibble; value = (nibble - 8) * d).

The blocks are ggml's (little-endian d). Writing rounds as ggml-cpu's x86 `from_float` does
when llama.cpp copies K/V into such a cache: Q8_0 as its AVX `quantize_row_q8_0` (d = amax/127
stored as f16, q = round-half-even(x * 127/amax), the same rule as the activation quantizer in
`quant.activations`), Q4_0 as
`quantize_row_q4_0_ref` (the block's first value of largest magnitude `max` gives d = max/-8,
q = min(15, trunc(x/d + 8.5))).

Rotation, as llama.cpp 0.3.36 does it (llama-kv-cache.cpp, llama-graph.cpp): a quantized cache
stores its rows multiplied by an orthonormal Walsh-Hadamard matrix, chunk by chunk, which spreads
an outlier dimension over its chunk so that a block's scale no longer flattens its neighbours
(Qwen2.5-0.5B's layer-0 keys reach |k| ~ 145). It applies only to a quantized cache whose heads
are a multiple of 64 values; otherwise the rows are stored as they are. K's chunk is the largest
power of two from 64 up that divides head_dim (64 for head_dim 64 or 192, 128 for 128, 256 for
256: `k_rotation`); V's is always 64 (`v_rotation`). Chunks are consecutive values of a row, so
they never straddle a head. The matrix is Sylvester's, H[i, j] = (-1)^popcount(i & j) /
sqrt(n), symmetric and its own inverse; ggml-cpu applies it (its `fwht` for the Hadamard-hinted
mul_mat) as a scale by 1/sqrtf(n) followed by butterflies (a + b, a - b) at strides 1, 2, ...,
n/2, in f32, and `rotate` does exactly that, so the stored blocks are llama.cpp's for the same
input rows (layer 0's q8_0 / q4_0 blocks on Qwen2.5-0.5B and Gemma 3 270M: all of them). The
keys are rotated after RoPE, as stored; `attn.quantized_kv` rotates the (roped) query by K's
matrix (q.k is kept) and the attention output by V's (the value mix comes out rotated).
llama.cpp's switch LLAMA_ATTN_ROT_DISABLE=1 turns its rotation off; minfer always rotates as
llama.cpp does by default.

`load_head(row, e0, n, dst)` (compiled code only) writes f32 values [e0, e0+n) of one cache row
into dst for any of the four formats (chosen by the row's dtype at compile time; quantized rows
in their rotated basis), so one kernel source serves every format. Quantized heads must start
and end on block boundaries: head_dim has to be a multiple of 32.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from minfer.backends.cpu.kernels.region.parts import share
from minfer.backends.cpu.kernels.simd.llvm import f16_to_f32, f32_to_f16

QK = 32  # values per block
BLOCK_BYTES = {"q8_0": 2 + QK, "q4_0": 2 + QK // 2}
CACHE_DTYPES: dict[str, type[np.generic]] = {
    "f32": np.float32, "f16": np.float16, "q8_0": np.int8, "q4_0": np.uint8}
KV_TYPES = tuple(CACHE_DTYPES)  # every accepted cache type, llama.cpp's names
QUANT_TYPES = tuple(BLOCK_BYTES)
PARALLEL_MIN_ROWS = 16  # fewer rows (decode) stay on the calling thread

# exact: only order-insensitive flags (no contract/arcp: every rounding is ggml's)
_FM = {"nnan", "ninf", "nsz", "reassoc"}


def row_width(kv_type: str, n: int) -> int:
    """Elements per cache row holding n values (bytes for the quantized formats)."""
    if kv_type in BLOCK_BYTES:
        if n % QK:
            raise ValueError(f"{kv_type} cache rows need a multiple of {QK} values, got {n}")
        return n // QK * BLOCK_BYTES[kv_type]
    if kv_type not in CACHE_DTYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r} (use one of {', '.join(KV_TYPES)})")
    return n


def bytes_per_value(kv_type: str) -> float:
    """Storage per cached value: 4, 2, 34/32 or 18/32 bytes."""
    if kv_type in BLOCK_BYTES:
        return BLOCK_BYTES[kv_type] / QK
    return float(np.dtype(CACHE_DTYPES[kv_type]).itemsize)


def bytes_per_token(n_layer: int, n_kv_embd: int, k_type: str, v_type: str) -> float:
    """KV cache bytes one token takes over all layers (its K and V rows)."""
    return n_layer * n_kv_embd * (bytes_per_value(k_type) + bytes_per_value(v_type))


def new_cache(kv_type: str, n_ctx: int, n: int) -> np.ndarray:
    """A zeroed cache of n_ctx rows of n values."""
    return np.zeros((n_ctx, row_width(kv_type, n)), CACHE_DTYPES[kv_type])


def check_query_heads(q: np.ndarray, out: np.ndarray, n_head: int, n_head_kv: int,
                      head_dim: int) -> None:
    """Refuse a query / output that is not `[nt, n_head*head_dim]`, or heads that do not
    group evenly over the KV heads (every attention kernel's first check)."""
    nt = q.shape[0]
    if q.shape != (nt, n_head * head_dim) or out.shape != q.shape or n_head % n_head_kv:
        raise ValueError(f"q {q.shape} / out {out.shape} do not fit {n_head}x{head_dim} heads "
                         f"over {n_head_kv} KV heads")


NO_SINKS = np.zeros(0, np.float32)  # the attention kernels' `sinks` where a model has none


def sink_logits(sinks: np.ndarray | None, n_head: int) -> np.ndarray:
    """The attention kernels' form of a layer's sink logits: f32 [n_head], or empty (none)."""
    if sinks is None:
        return NO_SINKS
    s = np.ascontiguousarray(sinks, dtype=np.float32).reshape(-1)
    if s.shape[0] != n_head:
        raise ValueError(f"{s.shape[0]} sink logits for {n_head} heads")
    return s


def cache_type(cache: np.ndarray) -> str:
    """The format of a cache array (uint16 counts as f16 bits)."""
    dt = np.dtype(cache.dtype)
    if dt == np.uint16:
        return "f16"
    for name, t in CACHE_DTYPES.items():
        if dt == np.dtype(t):
            return name
    raise ValueError(f"not a KV cache dtype: {dt}")


def is_quant(cache: np.ndarray) -> bool:
    return np.dtype(cache.dtype) in (np.dtype(np.int8), np.dtype(np.uint8))


def kernel_view(cache: np.ndarray) -> np.ndarray:
    """The array the kernels take: f16 caches as uint16 bits, everything else as it is."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


# -- the rotation ------------------------------------------------------------------------------
ROT_MIN = 64  # llama.cpp rotates a quantized cache only when head_dim is a multiple of this


def k_rotation(kv_type: str, head_dim: int) -> int:
    """The chunk a K cache of kv_type rotates its rows by (0: not rotated): the largest power of
    two from 64 up dividing head_dim, as llama.cpp's build_input_k_rot loop finds it."""
    if kv_type not in QUANT_TYPES or head_dim % ROT_MIN:
        return 0
    n = ROT_MIN
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def v_rotation(kv_type: str, head_dim: int) -> int:
    """The chunk a V cache of kv_type rotates its rows by (0: not rotated): 64 (llama.cpp found
    the small matrix better for V)."""
    return ROT_MIN if kv_type in QUANT_TYPES and head_dim % ROT_MIN == 0 else 0


def rotations(k_cache: np.ndarray, v_cache: np.ndarray, head_dim: int) -> tuple[int, int]:
    """The chunks a K and a V cache (or their kernel views) rotate their rows by (0: not
    rotated)."""
    return k_rotation(cache_type(k_cache), head_dim), v_rotation(cache_type(v_cache), head_dim)


@njit(error_model="numpy")
def _fwht(x, n):  # pragma: no cover - compiled
    """x[:n] = H x in place, H the orthonormal n x n Walsh-Hadamard matrix, as ggml-cpu's fwht:
    every value times 1/sqrtf(n) first, then the butterflies a + b, a - b at strides 1, 2, ...,
    n/2 (strict f32: each step rounds once, as ggml's)."""
    scale = np.float32(1.0) / np.float32(np.sqrt(np.float32(n)))
    for j in range(n):
        x[j] = x[j] * scale
    h = 1
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                a = x[j]
                b = x[j + h]
                x[j] = a + b
                x[j + h] = a - b
        h *= 2


@njit(error_model="numpy")  # a call (LLVM may inline it): numba's inliner trips on the loops
def _rotate_row(row, n):  # pragma: no cover - compiled
    # the usual chunk as a constant: LLVM unrolls and vectorises those butterflies (2.5x)
    if n == 64:
        for c in range(row.shape[0] // 64):
            _fwht(row[c * 64 : c * 64 + 64], 64)
    else:
        for c in range(row.shape[0] // n):
            _fwht(row[c * n : c * n + n], n)


@njit(parallel=True, cache=True, error_model="numpy")
def _rotate_rows(x, n):  # pragma: no cover - compiled
    for t in prange(x.shape[0]):
        _rotate_row(x[t], n)


@njit(cache=True, error_model="numpy")
def _rotate_rows_serial(x, n):  # pragma: no cover - compiled
    for t in range(x.shape[0]):
        _rotate_row(x[t], n)


def rotate(x: np.ndarray, n: int) -> None:
    """Every n-value chunk of every row of x (f32, C-contiguous `[rows, width]`) times the
    orthonormal Hadamard matrix, in place (its own inverse); n = 0 leaves x alone. Per row, so
    batch invariant."""
    if not n:
        return
    if n & (n - 1) or x.ndim != 2 or x.dtype != np.float32 or not x.flags.c_contiguous \
            or x.shape[1] % n:
        raise ValueError(f"rotate needs C-contiguous f32 [rows, k*{n}] (n a power of two), "
                         f"got {x.dtype} {x.shape}")
    # a decode step's few rows stay on the calling thread (a parallel region costs more)
    (_rotate_rows if x.shape[0] >= PARALLEL_MIN_ROWS else _rotate_rows_serial)(x, n)


# -- reading -----------------------------------------------------------------------------------
def load_head(row: Any, e0: Any, n: Any, dst: Any) -> Any:
    """dst[:n] = values [e0, e0+n) of a cache row, as f32 (compiled code only)."""
    raise NotImplementedError("only callable from compiled code")


@njit(inline="always")
def _d_bits(lo, hi):  # pragma: no cover - compiled
    return f16_to_f32(np.uint16((np.int32(lo) & 0xFF) | ((np.int32(hi) & 0xFF) << 8)))


@njit(inline="always")
def _block(row, b, size):  # pragma: no cover - compiled
    """Block b of a quantized cache row of `size`-byte blocks: (its scale d, its code bytes)."""
    o = b * size
    return _d_bits(row[o], row[o + 1]), row[o + 2 : o + size]


@overload(load_head, inline="always")
def _load_head(row, e0, n, dst):  # unannotated: numba matches it against the lambdas below
    if row.dtype == types.int8:  # q8_0
        def load_q8_0(row, e0, n, dst):
            b0 = e0 // 32
            for b in range(n // 32):
                d, qs = _block(row, b0 + b, 34)
                db = dst[b * 32 : b * 32 + 32]
                for j in range(32):
                    db[j] = np.float32(qs[j]) * d
        return load_q8_0
    if row.dtype == types.uint8:  # q4_0
        def load_q4_0(row, e0, n, dst):
            b0 = e0 // 32
            for b in range(n // 32):
                d, qs = _block(row, b0 + b, 18)
                lo = dst[b * 32 : b * 32 + 16]
                hi = dst[b * 32 + 16 : b * 32 + 32]
                for j in range(16):
                    lo[j] = np.float32(np.int32(qs[j] & 15) - 8) * d
                    hi[j] = np.float32(np.int32(qs[j] >> 4) - 8) * d
        return load_q4_0
    if row.dtype == types.uint16:  # f16 bits
        def load_f16(row, e0, n, dst):
            src = row[e0 : e0 + n]
            for j in range(n):
                dst[j] = f16_to_f32(src[j])
        return load_f16

    def load_f32(row, e0, n, dst):
        src = row[e0 : e0 + n]
        for j in range(n):
            dst[j] = np.float32(src[j])
    return load_f32


@njit(parallel=True, cache=True, error_model="numpy")
def _dequantize(cache, n, out):  # pragma: no cover - compiled
    for c in prange(cache.shape[0]):
        load_head(cache[c], 0, n, out[c])


def dequantize_rows(cache: np.ndarray, n: int, *, rot: int) -> np.ndarray:
    """Rows of a cache (any format) as f32 `[rows, n]`: the values written, up to rounding
    (a quantized cache's rotation by `rot`-value chunks undone; `k_rotation` / `v_rotation`)."""
    out = np.empty((cache.shape[0], n), np.float32)
    _dequantize(kernel_view(np.ascontiguousarray(cache)), n, out)
    rotate(out, rot if is_quant(cache) else 0)
    return out


# -- writing -----------------------------------------------------------------------------------
@njit(inline="always")
def _put_scale(dst, o, d):  # pragma: no cover - compiled
    """A block's scale d as f16 bits, little-endian, at dst[o], dst[o+1] (int8 or uint8 bytes:
    storing an int into either keeps its low byte)."""
    bits = np.int32(f32_to_f16(d))
    dst[o] = bits & 0xFF
    dst[o + 1] = bits >> 8


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _store_q8_0(x, dst):  # pragma: no cover - compiled
    """One f32 row into Q8_0 blocks (dst: int8 bytes)."""
    for b in range(x.shape[0] // 32):
        xb = x[b * 32 : b * 32 + 32]
        o = b * 34
        amax = np.float32(0.0)
        for j in range(32):
            a = abs(xb[j])
            amax = a if a > amax else amax
        idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        _put_scale(dst, o, amax / np.float32(127.0))
        qs = dst[o + 2 : o + 34]
        for j in range(32):
            qs[j] = np.int8(np.rint(xb[j] * idd))


@njit(inline="always", fastmath=_FM, error_model="numpy")
def _store_q4_0(x, dst):  # pragma: no cover - compiled
    """One f32 row into Q4_0 blocks (dst: uint8 bytes), as quantize_row_q4_0_ref."""
    for b in range(x.shape[0] // 32):
        xb = x[b * 32 : b * 32 + 32]
        o = b * 18
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for j in range(32):
            a = abs(xb[j])
            if amax < a:
                amax = a
                mx = xb[j]
        d = mx / np.float32(-8.0)
        idd = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        _put_scale(dst, o, d)
        qs = dst[o + 2 : o + 18]
        for j in range(16):
            x0 = xb[j] * idd + np.float32(8.5)
            x1 = xb[j + 16] * idd + np.float32(8.5)
            q0 = np.int32(x0)  # (int8_t) cast: truncation toward zero; then MIN(15, .)
            q1 = np.int32(x1)
            qs[j] = np.uint8((q0 if q0 < 15 else 15) | ((q1 if q1 < 15 else 15) << 4))


def _store_row(x: Any, dst: Any) -> Any:
    """One f32 row into a quantized cache row (compiled code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_store_row, inline="always")
def _store_row_impl(x, dst):  # unannotated: numba matches it against the functions below
    if dst.dtype == types.int8:
        return lambda x, dst: _store_q8_0(x, dst)
    return lambda x, dst: _store_q4_0(x, dst)


@njit(inline="always", error_model="numpy")
def _store_rotated(x, dst, rot):  # pragma: no cover - compiled
    r = x.copy()
    if rot:
        _rotate_row(r, rot)
    _store_row(r, dst)  # one call site: numba's inliner trips on two


def _put_row(x: Any, dst: Any, rot: Any) -> Any:
    """One f32 row into a cache row of any format, a quantized one rotated by rot-value chunks
    first (0: not rotated) (compiled code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_put_row, inline="always")
def _put_row_impl(x, dst, rot):  # unannotated: numba matches it against the functions below
    if dst.dtype == types.uint16:  # f16 bits, rounded to nearest even as numpy's astype
        def put_f16(x, dst, rot):
            for j in range(x.shape[0]):
                dst[j] = f32_to_f16(x[j])
        return put_f16
    if dst.dtype == types.float32:
        def put_f32(x, dst, rot):
            for j in range(x.shape[0]):
                dst[j] = x[j]
        return put_f32
    return lambda x, dst, rot: _store_rotated(x, dst, rot)


@njit(inline="always")
def _check_cells(cells, n_ctx):  # pragma: no cover - compiled
    for t in range(cells.shape[0]):
        if cells[t] < 0 or cells[t] >= n_ctx:
            raise ValueError("KV cache cell outside the cache")


@njit(parallel=True, cache=True, error_model="numpy")
def _store_rows(x, cache, cells, rot):  # pragma: no cover - compiled
    _check_cells(cells, cache.shape[0])
    for t in prange(x.shape[0]):
        _put_row(x[t], cache[cells[t]], rot)


@njit(cache=True, error_model="numpy")
def _store_rows_part(part, n_parts, x, cache, cells, rot):  # pragma: no cover - compiled
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    _check_cells(cells, cache.shape[0])
    for t in range(*share(part, n_parts, x.shape[0])):
        _put_row(x[t], cache[cells[t]], rot)


@njit(cache=True, error_model="numpy")
def _store_rows_serial(x, cache, cells, rot):  # pragma: no cover - compiled
    _check_cells(cells, cache.shape[0])
    for t in range(x.shape[0]):
        _put_row(x[t], cache[cells[t]], rot)


@njit(parallel=True, cache=True, error_model="numpy")
def _store_kv(k, v, k_cache, v_cache, cells, rot_k, rot_v):  # pragma: no cover - compiled
    _check_cells(cells, k_cache.shape[0])
    for t in prange(k.shape[0]):
        _put_row(k[t], k_cache[cells[t]], rot_k)
        _put_row(v[t], v_cache[cells[t]], rot_v)


@njit(cache=True, error_model="numpy")
def _store_kv_part(part, n_parts, k, v, k_cache, v_cache, cells, rot_k, rot_v):  # pragma: no cover
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    _check_cells(cells, k_cache.shape[0])
    for t in range(*share(part, n_parts, k.shape[0])):
        _put_row(k[t], k_cache[cells[t]], rot_k)
        _put_row(v[t], v_cache[cells[t]], rot_v)


@njit(cache=True, error_model="numpy")
def _store_kv_serial(k, v, k_cache, v_cache, cells, rot_k, rot_v):  # pragma: no cover
    _check_cells(cells, k_cache.shape[0])
    for t in range(k.shape[0]):
        _put_row(k[t], k_cache[cells[t]], rot_k)
        _put_row(v[t], v_cache[cells[t]], rot_v)


def _check_rows(x: np.ndarray, cache: np.ndarray) -> None:
    if x.ndim != 2 or cache.ndim != 2 or cache.shape[1] != row_width(cache_type(cache),
                                                                      x.shape[1]):
        raise ValueError(f"rows {x.shape} do not fit the {cache_type(cache)} cache "
                         f"{cache.shape}")


def _check_rot(rot: int, width: int) -> int:
    if rot < 0 or rot & (rot - 1) or (rot and width % rot):
        raise ValueError(f"rotation chunk {rot} does not divide rows of {width} values")
    return rot


def store_rows(x: np.ndarray, cache: np.ndarray, cells: np.ndarray, *, rot: int) -> None:
    """cache[cells[t]] = x[t] for every row, in the cache's format, a quantized cache's rows
    rotated by `rot`-value chunks first (`k_rotation` / `v_rotation`; 0: not rotated). A cell
    outside the cache is refused before anything is written."""
    xs = np.ascontiguousarray(x, dtype=np.float32)
    _check_rows(xs, cache)
    rot = _check_rot(rot, xs.shape[1]) if is_quant(cache) else 0
    cells = np.asarray(cells, dtype=np.int64).reshape(-1)
    if cells.shape[0] != xs.shape[0]:
        raise ValueError(f"{xs.shape[0]} rows for {cells.shape[0]} cells")
    run = _store_rows if xs.shape[0] >= PARALLEL_MIN_ROWS else _store_rows_serial
    run(xs, kernel_view(cache), cells, rot)


def bind_store_kv(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                  cells: np.ndarray, *, head_dim: int = 0) -> Callable[[], None]:
    """K and V rows into their caches' cells (the op tape's KV store): shapes checked once, one
    compiled call per step, the cells (data the batch fills in) checked in it. A quantized
    cache needs `head_dim`, which sets its rotation (`k_rotation`, `v_rotation`)."""
    if k.shape != v.shape or k.dtype != np.float32 or v.dtype != np.float32:
        raise ValueError(f"k {k.shape} {k.dtype} / v {v.shape} {v.dtype}: f32 rows of one shape")
    for x, cache in ((k, k_cache), (v, v_cache)):
        _check_rows(x, cache)
    if cells.shape != (k.shape[0],) or cells.dtype.kind not in "iu":
        raise ValueError(f"cells {cells.shape} {cells.dtype}: one integer per row")
    if (is_quant(k_cache) or is_quant(v_cache)) and (head_dim <= 0 or k.shape[1] % head_dim):
        raise ValueError(f"a quantized KV cache needs the head_dim its rows are made of "
                         f"(rows of {k.shape[1]}, head_dim {head_dim})")
    rot_k, rot_v = rotations(k_cache, v_cache, head_dim)
    run = _store_kv if k.shape[0] >= PARALLEL_MIN_ROWS else _store_kv_serial
    return partial(run, k, v, kernel_view(k_cache), kernel_view(v_cache), cells, rot_k, rot_v)
