"""Moving KV cells to new positions in place: the "context shift" for an overflowing chat.

The engine stores K rows after RoPE (NEOX: pair i of each head is elements (i, i + rope_dim/2);
normal mode, Llama: elements (2i, 2i+1); rotated by
theta_i(p) = freq_scale * p * base^(-2i/rope_dim) / f_i, each layer with its own base and scale
(Gemma 3's sliding-window layers), f_i the optional `rope_freqs` factors (or LongRoPE's, for
the context's size); with YaRN each pair's angle a blend of that and the unscaled one, still
linear in p), and a token's cell is its position. A layer without RoPE (SmolLM3's every 4th)
moves its keys as they are. Moving the
rows of cells [src_start, src_end) to [dst_start, ...) therefore has to re-position the keys too.
RoPE is a plane rotation per pair, and rotations compose, so rotating a stored key by
theta_i(q) - theta_i(p) turns the key at position p into the key at position q — no weights and
no forward needed. V rows carry no position and are copied as they are.

The angles are built exactly as the rope kernel builds them (f32 theta by repeated f32
multiplication by theta_scale from the position, see backends/cpu/kernels/rope.py), the
difference and the rotation are computed in f64 and the result is written back in the cache's
dtype: a shifted row equals a fresh computation at the new position up to the kernel's own f32
rounding (plus one more f16 rounding with an f16 cache). The cache's formats are the backend's
(`KVHost.move_kv` reads K's rows as values, hands them to `rerotate` and stores the result, and
copies V's): a quantized K cache gains one more quantization of the keys per shift, as with
llama.cpp's build_rope_shift.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

import minfer.jit_cache  # noqa: F401  (before any njit: where compiled code is cached)
from minfer.backends.cpu.kernels.elementwise.rope import pair_angle
from minfer.errors import MinferError
from minfer.gguf.rope_scaling import NO_YARN, YarnRope

if TYPE_CHECKING:
    from minfer.engine.forward import Engine


_NO_FACTORS = np.ones(0, np.float32)


@njit(cache=True, error_model="numpy")
def _thetas(positions, rope_dim, base, freq_scale, factors, yarn):  # pragma: no cover - compiled
    """theta[t, i] as the rope kernel computes it (f32 all the way; YaRN's blend included,
    its magnitude not: a stored key carries it already and a rotation keeps it)."""
    half = rope_dim // 2
    theta_scale = np.float32(base ** (np.float32(-2.0) / np.float32(rope_dim)))
    out = np.empty((positions.shape[0], half), np.float32)
    for t in range(positions.shape[0]):
        theta = np.float32(positions[t])
        for i in range(half):
            out[t, i] = pair_angle(theta, i, factors, freq_scale, yarn)
            theta = theta * theta_scale
    return out


def rope_thetas(positions: np.ndarray, *, rope_dim: int, base: float, freq_scale: float = 1.0,
                factors: np.ndarray | None = None, yarn: YarnRope = NO_YARN) -> np.ndarray:
    """The f32 angles `[n, rope_dim/2]` the rope kernel uses at `positions`."""
    pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    ff = _NO_FACTORS if factors is None else np.ascontiguousarray(factors, dtype=np.float32)
    result: np.ndarray = _thetas(pos, rope_dim, np.float32(base), np.float32(freq_scale), ff,
                                 yarn.terms())
    return result


def rerotate(k: np.ndarray, src_pos: np.ndarray, dst_pos: np.ndarray, *, n_head: int,
             head_dim: int, rope_dim: int, base: float, style: str = "neox",
             freq_scale: float = 1.0, factors: np.ndarray | None = None,
             yarn: YarnRope = NO_YARN) -> np.ndarray:
    """Post-RoPE keys `[n, n_head*head_dim]` at src_pos turned into keys at dst_pos (f64)."""
    n = k.shape[0]
    half = rope_dim // 2
    kw = {"rope_dim": rope_dim, "base": base, "freq_scale": freq_scale, "factors": factors,
          "yarn": yarn}
    delta = (rope_thetas(dst_pos, **kw).astype(np.float64)  # type: ignore[arg-type]
             - rope_thetas(src_pos, **kw).astype(np.float64))  # type: ignore[arg-type]
    cos = np.cos(delta)[:, None, :]
    sin = np.sin(delta)[:, None, :]
    x = k.astype(np.float64).reshape(n, n_head, head_dim)
    first, second = (slice(0, half), slice(half, rope_dim)) if style == "neox" else \
        (slice(0, rope_dim, 2), slice(1, rope_dim, 2))
    x0 = x[:, :, first].copy()
    x1 = x[:, :, second].copy()
    x[:, :, first] = x0 * cos - x1 * sin
    x[:, :, second] = x0 * sin + x1 * cos
    return x.reshape(n, n_head * head_dim)


def shift_kv(engine: Engine, *, src_start: int, src_end: int, dst_start: int) -> None:
    """Move KV cells [src_start, src_end) to [dst_start, ...) in every layer, re-rotating K.

    Assumes the engine's usual single-sequence layout (the token in cell c sits at position c).
    Cells outside the destination are left as they are (those past the new cursor are stale).
    A model with recurrent layers is refused: their state cannot be shifted; so is one with
    M-RoPE (its keys' angles come from several positions).
    """
    n = src_end - src_start
    n_ctx = engine.n_ctx
    if not 0 <= src_start <= src_end <= n_ctx or dst_start < 0 or dst_start + n > n_ctx:
        raise MinferError(f"cannot shift KV cells [{src_start}, {src_end}) to {dst_start} "
                          f"(n_ctx = {n_ctx})")
    if n == 0 or dst_start == src_start:
        return
    hp = engine.hparams
    if hp.recurrent:
        raise MinferError(f"a context shift cannot move {hp.arch}'s recurrent state: it holds "
                          "every token so far and cannot drop the oldest ones (recompute the "
                          "kept tokens instead)")
    if hp.rope_sections:
        raise MinferError(f"a context shift cannot re-rotate {hp.arch}'s M-RoPE keys (several "
                          "positions per cell): recompute the kept tokens instead")
    src_pos = np.arange(src_start, src_end, dtype=np.int64)
    dst_pos = src_pos + (dst_start - src_start)
    factors_name = hp.rope_factors(n_ctx)
    factors = engine.weights.vector(factors_name) if factors_name else None
    for il, (k, v) in enumerate(zip(engine.kv.k, engine.kv.v, strict=True)):
        if hp.kv_layer(il) != il:  # a shared-KV layer (Gemma 4) holds no cells of its own
            continue
        head_dim = hp.layer_head_dim(il)
        if not hp.layer_has_rope(il):  # a NoPE layer's keys hold no position: moved as they are
            engine.kv_host.move_kv(k, v, src_start=src_start, src_end=src_end,
                                   dst_start=dst_start, head_dim=head_dim, rekey=None)
            continue
        rekey = partial(rerotate, src_pos=src_pos, dst_pos=dst_pos, n_head=hp.layer_n_head_kv(il),
                        head_dim=head_dim, rope_dim=hp.layer_rope_dim(il),
                        base=hp.layer_rope_base(il), style=hp.rope_style,
                        freq_scale=hp.layer_rope_freq_scale(il),
                        factors=None if hp.is_swa(il) else factors,  # as the graph's rope
                        yarn=hp.layer_rope_yarn(il))
        engine.kv_host.move_kv(k, v, src_start=src_start, src_end=src_end, dst_start=dst_start,
                               head_dim=head_dim, rekey=rekey)
