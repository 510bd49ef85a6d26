"""Weight layouts for the integer dots, made once per weight on first use
(`linear.dispatch.repack_weight`).

Each is an exact rearrangement of the weight's codes and scales (same length, nothing rounded)
into the order the VNNI dots consume, so that they load codes instead of unpacking and shuffling
them for every call and every token pass:

- Q4_0 / Q5_0 / Q8_0 / IQ4_NL / MXFP4 (`interleave_block32`): 16 rows at a time, block column
  by block column, each column's 16 blocks as one packed group whose int32 lane i holds 4
  codes of row i (see `simd.interleaved._group`).
- Q4_K / Q6_K / Q7_K / IQ4_XS / Q2_K / TQ2_0 (`interleave_kquant`): 16 rows at a time,
  super-block column by
  column, the rows' scales side by side and each sub-block's codes as vectors whose int32 lane i
  holds 4 codes of row i (see `simd.interleaved_k`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

U = np.uint64


def _repack_layout(size: int) -> tuple[int, bool]:
    """(qs offset in a block, whether it has a qh word) of the repackable block types (the
    scale takes the bytes before the qh word or the codes)."""
    if size == 18:
        return 2, False  # Q4_0, IQ4_NL
    if size == 17:
        return 1, False  # MXFP4: an E8M0 byte
    if size == 22:
        return 6, True  # Q5_0
    if size == 34:
        return 2, False  # Q8_0: whole bytes
    raise ValueError(f"no repacked layout for {size}-byte blocks")


# The group copy is called, not inlined (inlined, it made the first run compile the repacking
# loop in 8 s instead of 3.6 s, for no measurable repacking speed).
@njit
def _repack_group(src, dst, o, g, size, qs_off, has_qh, sliced):
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
    sb = 2 if has_qh else qs_off  # scale bytes
    cbase = sb * g + (n if has_qh else 0)
    for i in range(g):
        bo = o + i * size
        for k in range(sb):
            dst[o + sb * i + k] = src[bo + k]
        for j in range(4):
            d, s = o + cbase + n * j + 4 * i, bo + qs_off + 4 * j
            dst[d], dst[d + 1], dst[d + 2], dst[d + 3] = src[s], src[s + 1], src[s + 2], src[s + 3]
    if has_qh and sliced:  # bit 4j+c of block i's qh goes to bit j of byte 4i+c
        for i in range(g):
            bo = o + i * size
            q = (U(src[bo + 2]) | (U(src[bo + 3]) << U(8))
                 | (U(src[bo + 4]) << U(16)) | (U(src[bo + 5]) << U(24)))
            for c in range(4):
                byte = U(0)
                for j in range(8):
                    byte |= ((q >> U(4 * j + c)) & U(1)) << U(j)
                dst[o + 2 * g + 4 * i + c] = np.uint8(byte)
    elif has_qh:  # bit 4j+c of block i's qh goes to bit 4i+c of word j: one pass over the blocks
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
def _interleave_rows(w, out, size, qs_off, has_qh, sliced):
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
            _repack_group(src, dst, 0, 16, size, qs_off, has_qh, sliced)
            o = g * 16 * nbytes + b * 16 * size
            flat[o:o + 16 * size] = dst


def interleave_block32(w: np.ndarray, size: int, out: np.ndarray, *, qh_sliced: bool) -> None:
    """A Q4_0 / Q5_0 / Q8_0 / IQ4_NL (Q4_0's layout) / MXFP4 (one scale byte) weight (uint8
    [n_out, row bytes], n_out a multiple of 16) with each group of 16 rows rewritten block
    column by block column: block b of the 16 rows as one packed group
    (`simd.interleaved._group`), the groups of a row group in block order. Same size, exact;
    written into `out` (w's shape). Read by
    `simd.interleaved`. Q5_0's 5th bits as eight 64-bit masks (mask j: the bits of the rows'
    codes 4j..4j+3), or `qh_sliced`, as 64 bytes (byte 4i + c: bit j of it that of row i's
    code 4j + c)."""
    qs_off, has_qh = _repack_layout(size)
    _interleave_rows(w, out, size, qs_off, has_qh, qh_sliced)


# Interleaved K-quant super-blocks (`simd.interleaved_k`). Per group of 16 rows and super-block
# column,
# a header of the rows' fields side by side, then per sub-block the 16 rows' codes as vectors whose
# dword i is row i's (see `simd.interleaved_k` for the byte order).
KQUANT_SIZES = {"q4_k": 144, "q6_k": 210, "q7_k": 276, "iq4_xs": 136, "q2_k": 84, "tq2_0": 66}


@njit(inline="always")
def _k_codes(row, b, q6, codes):
    """The 256 codes of the super-block at byte b of a plain Q4_K (4-bit) / Q6_K (6-bit,
    offset 32 kept) row, in value order, into codes."""
    if q6:
        for v in range(256):
            n, r = v // 128, v % 128
            qr, lo = r // 32, r % 32
            low = (row[b + 64 * n + lo + 32 * (qr % 2)] >> np.uint8(4 * (qr // 2))) & np.uint8(15)
            high = (row[b + 128 + 32 * n + lo] >> np.uint8(2 * qr)) & np.uint8(3)
            codes[v] = low | (high << np.uint8(4))
    else:
        for v in range(256):
            p, r = v // 64, v % 64
            byte = row[b + 16 + 32 * p + r % 32]
            codes[v] = (byte >> np.uint8(4)) if r >= 32 else (byte & np.uint8(15))


@njit(inline="always")
def _two_bit_group(row, b, size, flat, o, i):
    """Row i's Q2_K (84-byte: scales[16] | qs[64] | d | dmin) or TQ2_0 (66-byte: qs[64] | d)
    super-block at byte b into the group at o: d of the 16 rows, (Q2_K) their dmin, scale byte k
    of the 16 rows for k = 0..15, then per 16-value sub-block k one 64-byte vector whose byte
    4i + c holds row i's codes c, 4 + c, 8 + c, 12 + c at bits 0, 2, 4, 6."""
    q2 = size == 84
    qs, d_at, codes_at = (16, 80, 320) if q2 else (0, 64, 32)
    flat[o + 2 * i], flat[o + 2 * i + 1] = row[b + d_at], row[b + d_at + 1]
    if q2:
        flat[o + 32 + 2 * i], flat[o + 33 + 2 * i] = row[b + 82], row[b + 83]
        for k in range(16):
            flat[o + 64 + 16 * k + i] = row[b + k]
    for k in range(16):
        for c in range(4):
            byte = np.uint8(0)
            for m in range(4):
                v = 16 * k + 4 * m + c  # value 128 h + 32 s + l: (qs[32 h + l] >> 2 s) & 3
                code = (row[b + qs + 32 * (v // 128) + v % 32] >> np.uint8(2 * (v % 128 // 32))
                        ) & np.uint8(3)
                byte |= code << np.uint8(2 * m)
            flat[o + codes_at + 64 * k + 4 * i + c] = byte


@njit(parallel=True, cache=True, nogil=True)
def _interleave_super(w, out, size, q6):
    n_out, nbytes = w.shape
    flat = out.reshape(-1)
    for g in prange(n_out // 16):
        codes = np.empty(256, np.uint8)
        for s in range(nbytes // size):
            o = g * 16 * nbytes + s * 16 * size
            for i in range(16):
                row = w[16 * g + i]
                b = s * size
                if size == 276:  # Q7_K: d (f32) | scale k of the 16 rows | sub-blocks
                    for c in range(4):
                        flat[o + 4 * i + c] = row[b + 272 + c]
                    for k in range(16):
                        flat[o + 64 + 16 * k + i] = row[b + 256 + k]
                        for m in range(4):
                            for c in range(4):
                                flat[o + 320 + 256 * k + 64 * m + 4 * i + c] = (
                                    row[b + 16 * k + 4 * m + c])
                    continue
                if size == 84 or size == 66:  # Q2_K / TQ2_0: d | (dmin | scale bytes) | codes
                    _two_bit_group(row, b, size, flat, o, i)
                    continue
                if size == 136:  # IQ4_XS: d | scales_h | scales_l | each sub-block's 16 qs
                    flat[o + 2 * i], flat[o + 2 * i + 1] = row[b], row[b + 1]
                    flat[o + 32 + 2 * i], flat[o + 33 + 2 * i] = row[b + 2], row[b + 3]
                    for c in range(4):
                        flat[o + 64 + 4 * i + c] = row[b + 4 + c]
                    for k in range(8):
                        for j in range(4):
                            for c in range(4):
                                flat[o + 128 + 256 * k + 64 * j + 4 * i + c] = (
                                    row[b + 8 + 16 * k + 4 * j + c])
                    continue
                _k_codes(row, b, q6, codes)
                if q6:  # d | scale k of the 16 rows, k = 0..15 | sub-blocks
                    flat[o + 2 * i], flat[o + 2 * i + 1] = row[b + 208], row[b + 209]
                    for k in range(16):
                        flat[o + 32 + 16 * k + i] = np.uint8(row[b + 192 + k])
                    for k in range(16):
                        sb = o + 288 + 192 * k + 4 * i
                        for c in range(4):
                            cd = codes[16 * k:16 * k + 16]
                            flat[sb + c] = (cd[c] & np.uint8(15)) | ((cd[8 + c] & np.uint8(15))
                                                                    << np.uint8(4))
                            flat[sb + 64 + c] = ((cd[4 + c] & np.uint8(15))
                                                 | ((cd[12 + c] & np.uint8(15)) << np.uint8(4)))
                            flat[sb + 128 + c] = ((cd[c] >> np.uint8(4))
                                                  | ((cd[4 + c] >> np.uint8(4)) << np.uint8(2))
                                                  | ((cd[8 + c] >> np.uint8(4)) << np.uint8(4))
                                                  | ((cd[12 + c] >> np.uint8(4)) << np.uint8(6)))
                else:  # d | dmin | the three scale dwords | sub-blocks
                    flat[o + 2 * i], flat[o + 2 * i + 1] = row[b], row[b + 1]
                    flat[o + 32 + 2 * i], flat[o + 33 + 2 * i] = row[b + 2], row[b + 3]
                    for k in range(3):
                        for c in range(4):
                            flat[o + 64 + 64 * k + 4 * i + c] = row[b + 4 + 4 * k + c]
                    for k in range(8):
                        for j in range(4):
                            for c in range(4):
                                v = 32 * k + 4 * j + c
                                flat[o + 256 + 256 * k + 64 * j + 4 * i + c] = (
                                    codes[v] | (codes[v + 16] << np.uint8(4)))


def interleave_kquant(w: np.ndarray, kind: str, out: np.ndarray) -> None:
    """A Q4_K / Q6_K / Q7_K / IQ4_XS / Q2_K / TQ2_0 weight (uint8 [n_out, row bytes], n_out a
    multiple of 16) with each group of 16 rows rewritten super-block column by column (read by
    `simd.interleaved_k`). Same size, exact; written into `out` (w's shape)."""
    _interleave_super(w, out, KQUANT_SIZES[kind], kind == "q6_k")
