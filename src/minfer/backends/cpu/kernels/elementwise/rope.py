"""Rotary position embedding as ggml's `ggml_rope_ext` computes it, in its two layouts: NEOX
(Qwen, Gemma) and normal (Llama).

NEOX rotates pair i (0 <= i < rope_dim/2) of each head as elements (i, i + rope_dim/2); normal
mode rotates adjacent elements (2i, 2i + 1). The angle is
theta_i = freq_scale * (pos * base^(-2i/rope_dim) / f_i), with per-pair frequency factors f_i
(Llama 3.1's `rope_freqs` tensor; 1 when absent) and freq_scale (linear rope scaling; 1 when
absent). Like ggml, pos * base^(-2i/rope_dim) is built by repeated f32 multiplication by
theta_scale = powf(base, -2/rope_dim) starting from pos, and cos/sin are f32; with f_i = 1 and
freq_scale = 1 the division and multiplication are exact. Elements past rope_dim pass through.
YaRN (ext_factor != 0) blends each pair's scaled and unscaled angle along the ramp from
corr_low to corr_high and multiplies cos and sin by mscale, as ggml's `rope_yarn` does
(`minfer.gguf.rope_scaling`); without it (ext_factor 0, mscale 1) the angles and products are
exactly the plain ones.

Multi-position rope (`ggml_rope_multi`; `rope_scaling.mrope_pairs`): each row has four
positions (t, h, w, e; given section-major, `positions[c * nt + t]`) and pair i takes column
cols[i]'s angle. As ggml builds them, the four angles start at their positions and are all
multiplied by theta_scale at every pair, column resets[i] (>= 0) starting over from its position
at pair i (the vision layout's independent sections). Interleaved M-RoPE (Qwen3-VL's text,
"imrope"): pair i is h where i % 3 == 1 and i < 3 sections[1], w where i % 3 == 2 and
i < 3 sections[2], t where i % 3 == 0 and i < 3 sections[0], else e. The vision layout
("vision": a 2-D rope over patches) rotates pairs (i, i + head_dim/2) over the whole head with
theta_scale = base^(-2/(head_dim/2)); its first quarter of pairs takes t, the next h, each from
its own position.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.region.parts import share
from minfer.gguf.rope_scaling import NO_YARN, YarnRope, mrope_pairs

_ONE = np.ones(0, np.float32)
_NONE = np.zeros(0, np.int32)
# From this many rows on (prefill, a server's batch of decode rows) the rows are split across
# the threads, PARALLEL_CHUNK at a time; fewer run on the calling thread (one sequence's decode:
# a parallel region costs more than the rows). 16 decode rows: rope_q 0.47 -> 0.35 ms a step
# (24 layers, 2 threads, Intel SPR) against 64 / 16.
PARALLEL_MIN_ROWS = 8
PARALLEL_CHUNK = 4


@njit(inline="always", error_model="numpy")
def pair_angle(theta, i, factors, freq_scale, yarn):
    """Pair i's f32 angle at `theta` = pos * base^(-2i/rope_dim) (built by the caller as
    ggml does): over the pair's factor, scaled; with YaRN (yarn[0] = ext_factor != 0) blended
    with the unscaled angle along ggml's `rope_yarn_ramp` from yarn[1] to yarn[2]. The rope
    kernel and the context shift's angles (`engine.kv_shift`) are this one function."""
    extrap = theta / factors[i] if factors.shape[0] > 0 else theta
    th = freq_scale * extrap
    if yarn[0] != 0.0:
        one = np.float32(1.0)
        y = (np.float32(i) - yarn[1]) / max(np.float32(0.001), yarn[2] - yarn[1])
        ramp = (one - min(one, max(np.float32(0.0), y))) * yarn[0]
        th = th * (one - ramp) + extrap * ramp
    return th


@njit(inline="always", error_model="numpy")
def _rope_row(x, positions, t, n_head, head_dim, rope_dim, base, freq_scale, factors, yarn, neox,
              out, cos, sin, theta_dim, cols, resets, th):
    half = rope_dim // 2
    theta_scale = np.float32(base ** (np.float32(-2.0) / np.float32(theta_dim)))
    mscale = yarn[3]
    if cols.shape[0] == 0:
        theta = np.float32(positions[t])
        for i in range(half):
            ang = pair_angle(theta, i, factors, freq_scale, yarn)
            cos[i] = np.cos(ang) * mscale
            sin[i] = np.sin(ang) * mscale
            theta = theta * theta_scale
    else:  # four positions per row, section-major
        nt = x.shape[0]
        for c in range(4):
            th[c] = np.float32(positions[c * nt + t])
        for i in range(half):
            if resets[i] >= 0:
                th[resets[i]] = np.float32(positions[resets[i] * nt + t])
            ang = pair_angle(th[cols[i]], i, factors, freq_scale, yarn)
            cos[i] = np.cos(ang) * mscale
            sin[i] = np.sin(ang) * mscale
            for c in range(4):
                th[c] = th[c] * theta_scale
    xr, yr = x[t], out[t]
    for h in range(n_head):
        b = h * head_dim
        if neox:  # pair i is (i, i + half): two contiguous runs
            for i in range(half):
                x0, x1 = xr[b + i], xr[b + half + i]
                yr[b + i] = x0 * cos[i] - x1 * sin[i]
                yr[b + half + i] = x0 * sin[i] + x1 * cos[i]
        else:  # normal: (2i, 2i + 1)
            for i in range(half):
                x0, x1 = xr[b + 2 * i], xr[b + 2 * i + 1]
                yr[b + 2 * i] = x0 * cos[i] - x1 * sin[i]
                yr[b + 2 * i + 1] = x0 * sin[i] + x1 * cos[i]
        for i in range(rope_dim, head_dim):
            yr[b + i] = xr[b + i]


