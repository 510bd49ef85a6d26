"""Weight layouts for the integer dots, made once per weight on first use (`matmul.repack_weight`).

Each is an exact rearrangement of a row's bytes (same length, nothing rounded) into the order
the VNNI dots consume: the codes of a group of blocks transposed so that int32 lane i of a
vector holds 4 codes of block (sub-block) i, which is the order the activation is transposed to
once per call. The dots then load codes instead of unpacking and shuffling them for every call
and every token pass.

- Q4_0 / Q5_0 / Q8_0 (`repack_block32`): groups of 16 blocks, then `simd.TAIL_GROUPS` (12,
  8, 4) where that many are left; the last < 4 blocks stay as they are (see
  `simd._packed_group`). A 896-wide row (28 blocks) is 16 + 12: two groups of 8 vpdpbusd per
  token, where 16 + 8 + 4 took three and its last 4 plain blocks had taken as long as the 16.
- Q4_K (`repack_q4_k`): groups of 2 super-blocks (16 sub-blocks of 32), then one if a single
  is left; headers kept (see `simd_kp._q4k_group`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import PACK_GROUP, TAIL_GROUPS

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


# The group copies are called, not inlined: inlined at their two call sites each they made the
# first run compile _repack_rows in 8 s (3.6 s now) for no measurable repacking speed.
@njit
def _repack_group(src, dst, o, g, size, qs_off, has_qh):
    """Blocks o/size .. + g of one row (g = 16, 12, 8 or 4) into the packed group at byte o."""
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


@njit(parallel=True, cache=True, nogil=True)
def _repack_rows(w, out, size, qs_off, has_qh):
    n_out, nbytes = w.shape
    nb = nbytes // size
    ng = nb // PACK_GROUP
    done = ng * PACK_GROUP * size
    for r in prange(n_out):
        src, dst = w[r], out[r]
        for g in range(ng):
            _repack_group(src, dst, g * PACK_GROUP * size, PACK_GROUP, size, qs_off, has_qh)
        rest = done
        for g in TAIL_GROUPS:  # then each where that many blocks are left
            if (nbytes - rest) // size >= g:
                _repack_group(src, dst, rest, g, size, qs_off, has_qh)
                rest += g * size
        for k in range(rest, nbytes):
            dst[k] = src[k]


def repack_block32(w: np.ndarray, size: int, out: np.ndarray) -> None:
    """A Q4_0 / Q5_0 weight (uint8 [n_out, row bytes], `size`-byte blocks) with each row's
    groups of PACK_GROUP blocks, then the TAIL_GROUPS where that many are left (the groups
    `block_transpose` makes), rearranged for the transposed dots
    (`simd._packed_group`); the last < 4 blocks stay as they are. Same size, a permutation of
    the bytes (plus Q5_0's 5th bits regrouped): exact, written into `out` (w's shape). Read it with
    `mv_q4_0p` / `mv_q5_0p` / `mv_q8_0p`."""
    qs_off, has_qh = _repack_layout(size)
    _repack_rows(w, out, size, qs_off, has_qh)


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
