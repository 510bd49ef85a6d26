"""Row-group dots for Q4_K / Q6_K / Q7_K / IQ4_XS / Q2_K / TQ2_0 weights interleaved sixteen rows
at a time
(`quant.repack.interleave_kquant`), as LLVM vector IR intrinsics (AVX512-VNNI).

The idea of `simd.interleaved` carried to the 256-value super-blocks: per group of 16 weight rows
and
super-block column, int32 lane i of every vector is row i, so one token's 16 exact sub-block
sums come from vpdpbusd against its activation dwords broadcast. Interleaved super-block bytes:

- Q4_K (16 x 144): d of the 16 rows (f16), dmin, the three dwords of 6-bit scales and mins of
  every row (three vectors, unpacked across the rows with ggml's word arithmetic), then per
  32-value sub-block four vectors, byte c of lane i: code 4j + c of row i (low nibble) and code
  16 + 4j + c (high nibble).
- Q6_K (16 x 210): d of the 16 rows, the rows' 16 scales (scale k of the 16 rows as 16 bytes),
  then per 16-value sub-block three vectors, byte c of lane i: the low 4 bits of codes c and
  8 + c (vector 0), 4 + c and 12 + c (vector 1), and the high 2 bits of codes c, 4 + c, 8 + c,
  12 + c (vector 2).
- Q7_K (16 x 276; minfer's re-encoding of the IQ2 types, `quant.reencode`): d of the 16 rows
  (f32), their scales as Q6_K's, then per 16-value sub-block four vectors, byte c of lane i of
  vector m: code 4m + c of row i (q + 64, read as it is). The step is Q6_K's template
  (`_offset_super`): the offset 64 in place of 32, an f32 d.

- IQ4_XS (16 x 136): d of the 16 rows, their scales_h words, their scales_l dwords, then per
  32-value sub-block Q4_K's four code vectors (the file's qs bytes as they are), the nibbles
  through the IQ4_NL levels by vpshufb into Q8_0's codes (level ^ 0x80 from -128 x the
  activation's 32-value sums, `linear.dots_k.iq4_corr`; int8 and the sign trick on AVX2), the
  6-bit scale minus 32 applied in float as Q4_K's. Its batched passes take 16 tokens on zmm
  (`WIDE_PASS`: the unpacking shared by twice the tokens).
- Q2_K (16 x 84): d of the 16 rows, their dmin, scale byte k of the 16 rows (scale | min << 4)
  for k = 0..15, then per 16-value sub-block one vector, byte c of lane i holding row i's codes
  c, 4 + c, 8 + c, 12 + c at bits 0, 2, 4, 6 (four shifts and masks make the four code vectors).
  Q6_K's step with 4-bit scales and no offset, plus Q4_K's mins term: the 16 mins in 8 word
  pairs vpdpwssd-ed with the activation's 16-value sums as they are (`bsums`).
- TQ2_0 (16 x 66): d of the 16 rows, then Q2_K's code vectors. Unit scales: each token's 16
  sub-block sums are one integer chain from -1 x the 16-value sums (`koffset_corr(bsums, 1)`),
  one float step per super-block.

Per token and super-block:

    sub-block sums      8 (Q4_K) / 4 (Q6_K, Q7_K) vpdpbusd; Q6_K's start from -32 x the
                        activation's 16-value sum, Q7_K's from -64 x it
                        (`linear.dots_k.koffset_corr`, the code offset)
    s  = fma(d * scale_k, float(sum_k), s)      one float step per sub-block, s from 0
    acc = fma(d_x, s, acc)
    Q4_K: acc = fma(-dmin * d_x, float(mins . sums32), acc)   the mins in 4 vpdpwssd (mins
                        paired in words; `linear.dots_k.kmins_pairs` orders the 32-value sums to
                        match)

The scales are applied in float (d * scale_k is shared by the tokens): against ggml's integer
multiply per sub-block and one conversion per super-block, it measured 1.05-1.10x faster on
Q4_K and 1.08-1.17x on Q6_K at 5-64 tokens, differing by about 2e-7 of the largest output. The
sub-blocks run as a loop, not unrolled: unrolled, LLVM hoisted every sub-block's code vectors
ahead of the dots and spilled them. No float step depends on how many tokens share the pass,
so results are batch-invariant. Measured on Intel Xeon (Sapphire Rapids), 2 threads, against
the former kernels (Q4_K: per-row repacked sub-block lanes; Q6_K: plain rows) on the 1.5B's
8960 x 1536 Q4_K and 1536 x 8960 Q6_K (integer scales then), ratios of medians in one run:
Q4_K 1.5x at 1 token, 1.4-1.6x at 8-64; Q6_K 1.0x at 1 token (memory), 1.7-2.2x at 8-64.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.simd.blocks import (
    _F32,
    _I8,
    _I16,
    _I32,
    HAS_VNNI512,
    _dots_pairs16,
    _fma,
    _ld,
    _lookup,
    _phi_loop,
    _splat,
    _vec,
    _vpdpbusd,
    define_passes,
)
from minfer.backends.cpu.kernels.simd.interleaved import (
    LUTS,
    PAIRS16,
    ROWS,
    SIGN_TRICK,
    RowSpan,
    _c,
    _psign,
    _store,
    halves,
    prefetch_span,
    row_spans,
)
from minfer.backends.cpu.kernels.simd.interleaved import _Front as _Front32
from minfer.backends.cpu.kernels.simd.kquants import _vpdpwssd

# Software prefetch: the weight stream PF_BYTES ahead, into L2 (`simd.interleaved.prefetch_span`),
# a column's share per sub-block step. A whole column at once (36 lines for Q4_K, 53 for Q6_K)
# stalled the core on its line-fill buffers: on an idle Intel SPR (2 threads, 36 GB/s read) the
# 1.5B's Q6_K output streamed at 21 GB/s that way and at 36 spread out (1 thread: 10.6 against
# 18.3, the machine's 18.5); its Q4_K FFN (434 MB) 24.7 against 28-31 GB/s at 1 token and 18.5
# against 21.9 at 4. 2-4 KiB ahead were alike, 8 KiB less good (on weights past the L3's size).
PF_BYTES = 4096
# (values per aux item, its bytes)
_AUX_BYTES = {"q4_k": (32, 2), "q6_k": (16, 4), "q7_k": (16, 4), "q7_ki": (16, 4),
              "iq4_xs": (32, 4), "q2_k": (16, 2), "tq2_0": (16, 4)}


def _ivec(v: int, lanes: int = ROWS) -> Any:
    return ir.Constant(_vec(_I32, lanes), [v] * lanes)


def _fzero(lanes: int) -> Any:
    return ir.Constant(_vec(_F32, lanes), [0.0] * lanes)


class _Front(_Front32):
    """`simd.interleaved`' arguments, read per 256-value super-block; `cb` is the aux array here."""

    def __init__(self, context: Any, builder: Any, sig: Any, args: Any, kind: str) -> None:
        super().__init__(context, builder, sig, args)
        self.nsb = builder.udiv(self.n_in, _c(256))
        self.aux = self.cb
        self.per, self.aux_bytes = _AUX_BYTES[kind]

    def token(self, builder: Any, j: int) -> tuple[Any, ...]:
        """Byte offsets of token t + j's row in x, in xd, of its 16 outputs out[t + j, 16 g ..]
        (as `simd.interleaved._store` reads them), and of its row in aux."""
        tj = builder.add(self.t, _c(j))
        aux_row = builder.mul(builder.udiv(self.n_in, _c(self.per)), _c(self.aux_bytes))
        return (builder.mul(tj, self.n_in), builder.mul(tj, builder.mul(self.nsb, _c(4))),
                builder.mul(_c(4), builder.add(builder.mul(tj, self.n_out),
                                               builder.mul(self.g, _c(ROWS)))),
                builder.mul(tj, aux_row))