@njit(cache=True, error_model="numpy")
def _rope(x, positions, n_head, head_dim, rope_dim, base, freq_scale, factors, yarn, neox, out,
          theta_dim, cols, resets):
    cos = np.empty(rope_dim // 2, np.float32)
    sin = np.empty(rope_dim // 2, np.float32)
    th = np.empty(4, np.float32)
    for t in range(x.shape[0]):
        _rope_row(x, positions, t, n_head, head_dim, rope_dim, base, freq_scale, factors, yarn,
                  neox, out, cos, sin, theta_dim, cols, resets, th)


@njit(cache=True, error_model="numpy", parallel=True)
def _rope_par(x, positions, n_head, head_dim, rope_dim, base, freq_scale, factors, yarn, neox,
              out, theta_dim, cols, resets):
    n_chunk = (x.shape[0] + PARALLEL_CHUNK - 1) // PARALLEL_CHUNK
    for c in prange(n_chunk):
        cos = np.empty(rope_dim // 2, np.float32)
        sin = np.empty(rope_dim // 2, np.float32)
        th = np.empty(4, np.float32)
        for t in range(c * PARALLEL_CHUNK, min(x.shape[0], (c + 1) * PARALLEL_CHUNK)):
            _rope_row(x, positions, t, n_head, head_dim, rope_dim, base, freq_scale, factors,
                      yarn, neox, out, cos, sin, theta_dim, cols, resets, th)


@njit(cache=True, error_model="numpy")
def _rope_par_part(part, n_parts, x, positions, n_head, head_dim, rope_dim, base, freq_scale,
                   factors, yarn, neox, out, theta_dim, cols, resets):
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    cos = np.empty(rope_dim // 2, np.float32)
    sin = np.empty(rope_dim // 2, np.float32)
    th = np.empty(4, np.float32)
    for t in range(*share(part, n_parts, x.shape[0])):
        _rope_row(x, positions, t, n_head, head_dim, rope_dim, base, freq_scale, factors, yarn,
                  neox, out, cos, sin, theta_dim, cols, resets, th)


def rope(x: np.ndarray, positions: np.ndarray, *, n_head: int, head_dim: int, rope_dim: int,
         base: float, style: str = "neox", freq_scale: float = 1.0,
         factors: np.ndarray | None = None, yarn: YarnRope = NO_YARN, out: np.ndarray,
         mrope: str = "", sections: tuple[int, ...] = ()) -> None:
    """Rotate x f32 `[nt, n_head*head_dim]` at `positions[nt]` (with `mrope`: [4 nt],
    section-major) into out (out may be x)."""
    positions = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    bind_rope(x, positions, n_head=n_head, head_dim=head_dim, rope_dim=rope_dim, base=base,
              style=style, freq_scale=freq_scale, factors=factors, yarn=yarn, out=out,
              mrope=mrope, sections=sections)()


def rope_neox(x: np.ndarray, positions: np.ndarray, *, n_head: int, head_dim: int,
              rope_dim: int, base: float, out: np.ndarray) -> None:
    """NEOX rotation without factors or scaling (Qwen)."""
    rope(x, positions, n_head=n_head, head_dim=head_dim, rope_dim=rope_dim, base=base,
         out=out)


def bind_rope(x: np.ndarray, positions: np.ndarray, *, n_head: int, head_dim: int, rope_dim: int,
              base: float, style: str = "neox", freq_scale: float = 1.0,
              factors: np.ndarray | None = None, yarn: YarnRope = NO_YARN,
              out: np.ndarray, mrope: str = "", sections: tuple[int, ...] = ()
              ) -> Callable[[], None]:
    """`rope` over fixed arrays (the op tape): shapes checked once; each call converts the
    positions the batch filled in and runs the kernel."""
    if x.ndim != 2 or x.shape[1] != n_head * head_dim or out.shape != x.shape:
        raise ValueError(f"x {x.shape} / out {out.shape} are not [nt, {n_head}*{head_dim}]")
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError(f"rope_dim {rope_dim} must be even and within head_dim {head_dim}")
    if style not in ("neox", "norm"):
        raise ValueError(f"unknown rope style {style!r} (neox or norm)")
    n_pos = 4 if mrope else 1
    if positions.shape != (n_pos * x.shape[0],):
        raise ValueError(f"{positions.shape} positions for {x.shape[0]} rows")
    if mrope and (style != "neox" or (mrope == "vision" and rope_dim != head_dim)):
        raise ValueError(f"a {mrope} rope rotates NEOX pairs (vision: the whole head)")
    ff = _ONE if factors is None else np.ascontiguousarray(factors, dtype=np.float32)
    if factors is not None and ff.shape != (rope_dim // 2,):
        raise ValueError(f"rope factors of shape {ff.shape}, expected ({rope_dim // 2},)")
    if positions.dtype.kind != "i":
        raise ValueError(f"positions must be integers, got {positions.dtype}")
    base32, scale32, neox = np.float32(base), np.float32(freq_scale), style == "neox"
    # the positions as the batch fills them in (int32 from the engine), read in place
    kernel = _rope_par if x.shape[0] >= PARALLEL_MIN_ROWS else _rope
    cols, resets, theta_dim = mrope_pairs(mrope, sections, rope_dim) if mrope \
        else (_NONE, _NONE, rope_dim)
    return partial(kernel, x, positions, n_head, head_dim, rope_dim, base32, scale32, ff,
                   yarn.terms(), neox, out, theta_dim, cols, resets)
