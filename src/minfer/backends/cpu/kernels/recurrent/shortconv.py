"""LFM2's gated causal short convolution with carried state (llama.cpp's shortconv block:
B * x, `ggml_ssm_conv` over the state then the new inputs, C * the result).

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

_CHANNEL_BLOCK = 64  # channels per parallel task: each task walks every row of its channels


def new_state(n_seq: int, l_cache: int, n_embd: int) -> np.ndarray:
    """The zeroed state region of one layer: `[n_seq, l_cache - 1, n_embd]` f32."""
    return np.zeros((n_seq, l_cache - 1, n_embd), np.float32)


@njit(cache=True, error_model="numpy", parallel=True)
def _short_conv(bcx, taps, state, positions, seq, out):
    nt, d = out.shape
    k = taps.shape[1] - 1
    n_blocks = (d + _CHANNEL_BLOCK - 1) // _CHANNEL_BLOCK
    for blk in prange(n_blocks):
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
                bx = bcx[t, c] * bcx[t, 2 * d + c]
                acc = np.float32(0.0)
                for j in range(k):
                    acc += st[j, c] * taps[c, j]
                acc += bx * taps[c, k]
                out[t, c] = bcx[t, d + c] * acc
                for j in range(k - 1):
                    st[j, c] = st[j + 1, c]
                st[k - 1, c] = bx


def short_conv(bcx: np.ndarray, taps: np.ndarray, state: np.ndarray, positions: np.ndarray,
               seq: np.ndarray, out: np.ndarray) -> None:
    """out[t] = C_t * conv(state of seq[t], B_t * x_t) for bcx [nt, 3 d] = B | C | x, taps
    [d, l_cache], state [n_seq, l_cache - 1, d] (updated in place), out [nt, d]."""
    bind_short_conv(bcx, taps, state, positions, seq, out)()


def bind_short_conv(bcx: np.ndarray, taps: np.ndarray, state: np.ndarray,
                    positions: np.ndarray, seq: np.ndarray,
                    out: np.ndarray) -> Callable[[], None]:
    """`short_conv` over fixed arrays, shapes checked once; each call checks that every row's
    sequence has a state row."""
    nt, d = out.shape
    n_seq, k, d_state = state.shape
    if bcx.shape != (nt, 3 * d) or taps.shape != (d, k + 1) or d_state != d or k < 1:
        raise ValueError(f"short conv of {bcx.shape} with taps {taps.shape} and state "
                         f"{state.shape} into {out.shape}")
    if positions.shape != (nt,) or seq.shape != (nt,):
        raise ValueError("short conv: positions and sequences must give each row one")
    for a in (bcx, taps, state, out):
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("short conv runs on contiguous f32 arrays")
    run = partial(_short_conv, bcx, taps, state, positions, seq, out)

    def call() -> None:
        if int(seq.min()) < 0 or int(seq.max()) >= n_seq:
            raise ValueError(f"a row's sequence is outside the {n_seq} state rows")
        run()

    return call