def _bcast(builder: Any, ptr: Any, off: Any, lanes: int) -> Any:
    """The dword at byte `off` of i8* `ptr`, broadcast to <lanes x i32>."""
    return _splat(builder, _ld(builder, ptr, off, _I32), lanes)


def _as_bytes(builder: Any, v: Any) -> Any:
    return builder.bitcast(v, _vec(_I8, 4 * v.type.count))


def _token_words(builder: Any, f: _Front, tok: tuple[Any, ...], s: Any, sub: Any, lanes: int
                 ) -> list[Any]:
    """The token's eight activation dwords of 32-value sub-block `sub` of super-block s, each
    broadcast to `lanes` rows as bytes: word j against codes 4j.. (j < 4) and 16 + 4(j - 4)..
    (j >= 4) of the Q4_K / IQ4_XS code vectors."""
    xo = builder.add(tok[0], builder.add(builder.mul(s, _c(256)), builder.mul(sub, _c(32))))
    return [_as_bytes(builder, _bcast(builder, f.x, builder.add(xo, _c(4 * j)), lanes))
            for j in range(8)]


def _q4k_super(builder: Any, f: _Front, toks: list[Any], s: Any, acc: list[Any],
               rows: RowSpan) -> list[Any]:
    """Super-block column s of the row group (Q4_K) for every token: the new accumulators."""
    w, base, n, lanes = f.w, _column(builder, f, s, 144), 4 * rows.lanes, rows.lanes

    def at(off: int) -> Any:
        return builder.add(base, _c(off))

    def word(k: int) -> Any:
        return _ld(builder, w, at(64 + 64 * k + 4 * rows.first), _vec(_I32, lanes))

    m3f, m0f, m03 = (_ivec(v, lanes) for v in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))
    four, six = _ivec(4, lanes), _ivec(6, lanes)
    u0, u2 = word(0), word(2)
    sc03 = builder.and_(u0, m3f)
    sc47 = builder.or_(builder.and_(u2, m0f),
                       builder.shl(builder.and_(builder.lshr(u0, six), m03), four))
    d = halves(builder, w, at(2 * rows.first), lanes)

    def sub_block(sub: Any, sums: list[Any]) -> list[Any]:
        # a loop, not unrolled code: LLVM then cannot hoist every sub-block's code vectors
        # ahead of the dots (measured: it did, and spilled them)
        if rows.prefetch:
            _prefetch_part(builder, f, base, sub, 144, 8)
        at_sub = builder.add(base, builder.add(_c(256 + 4 * rows.first),
                                               builder.mul(sub, _c(256))))
        q = [_ld(builder, w, builder.add(at_sub, _c(64 * j)), _vec(_I8, n)) for j in range(4)]
        codes = ([builder.and_(v, _splat(builder, 15, n)) for v in q]
                 + [builder.lshr(v, _splat(builder, 4, n)) for v in q])
        high = builder.icmp_unsigned(">=", sub, _c(4))
        shift = builder.trunc(builder.mul(builder.and_(sub, _c(3)), _c(8)), _I32)
        scale = builder.and_(builder.lshr(builder.select(high, sc47, sc03),
                                          _splat(builder, shift, lanes)), _ivec(0xFF, lanes))
        dsc = builder.fmul(d, builder.sitofp(scale, _vec(_F32, lanes)))
        new = []
        for i, tok in enumerate(toks):
            xs = _token_words(builder, f, tok, s, sub, lanes)
            if PAIRS16:  # AVX2: one pmaddwd for the eight (codes <= 15)
                isum = _dots_pairs16(builder, codes, xs, _ivec(0, lanes), 15)
            else:
                part: list[Any] = [None, None]  # two chains (one measured slower at 8 tokens)
                for j in range(8):
                    part[j % 2] = _vpdpbusd(builder, codes[j], xs[j], part[j % 2])
                isum = builder.add(part[0], part[1])
            new.append(_fma(builder, dsc, builder.sitofp(isum, _vec(_F32, lanes)), sums[i]))
        return new

    sums = _phi_loop(builder, _c(8), [_fzero(lanes)] * len(toks), sub_block)
    u1 = word(1)
    mn03 = builder.and_(u1, m3f)
    mn47 = builder.or_(builder.and_(builder.lshr(u2, four), m0f),
                       builder.shl(builder.and_(builder.lshr(u1, six), m03), four))
    w00, eight = _ivec(0x00FF00FF, lanes), _ivec(8, lanes)
    mins = []  # word pairs (m0, m2), (m1, m3), (m4, m6), (m5, m7): `kmins_pairs`' order
    for mw in (mn03, mn47):
        mins += [builder.and_(mw, w00), builder.and_(builder.lshr(mw, eight), w00)]
    ndmin = builder.fneg(halves(builder, w, at(32 + 2 * rows.first), lanes))
    new = []
    for i, tok in enumerate(toks):
        dx = _dx(builder, f, tok, s, lanes)
        ao = builder.add(tok[3], builder.mul(s, _c(16)))
        msum: Any = _ivec(0, lanes)
        for k in range(4):
            xs = _bcast(builder, f.aux, builder.add(ao, _c(4 * k)), lanes)
            msum = _vpdpwssd(builder, msum, builder.bitcast(mins[k], _vec(_I16, 2 * lanes)),
                             builder.bitcast(xs, _vec(_I16, 2 * lanes)))
        a = _fma(builder, dx, sums[i], acc[i])
        new.append(_fma(builder, builder.fmul(ndmin, dx),
                        builder.sitofp(msum, _vec(_F32, lanes)), a))
    return new


