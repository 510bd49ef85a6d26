"""Element-wise activations and arithmetic: `silu`, `swiglu` (and gpt-oss's clamped form),
`add`, `mul`, `sigmoid_gate`, `softmax_rows` (a classifier head's row softmax), `round_f16`
(an encoder's input to an f16 weight, as ggml rounds it), and the
attention kernels' row softmax (`softmax_groups`, with attention sinks: `sink_inv`).

silu(x) = x / (1 + exp(-x)) in f32, as ggml's `ggml_silu_f32`. Like ggml's SIMD path, exp is a
polynomial (`fast_exp`, within a few ulp of expf) that LLVM vectorises -- a libm call per element
would cost ~10x more. Serial kernels over flat arrays: at decode sizes a parallel region would
cost more than the work; silu / swiglu from `PARALLEL_MIN` elements on (prefill, a batch of
16 decode rows) run the same serial kernel on chunks spread over the threads. Every output may
alias an input.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.attn.vector_ir import exp_sum, scale_max
from minfer.backends.cpu.kernels.region.parts import share
from minfer.backends.cpu.kernels.simd.llvm import bits_to_f32, f16_to_f32, f32_to_f16

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # few mantissa bits: n * _LN2_HI is exact
_LN2_LO = np.float32(1.4286068203094172e-06)
# fastmath without `reassoc`: reassociation would undo the two-step (Cody-Waite) reduction. And
# without `arcp`: with it LLVM may lower a *vector* division to a reciprocal estimate plus a Newton
# step (it does on Sapphire Rapids) while the scalar loop (taken when an output aliases an input,
# and for the tail) divides exactly, so the same element would round differently by where it sits.
_FM = {"nnan", "ninf", "nsz", "contract"}


@njit(inline="always", fastmath=_FM)
def fast_exp(x):
    """exp(x) for f32 x: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p the degree-7 Taylor
    polynomial (error < 1e-8 relative); x is clamped to [-87, 88] so 2^n stays a normal float."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.float32(np.rint(x * _LOG2E))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * bits_to_f32(np.uint32(np.int32(n) + 127) << np.uint32(23))


@njit(inline="always")
def sink_inv(total, mx, sink):
    """The factor that turns sum_c exp(s_c - mx) v_c into the softmax's mix when a sink logit
    joins the denominator (no value of its own): 1 / (total + exp(sink - mx)), taken as
    ggml's flash attention takes it, the sum rescaled to the sink where the sink is the larger
    (exp(mx - sink) / (total * exp(mx - sink) + 1)). total: the f64 sum of the row's exps."""
    if sink > mx:
        ms = np.exp(np.float32(mx - sink))
        return np.float32(ms / (total * ms + 1.0))
    return np.float32(1.0 / (total + np.exp(np.float32(sink - mx))))


@njit(inline="always")
def softmax_groups(scores, group, n, sinks, h0):
    """scores[g, :n] = exp(scores[g, :n] - max) in place for each of `group` rows (the f64 sum
    of ggml's softmax); returns 1/sum per row (0 for an empty row). With `sinks` (an [n_head]
    array; empty: none) row g's is head h0 + g's sink logit, in the sum (`sink_inv`). Shared by
    the attention kernels over plain and quantized caches. The max and exp passes are vector
    IR (`attn.vector_ir`: numba's float max is a scalar compare-and-select chain, 1 ns a cell);
    `scores` must have contiguous rows."""
    inv = np.empty(group, np.float32)
    for g in range(group):
        row = scores[g]
        mx = scale_max(row, n, np.float32(1.0))
        total = exp_sum(row, n, mx)
        if n <= 0:
            inv[g] = np.float32(0.0)
        elif sinks.shape[0]:
            inv[g] = sink_inv(total, mx, sinks[h0 + g])
        else:
            inv[g] = np.float32(1.0 / total)
    return inv


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _silu(x, out):
    for i in range(x.shape[0]):
        v = x[i]
        out[i] = v / (np.float32(1.0) + fast_exp(-v))


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _swiglu(g, u, out):
    for i in range(g.shape[0]):
        v = g[i]
        out[i] = v / (np.float32(1.0) + fast_exp(-v)) * u[i]


# gpt-oss's clamped SwiGLU (ggml_swiglu_oai as llama.cpp's build_moe_ffn calls it for
# LLM_FFN_SWIGLU_OAI_MOE: fixed there, not read from the file)
SWIGLU_OAI_ALPHA = np.float32(1.702)
SWIGLU_OAI_LIMIT = np.float32(7.0)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _swiglu_oai(g, u, out):
    for i in range(g.shape[0]):
        x = min(g[i], SWIGLU_OAI_LIMIT)
        y = min(max(u[i], -SWIGLU_OAI_LIMIT), SWIGLU_OAI_LIMIT)
        out[i] = x / (np.float32(1.0) + fast_exp(SWIGLU_OAI_ALPHA * -x)) * (y + np.float32(1.0))


