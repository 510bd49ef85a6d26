"""Causal depthwise convolutions with carried state: LFM2's gated short convolution
(llama.cpp's shortconv block: B * x, `ggml_ssm_conv` over the state then the new inputs, C *
the result) and Qwen3.5's `ssm_conv` (`ggml_ssm_conv` of the mixed q | k | v, then SiLU), one
loop for both.

State: one `[l_cache - 1, n_embd]` f32 array per sequence (`new_state`), the sequence's last
B * x rows, oldest first; the layer's `[n_seq, l_cache - 1, n_embd]` region is the backend's
persistent memory, as the KV cells are. The kernel walks the batch's rows in order, each
reading and writing only its own sequence's state (a row at position 0 first zeroes it), and
runs every channel's recurrence token by token in one fixed order, so a token's result is
bitwise the same in a prefill chunk of any size, a decode step, or beside other sequences.
Per channel the taps are summed in f32 from the oldest input up, as ggml's `ssm_conv` sums.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.region.parts import share

_CHANNEL_BLOCK = 64  # channels per parallel task: each task walks every row of its channels


def new_state(n_seq: int, l_cache: int, n_embd: int) -> np.ndarray:
    """The zeroed state region of one layer: `[n_seq, l_cache - 1, n_embd]` f32."""
    return np.zeros((n_seq, l_cache - 1, n_embd), np.float32)


@njit(inline="always")
def check_sequences(seq, n_seq):  # pragma: no cover - compiled
    """Refuse a row whose sequence has no state row (before any state is touched)."""
    for t in range(seq.shape[0]):
        if seq[t] < 0 or seq[t] >= n_seq:
            raise ValueError("a row's sequence is outside the state rows")


@njit(inline="always")
def _conv_block(blk, src, taps, state, positions, seq, out, gated):
    """Channels [blk * _CHANNEL_BLOCK, ...) of every row, in row order."""
    nt, d = out.shape
    k = taps.shape[1] - 1
    c0 = blk * _CHANNEL_BLOCK
    c1 = min(c0 + _CHANNEL_BLOCK, d)
    for t in range(nt):
        s = seq[t]
        st = state[s]
        if positions[t] == 0:
            for j in range(k):
                for c in range(c0, c1):
                    st[j, c] = np.float32(0.0)
        for c in range(c0, c1):
            bx = src[t, c]
            if gated:
                bx = bx * src[t, 2 * d + c]
            acc = np.float32(0.0)
            for j in range(k):
                acc += st[j, c] * taps[c, j]
            acc += bx * taps[c, k]
            if gated:
                out[t, c] = src[t, d + c] * acc
            else:
                out[t, c] = acc / (np.float32(1.0) + np.exp(-acc))
            for j in range(k - 1):
                st[j, c] = st[j + 1, c]
            st[k - 1, c] = bx


@njit(cache=True, error_model="numpy", parallel=True)
def _causal_conv(src, taps, state, positions, seq, out, gated):
    """The one convolution loop: gated (LFM2) reads B | C | x and convolves B * x, scaling by
    C; else (`ssm_conv`) it convolves src itself and applies SiLU, as Qwen3.5's layer does."""
    check_sequences(seq, state.shape[0])
    for blk in prange((out.shape[1] + _CHANNEL_BLOCK - 1) // _CHANNEL_BLOCK):
        _conv_block(blk, src, taps, state, positions, seq, out, gated)


@njit(cache=True, error_model="numpy")
def _causal_conv_part(part, n_parts, src, taps, state, positions, seq, out, gated):
    """`_causal_conv`'s channel blocks for part `part` of `n_parts` (a region's thread)."""
    check_sequences(seq, state.shape[0])
    n = (out.shape[1] + _CHANNEL_BLOCK - 1) // _CHANNEL_BLOCK
    for blk in range(*share(part, n_parts, n)):
        _conv_block(blk, src, taps, state, positions, seq, out, gated)

def short_conv(bcx: np.ndarray, taps: np.ndarray, state: np.ndarray, positions: np.ndarray,
               seq: np.ndarray, out: np.ndarray) -> None:
    """out[t] = C_t * conv(state of seq[t], B_t * x_t) for bcx [nt, 3 d] = B | C | x, taps
    [d, l_cache], state [n_seq, l_cache - 1, d] (updated in place), out [nt, d]."""
    bind_short_conv(bcx, taps, state, positions, seq, out)()


def bind_short_conv(bcx: np.ndarray, taps: np.ndarray, state: np.ndarray,
                    positions: np.ndarray, seq: np.ndarray,
                    out: np.ndarray) -> Callable[[], None]:
    """`short_conv` over fixed arrays, shapes checked once; the kernel checks that every row's
    sequence has a state row."""
    nt, d = out.shape
    _, k, d_state = state.shape
    if bcx.shape != (nt, 3 * d) or taps.shape != (d, k + 1) or d_state != d or k < 1:
        raise ValueError(f"short conv of {bcx.shape} with taps {taps.shape} and state "
                         f"{state.shape} into {out.shape}")
    _check_rows(positions, seq, nt, (bcx, taps, state, out))
    return partial(_causal_conv, bcx, taps, state, positions, seq, out, True)


def ssm_conv(x: np.ndarray, taps: np.ndarray, state: np.ndarray, positions: np.ndarray,
             seq: np.ndarray, out: np.ndarray) -> None:
    """out[t] = silu(conv(state of seq[t], x_t)) for x [nt, d], taps [d, d_conv], state
    [n_seq, d_conv - 1, d] (updated in place), out [nt, d]."""
    bind_ssm_conv(x, taps, state, positions, seq, out)()


def bind_ssm_conv(x: np.ndarray, taps: np.ndarray, state: np.ndarray, positions: np.ndarray,
                  seq: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    """`ssm_conv` over fixed arrays, checked as `bind_short_conv`."""
    nt, d = out.shape
    _, k, d_state = state.shape
    if x.shape != (nt, d) or taps.shape != (d, k + 1) or d_state != d or k < 1:
        raise ValueError(f"ssm conv of {x.shape} with taps {taps.shape} and state "
                         f"{state.shape} into {out.shape}")
    _check_rows(positions, seq, nt, (x, taps, state, out))
    return partial(_causal_conv, x, taps, state, positions, seq, out, False)


def _check_rows(positions: np.ndarray, seq: np.ndarray, nt: int,
                arrays: tuple[np.ndarray, ...]) -> None:
    if positions.shape != (nt,) or seq.shape != (nt,):
        raise ValueError("causal conv: positions and sequences must give each row one")
    for a in arrays:
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("causal conv runs on contiguous f32 arrays")