# The offset-coded types (no mins): (bytes of a row's super-block, bytes of a row's d, code
# vectors per 16-value sub-block, the highest code, the code offset)
_OFFSET_CODED = {"q6_k": (210, 2, 3, 63, 32), "q7_k": (276, 4, 4, 127, 64)}


def _offset_super(kind: str, int_scales: bool = False) -> Any:
    """The super-block step of Q6_K / Q7_K (`_OFFSET_CODED`): one template, the two layouts
    differing in d (f16 / f32), the code vectors (Q6_K's 6-bit codes unpacked from three,
    Q7_K's four read as they are) and the highest code (AVX2's int16 pair sums).
    `int_scales` (Q7_K expanded from IQ2 / IQ3 rows, `simd.iquants`): the sub-block
    sums times the scales summed in int32 (exact), one float step per super-block, acc =
    fma(d * d_x, float(sum), acc): the float steps of `simd.iquants`' plain rows."""
    size, d_bytes, n_vec, code_max, _ = _OFFSET_CODED[kind]
    codes_at = ROWS * d_bytes + 256  # the d of the 16 rows, their 16 scales each, then codes

    def step(builder: Any, f: _Front, toks: list[Any], s: Any, acc: list[Any],
             rows: RowSpan) -> list[Any]:
        """Super-block column s of the row group for every token: the new accumulators."""
        w, base, n, lanes = f.w, _column(builder, f, s, size), 4 * rows.lanes, rows.lanes

        def at(off: int) -> Any:
            return builder.add(base, _c(off))

        m15, m3, four = (_splat(builder, v, n) for v in (15, 3, 4))
        d = (halves(builder, w, at(2 * rows.first), lanes) if d_bytes == 2
             else _ld(builder, w, at(4 * rows.first), _vec(_F32, lanes)))

        def sub_block(k: Any, sums: list[Any]) -> list[Any]:  # a loop, as Q4_K's
            if rows.prefetch:
                _prefetch_part(builder, f, base, k, size, 16)
            sc = builder.sext(_ld(builder, w, builder.add(at(ROWS * d_bytes + rows.first),
                                                          builder.mul(k, _c(16))),
                                  _vec(_I8, lanes)), _vec(_I32, lanes))
            dsc = None if int_scales else builder.fmul(d, builder.sitofp(sc, _vec(_F32, lanes)))
            at_sub = builder.add(at(codes_at + 4 * rows.first), builder.mul(k, _c(64 * n_vec)))
            vecs = [_ld(builder, w, builder.add(at_sub, _c(64 * v)), _vec(_I8, n))
                    for v in range(n_vec)]
            codes = vecs  # Q7_K: codes 4m..4m+3 of the sub-block in vector m
            if n_vec == 3:  # Q6_K: low nibbles in a0 / a1, the high 2 bits in h
                a0, a1, h = vecs
                codes = []
                for m in range(4):
                    lo = (builder.and_((a0, a1)[m], m15) if m < 2
                          else builder.lshr((a0, a1)[m - 2], four))
                    hi = builder.and_(builder.lshr(h, _splat(builder, 2 * m, n)) if m else h, m3)
                    codes.append(builder.or_(lo, builder.shl(hi, four)))
            new = []
            for i, tok in enumerate(toks):
                xo = builder.add(tok[0], builder.add(builder.mul(s, _c(256)),
                                                     builder.mul(k, _c(16))))
                co = builder.add(tok[3], builder.add(builder.mul(s, _c(64)),
                                                     builder.mul(k, _c(4))))
                part = _bcast(builder, f.aux, co, lanes)
                xs = [_as_bytes(builder, _bcast(builder, f.x, builder.add(xo, _c(4 * m)), lanes))
                      for m in range(4)]
                if PAIRS16:  # AVX2: pmaddwd of int16 pair sums (`pairs16_group(code_max)`)
                    part = _dots_pairs16(builder, codes, xs, part, code_max)
                else:
                    for m in range(4):
                        part = _vpdpbusd(builder, codes[m], xs[m], part)
                if int_scales:
                    new.append(builder.add(sums[i], builder.mul(part, sc)))
                else:
                    new.append(_fma(builder, dsc, builder.sitofp(part, _vec(_F32, lanes)),
                                    sums[i]))
            return new

        zero = _ivec(0, lanes) if int_scales else _fzero(lanes)
        sums = _phi_loop(builder, _c(16), [zero] * len(toks), sub_block)
        if int_scales:
            return [_fma(builder, builder.fmul(d, _dx(builder, f, tok, s, lanes)),
                         builder.sitofp(sums[i], _vec(_F32, lanes)), acc[i])
                    for i, tok in enumerate(toks)]
        return [_fma(builder, _dx(builder, f, tok, s, lanes), sums[i], acc[i])
                for i, tok in enumerate(toks)]

    return step


