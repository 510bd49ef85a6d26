"""`out = x @ W.T` for every supported weight type: the dispatch between the decode and prefill
paths.

Decode / small batches (nt < `prefill_min_tokens(qtype)`): the activation rows are quantized once
per call (Q8_0+Q8_1 blocks for the 32-value types, Q8_K for K-quants; rounded to f16 / bf16 for
those float weights) and dotted against the GGUF blocks in integers, as ggml does -- see
`linear.dots32`
and `linear.dots_k`. `quantize_activation` + `matmul_prequant` let a caller share one quantized
activation
across several weights that read the same input (q/k/v, gate/up).

Prefill: with AVX512-VNNI the same integer kernels are also the fastest prefill path for every
quantized type. Their 8-token passes unpack each weight block once for eight activation rows and
form the block sums with transposed vpdpbusd, so at 512 tokens they run at 280-470 GFLOP/s on two
threads against 180-245 for dequantized tiles through BLAS sgemm (benchmarks/kernels_bench.py
--crossover, re-measured per type at nt 16..512). They are also bitwise batch-invariant and use
llama.cpp's arithmetic (Q8 activations), so prefill and decode agree exactly. On AVX2 (with or
without AVX-VNNI) the interleaved rows (`repack_weight`: Q4_0 / Q5_0 / Q4_K / Q6_K / Q7_K /
Q2_K / TQ2_0, and Q8_0: with VNNI, or for a batched engine, see `packable`) run as two ymm
halves and are likewise the fastest path at every batch size: measured
on AMD EPYC (Zen 4) compiled for Haswell, 2 threads, against the sgemm path at 512 tokens Q5_0
23.1 vs 23.9 ms (4864 x 896), Q4_K 58 vs 76 (8960 x 1536), Q6_K 60 vs 124 (1536 x 8960), and
1.3-2x faster than the plain integer rows at 4-64 tokens. Float weights, and other quantized
weights on a CPU without AVX512-VNNI, switch to the sgemm path (see `linear.sgemm`) from
`prefill_min_tokens(qtype)` rows on: tiles of weight rows dequantized to f32 times f32
activations, which differs from the integer path by float rounding only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from minfer.backends.cpu.kernels.linear.float_rows import round_to_bf16, round_to_f16
from minfer.backends.cpu.kernels.linear.row_drivers import (
    expert_form,
    mv_bf16,
    mv_f16,
    mv_f32,
    mv_iq2_s,
    mv_iq2_xs,
    mv_iq2_xxs,
    mv_iq3_s,
    mv_iq3_xxs,
    mv_iq4_nl,
    mv_iq4_nlp,
    mv_iq4_xs,
    mv_iq4_xsr,
    mv_mxfp4,
    mv_mxfp4p,
    mv_q2_k,
    mv_q2_kr,
    mv_q4_0,
    mv_q4_0p,
    mv_q4_1,
    mv_q4_k,
    mv_q4_kr,
    mv_q5_0,
    mv_q5_0p,
    mv_q5_1,
    mv_q5_k,
    mv_q6_k,
    mv_q6_kr,
    mv_q7_k,
    mv_q7_kr,
    mv_q8_0,
    mv_q8_0p,
    mv_tq1_0,
    mv_tq2_0,
    mv_tq2_0r,
)
from minfer.backends.cpu.kernels.linear.sgemm import sgemm_tiles
from minfer.backends.cpu.kernels.quant.activations import (
    Q8Blocks,
    Q8KBlocks,
    bind_quantize_q8_0,
    bind_quantize_q8_k,
    dequantize_activation,
    new_q8_0,
    new_q8_k,
    quantize_q8_0,
    quantize_q8_k,
)
from minfer.backends.cpu.kernels.quant.reencode import reads_direct, widen
from minfer.backends.cpu.kernels.quant.repack import interleave_block32, interleave_kquant
from minfer.backends.cpu.kernels.quant.types import (
    BLOCK_LAYOUT,
    DERIVED_TYPES,
    KQUANT_TYPES,
    PACKED_TYPES,
    QType,
    qtype_of,
    weight_view,
)
from minfer.backends.cpu.kernels.simd.blocks import DOT4, HAS_VNNI512
from minfer.backends.cpu.kernels.simd.interleaved import QH_SLICED, ROWS, SIGN_TRICK
from minfer.backends.cpu.kernels.simd.iquants import EXPANDS

# From this many activation rows on, dequantize + sgemm beats the integer dots. With AVX512-VNNI
# only float weights ever switch; PREFILL_MIN_TOKENS is the default elsewhere.
PREFILL_MIN_TOKENS = 32
_FLOAT_MIN = {QType.F32: 16, QType.F16: 16, QType.BF16: 16}
_NEVER = 1 << 62
_PREFILL_MIN = _FLOAT_MIN if HAS_VNNI512 else {
    QType.Q4_0: 64, QType.Q8_0: 64, QType.Q4_K: 64, QType.Q6_K: 128,
    QType.Q4_1: 32, QType.Q5_K: 48, QType.Q5_0: 16, QType.Q5_1: 16, **_FLOAT_MIN,
    # widened copies (`quant.reencode`; IQ2_XXS / IQ3_XXS under MINFER_IQ_WIDEN): their Q6_K /
    # Q7_K kernel's
    **dict.fromkeys((QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S,
                     QType.IQ1_S, QType.IQ1_M), 128),
    QType.IQ4_NL: 64, QType.IQ4_XS: 64, QType.MXFP4: 64,
    # the plain Q2_K / TQ2_0 rows (`simd.kquants`; their interleaved rows, where the row count
    # is a multiple of 16, take the integer path throughout), one layer of the 1.5B's --pure
    # files, 2 threads, Intel SPR compiled for Haswell, loaded host, ms against sgemm: Q2_K
    # 128 / 256 / 512 tokens 353 / 557 / 1313 against 387 / 518 / 1029; TQ2_0 faster at every
    # count (512: 897 against 1264)
    QType.Q2_K: 256, QType.TQ2_0: _NEVER,
    # its own blocks (`simd.ternary`), compiled for Haswell on Intel SPR, 2 threads: 1536 x 1536
    # at 128 / 256 / 512 tokens 19.3 / 34.5 / 72.3 ms against sgemm's 23.3 / 35.8 / 57.5
    QType.TQ1_0: 256,
}
# Q3_K's plain rows run on a re-encoded copy (`quant.reencode`): dequantized tiles of the file's
# weight through sgemm win from here on.
_PLAIN_LOOP_MIN = {QType.Q3_K: PREFILL_MIN_TOKENS}


def prefill_min_tokens(qtype: int) -> int:
    """Token count from which `matmul` takes the sgemm path for this weight type (a huge number
    where the integer path is always the faster one)."""
    qt = qtype_of(qtype)
    if qt in _PLAIN_LOOP_MIN:
        return _PLAIN_LOOP_MIN[qt]
    if qt in DERIVED_TYPES:  # interleaved rows, Q7_K: the integer path only
        return _NEVER
    if reads_direct(qt) and EXPANDS:  # long calls expand row groups to Q7_K_PACKED's form
        return _NEVER
    if HAS_VNNI512 and qt not in _FLOAT_MIN:
        return _NEVER
    return _PREFILL_MIN.get(qt, PREFILL_MIN_TOKENS)


QuantizedActivation = Q8Blocks | Q8KBlocks | np.ndarray

_BLOCK32 = {
    QType.Q4_0: mv_q4_0,
    QType.Q4_1: mv_q4_1,
    QType.Q5_0: mv_q5_0,
    QType.Q5_1: mv_q5_1,
    QType.Q8_0: mv_q8_0,
    QType.IQ4_NL: mv_iq4_nl,
    QType.MXFP4: mv_mxfp4,
    QType.Q4_0_PACKED: mv_q4_0p,
    QType.Q5_0_PACKED: mv_q5_0p,
    QType.Q8_0_PACKED: mv_q8_0p,
    QType.IQ4_NL_PACKED: mv_iq4_nlp,
    QType.MXFP4_PACKED: mv_mxfp4p,
}
_FLOAT = {QType.F32: mv_f32, QType.F16: mv_f16, QType.BF16: mv_bf16}
_KQUANT = {QType.Q4_K: mv_q4_k, QType.Q5_K: mv_q5_k, QType.Q6_K: mv_q6_k,
           QType.Q4_K_PACKED: mv_q4_kr, QType.Q6_K_PACKED: mv_q6_kr, QType.Q2_K: mv_q2_k,
           QType.TQ2_0: mv_tq2_0, QType.Q7_K: mv_q7_k, QType.Q7_K_PACKED: mv_q7_kr,
           QType.IQ4_XS: mv_iq4_xs, QType.IQ4_XS_PACKED: mv_iq4_xsr,
           QType.Q2_K_PACKED: mv_q2_kr, QType.TQ2_0_PACKED: mv_tq2_0r,
           QType.TQ1_0: mv_tq1_0, QType.IQ2_XXS: mv_iq2_xxs,
           QType.IQ3_XXS: mv_iq3_xxs, QType.IQ3_S: mv_iq3_s, QType.IQ2_XS: mv_iq2_xs,
           QType.IQ2_S: mv_iq2_s}


# The name the repacked weights are kept under (`ModelWeights.derived`, on disk too): Q5_0's
# layout differs between CPUs with and without mask registers (`QH_SLICED`).
PACKED_FORM = "cpu-packed-qhs" if QH_SLICED else "cpu-packed"


@functools.lru_cache(maxsize=256)  # asked once per matmul node per forward
def packable(qtype: int, n_in: int, n_out: int, batched: bool = True) -> bool:
    """Whether `repack_weight` has a faster layout for this weight: Q4_0 / Q5_0 / Q8_0 / Q4_K /
    Q6_K / IQ4_NL / IQ4_XS / MXFP4 / Q2_K / TQ2_0, and the widened Q7_K copies
    (`integer_weight`), with a
    multiple of 16 rows (interleaved 16 at a time) on a CPU with AVX2 at least.
    Q8_0 without VNNI (the sign trick, `simd.interleaved.SIGN_TRICK`) only where the weight
    is `batched` (read by many rows at a time): its interleaved rows are 1.7-2x faster from two
    rows on, but one row alone reads the file's rows 10-25% faster (AMD EPYC Zen 3, 2 threads,
    151936 x 896), and a single-stream decode is all one row."""
    qt = qtype_of(qtype)
    if qt not in PACKED_TYPES or n_out % ROWS or not DOT4:
        return False
    return batched or not (qt is QType.Q8_0 and SIGN_TRICK)


def repack_weight(w_raw: np.ndarray, qtype: int, out: np.ndarray | None = None
                  ) -> tuple[np.ndarray, QType]:
    """A `packable` weight in the repacked layout the integer dots read fastest: (copy, its
    QType), written into `out` (the raw array's shape and dtype) when given. The bytes are only
    rearranged; `matmul` on the copy gives the original's result up to float summation order."""
    qt = qtype_of(qtype)
    w, n_in = weight_view(w_raw, qt)
    if not packable(qt, n_in, w.shape[0]):
        raise ValueError(f"{qt.name} weight of {w.shape[0]} rows has no repacked layout here")
    dst = np.empty(w.shape, np.uint8) if out is None else out.reshape(w.shape)
    if qt in (QType.Q4_K, QType.Q6_K, QType.Q7_K, QType.IQ4_XS, QType.Q2_K, QType.TQ2_0):
        interleave_kquant(w, qt.name.lower(), dst)
    else:
        interleave_block32(w, BLOCK_LAYOUT[qt][1], dst, qh_sliced=QH_SLICED)
    return dst, PACKED_TYPES[qt]


def quantize_activation(x: np.ndarray, qtype: int) -> QuantizedActivation:
    """x f32 `[nt, n_in]` in the form `qtype`'s dot kernel reads (ggml's `vec_dot_type`)."""
    qt = qtype_of(qtype)
    if qt in KQUANT_TYPES:
        return quantize_q8_k(x)
    if qt is QType.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if qt is QType.F16:
        return round_to_f16(x)
    if qt is QType.BF16:
        return round_to_bf16(x)
    return quantize_q8_0(x)


def new_activation(nt: int, n_in: int, qtype: int) -> Q8Blocks | Q8KBlocks | None:
    """Empty buffers for an activation `[nt, n_in]` in the quantized form `qtype`'s dot kernel
    reads, to be filled by `bind_quantize`; None for float weights (their form is a rounding,
    made per call by `quantize_activation`)."""
    qt = qtype_of(qtype)
    if qt in KQUANT_TYPES:
        return new_q8_k(nt, n_in)
    if qt in _FLOAT:
        return None
    return new_q8_0(nt, n_in)


def bind_quantize(x: np.ndarray, xq: Q8Blocks | Q8KBlocks) -> Callable[[], None]:
    """The call that quantizes x into `xq` (made by `new_activation`), shapes checked once."""
    if isinstance(xq, Q8KBlocks):
        return bind_quantize_q8_k(x, xq)
    return bind_quantize_q8_0(x, xq)


PrequantKernel = Callable[[QuantizedActivation, np.ndarray], None]


@functools.cache
def _kernel_for(qt: QType) -> tuple[Callable[..., None], type, str]:
    kernel: object
    want: type
    if qt in _BLOCK32:
        kernel, want, label = _BLOCK32[qt], Q8Blocks, "a Q8_0"
    elif qt in _KQUANT:
        kernel, want, label = _KQUANT[qt], Q8KBlocks, "a Q8_K"
    else:
        kernel, want, label = _FLOAT[qt], np.ndarray, "a float"
    return cast(Callable[..., None], kernel), want, label  # the kernels differ in arguments only


def integer_weight(w_raw: np.ndarray, qtype: int) -> tuple[np.ndarray, QType]:
    """The weight as the integer kernels read it, and its type: the file's blocks (IQ4_NL,
    IQ4_XS, MXFP4, TQ1_0 and TQ2_0 among them; the `reencode.READ_DIRECT` i-quants unless
    MINFER_IQ_WIDEN, `reencode.reads_direct`), or for Q3_K and the other i-quants below IQ4 a
    copy widened to Q6_K / Q7_K (see `quant.reencode`), made here."""
    qt = qtype_of(qtype)
    w, _ = weight_view(w_raw, qt)
    return widen(w, qt)


def bind_prequant(w_raw: np.ndarray, qtype: int) -> PrequantKernel:
    """`matmul_prequant` for one weight, its checks done once: run(xq, out) checks only the
    activation's kind and the widths, then calls the compiled kernel. For a caller that runs
    the same weight every token (the per-call checks of a decode step add up: ~3 µs x 168).
    A weight `integer_weight` widens is widened here: pass its result to share the copy."""
    w, qt = integer_weight(w_raw, qtype)
    n_in = weight_view(w, qt)[1]
    n_out = w.shape[0]
    fn, want, label = _kernel_for(qt)

    def run(xq: QuantizedActivation, out: np.ndarray) -> None:
        if not isinstance(xq, want):
            raise TypeError(f"{qt.name} needs {label} activation")
        if isinstance(xq, np.ndarray):
            _check_widths(xq, out, n_in, n_out)
            fn(w, xq, out)
            return
        _check_widths(xq.qs, out, n_in, n_out)
        # the bias argument None given explicitly: the op tape binds every argument's type
        # (`jit_cache.direct`), so every call then shares one compiled form
        fn(w, xq.qs, xq.d, xq.s if isinstance(xq, Q8Blocks) else xq.bsums, out, None)

    return run


def takes_bias(qtype: int) -> bool:
    """Whether `bind_prequant_into` adds a bias in its kernel for this weight type (the
    generated row drivers' epilogue; not the float rows)."""
    _, want, _ = _kernel_for(qtype_of(qtype))
    return want is not np.ndarray


def bind_prequant_into(w_raw: np.ndarray, qtype: int, xq: Q8Blocks | Q8KBlocks,
                       out: np.ndarray, bias: np.ndarray | None = None) -> Callable[[], None]:
    """`matmul_prequant(w, qtype, xq, out)` over fixed buffers: every check done here, once;
    the call is the compiled kernel alone (whatever `xq` holds when it runs). With `bias`
    (f32 [n_out], where `takes_bias`), out + bias: each thread adds it to the rows it computed,
    the bits of a separate add after the kernel."""
    qt = qtype_of(qtype)
    w, n_in = weight_view(w_raw, qt)
    fn, want, label = _kernel_for(qt)
    if not isinstance(xq, want):
        raise TypeError(f"{qt.name} needs {label} activation")
    _check_widths(xq.qs, out, n_in, w.shape[0])
    aux = xq.s if isinstance(xq, Q8Blocks) else xq.bsums
    if bias is None:
        return functools.partial(fn, w, xq.qs, xq.d, aux, out, None)
    if not takes_bias(qt) or bias.shape != (out.shape[1],) or bias.dtype != np.float32:
        raise ValueError(f"a {qt.name} projection takes no bias {bias.shape} {bias.dtype} "
                         f"into {out.shape}")
    return functools.partial(fn, w, xq.qs, xq.d, aux, out, bias)


def bind_experts_into(w3: np.ndarray, qtype: int, groups: np.ndarray, n_groups: np.ndarray,
                      xq: Q8Blocks | Q8KBlocks | None, x: np.ndarray,
                      out: np.ndarray) -> Callable[[], None]:
    """`out[i] = x[i] @ W_e.T` for the activation rows i of each expert group (the row drivers'
    `_x` forms: `groups[g] = (e, i0, i1)` for g < n_groups[0], filled when it runs) over the
    stacked experts `w3[n_expert, n_out, ...]` as `integer_weight` / `repack_weight` leave
    them; xq: x in the weight type's quantized form (None for a float weight: x is rounded to
    it per call)."""
    qt = qtype_of(qtype)
    fn, want, label = _kernel_for(qt)
    fn_x: Any = expert_form(fn)
    n_in = weight_view(w3[0], qt)[1]
    if qt in _FLOAT:
        if xq is not None:
            raise TypeError(f"{qt.name} experts read a float activation")
        _check_widths(x, out, n_in, w3.shape[1])
        w = weight_view(w3.reshape(-1, w3.shape[-1]), qt)[0].reshape(w3.shape[0], w3.shape[1],
                                                                     -1)
        if qt is QType.F32:
            return functools.partial(fn_x, w, groups, n_groups, x, out)
        rounding = round_to_f16 if qt is QType.F16 else round_to_bf16
        return lambda: fn_x(w, groups, n_groups, rounding(x), out)
    if not isinstance(xq, want) or xq is None:
        raise TypeError(f"{qt.name} needs {label} activation")
    _check_widths(xq.qs, out, n_in, w3.shape[1])
    return functools.partial(fn_x, w3, groups, n_groups, xq.qs, xq.d,
                             xq.s if isinstance(xq, Q8Blocks) else xq.bsums, out)


def _check_widths(x_rows: np.ndarray, out: np.ndarray, n_in: int, n_out: int) -> None:
    if x_rows.ndim != 2 or x_rows.shape[1] != n_in:
        raise ValueError(f"activation has shape {x_rows.shape}, weight rows {n_in} values")
    _check_out(out, (x_rows.shape[0], n_out))


def matmul_prequant(w_raw: np.ndarray, qtype: int, xq: QuantizedActivation,
                    out: np.ndarray) -> None:
    """`out[nt, n_out] = x @ W.T` from an activation made by `quantize_activation(x, qtype)`."""
    bind_prequant(w_raw, qtype)(xq, out)


def matmul(w_raw: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray) -> None:
    """`out[nt, n_out] = x[nt, n_in] @ W.T` for weight `w_raw` of GGML type `qtype`."""
    qt = qtype_of(qtype)
    w, n_in = weight_view(w_raw, qt)
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ValueError(f"x of shape {x.shape} does not match weight rows of {n_in}")
    _check_out(out, (x.shape[0], w.shape[0]))
    if x.shape[0] >= prefill_min_tokens(qt):
        matmul_sgemm(w, qt, x, out)
    else:
        matmul_prequant(w, qt, quantize_activation(x, qt), out)


def matmul_sgemm(w_raw: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray) -> None:
    """The prefill path: dequantized f32 weight tiles through BLAS, times the activation as the
    integer path rounds it (`activation_values`): the same products as ggml's dots, which take
    quantized activations, up to float rounding."""
    qt = qtype_of(qtype)
    if qt in DERIVED_TYPES:
        raise ValueError(f"{qt.name} weights are read by the integer path only")
    w, n_in = weight_view(w_raw, qt)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ValueError(f"x of shape {x.shape} does not match weight rows of {n_in}")
    _check_out(out, (x.shape[0], w.shape[0]))
    sgemm_tiles(w, qt, activation_values(x, qt), out)


def activation_values(x: np.ndarray, qtype: int) -> np.ndarray:
    """x as `qtype`'s dots see it, in f32: through its quantized form (Q8_0 / Q8_K codes times
    their scales), rounded to f16 / bf16 for those weights, itself for f32. Without it the sgemm
    path's f32 activations put Gemma-3-270M's perplexity 1.45% from llama.cpp's (4.435 against
    4.500; with it 4.479, the integer path 4.481; AMD EPYC Zen 3, whose Q8_0 prefill takes
    sgemm)."""
    xq = quantize_activation(x, qtype)
    return xq if isinstance(xq, np.ndarray) else dequantize_activation(xq)


def _check_out(out: np.ndarray, shape: tuple[int, int]) -> None:
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous f32 {shape}, got {out.dtype} {out.shape}")


__all__ = [
    "PREFILL_MIN_TOKENS",
    "PrequantKernel",
    "QuantizedActivation",
    "bind_experts_into",
    "bind_prequant",
    "bind_prequant_into",
    "bind_quantize",
    "integer_weight",
    "matmul",
    "matmul_prequant",
    "matmul_sgemm",
    "new_activation",
    "packable",
    "prefill_min_tokens",
    "quantize_activation",
    "repack_weight",
]
