"""Integer dot kernels for the 32-value block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4.

Each kernel computes `out[t, r] = dot(W[r], x[t])` with the activation already quantized to Q8
blocks (`quant.activations.Q8Blocks`), the way ggml's `ggml_vec_dot_q*_q8_*` do: per block an exact
int32 dot
of the weight codes with the activation quants, scaled by `d_w * d_x` (f32) and summed in f32;
Q4_1/Q5_1 add `sum(m_w * s_x)`. Summation order differs from ggml's SIMD lanes, so results agree
to f32 rounding, not bit for bit.

The per-row work is one `simd.rowdot_*` intrinsic (the whole row loop in explicit vector IR:
VNNI lane sums, per-block scales folded into register accumulators, software prefetch, one
horizontal sum per row). Here rows are split across threads in contiguous chunks of `_CHUNK`
(numba's static schedule hands each thread one contiguous run of chunks). Tokens go through a
chunk MAX_TOKENS (8) at a time (`rowdot8_*`: each weight block unpacked once, dotted against
eight activation rows; rows of more than ROWS8_MAX_IN inputs go four at a time), then four,
two, one; the intrinsics emit the same per-token float
operations, so out[t] is bitwise independent of the batch (batch-invariant serving). Per call
the activation-only parts are precomputed: `lane_corr` / `block_corr` (the code offset times
activation sums, where the dots start) and `block_transpose` (the multi-row layout). Compiled
without fastmath on purpose: numba would otherwise flag the intrinsics' float ops as
reassociable. The drivers (`mv_q4_0`, ..., and `mv_q4_0p`, ... for the weights interleaved
16 rows at a time, `simd.interleaved`) are generated per type
from one template by `linear.row_drivers` (numba caches a compiled function only when its callees
are
module globals, so a closure factory would recompile every run); here, the per-call activation
preparation they share.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from minfer.backends.cpu.kernels.simd.blocks import BLOCKS_PER_CALL, DOT4, HAS_VNNI512, TAIL_GROUPS
from minfer.backends.cpu.kernels.simd.llvm import f16_to_f32

_CHUNK = 16  # rows per work item
U = np.uint64


@njit(inline="always")
def even_groups(groups, ng):
    """Whether every expert group of a stacked-expert driver (`row_drivers`' `_x` forms) has
    as many rows (a decode step's one row each). Then its jobs run expert by expert, each
    thread streaming whole experts' rows in order (2x the read rate of interleaving the
    experts, measured); otherwise (a prefill's uneven groups) chunk by chunk across the
    experts, so the threads share every expert's work evenly."""
    for g in range(1, ng):  # noqa: SIM110 (a loop numba compiles; no generator)
        if groups[g, 2] - groups[g, 1] != groups[0, 2] - groups[0, 1]:
            return False
    return True


@njit(inline="always")
def load_f16(buf, off):
    """The f16 at byte offset `off` of a uint8 array, as f32."""
    return f16_to_f32(np.uint16(buf[off]) | np.uint16(np.uint16(buf[off + 1]) << np.uint16(8)))


@njit(cache=True)
def lane_corr(xq, offset):
    """int32 [nt, n/4]: -offset * (sums of 4 consecutive activation quants), the lanes the VNNI
    row dots start from so that one vpdpbusd gives (code - offset) . x (0 columns when there is
    no code offset or no VNNI). It depends on the activation only: computed once per call."""
    nt, n = xq.shape
    if offset == 0 or not DOT4:
        return np.zeros((nt, 0), np.int32)
    xc = np.empty((nt, n // 4), np.int32)
    for t in range(nt):
        for i in range(n // 4):
            s = (np.int32(xq[t, 4 * i]) + np.int32(xq[t, 4 * i + 1]) + np.int32(xq[t, 4 * i + 2])
                 + np.int32(xq[t, 4 * i + 3]))
            xc[t, i] = -offset * s
    return xc


@njit(cache=True)
def block_corr(xq, offset, packed=False):
    """int32 [nt, n/32]: -offset * (sum of each block's activation quants), where the
    transposed multi-row dots and the interleaved rows start (0 columns when unused: no
    offset, or plain weights with one row or without AVX512-VNNI)."""
    nt, n = xq.shape
    if offset == 0 or not (packed or (HAS_VNNI512 and nt >= 2)):
        return np.zeros((nt, 0), np.int32)
    cb = np.empty((nt, n // 32), np.int32)
    for t in range(nt):
        for b in range(n // 32):
            s = np.int32(0)
            for i in range(32):
                s += np.int32(xq[t, 32 * b + i])
            cb[t, b] = -offset * s
    return cb


@njit(cache=True)
def block_transpose(xq):
    """The activation for the transposed multi-row dots (`simd.blocks._emit_blocks`): in each group
    of G blocks (groups of BLOCKS_PER_CALL = 16 from the start, then each of
    `simd.blocks.TAIL_GROUPS` where that many are left), dword j of
    block i moves to dword j * G + i of the group; the rest stays as it is. One pass per call
    (0 columns for one row of plain weights or without AVX512-VNNI)."""
    nt, n = xq.shape
    if not HAS_VNNI512 or nt < 2:
        return np.zeros((nt, 0), np.int8)
    xt = xq.copy()
    nb = n // 32
    for t in range(nt):
        b0 = 0
        while nb - b0 >= BLOCKS_PER_CALL:
            _transpose_group(xq, xt, t, b0, BLOCKS_PER_CALL)
            b0 += BLOCKS_PER_CALL
        for g in TAIL_GROUPS:
            if nb - b0 >= g:
                _transpose_group(xq, xt, t, b0, g)
                b0 += g
    return xt


@njit(inline="always")
def _transpose_group(xq, xt, t, b0, g):
    """Blocks b0 .. b0 + g of row t: dword j of block i to dword j * g + i of the group."""
    for i in range(g):
        for j in range(8):
            for c in range(4):
                xt[t, 32 * b0 + 4 * (j * g + i) + c] = xq[t, 32 * (b0 + i) + 4 * j + c]