def _iq4xs_super(builder: Any, f: _Front, toks: list[Any], s: Any, acc: list[Any],
                 rows: RowSpan) -> list[Any]:
    """Super-block column s of the row group (IQ4_XS) for every token: the new accumulators."""
    w, base, n, lanes = f.w, _column(builder, f, s, 136), 4 * rows.lanes, rows.lanes

    def at(off: int) -> Any:
        return builder.add(base, _c(off))

    d = halves(builder, w, at(2 * rows.first), lanes)
    sh = builder.zext(_ld(builder, w, at(32 + 2 * rows.first), _vec(_I16, lanes)),
                      _vec(_I32, lanes))
    sl = _ld(builder, w, at(64 + 4 * rows.first), _vec(_I32, lanes))
    table = tuple(v if SIGN_TRICK else v ^ -128 for v in LUTS["iq4_nl"])

    def sub_block(sub: Any, sums: list[Any]) -> list[Any]:  # a loop, as Q4_K's
        if rows.prefetch:
            _prefetch_part(builder, f, base, sub, 136, 8)
        at_sub = builder.add(at(128 + 4 * rows.first), builder.mul(sub, _c(256)))
        q = [_ld(builder, w, builder.add(at_sub, _c(64 * j)), _vec(_I8, n)) for j in range(4)]
        codes = [_lookup(builder, v, table) for v in (
            [builder.and_(v, _splat(builder, 15, n)) for v in q]
            + [builder.lshr(v, _splat(builder, 4, n)) for v in q])]
        mags = [_psign(builder, v, v) for v in codes] if SIGN_TRICK else codes  # |w|, once
        s32 = builder.trunc(sub, _I32)
        lo = builder.and_(builder.lshr(sl, _splat(builder, builder.mul(s32, ir.Constant(
            _I32, 4)), lanes)), _ivec(15, lanes))
        hi = builder.and_(builder.lshr(sh, _splat(builder, builder.mul(s32, ir.Constant(
            _I32, 2)), lanes)), _ivec(3, lanes))
        scale = builder.sub(builder.or_(lo, builder.shl(hi, _ivec(4, lanes))), _ivec(32, lanes))
        dsc = builder.fmul(d, builder.sitofp(scale, _vec(_F32, lanes)))
        new = []
        for i, tok in enumerate(toks):
            xs = _token_words(builder, f, tok, s, sub, lanes)
            isum: Any = None
            if SIGN_TRICK:
                xs = [_psign(builder, x, c) for x, c in zip(xs, codes, strict=True)]
            else:  # level ^ 0x80 codes: the chain starts from -128 x the activation's sum
                co = builder.add(tok[3], builder.add(builder.mul(s, _c(32)),
                                                     builder.mul(sub, _c(4))))
                isum = _bcast(builder, f.aux, co, lanes)
            # one chain per token, the pass's tokens side by side: two, added at the end,
            # measured 1.03-1.11x slower (8 tokens a pass; the same integers, the same bits)
            for j in range(8):
                isum = _vpdpbusd(builder, mags[j], xs[j], isum)
            new.append(_fma(builder, dsc, builder.sitofp(isum, _vec(_F32, lanes)), sums[i]))
        return new

    sums = _phi_loop(builder, _c(8), [_fzero(lanes)] * len(toks), sub_block)
    return [_fma(builder, _dx(builder, f, tok, s, lanes), sums[i], acc[i])
            for i, tok in enumerate(toks)]


