"""The ops the torch backend runs, as plain functions on tensors (f32 unless said otherwise).

The matmul is where the speed is: bf16 operands into oneDNN (AMX / AVX512-BF16) or cuBLAS. On
the CPU build a bf16 GEMM returns bf16 (`torch.mm(..., out_dtype=torch.float32)` has no CPU
kernel in torch 2.13), so the product is rounded once more before it lands in the f32 buffer.
Measured on the 0.5B model (the greedy.json prompts): an f32 product of the same bf16 operands
lands no closer to the CPU backend (max |logit diff| 0.22-0.45 either way); the operands'
rounding dominates. Everything else (norms, RoPE, attention with its softmax) runs in f32, as
DESIGN §3 asks; torch's fused SDPA beat a hand-written bf16 attention on this CPU.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F

from minfer.gguf.rope_scaling import NO_YARN, YarnRope, mrope_pairs, mrope_powers, pair_scales


def linear_bf16(x_bf16: torch.Tensor, w_bf16: torch.Tensor) -> torch.Tensor:
    """x @ W.T on bf16 operands: [nt, n_in] x [n_out, n_in] -> [nt, n_out] (bf16)."""
    return F.linear(x_bf16, w_bf16)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out = x / sqrt(mean(x^2) + eps) * w over the last axis."""
    scale = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    torch.mul(x * scale, w, out=out)


def head_rms_norm(x: torch.Tensor, w: torch.Tensor, *, n_head: int, head_dim: int, eps: float,
                  out: torch.Tensor) -> None:
    """RMSNorm of every head separately (Qwen3's q/k norm): x is [nt, n_head * head_dim]."""
    heads = x.view(-1, n_head, head_dim)
    rms_norm(heads, w, eps, out.view(-1, n_head, head_dim))


def rope_tables(positions: torch.Tensor, *, base: float, rope_dim: int, freq_scale: float = 1.0,
                factors: torch.Tensor | None = None,
                yarn: YarnRope = NO_YARN, mrope: str = "",
                sections: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of freq_scale * pos * base^(-2i / rope_dim) / factors[i], [nt, rope_dim / 2],
    computed in f64 (with YaRN: each pair's blended scale, cos and sin times its mscale); with
    `mrope`, pair i's position and power of base^(-2 / theta_dim) as `mrope_pairs` lays out."""
    half = rope_dim // 2
    dev = positions.device
    if mrope:
        cols, resets, theta_dim = mrope_pairs(mrope, sections, rope_dim)
        power = torch.from_numpy(mrope_powers(cols, resets)).to(dev, torch.float64)
        inv = base ** (-power * 2 / theta_dim)
        pos = positions.to(torch.float64).view(4, -1).T[:, torch.from_numpy(cols).to(dev).long()]
    else:
        inv = base ** (-torch.arange(half, dtype=torch.float64, device=dev) * 2 / rope_dim)
        pos = positions.to(torch.float64)[:, None]
    inv = inv * torch.from_numpy(pair_scales(half, freq_scale, yarn)).to(inv.device)
    if factors is not None:
        inv = inv / factors.to(torch.float64)
    angles = pos * inv[None, :]
    return (angles.cos() * yarn.mscale).float(), (angles.sin() * yarn.mscale).float()


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, n_head: int,
              head_dim: int, rope_dim: int, out: torch.Tensor) -> None:
    """NEOX rotation: pairs (i, i + rope_dim/2) of each head; dims past rope_dim pass through."""
    half = rope_dim // 2
    heads = x.view(-1, n_head, head_dim)
    dst = out.view(-1, n_head, head_dim)
    a, b = heads[..., :half], heads[..., half:rope_dim]
    c, s = cos[:, None, :], sin[:, None, :]
    ra = a * c - b * s
    rb = a * s + b * c
    dst[..., :half] = ra
    dst[..., half:rope_dim] = rb
    if rope_dim < head_dim:
        dst[..., rope_dim:] = heads[..., rope_dim:]


def rope_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, n_head: int,
              head_dim: int, rope_dim: int, out: torch.Tensor) -> None:
    """Normal-mode rotation (Llama): adjacent pairs (2i, 2i+1); dims past rope_dim pass through."""
    heads = x.view(-1, n_head, head_dim)
    dst = out.view(-1, n_head, head_dim)
    a, b = heads[..., 0:rope_dim:2], heads[..., 1:rope_dim:2]
    c, s = cos[:, None, :], sin[:, None, :]
    ra = a * c - b * s
    rb = a * s + b * c
    dst[..., 0:rope_dim:2] = ra
    dst[..., 1:rope_dim:2] = rb
    if rope_dim < head_dim:
        dst[..., rope_dim:] = heads[..., rope_dim:]


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             cells: torch.Tensor) -> None:
    """Rows k[t], v[t] into cache cell cells[t] (converted to the cache's dtype)."""
    index = cells.long()
    k_cache.index_copy_(0, index, k.to(k_cache.dtype))
    v_cache.index_copy_(0, index, v.to(v_cache.dtype))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              kv_start: torch.Tensor, kv_end: torch.Tensor, *, n_head: int, n_head_kv: int,
              head_dim: int, scale: float, out: torch.Tensor, window: int = 0) -> None:
    """Query t attends to cache cells [kv_start[t], kv_end[t]); grouped-query heads. A sliding
    `window` > 0 narrows that to [max(kv_start, kv_end - window), kv_end).

    Consecutive queries with the same window start (one sequence of a batch) are one run, and
    each run reads only the cells it can see, so sequences far apart in the cache never make
    a [tokens, whole-cache] mask.
    """
    starts = kv_start.cpu().numpy()  # runs are cut by sequence, before the window narrows them
    cuts = [0, *(np.flatnonzero(np.diff(starts)) + 1).tolist(), len(starts)]
    if window:
        kv_start = torch.maximum(kv_start, kv_end - window)
    for a, b in itertools.pairwise(cuts):
        _attend(q[a:b], k_cache, v_cache, kv_start[a:b], kv_end[a:b], n_head=n_head,
                n_head_kv=n_head_kv, head_dim=head_dim, scale=scale, out=out[a:b])


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            kv_start: torch.Tensor, kv_end: torch.Tensor, *, n_head: int, n_head_kv: int,
            head_dim: int, scale: float, out: torch.Tensor) -> None:
    lo, hi = int(kv_start.min()), int(kv_end.max())
    nt, span, group = q.shape[0], hi - lo, n_head // n_head_kv
    keys = k_cache[lo:hi].view(span, n_head_kv, head_dim).float().transpose(0, 1)
    vals = v_cache[lo:hi].view(span, n_head_kv, head_dim).float().transpose(0, 1)
    if group > 1:  # [n_head, span, head_dim]
        keys = keys.repeat_interleave(group, dim=0)
        vals = vals.repeat_interleave(group, dim=0)
    cell = torch.arange(lo, hi, device=q.device, dtype=torch.int32)
    mask = (cell[None, :] >= kv_start[:, None]) & (cell[None, :] < kv_end[:, None])  # [nt, span]
    queries = q.view(nt, n_head, head_dim).transpose(0, 1)  # [n_head, nt, head_dim]
    # 4-D operands (a batch of one) take torch's fused CPU attention kernel; 3-D ones do not.
    ctx = F.scaled_dot_product_attention(queries[None], keys[None], vals[None],
                                         attn_mask=mask[None, None], scale=scale)
    out.view(nt, n_head, head_dim).copy_(ctx[0].transpose(0, 1))
