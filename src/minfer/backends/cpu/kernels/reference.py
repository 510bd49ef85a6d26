"""Slow, obviously-correct numpy references the compiled kernels are tested against.

Independent of the kernels' code: activation quantizers written from ggml's definitions, the
exact (float64) value of the integer dot products ggml computes, and plain float64 RoPE,
attention and RMSNorm. Also random weight blocks for the K-quants and the i-quants, which
`gguf.quants` cannot quantize.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from minfer.backends.cpu.kernels.quant.types import BLOCK_LAYOUT, KQUANT_TYPES, QType
from minfer.gguf.rope_scaling import NO_YARN, YarnRope, mrope_pairs, mrope_powers, pair_scales


def ref_quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qs int8 [nt, n], d f32 [nt, n/32] (f16-rounded), s f32 [nt, n/32]) as ggml's AVX path."""
    nt, n = x.shape
    xb = x.astype(np.float32).reshape(nt, n // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    s = (d * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float16)
    return q.reshape(nt, n), d.astype(np.float16).astype(np.float32), s.astype(np.float32)


def ref_quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qs int8 [nt, n], d f32 [nt, n/256], bsums int16 [nt, n/16]) as quantize_row_q8_K_ref."""
    nt, n = x.shape
    xb = x.astype(np.float32).reshape(nt, n // 256, 256)
    first = np.abs(xb).argmax(axis=-1)  # first index of the largest magnitude
    vmax = np.take_along_axis(xb, first[..., None], axis=-1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(vmax != 0, np.float32(-127.0) / vmax, np.float32(0.0)).astype(np.float32)
    q = np.minimum(127, np.rint(xb * iscale[..., None])).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(iscale != 0, np.float32(1.0) / iscale, np.float32(0.0)).astype(np.float32)
    bsums = q.reshape(nt, n // 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    return q.reshape(nt, n), d, bsums


def ref_matmul_quant(w: np.ndarray, qtype: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The exact value (float64) of ggml's integer-path `x @ W.T`, and the sum of |terms| (a
    scale for tolerances). The activation is quantized as ggml does for this weight type."""
    qt = QType(qtype)
    gt = GGMLQuantizationType(int(qt))
    size = BLOCK_LAYOUT[qt][1]
    wq = gguf_dequantize(w, gt).astype(np.float64)
    if qt in KQUANT_TYPES:
        qs, d, _ = ref_quantize_q8_k(x)
        xd = (qs.astype(np.float64).reshape(x.shape[0], -1, 256) * d[..., None]).reshape(x.shape)
        return xd @ wq.T, np.abs(xd) @ np.abs(wq).T
    qs, d, s = ref_quantize_q8_0(x)
    xd = (qs.astype(np.float64).reshape(x.shape[0], -1, 32) * d[..., None]).reshape(x.shape)
    if qt not in (QType.Q4_1, QType.Q5_1):
        return xd @ wq.T, np.abs(xd) @ np.abs(wq).T
    # m_w * s_x replaces m_w * d_x * sum(q_x): split the codes part from the mins part
    blocks = w.reshape(w.shape[0], -1, size).copy()
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)  # [n_out, nb]
    blocks[:, :, 2:4] = 0
    wcodes = gguf_dequantize(blocks.reshape(w.shape), gt).astype(np.float64)
    ref = xd @ wcodes.T + s.astype(np.float64) @ m.T
    scale = np.abs(xd) @ np.abs(wcodes).T + np.abs(s) @ np.abs(m).T
    return ref, scale


