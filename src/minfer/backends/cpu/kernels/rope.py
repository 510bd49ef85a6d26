"""Rotary position embedding, NEOX style (Qwen families), as ggml's `ggml_rope_ext` computes it
with freq_scale 1, ext_factor 0 (no YaRN) and attn_factor 1.

Pair i (0 <= i < rope_dim/2) of each head rotates elements (i, i + rope_dim/2) by
theta_i = pos * base^(-2i/rope_dim). Like ggml, theta is built by repeated f32 multiplication by
theta_scale = powf(base, -2/rope_dim) starting from pos, and cos/sin are f32. Elements past
rope_dim pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit


@njit(cache=True, error_model="numpy")
def _rope_neox(x, positions, n_head, head_dim, rope_dim, base, out):
    half = rope_dim // 2
    theta_scale = np.float32(base ** (np.float32(-2.0) / np.float32(rope_dim)))
    cos = np.empty(half, np.float32)
    sin = np.empty(half, np.float32)
    for t in range(x.shape[0]):
        theta = np.float32(positions[t])
        for i in range(half):
            cos[i] = np.cos(theta)
            sin[i] = np.sin(theta)
            theta = theta * theta_scale
        for h in range(n_head):
            b = h * head_dim
            for i in range(half):
                x0 = x[t, b + i]
                x1 = x[t, b + i + half]
                out[t, b + i] = x0 * cos[i] - x1 * sin[i]
                out[t, b + i + half] = x0 * sin[i] + x1 * cos[i]
            for i in range(rope_dim, head_dim):
                out[t, b + i] = x[t, b + i]


def rope_neox(x: np.ndarray, positions: np.ndarray, *, n_head: int, head_dim: int,
              rope_dim: int, base: float, out: np.ndarray) -> None:
    """Rotate x f32 `[nt, n_head*head_dim]` at `positions[nt]` into out (out may be x)."""
    if x.ndim != 2 or x.shape[1] != n_head * head_dim or out.shape != x.shape:
        raise ValueError(f"x {x.shape} / out {out.shape} are not [nt, {n_head}*{head_dim}]")
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError(f"rope_dim {rope_dim} must be even and within head_dim {head_dim}")
    positions = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"{positions.shape[0]} positions for {x.shape[0]} rows")
    _rope_neox(x, positions, n_head, head_dim, rope_dim, np.float32(base), out)


def bind_rope_neox(x: np.ndarray, positions: np.ndarray, *, n_head: int, head_dim: int,
                   rope_dim: int, base: float, out: np.ndarray) -> Callable[[], None]:
    """`rope_neox` over fixed arrays (the op tape): shapes checked once; each call converts the
    positions the batch filled in and runs the kernel."""
    if x.ndim != 2 or x.shape[1] != n_head * head_dim or out.shape != x.shape:
        raise ValueError(f"x {x.shape} / out {out.shape} are not [nt, {n_head}*{head_dim}]")
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError(f"rope_dim {rope_dim} must be even and within head_dim {head_dim}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"{positions.shape} positions for {x.shape[0]} rows")
    base32 = np.float32(base)

    def step() -> None:
        _rope_neox(x, positions.astype(np.int64), n_head, head_dim, rope_dim, base32, out)

    return step