# From this many elements on, silu / swiglu split their flat arrays over numba's threads in
# chunks; each chunk runs the serial kernel, so every element gets the same instructions either
# way. Smaller calls stay serial. 2^16: a 16-stream server's decode step (16 x 4864 gate
# values on the development model) is split too; its SwiGLU went from 1.32 to 0.85 ms a step
# (24 layers, 2 threads, Intel SPR), where 2^18 had kept everything below prefill serial.
PARALLEL_MIN = 1 << 16
_CHUNK = 1 << 13


@njit(parallel=True, cache=True)
def _silu_chunks(x, out):
    for c in prange((x.shape[0] + _CHUNK - 1) // _CHUNK):
        a, b = c * _CHUNK, min(x.shape[0], (c + 1) * _CHUNK)
        _silu(x[a:b], out[a:b])


@njit(cache=True)
def _silu_chunks_part(part, n_parts, x, out):
    """The chunks of part `part` of `n_parts` (a parallel region's thread)."""
    n_chunk = (x.shape[0] + _CHUNK - 1) // _CHUNK
    for c in range(*share(part, n_parts, n_chunk)):
        a, b = c * _CHUNK, min(x.shape[0], (c + 1) * _CHUNK)
        _silu(x[a:b], out[a:b])


@njit(parallel=True, cache=True)
def _swiglu_chunks(g, u, out):
    for c in prange((g.shape[0] + _CHUNK - 1) // _CHUNK):
        a, b = c * _CHUNK, min(g.shape[0], (c + 1) * _CHUNK)
        _swiglu(g[a:b], u[a:b], out[a:b])


@njit(cache=True)
def _swiglu_chunks_part(part, n_parts, g, u, out):
    """The chunks of part `part` of `n_parts` (a parallel region's thread)."""
    n_chunk = (g.shape[0] + _CHUNK - 1) // _CHUNK
    for c in range(*share(part, n_parts, n_chunk)):
        a, b = c * _CHUNK, min(g.shape[0], (c + 1) * _CHUNK)
        _swiglu(g[a:b], u[a:b], out[a:b])


@njit(parallel=True, cache=True)
def _swiglu_oai_chunks(g, u, out):
    for c in prange((g.shape[0] + _CHUNK - 1) // _CHUNK):
        a, b = c * _CHUNK, min(g.shape[0], (c + 1) * _CHUNK)
        _swiglu_oai(g[a:b], u[a:b], out[a:b])


@njit(cache=True)
def _swiglu_oai_chunks_part(part, n_parts, g, u, out):
    """The chunks of part `part` of `n_parts` (a parallel region's thread)."""
    n_chunk = (g.shape[0] + _CHUNK - 1) // _CHUNK
    for c in range(*share(part, n_parts, n_chunk)):
        a, b = c * _CHUNK, min(g.shape[0], (c + 1) * _CHUNK)
        _swiglu_oai(g[a:b], u[a:b], out[a:b])


def _by_size(serial: Callable[..., None], chunks: Callable[..., None],
             flat: list[np.ndarray]) -> Callable[..., None]:
    """The chunked kernel for PARALLEL_MIN elements or more, else the serial one."""
    return chunks if flat[0].shape[0] >= PARALLEL_MIN else serial


@njit(cache=True, fastmath=True, error_model="numpy")
def _add(a, b, out):
    for i in range(a.shape[0]):
        out[i] = a[i] + b[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def _mul(a, b, out):
    for i in range(a.shape[0]):
        out[i] = a[i] * b[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def _add_row(a, b, out):  # a, out: [rows, n]; b: [n]
    for r in range(a.shape[0]):
        for i in range(a.shape[1]):
            out[r, i] = a[r, i] + b[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def _mul_row(a, b, out):  # a, out: [rows, n]; b: [n]
    for r in range(a.shape[0]):
        for i in range(a.shape[1]):
            out[r, i] = a[r, i] * b[i]


def _flat(*arrs: np.ndarray) -> list[np.ndarray]:
    flat = []
    for a in arrs:
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("element-wise kernels take C-contiguous f32 arrays")
        flat.append(a.reshape(-1))
    return flat


def silu(x: np.ndarray, out: np.ndarray) -> None:
    """out = x * sigmoid(x)."""
    if x.shape != out.shape:
        raise ValueError(f"shape mismatch {x.shape} vs {out.shape}")
    flat = _flat(x, out)
    _by_size(_silu, _silu_chunks, flat)(*flat)


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = silu(gate) * up."""
    if not gate.shape == up.shape == out.shape:
        raise ValueError(f"shape mismatch {gate.shape}, {up.shape}, {out.shape}")
    flat = _flat(gate, up, out)
    _by_size(_swiglu, _swiglu_chunks, flat)(*flat)


def _binary(a: np.ndarray, b: np.ndarray, out: np.ndarray, full, row) -> Callable[[], None]:
    """Same shapes, or b one row broadcast over a's rows (a bias / a norm weight): the kernel
    call over flat views, checked once."""
    if a.shape != out.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {out.shape}")
    if b.shape == a.shape:
        return partial(full, *_flat(a, b, out))
    if b.ndim == 1 and b.shape[0] == a.shape[-1]:
        fa, fb, fo = _flat(a, b, out)
        return partial(row, fa.reshape(-1, b.shape[0]), fb, fo.reshape(-1, b.shape[0]))
    raise ValueError(f"cannot broadcast {b.shape} over {a.shape}")


def add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a + b (b same shape, or one row added to every row)."""
    _binary(a, b, out, _add, _add_row)()


def mul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a * b (b same shape, or one row multiplied into every row)."""
    _binary(a, b, out, _mul, _mul_row)()


# The same operations bound to fixed arrays (the op tape): checks once, then the kernel alone.


def bind_add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    return _binary(a, b, out, _add, _add_row)


def bind_mul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    return _binary(a, b, out, _mul, _mul_row)


def bind_swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray, *,
                oai: bool = False) -> Callable[[], None]:
    """out = silu(gate) * up; with `oai` gpt-oss's clamped form: g = min(gate, 7),
    u = clamp(up, -7, 7), out = g * sigmoid(1.702 g) * (u + 1)."""
    if not gate.shape == up.shape == out.shape:
        raise ValueError(f"shape mismatch {gate.shape}, {up.shape}, {out.shape}")
    flat = _flat(gate, up, out)
    kernels = (_swiglu_oai, _swiglu_oai_chunks) if oai else (_swiglu, _swiglu_chunks)
    return partial(_by_size(*kernels, flat), *flat)


def bind_silu(x: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    if x.shape != out.shape:
        raise ValueError(f"shape mismatch {x.shape} vs {out.shape}")
    flat = _flat(x, out)
    return partial(_by_size(_silu, _silu_chunks, flat), *flat)


@njit(cache=True, error_model="numpy")
def sigmoid_gate(x: np.ndarray, h: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """out[t] = x[t] * sigmoid(h[t] . w): a shared expert's gate (Qwen2-MoE); the dot in f64,
    the sigmoid in f32 as ggml's; out may be x."""
    for t in range(x.shape[0]):
        acc = 0.0
        for j in range(h.shape[1]):
            acc += np.float64(h[t, j]) * w[j]
        g = np.float32(1.0) / (np.float32(1.0) + np.exp(-np.float32(acc)))
        for j in range(x.shape[1]):
            out[t, j] = x[t, j] * g


@njit(cache=True, error_model="numpy")
def sigmoid_mul(x: np.ndarray, g: np.ndarray, out: np.ndarray) -> None:
    """out = x * sigmoid(g) elementwise over 2-D arrays (Qwen3.5's gated attention output),
    the sigmoid in f32 as ggml's."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[t, j] = x[t, j] * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g[t, j])))


@njit(cache=True, error_model="numpy")
def softmax_rows(x: np.ndarray, out: np.ndarray) -> None:
    """out[r] = softmax(x[r]) for every row of a 2-D f32 array, as ggml_soft_max without mask
    or scale: exp(x - max) in f32 (libm's expf), their sum in f64, each scaled by 1/sum. A
    reranker's two-way head, so no vector path; out may be x."""
    for r in range(x.shape[0]):
        mx = x[r, 0]
        for j in range(1, x.shape[1]):
            mx = max(mx, x[r, j])
        total = 0.0
        for j in range(x.shape[1]):
            e = np.exp(np.float32(x[r, j] - mx))
            out[r, j] = e
            total += np.float64(e)
        inv = np.float32(1.0 / total)
        for j in range(x.shape[1]):
            out[r, j] = out[r, j] * inv


@njit(parallel=True, cache=True)
def _round_f16_chunks(x, out):
    for c in prange((x.shape[0] + _CHUNK - 1) // _CHUNK):
        for i in range(c * _CHUNK, min(x.shape[0], (c + 1) * _CHUNK)):
            out[i] = f16_to_f32(f32_to_f16(x[i]))


def round_f16(x: np.ndarray, out: np.ndarray) -> None:
    """out = x rounded to f16 (to nearest even, as numpy's astype) and back to f32: what ggml's
    matmul over an f16 weight reads. Chunks over the threads, no f16 temporary (numpy's astype
    pair: ~12 ns an element on 2 threads of a Sapphire Rapids; this: well under 1). out may be
    x."""
    if x.dtype != np.float32 or not (x.flags.c_contiguous and out.flags.c_contiguous):
        out[:] = x.astype(np.float16)
        return
    _round_f16_chunks(x.reshape(-1), out.reshape(-1))
