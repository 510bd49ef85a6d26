"""Weight layouts for the integer dots, made once per weight on first use (`matmul.repack_weight`).

Each is an exact rearrangement of the weight's bytes (same length, nothing rounded) into the
order the VNNI dots consume, so that they load codes instead of unpacking and shuffling them for
every call and every token pass:

- Q4_0 / Q5_0 / Q8_0 (`interleave_block32`): 16 rows at a time, block column by block column,
  each column's 16 blocks as one packed group whose int32 lane i holds 4 codes of row i (see
  `simd_rows._group`).
- Q4_K (`repack_q4_k`): per row, groups of 2 super-blocks (16 sub-blocks of 32), then one if a
  single is left, lane i holding 4 codes of sub-block i; headers kept (see
  `simd_kp._q4k_group`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

U = np.uint64


def _repack_layout(size: int) -> tuple[int, bool]:
    """(qs offset in a block, whether it has a qh word) of the repackable block types."""
    if size == 18:
        return 2, False  # Q4_0
    if size == 22:
        return 6, True  # Q5_0
    if size == 34:
        return 2, False  # Q8_0: whole bytes
    raise ValueError(f"no repacked layout for {size}-byte blocks")


# The group copy is called, not inlined (inlined, it made the first run compile the repacking
# loop in 8 s instead of 3.6 s, for no measurable repacking speed).
@njit
def _repack_group(src, dst, o, g, size, qs_off, has_qh):
    """g consecutive blocks of src from byte o into the packed group at byte o of dst."""
    n = 4 * g
    if size == 34:  # Q8_0: scales, then the codes transposed as they are, ^ 0x80
        x = np.uint8(0x80)
        for i in range(g):
            bo = o + i * size
            dst[o + 2 * i] = src[bo]
            dst[o + 2 * i + 1] = src[bo + 1]
            for j in range(8):
                d, s = o + 2 * g + n * j + 4 * i, bo + qs_off + 4 * j
                dst[d], dst[d + 1] = src[s] ^ x, src[s + 1] ^ x
                dst[d + 2], dst[d + 3] = src[s + 2] ^ x, src[s + 3] ^ x
        return
    cbase = 2 * g + (n if has_qh else 0)
    for i in range(g):
        bo = o + i * size
        dst[o + 2 * i] = src[bo]
        dst[o + 2 * i + 1] = src[bo + 1]
        for j in range(4):
            d, s = o + cbase + n * j + 4 * i, bo + qs_off + 4 * j
            dst[d], dst[d + 1], dst[d + 2], dst[d + 3] = src[s], src[s + 1], src[s + 2], src[s + 3]
    if has_qh:  # bit 4j+c of block i's qh goes to bit 4i+c of word j: one pass over the blocks
        m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = U(0)
        f = U(15)
        for i in range(g):
            bo = o + i * size
            q = (U(src[bo + 2]) | (U(src[bo + 3]) << U(8))
                 | (U(src[bo + 4]) << U(16)) | (U(src[bo + 5]) << U(24)))
            sh = U(4 * i)
            m0 |= (q & f) << sh
            m1 |= ((q >> U(4)) & f) << sh
            m2 |= ((q >> U(8)) & f) << sh
            m3 |= ((q >> U(12)) & f) << sh
            m4 |= ((q >> U(16)) & f) << sh
            m5 |= ((q >> U(20)) & f) << sh
            m6 |= ((q >> U(24)) & f) << sh
            m7 |= ((q >> U(28)) & f) << sh
        h = g // 2  # bytes per word
        for k in range(h):
            s8, b = U(8 * k), o + 2 * g + k
            dst[b] = np.uint8((m0 >> s8) & U(255))
            dst[b + h] = np.uint8((m1 >> s8) & U(255))
            dst[b + 2 * h] = np.uint8((m2 >> s8) & U(255))
            dst[b + 3 * h] = np.uint8((m3 >> s8) & U(255))
            dst[b + 4 * h] = np.uint8((m4 >> s8) & U(255))
            dst[b + 5 * h] = np.uint8((m5 >> s8) & U(255))
            dst[b + 6 * h] = np.uint8((m6 >> s8) & U(255))
            dst[b + 7 * h] = np.uint8((m7 >> s8) & U(255))


@njit(inline="always")
def _q4k_code(src, sb0, i, q):
    """Code q (0..31) of sub-block i (0..15) of the group whose first super-block starts at
    byte sb0 of a plain Q4_K row."""
    base = sb0 + (i // 8) * 144
    s = i % 8
    byte = src[base + 16 + 32 * (s // 2) + q]
    return (byte >> np.uint8(4)) if s % 2 else (byte & np.uint8(15))


@njit
def _repack_q4k_group(src, dst, o, count):
    n_sb = count // 8
    for k in range(16 * n_sb):  # the super-blocks' headers: d, dmin, scales and mins
        dst[o + k] = src[o + 144 * (k // 16) + k % 16]
    for j in range(4):
        for i in range(count):
            for c in range(4):
                lo = _q4k_code(src, o, i, 4 * j + c)
                hi = _q4k_code(src, o, i, 16 + 4 * j + c)
                dst[o + 16 * n_sb + 4 * count * j + 4 * i + c] = lo | (hi << np.uint8(4))


@njit(parallel=True, cache=True, nogil=True)
def _repack_q4k_rows(w, out):
    n_out, nbytes = w.shape
    nsb = nbytes // 144
    for r in prange(n_out):
        src, dst = w[r], out[r]
        for p in range(nsb // 2):
            _repack_q4k_group(src, dst, p * 288, 16)
        if nsb % 2:
            _repack_q4k_group(src, dst, (nsb - 1) * 144, 8)


def repack_q4_k(w: np.ndarray, out: np.ndarray) -> None:
    """A Q4_K weight (uint8 [n_out, row bytes]) in the repacked layout `simd_kp` reads,
    written into `out` (w's shape)."""
    _repack_q4k_rows(w, out)


@njit(parallel=True, cache=True, nogil=True)
def _interleave_rows(w, out, size, qs_off, has_qh):
    n_out, nbytes = w.shape
    nb = nbytes // size
    flat = out.reshape(-1)
    for g in prange(n_out // 16):
        src = np.empty(16 * size, np.uint8)
        dst = np.empty(16 * size, np.uint8)
        for b in range(nb):
            for i in range(16):
                for k in range(size):
                    src[i * size + k] = w[16 * g + i, b * size + k]
            _repack_group(src, dst, 0, 16, size, qs_off, has_qh)
            o = g * 16 * nbytes + b * 16 * size
            flat[o:o + 16 * size] = dst


def interleave_block32(w: np.ndarray, size: int, out: np.ndarray) -> None:
    """A Q4_0 / Q5_0 / Q8_0 weight (uint8 [n_out, row bytes], n_out a multiple of 16) with
    each group of 16 rows rewritten block column by block column: block b of the 16 rows as
    one packed group (`simd_rows._group`), the groups of a row
    group in block order. Same size, exact; written into `out` (w's shape). Read by
    `simd_rows`."""
    qs_off, has_qh = _repack_layout(size)
    _interleave_rows(w, out, size, qs_off, has_qh)