def _two_bit_super(kind: str) -> Any:
    """The super-block step of Q2_K / TQ2_0 (one template; TQ2_0 is Q2_K's codes with unit
    scales, no mins and a -1 offset)."""
    q2 = kind == "q2_k"
    size, codes_at = (84, 320) if q2 else (66, 32)  # after d (and dmin, the scale bytes)

    def step(builder: Any, f: _Front, toks: list[Any], s: Any, acc: list[Any],
             rows: RowSpan) -> list[Any]:
        """Super-block column s of the row group for every token: the new accumulators."""
        w, base, n, lanes = f.w, _column(builder, f, s, size), 4 * rows.lanes, rows.lanes

        def at(off: int) -> Any:
            return builder.add(base, _c(off))

        d = halves(builder, w, at(2 * rows.first), lanes)

        def scale_bytes(k: Any) -> Any:  # byte k of the rows' scales: scale | min << 4
            return builder.zext(_ld(builder, w, builder.add(at(64 + rows.first),
                                                            builder.mul(k, _c(16))),
                                    _vec(_I8, lanes)), _vec(_I32, lanes))

        def sub_block(k: Any, sums: list[Any]) -> list[Any]:  # a loop, as Q4_K's
            if rows.prefetch:
                _prefetch_part(builder, f, base, k, size, 16)
            v = _ld(builder, w, builder.add(at(codes_at + 4 * rows.first),
                                            builder.mul(k, _c(64))), _vec(_I8, n))
            codes = [builder.and_(builder.lshr(v, _splat(builder, 2 * m, n)) if m else v,
                                  _splat(builder, 3, n)) for m in range(4)]
            dsc = (builder.fmul(d, builder.uitofp(builder.and_(scale_bytes(k), _ivec(15, lanes)),
                                                  _vec(_F32, lanes))) if q2 else None)
            new = []
            for i, tok in enumerate(toks):
                xo = builder.add(tok[0], builder.add(builder.mul(s, _c(256)),
                                                     builder.mul(k, _c(16))))
                xs = [_as_bytes(builder, _bcast(builder, f.x, builder.add(xo, _c(4 * m)), lanes))
                      for m in range(4)]
                part: Any = _ivec(0, lanes)
                if not q2:  # -1 x the 16-value sum (`koffset_corr(bsums, 1)`)
                    part = _bcast(builder, f.aux, builder.add(tok[3], builder.add(
                        builder.mul(s, _c(64)), builder.mul(k, _c(4)))), lanes)
                if PAIRS16:
                    part = _dots_pairs16(builder, codes, xs, part, 3)
                else:
                    for m in range(4):
                        part = _vpdpbusd(builder, codes[m], xs[m], part)
                new.append(_fma(builder, dsc, builder.sitofp(part, _vec(_F32, lanes)), sums[i])
                           if q2 else builder.add(part, sums[i]))  # TQ2_0: exact int sums
            return new

        zero = _fzero(lanes) if q2 else _ivec(0, lanes)
        sums = _phi_loop(builder, _c(16), [zero] * len(toks), sub_block)
        if not q2:  # one float step per super-block: d_x * d_w * sum
            return [_fma(builder, builder.fmul(_dx(builder, f, tok, s, lanes), d),
                         builder.sitofp(sums[i], _vec(_F32, lanes)), acc[i])
                    for i, tok in enumerate(toks)]
        mins = []  # word pairs (m_2j, m_2j+1): against the 16-value sums' dword j
        for j in range(8):
            lo, hi = (builder.lshr(scale_bytes(_c(2 * j + h)), _ivec(4, lanes)) for h in (0, 1))
            mins.append(builder.bitcast(builder.or_(lo, builder.shl(hi, _ivec(16, lanes))),
                                        _vec(_I16, 2 * lanes)))
        ndmin = builder.fneg(halves(builder, w, at(32 + 2 * rows.first), lanes))
        new = []
        for i, tok in enumerate(toks):
            dx = _dx(builder, f, tok, s, lanes)
            ao = builder.add(tok[3], builder.mul(s, _c(32)))
            msum: Any = _ivec(0, lanes)
            for j in range(8):
                bs = _bcast(builder, f.aux, builder.add(ao, _c(4 * j)), lanes)
                msum = _vpdpwssd(builder, msum, mins[j], builder.bitcast(bs, _vec(_I16, 2 * lanes)))
            a = _fma(builder, dx, sums[i], acc[i])
            new.append(_fma(builder, builder.fmul(ndmin, dx),
                            builder.sitofp(msum, _vec(_F32, lanes)), a))
        return new

    return step


