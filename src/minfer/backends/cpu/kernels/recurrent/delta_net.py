"""The gated delta rule (Qwen3.5's Gated DeltaNet core, ggml's `gated_delta_net` with the
scalar gate) over a per-sequence f32 state matrix per value head.

Per token t, value head h (its key head h % n_k_heads: ggml's tiled broadcast, which
llama.cpp's converter orders the value heads for): q and k are L2-normalised (sum of squares in
f64, 1 / max(norm, eps), as `ggml_l2_norm`), g = softplus(alpha + dt_bias) * a (a = -exp(A_log),
as the file stores it), beta = sigmoid(beta_raw); with the state S [S_k, S_v] of the row's
sequence: S *= exp(g); delta = (v - S^T k) * beta; S += k delta^T; out = S^T q / sqrt(S_v).
Each state row's pass (the decay then its dot with k; the rank-one update then its dot with q)
is one `simd.floats.update_dot`: vector IR in one fixed order, the same bits everywhere.

State: `[n_seq, n_v_heads, S_v, S_k]` f32 (`new_delta_state`), stored transposed as ggml keeps
it (row j of a head's matrix is column j of S); the region is the backend's persistent memory.
Every head walks the batch's rows in order, each reading and writing only its own sequence's
matrix (a row at position 0 first zeroes it), each dot product summed in f32 in that fixed order,
so a token's result is bitwise the same in any chunking or beside other rows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.recurrent.shortconv import check_sequences
from minfer.backends.cpu.kernels.region.parts import share
from minfer.backends.cpu.kernels.simd.floats import update_dot


def new_delta_state(n_seq: int, n_v_heads: int, head_dim: int) -> np.ndarray:
    """The zeroed delta-rule state of one layer: `[n_seq, n_v_heads, head_dim, head_dim]` f32."""
    return np.zeros((n_seq, n_v_heads, head_dim, head_dim), np.float32)


@njit(cache=True, error_model="numpy")
def _l2_normed(x, eps, out):
    ss = 0.0
    for i in range(x.shape[0]):
        ss += np.float64(x[i] * x[i])
    scale = np.float32(1.0) / max(np.float32(np.sqrt(ss)), eps)
    for i in range(x.shape[0]):
        out[i] = x[i] * scale


@njit(inline="always")
def _delta_head(h, qkv, alpha, beta, dt_bias, a, state, positions, seq, out, n_k_heads, eps):
    """Value head h of every row, in row order (the recurrence runs token by token)."""
    nt = qkv.shape[0]
    dim = state.shape[2]
    k_off = n_k_heads * dim
    v_off = 2 * k_off
    scale = np.float32(1.0) / np.float32(np.sqrt(np.float32(dim)))
    kh = h % n_k_heads
    q = np.empty(dim, np.float32)
    k = np.empty(dim, np.float32)
    delta = np.empty(dim, np.float32)
    for t in range(nt):
        m = state[seq[t], h]
        if positions[t] == 0:
            m[:, :] = np.float32(0.0)
        _l2_normed(qkv[t, kh * dim:(kh + 1) * dim], eps, q)
        _l2_normed(qkv[t, k_off + kh * dim:k_off + (kh + 1) * dim], eps, k)
        x = alpha[t, h] + dt_bias[h]
        sp = x if x > np.float32(20.0) else np.float32(np.log1p(np.exp(x)))
        decay = np.float32(np.exp(sp * a[h]))
        b = np.float32(1.0) / (np.float32(1.0) + np.exp(-beta[t, h]))
        zero, one = np.float32(0.0), np.float32(1.0)
        for j in range(dim):
            delta[j] = (qkv[t, v_off + h * dim + j] - update_dot(m[j], decay, zero, k, k)) * b
        for j in range(dim):
            out[t, h * dim + j] = update_dot(m[j], one, delta[j], k, q) * scale


@njit(cache=True, error_model="numpy", parallel=True)
def _delta_net(qkv, alpha, beta, dt_bias, a, state, positions, seq, out, n_k_heads, eps):
    check_sequences(seq, state.shape[0])
    for h in prange(state.shape[1]):
        _delta_head(h, qkv, alpha, beta, dt_bias, a, state, positions, seq, out, n_k_heads, eps)


@njit(cache=True, error_model="numpy")
def _delta_net_part(part, n_parts, qkv, alpha, beta, dt_bias, a, state, positions, seq, out,
                    n_k_heads, eps):
    """`_delta_net`'s heads for part `part` of `n_parts` (a parallel region's thread)."""
    check_sequences(seq, state.shape[0])
    n = state.shape[1]
    for h in range(*share(part, n_parts, n)):
        _delta_head(h, qkv, alpha, beta, dt_bias, a, state, positions, seq, out, n_k_heads, eps)

def delta_net(qkv: np.ndarray, alpha: np.ndarray, beta: np.ndarray, dt_bias: np.ndarray,
              a: np.ndarray, state: np.ndarray, positions: np.ndarray, seq: np.ndarray,
              out: np.ndarray, *, n_k_heads: int, eps: float) -> None:
    """out [nt, n_v_heads * S_v] of the gated delta rule on qkv [nt, 2 n_k_heads S + n_v_heads
    S] = q | k | v (after the convolution), alpha and beta [nt, n_v_heads] (raw projections),
    dt_bias and a [n_v_heads], state [n_seq, n_v_heads, S, S] (updated in place)."""
    bind_delta_net(qkv, alpha, beta, dt_bias, a, state, positions, seq, out,
                   n_k_heads=n_k_heads, eps=eps)()


def bind_delta_net(qkv: np.ndarray, alpha: np.ndarray, beta: np.ndarray, dt_bias: np.ndarray,
                   a: np.ndarray, state: np.ndarray, positions: np.ndarray, seq: np.ndarray,
                   out: np.ndarray, *, n_k_heads: int, eps: float) -> Callable[[], None]:
    """`delta_net` over fixed arrays, shapes checked once; the kernel checks that every row's
    sequence has a state row."""
    nt = qkv.shape[0]
    _, n_v, dim, dim2 = state.shape
    if (dim != dim2 or n_k_heads < 1 or n_v % n_k_heads
            or qkv.shape != (nt, (2 * n_k_heads + n_v) * dim) or out.shape != (nt, n_v * dim)
            or alpha.shape != (nt, n_v) or beta.shape != (nt, n_v)
            or dt_bias.shape != (n_v,) or a.shape != (n_v,)):
        raise ValueError(f"delta net of {qkv.shape} over {n_k_heads} key heads and state "
                         f"{state.shape} into {out.shape}")
    if positions.shape != (nt,) or seq.shape != (nt,):
        raise ValueError("delta net: positions and sequences must give each row one")
    for arr in (qkv, alpha, beta, dt_bias, a, state, out):
        if arr.dtype != np.float32 or not arr.flags.c_contiguous:
            raise ValueError("delta net runs on contiguous f32 arrays")
    return partial(_delta_net, qkv, alpha, beta, dt_bias, a, state, positions, seq, out,
                   n_k_heads, np.float32(eps))