def random_kquant_blocks(qtype: int, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q2_K … Q6_K weight bytes `[n_out, row_bytes]` with moderate f16 scales."""
    qt = QType(qtype)
    size = BLOCK_LAYOUT[qt][1]
    nb = n_in // 256
    blocks = rng.integers(0, 256, (n_out, nb, size), dtype=np.uint8)
    scales = (rng.random((n_out, nb, 2)) * np.array([0.01, 0.005])).astype(np.float16)
    raw = scales.view(np.uint8).reshape(n_out, nb, 4)
    if qt is QType.Q6_K:
        blocks[:, :, 208:210] = raw[:, :, 0:2]
    elif qt is QType.Q3_K:
        blocks[:, :, 108:110] = raw[:, :, 0:2]
    elif qt is QType.Q2_K:
        blocks[:, :, 80:84] = raw
    else:
        blocks[:, :, 0:4] = raw
    return blocks.reshape(n_out, nb * size)


IQUANT_TYPES = (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S,
                QType.IQ1_S, QType.IQ1_M, QType.IQ4_XS, QType.TQ1_0, QType.TQ2_0, QType.MXFP4)


def _set_scale(blocks: np.ndarray, qt: QType, d: np.ndarray) -> None:
    """Write each block's scale field: f16 d (IQ1_M: split over its scales' top nibbles),
    MXFP4: the E8M0 exponent e with 2^(e - 128) nearest d."""
    if qt is QType.MXFP4:
        e = np.clip(np.rint(np.log2(np.maximum(d, 2.0 ** -120))) + 128, 1, 254)
        blocks[..., 0] = e.astype(np.uint8)
        return
    bits = d.astype(np.float16).view(np.uint16)
    if qt is QType.IQ1_M:
        sc = blocks[..., 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i in range(4):
            sc[..., i] |= ((bits >> np.uint16(4 * i)) & np.uint16(15)) << np.uint16(12)
        blocks[..., 48:56] = sc.view(np.uint8)
        return
    at = {QType.TQ1_0: 52, QType.TQ2_0: 64}.get(qt, 0)
    blocks[..., at:at + 2] = bits[..., None].view(np.uint8)


def random_iquant_blocks(qtype: int, n_out: int, n_in: int, rng: np.random.Generator,
                         rms: float | np.ndarray = 0.05) -> np.ndarray:
    """Random valid blocks `[n_out, row_bytes]` of an i-quant / ternary / MXFP4 type (random
    grid indices, signs and sub-scales), each block's scale set so its values' RMS is about
    `rms` (a number, or one per block `[n_out, n_blocks]`)."""
    qt = QType(qtype)
    block, size = BLOCK_LAYOUT[qt]
    nb = n_in // block
    blocks = rng.integers(0, 256, (n_out, nb, size), dtype=np.uint8)
    _set_scale(blocks, qt, np.ones((n_out, nb)))
    unit = gguf_dequantize(blocks.reshape(n_out, -1), GGMLQuantizationType(int(qt)))
    unit_rms = np.sqrt((unit.reshape(n_out, nb, block).astype(np.float64) ** 2).mean(-1))
    _set_scale(blocks, qt, np.broadcast_to(rms, (n_out, nb)) / np.maximum(unit_rms, 1e-3))
    return blocks.reshape(n_out, nb * size)


def ref_rope_neox(x: np.ndarray, positions: np.ndarray, *, n_head: int, head_dim: int,
                  rope_dim: int, base: float) -> np.ndarray:
    """NEOX RoPE in float64 with the exact theta = pos * base^(-2i/rope_dim)."""
    return ref_rope(x, positions, n_head=n_head, head_dim=head_dim, rope_dim=rope_dim, base=base)


def ref_rope(x: np.ndarray, positions: np.ndarray, *, n_head: int, head_dim: int,
             rope_dim: int, base: float, style: str = "neox", freq_scale: float = 1.0,
             factors: np.ndarray | None = None, yarn: YarnRope = NO_YARN, mrope: str = "",
             sections: tuple[int, ...] = ()) -> np.ndarray:
    """RoPE in float64: theta_i = freq_scale * pos * base^(-2i/rope_dim) / factors[i] (YaRN:
    each pair's blended scale, cos and sin times its mscale); "neox" rotates pairs
    (i, i + rope_dim/2), "norm" adjacent pairs (2i, 2i + 1). With `mrope`: positions [4 nt]
    section-major, pair i's column and power of base^(-2/theta_dim) as `mrope_pairs` says."""
    nt = x.shape[0]
    half = rope_dim // 2
    if mrope:
        cols, resets, theta_dim = mrope_pairs(mrope, sections, rope_dim)
        inv = float(base) ** (-2.0 * mrope_powers(cols, resets) / theta_dim)
        pos = positions.astype(np.float64).reshape(4, nt).T[:, cols]
    else:
        inv = float(base) ** (-2.0 * np.arange(half) / rope_dim)
        pos = positions.astype(np.float64)[:, None]
    inv = inv * pair_scales(half, freq_scale, yarn)
    if factors is not None:
        inv = inv / factors.astype(np.float64)
    theta = pos * inv[None, :]  # [nt, half]
    cos = yarn.mscale * np.cos(theta)[:, None, :]
    sin = yarn.mscale * np.sin(theta)[:, None, :]
    xh = x.astype(np.float64).reshape(nt, n_head, head_dim)
    out = xh.copy()
    if style == "neox":
        x0, x1 = xh[..., :half], xh[..., half:rope_dim]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:rope_dim] = x0 * sin + x1 * cos
    else:
        x0, x1 = xh[..., 0:rope_dim:2], xh[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = x0 * cos - x1 * sin
        out[..., 1:rope_dim:2] = x0 * sin + x1 * cos
    return out.reshape(nt, n_head * head_dim)


def ref_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_start: np.ndarray,
                  kv_end: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int,
                  scale: float, window: int = 0, softcap: float = 0.0,
                  sinks: np.ndarray | None = None) -> np.ndarray:
    """Windowed GQA softmax attention in float64 (caches given as f32/f16 arrays); with a
    sliding `window`, query t reads [max(kv_start, kv_end - window), kv_end); `sinks`: one
    logit per head in each softmax's max and sum, a cell without a value."""
    nt = q.shape[0]
    group = n_head // n_head_kv
    out = np.zeros((nt, n_head * head_dim))
    kf, vf = k.astype(np.float64), v.astype(np.float64)
    for t in range(nt):
        lo, hi = int(kv_start[t]), int(kv_end[t])
        if window:
            lo = max(lo, hi - window)
        for h in range(n_head):
            c = (h // group) * head_dim
            kw, vw = kf[lo:hi, c : c + head_dim], vf[lo:hi, c : c + head_dim]
            s = kw @ q[t, h * head_dim : (h + 1) * head_dim].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if s.size:
                sink = -np.inf if sinks is None else float(sinks[h])
                mx = max(s.max(), sink)
                p = np.exp(s - mx)
                out[t, h * head_dim : (h + 1) * head_dim] = \
                    (p / (p.sum() + np.exp(sink - mx))) @ vw
    return out


def ref_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w per row, float64."""
    xf = x.astype(np.float64)
    return xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + eps) * w.astype(np.float64)