def _column(builder: Any, f: _Front, s: Any, size: int) -> Any:
    """Byte offset of super-block column s in the row group's slab (`size` bytes per row's
    super-block)."""
    return builder.add(f.slab, builder.mul(s, _c(ROWS * size)))


def _prefetch_part(builder: Any, f: _Front, base: Any, sub: Any, size: int, n_sub: int
                   ) -> None:
    """Prefetch part `sub` of n_sub of the column PF_BYTES ahead: spread over the sub-block
    loop, not a column's 36 (Q4_K) or 53 (Q6_K) lines at once."""
    part = -(-ROWS * size // n_sub)
    start = builder.add(builder.add(base, _c(PF_BYTES)), builder.mul(sub, _c(part)))
    prefetch_span(builder, f.w, start, part)


def _dx(builder: Any, f: _Front, tok: Any, s: Any, lanes: int) -> Any:
    """The token's Q8_K scale of super-block s, splat over `lanes` rows."""
    return _splat(builder, _ld(builder, f.xd, builder.add(tok[1], builder.mul(s, _c(4))), _F32),
                  lanes)


_SUPER = {"q4_k": _q4k_super, "q6_k": _offset_super("q6_k"), "q7_k": _offset_super("q7_k"),
          "q7_ki": _offset_super("q7_k", int_scales=True), "iq4_xs": _iq4xs_super,
          "q2_k": _two_bit_super("q2_k"), "tq2_0": _two_bit_super("tq2_0")}


def rows_dot_k(kind: str, ntok: int, weight_group: bool = False) -> Any:
    """An intrinsic (w, x, xd, aux, t, out, g) -> None: out[t + j, 16 g + i] for j < ntok and
    the 16 rows i of row group g, from the interleaved weight w (uint8 [n_out, row bytes]), the
    Q8_K activation codes x (int8 [nt, n]) and scales xd (f32 [nt, n/256]), and aux: Q4_K the
    32-value sums in `kmins_pairs`' order (int16 [nt, n/32]), Q6_K / Q7_K -32 / -64 x the
    16-value sums (int32 [nt, n/16], `koffset_corr`), IQ4_XS -128 x the 32-value sums (int32
    [nt, n/32], `iq4_corr`; unread with the sign trick), Q2_K the 16-value sums (int16 [nt,
    n/16], `bsums` itself), TQ2_0 -1 x them (int32, `koffset_corr(bsums, 1)`).
    `weight_group`: an eighth argument wg, the row group of w to read (`simd.iquants.expand_*`'
    copy: 0)."""
    step = _SUPER[kind]

    def typed(sig: Any) -> Any:

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            f = _Front(context, builder, signature, args, kind)
            toks = [f.token(builder, j) for j in range(ntok)]
            for rows in row_spans(ntok):
                acc = _phi_loop(builder, f.nsb, [_fzero(rows.lanes)] * ntok,
                                lambda s, a, rows=rows: step(builder, f, toks, s, a, rows))
                _store(builder, f, toks, acc, rows.first)
            return context.get_dummy_value()

        return sig, codegen

    def typer(typingctx: Any, w: Any, x: Any, xd: Any, aux: Any, t: Any, out: Any, g: Any
              ) -> Any:
        return typed(types.void(w, x, xd, aux, t, out, g))

    def typer_wg(typingctx: Any, w: Any, x: Any, xd: Any, aux: Any, t: Any, out: Any, g: Any,
                 wg: Any) -> Any:
        return typed(types.void(w, x, xd, aux, t, out, g, wg))

    return intrinsic(typer_wg if weight_group else typer)


define_passes(globals(), "rowsdot", rows_dot_k, ("q4_k", "q6_k", "q7_k", "iq4_xs", "q2_k",
                                                  "tq2_0"))
# Q7_K with integer scales on a row group expanded from the file's IQ2 / IQ3 rows
# (`simd.iquants`)
define_passes(globals(), "rowsdotx", lambda qt, n: rows_dot_k(qt, n, True), ("q7_ki",))
# Wider passes where they measured faster (the row drivers run them first, `RowsDriver.wide`):
# IQ4_XS unpacks each sub-block's codes (two shifts / masks and a vpshufb per code vector) once
# per pass, so 16 tokens a pass halve that per token; its 16 accumulators fit zmm's 32
# registers (not AVX2's 16). Intel Xeon (Sapphire Rapids), 2 threads, 512 tokens, medians
# alternated on a loaded host, three runs: 8960 x 1536 1.06-1.07x, 1536 x 8960 1.05-1.20x
# against 8 tokens a pass with two chains per token (`_iq4xs_super` now one). Q4_K's 16-token
# passes measured no faster (0.96-1.09x).
WIDE_PASS = {"iq4_xs": 16} if HAS_VNNI512 else {}
for _kind, _n in WIDE_PASS.items():
    globals()[f"rowsdot{_n}_{_kind}"] = rows_dot_k(_kind, _n)
