"""Element-wise activations: Gemma's GELU (tanh approximation) and its gated form, the scalar
`scale` and the logit `softcap`; BERT's exact GELU (`gelu_erf`, 0.5x(1 + erf(x/sqrt 2)) in f32,
as PyTorch's `gelu`, erf a rational approximation good to a few ulp) and `tanh` (its
classifier head).

GELU follows ggml's CPU path (built with GGML_GELU_FP16): for -10 < x < 10 the input is rounded
to f16 and looked up in a 65,536-entry table of f16(gelu_f32(x)); from 10 on it is x, at -10 and
below 0. The table is ggml's entry for entry: `gelu_f32` computes as llama.cpp's x86 builds do
(libm's tanhf, 1 + a*x*x fused), and all 65,536 f16 entries equal those read out of
llama-cpp-python 0.3.36's `ggml_table_gelu_f16` (AVX2 build, glibc 2.36); built with numpy's
f32 tanh, 234 of them were one to three f16 ulps off (x in (-10, -1.8)). So gelu(x) here equals
llama.cpp's bit for bit. Rows never interact: every output element depends on its own input
alone (batch invariant).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.simd.llvm import f32_to_f16

GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)


def gelu_f32(x: np.ndarray) -> np.ndarray:
    """ggml's `ggml_gelu_f32` in f32 as its x86 builds compile it:
    0.5x(1 + tanhf(sqrt(2/pi) x fma(0.044715 x, x, 1))). The compiler contracts 1 + a*x*x into
    one fused multiply-add (emulated here by the exact f64 product plus 1, rounded once to f32),
    and tanhf is libm's, close to correctly rounded: here tanh in f64 rounded to f32 (numpy's
    f32 tanh is a few ulp off, which moved 234 of the table's f16 entries by one ulp)."""
    x = np.asarray(x, np.float32)
    with np.errstate(all="ignore"):
        ax = (GELU_COEF_A * x).astype(np.float64)
        fused = (ax * x.astype(np.float64) + 1.0).astype(np.float32)
        arg = SQRT_2_OVER_PI * x * fused
        t = np.tanh(arg.astype(np.float64)).astype(np.float32)
        return np.float32(0.5) * x * (np.float32(1.0) + t)


def _gelu_table() -> np.ndarray:
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    return gelu_f32(halves.astype(np.float32)).astype(np.float16).astype(np.float32)


GELU_TABLE = _gelu_table()  # f32 values of the f16 table, indexed by the input's f16 bits


@njit(inline="always")
def _gelu1(v, table):
    if v <= np.float32(-10.0):
        return np.float32(0.0)
    if v >= np.float32(10.0):
        return v
    return table[f32_to_f16(v)]


@njit(cache=True, error_model="numpy")
def _gelu(x, table, out):
    for i in range(x.shape[0]):
        out[i] = _gelu1(x[i], table)


@njit(cache=True, error_model="numpy")
def _geglu(g, u, table, out):
    for i in range(g.shape[0]):
        out[i] = _gelu1(g[i], table) * u[i]


@njit(cache=True, error_model="numpy")
def _scale(x, s, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * s


@njit(cache=True, error_model="numpy")
def _softcap(x, inv_cap, cap, out):
    for i in range(x.shape[0]):
        out[i] = np.tanh(x[i] * inv_cap) * cap


# erf(x) on [-4, 4] as x * P(x^2) / Q(x^2), the rational minimax form Eigen and XLA use for f32
# (a few ulp; beyond +-4 erf is +-1 in f32): no branch, no libm call, so the loop vectorises
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = (np.float32(c) for c in _ERF_P)
_Q0, _Q1, _Q2, _Q3, _Q4 = (np.float32(c) for c in _ERF_Q)


@njit(inline="always", error_model="numpy", fastmath={"contract"})
def erf_f32(v):
    x = min(max(v, np.float32(-4.0)), np.float32(4.0))
    x2 = x * x
    p = x2 * _P0 + _P1
    p = x2 * p + _P2
    p = x2 * p + _P3
    p = x2 * p + _P4
    p = x2 * p + _P5
    p = x2 * p + _P6
    q = x2 * _Q0 + _Q1
    q = x2 * q + _Q2
    q = x2 * q + _Q3
    q = x2 * q + _Q4
    return x * p / q


@njit(cache=True, error_model="numpy", parallel=True, fastmath={"contract"})
def _gelu_erf(x, out):
    n = x.shape[0]
    step = 4096
    for b in prange((n + step - 1) // step):
        for i in range(b * step, min(n, (b + 1) * step)):
            v = x[i]
            out[i] = np.float32(0.5) * v * (np.float32(1.0) + erf_f32(v * _INV_SQRT2))


@njit(cache=True, error_model="numpy")
def _tanh(x, out):
    for i in range(x.shape[0]):
        out[i] = np.tanh(x[i])


_INV_SQRT2 = np.float32(0.70710678118654752440)


def _flat(*arrs: np.ndarray) -> list[np.ndarray]:
    if len({a.shape for a in arrs}) != 1:
        raise ValueError(f"shape mismatch {[a.shape for a in arrs]}")
    for a in arrs:
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("element-wise kernels take C-contiguous f32 arrays")
    return [a.reshape(-1) for a in arrs]


def gelu(x: np.ndarray, out: np.ndarray) -> None:
    """out = gelu_tanh(x), through ggml's f16 table; out may be x."""
    fx, fo = _flat(x, out)
    _gelu(fx, GELU_TABLE, fo)


def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = gelu_tanh(gate) * up (ggml's `geglu` on split gate/up); out may alias either."""
    fg, fu, fo = _flat(gate, up, out)
    _geglu(fg, fu, GELU_TABLE, fo)


def gelu_erf(x: np.ndarray, out: np.ndarray) -> None:
    """out = 0.5 x (1 + erf(x / sqrt(2))), the exact GELU; out may be x."""
    fx, fo = _flat(x, out)
    _gelu_erf(fx, fo)


def tanh(x: np.ndarray, out: np.ndarray) -> None:
    """out = tanh(x); out may be x."""
    fx, fo = _flat(x, out)
    _tanh(fx, fo)


def scale(x: np.ndarray, factor: float, out: np.ndarray) -> None:
    """out = x * factor (one f32 multiply, as ggml_scale)."""
    fx, fo = _flat(x, out)
    _scale(fx, np.float32(factor), fo)


def softcap(x: np.ndarray, cap: float, out: np.ndarray) -> None:
    """out = tanh(x * (1/cap)) * cap, as ggml's scale -> tanh -> scale."""
    if not cap > 0:
        raise ValueError(f"soft-cap must be positive, got {cap}")
    fx, fo = _flat(x, out)
    _softcap(fx, np.float32(1.0) / np.float32(cap), np.float32(cap), fo)
