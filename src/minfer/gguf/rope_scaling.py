"""YaRN rope scaling as llama.cpp applies it: the file's parameters (`Yarn`) and, per layer, the
four numbers a rope op takes (`YarnRope`).

YaRN (Peng et al. 2023) stretches a model's context by a factor s = 1 / freq_scale. Each rotary
pair i blends the interpolated angle (freq_scale * theta) and the trained one (theta):

    ramp_i = (1 - clamp((i - low) / max(0.001, high - low), 0, 1)) * ext_factor
    angle_i = freq_scale * theta * (1 - ramp_i) + theta * ramp_i

so the fast pairs (i <= low) keep their trained angle and the slow ones (i >= high) are
interpolated; cos and sin are then multiplied by `mscale`. low and high are the pairs that turn
beta_fast and beta_slow times over the original context (`corr_dims`, floored and ceiled,
within [0, rope_dim - 1]), from the layer's own base. As in llama.cpp (ggml's `rope_yarn` and
`llama_context`'s set-up), in f32:
- ext_factor is 1 (llama.cpp's default for a YaRN file; it reads no per-file value for the
  architectures minfer runs, nor per-file betas: `hparams._yarn`);
- the magnitude is attn_factor * (1 + 0.1 ln(1 / freq_scale)) where the layer is stretched,
  attn_factor where it is not (ext_factor 0, or a sliding-window layer kept at scale 1);
- attn_factor is get_mscale(s, 1) / get_mscale(s, log_mul) / (1 + 0.1 ln s) times the file's
  `rope.scaling.attn_factor` (log_mul 0 leaves get_mscale(s, 1) / (1 + 0.1 ln s) = 1 for
  s > 1): the usual magnitude is 1 + 0.1 ln s, transformers' `attention_factor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class YarnRope:
    """One layer's YaRN terms: the ramp's strength and its pair range, and the magnitude cos
    and sin are multiplied by. The default is no YaRN (angles freq_scale * theta, magnitude 1)."""

    ext_factor: float = 0.0
    corr_low: float = 0.0
    corr_high: float = 0.0
    mscale: float = 1.0

    def terms(self) -> np.ndarray:
        """The four as the compiled rope kernels take them: f32 [ext_factor, corr_low,
        corr_high, mscale]."""
        return np.array([self.ext_factor, self.corr_low, self.corr_high, self.mscale], F32)


NO_YARN = YarnRope()


@dataclass(frozen=True)
class Yarn:
    """A file's YaRN parameters (`rope.scaling.type = yarn`)."""

    factor: float  # the context stretch s (rope.scaling.factor)
    n_ctx_orig: int  # the context the model was trained at (rope.scaling.original_context_length)
    ext_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    log_mul: float = 0.0
    attn_factor: float = 1.0  # the file's rope.scaling.attn_factor

    def context_attn_factor(self) -> float:
        """The magnitude llama.cpp's context passes to every rope (cparams.yarn_attn_factor)."""
        s = F32(self.factor)
        if self.ext_factor == 0.0:
            return float(F32(self.attn_factor))

        def get_mscale(scale: np.float32, mscale: float) -> np.float32:
            if scale <= 1.0:
                return F32(1.0)
            return F32(F32(0.1) * F32(mscale) * np.log(scale) + F32(1.0))

        attn = (get_mscale(s, 1.0) / get_mscale(s, self.log_mul) if self.log_mul != 0.0
                else get_mscale(s, 1.0))
        attn = F32(attn * (F32(1.0) / (F32(1.0) + F32(0.1) * np.log(s))))
        return float(F32(attn * F32(self.attn_factor)))

    def layer(self, *, rope_dim: int, base: float, freq_scale: float) -> YarnRope:
        """The terms of a layer rotating rope_dim dims at `base`, stretched by 1 / freq_scale."""
        low, high = corr_dims(rope_dim, self.n_ctx_orig, base, self.beta_fast, self.beta_slow)
        mscale = F32(self.context_attn_factor())
        if self.ext_factor != 0.0:
            mscale = F32(mscale * (F32(1.0) + F32(0.1) * np.log(F32(1.0) / F32(freq_scale))))
        return YarnRope(float(F32(self.ext_factor)), low, high, float(mscale))


def corr_dims(rope_dim: int, n_ctx_orig: int, base: float, beta_fast: float,
              beta_slow: float) -> tuple[float, float]:
    """The pairs the YaRN ramp runs between (ggml_rope_yarn_corr_dims): the pair that turns
    beta times over the original context, floored for beta_fast and ceiled for beta_slow."""

    def dim(n_rot: float) -> np.float32:
        ratio = F32(n_ctx_orig) / (F32(n_rot) * F32(2.0) * F32(math.pi))
        return F32(F32(rope_dim) * np.log(ratio) / (F32(2.0) * np.log(F32(base))))

    start = np.floor(dim(beta_fast))
    end = np.ceil(dim(beta_slow))
    return float(max(F32(0.0), start)), float(min(F32(rope_dim - 1), end))


def pair_scales(half: int, freq_scale: float, yarn: YarnRope) -> np.ndarray:
    """Each pair's angle over its unscaled one (f64, `[half]`): freq_scale without YaRN, the
    ramp's blend of freq_scale and 1 with it (for the float64 references and the torch
    backend; the CPU kernel blends in f32 as ggml does)."""
    scale = np.full(half, float(freq_scale))
    if yarn.ext_factor == 0.0:
        return scale
    y = (np.arange(half) - yarn.corr_low) / max(0.001, yarn.corr_high - yarn.corr_low)
    ramp = (1.0 - np.clip(y, 0.0, 1.0)) * yarn.ext_factor
    return scale * (1.0 - ramp) + ramp


def mrope_pairs(mode: str, sections: tuple[int, ...], rope_dim: int
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """(cols, resets, theta_dim) of a multi-position rope (`ggml_rope_multi`; the CPU rope
    kernel's module docstring): each pair's position column, the column each pair restarts
    (-1: none), and the dims of theta_scale = base^(-2/theta_dim)."""
    half = rope_dim // 2
    cols = np.zeros(half, np.int32)
    resets = np.full(half, -1, np.int32)
    s = [*sections, 0, 0, 0, 0][:4]
    if mode == "vision":
        quarter = rope_dim // 4
        cols[quarter:] = 1
        resets[0], resets[quarter] = 0, 1
        return cols, resets, half
    if mode != "imrope":
        raise ValueError(f"unknown multi-position rope {mode!r} (imrope, vision)")
    for i in range(half):
        sector = i % max(1, sum(s))
        if sector % 3 == 1 and sector < 3 * s[1]:
            cols[i] = 1
        elif sector % 3 == 2 and sector < 3 * s[2]:
            cols[i] = 2
        elif sector % 3 == 0 and sector < 3 * s[0]:
            cols[i] = 0
        else:
            cols[i] = 3
    return cols, resets, rope_dim


def mrope_powers(cols: np.ndarray, resets: np.ndarray) -> np.ndarray:
    """Each pair's power of theta_scale in its angle: pairs since its column last started."""
    start = np.zeros(4, np.int64)
    powers = np.zeros(len(cols), np.int64)
    for i, (c, r) in enumerate(zip(cols, resets, strict=True)):
        if r >= 0:
            start[r] = i
        powers[i] = i - start[c]
    return powers
