"""Row dot products for the K-quants (Q2_K, Q4_K, Q5_K, Q6_K; Q7_K, minfer's re-encoding of
the IQ2 types, `quant.types`; IQ4_XS, its 4-bit codes through the level table, `_dot_iq4_xs`;
and TQ2_0, Q2_K's codes with unit scales, `_unpack_q2`) as LLVM vector IR intrinsics.

One `rowdot_*_k(w_row, x, xd, bsums) -> f32` intrinsic per weight row: per 256-value super-block
the 6-bit scales and mins are unpacked with 32-bit word arithmetic (as ggml), the sub-block codes
are dotted with the Q8_K activation in exact int32 lanes times the sub-block scales (with AVX2:
pmaddubsw pair sums (Q7_K's codes <= 127: |pair sum| <= 2 * 127 * 128, no saturation), fed to
vpdpwssd against the i16 scales (AVX512-VNNI: two 32-code groups per zmm), or on AVX2 without
VNNI to pmaddwd and an add; else `simd.blocks._lane_sums` times the scales). Q6_K's -32 code
offset is -32 * (scales . bsums), one pmaddwd of the activation's 16-value sums against the
row's scales, added to the lanes (Q7_K: the same with -64, and an f32 d); Q4_K / Q5_K's
mins . bsums is the same pmaddwd against the mins, kept as lanes too. Q2_K is Q6_K's per-16
scales (4-bit, its 2-bit codes unpacked by shifts of the 32 qs bytes of each half) with Q4_K's
mins term (its 16 4-bit mins against the 16 bsums, one pmaddwd), ggml's
`ggml_vec_dot_q2_K_q8_K`; TQ2_0 (value d * (code - 1), its 66-byte blocks read as they are)
takes Q2_K's code layout with unit scales: vpdpbusd of the codes as they are, -bsums for the
-1 (ggml's `ggml_vec_dot_tq2_0_q8_K`). Then d_x * d_w *
float(lanes) goes into an f32 register accumulator and -d_x * dmin_w * float(min lanes) into a
second one; two fixed-order horizontal sums per row. Per token the activation side is only its
quants and bsums (no per-call correction arrays), which keeps several tokens' rows in L1 while
the weights stream past.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.quant.iq_grids import IQ4_LEVELS
from minfer.backends.cpu.kernels.simd.blocks import (
    _F32,
    _I8,
    _I16,
    _I32,
    DOT4,
    HAS_VNNI,
    HAS_VNNI512,
    LANES,
    _concat,
    _dots_pairs16,
    _fma,
    _half,
    _hsum,
    _lane_sums,
    _ld,
    _lookup,
    _nibbles,
    _phi_loop,
    _pmaddubsw,
    _pmaddwd,
    _prefetch_span,
    _row_front,
    _splat,
    _store_totals,
    _token_rows,
    _vec,
    _vpdpbusd,
    _x86,
    define_passes,
)
from minfer.backends.cpu.kernels.simd.llvm import half_to_float

# Software prefetch of a row's super-blocks: this many bytes ahead, into L1. The 32-value
# blocks' 4 KiB into L2 (`simd.blocks.PREFETCH`) was slower here: the 1.5B's Q4_K FFN (1.3 GB, 2
# threads, Intel SPR compiled for Haswell) streamed at 22.6 GB/s with it, 26.0 with this.
PREFETCH = 1024


def scales_mins(builder: Any, w: Any, at: Any) -> Any:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins at byte `at`, unpacked as ggml does with
    32-bit words: <16 x i32>, the 8 scales then the 8 mins."""
    u0, u1, u2 = (_ld(builder, w, builder.add(at, ir.Constant(at.type, off)), _I32)
                  for off in (0, 4, 8))

    def c(v: int) -> Any:
        return ir.Constant(_I32, v)

    m3f, m0f, m03 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
    t3 = builder.or_(builder.and_(builder.lshr(u2, c(4)), m0f),
                     builder.shl(builder.and_(builder.lshr(u1, c(6)), m03), c(4)))
    t1 = builder.or_(builder.and_(u2, m0f),
                     builder.shl(builder.and_(builder.lshr(u0, c(6)), m03), c(4)))
    words = ir.Constant(_vec(_I32, 4), None)
    for j, v in enumerate((builder.and_(u0, m3f), t1, builder.and_(u1, m3f), t3)):
        words = builder.insert_element(words, v, c(j))
    return builder.zext(builder.bitcast(words, _vec(_I8, 16)), _vec(_I32, 16))


def _unpack_super(builder: Any, w: Any, base: Any, kind: str) -> tuple[list[Any], Any]:
    """Super-block at byte `base` of the row at i8* `w`: its eight 32-code groups (<32 x i8>, in
    activation order; Q6_K's still offset by 32) and the scales/mins as <16 x i32> (Q4_K/Q5_K:
    8 scales then 8 mins; Q6_K: 16 signed scales, one per 16 values)."""
    u64 = base.type

    def wat(off: int) -> Any:
        return builder.add(base, ir.Constant(u64, off))

    codes = []
    if kind == "iq4":
        return _unpack_iq4_xs(builder, w, base)
    if kind in ("q2", "tq2"):
        return _unpack_q2(builder, w, base, kind)
    if kind == "q7":  # codes[256] | scales int8[16] | d f32
        sc = builder.sext(_ld(builder, w, wat(256), _vec(_I8, 16)), _vec(_I32, 16))
        return [_ld(builder, w, wat(32 * g), _vec(_I8, 32)) for g in range(8)], sc
    if kind == "q6":
        sc = builder.sext(_ld(builder, w, wat(192), _vec(_I8, 16)), _vec(_I32, 16))
        for n in range(2):
            h = _ld(builder, w, wat(128 + 32 * n), _vec(_I8, 32))
            for k in range(4):
                q = _ld(builder, w, wat(64 * n + 32 * (k & 1)), _vec(_I8, 32))
                lo = builder.and_(builder.lshr(q, _splat(builder, 4 * (k >> 1), 32)),
                                  _splat(builder, 15, 32))
                hi = builder.and_(builder.lshr(h, _splat(builder, 2 * k, 32)),
                                  _splat(builder, 3, 32))
                codes.append(builder.or_(lo, builder.shl(hi, _splat(builder, 4, 32))))
        return codes, sc
    sm = scales_mins(builder, w, wat(4))  # 8 sc, 8 mins
    qs = 48 if kind == "q5" else 16
    h = _ld(builder, w, wat(16), _vec(_I8, 32)) if kind == "q5" else None
    for j in range(4):
        q = _ld(builder, w, wat(qs + 32 * j), _vec(_I8, 32))
        for half_i, shift in ((0, 0), (1, 4)):
            cd = builder.and_(builder.lshr(q, _splat(builder, shift, 32)),
                              _splat(builder, 15, 32))
            if h is not None:
                bit = builder.and_(builder.lshr(h, _splat(builder, 2 * j + half_i, 32)),
                                   _splat(builder, 1, 32))
                cd = builder.or_(cd, builder.shl(bit, _splat(builder, 4, 32)))
            codes.append(cd)
    return codes, sm


def _unpack_q2(builder: Any, w: Any, base: Any, kind: str) -> tuple[list[Any], Any]:
    """Q2_K super-block (scales[16] | qs[64] | d f16 | dmin f16) or TQ2_0 block (qs[64] | d
    f16) at byte `base`: the eight 32-code groups, group 4c + s being (qs[32c .. 32c + 31] >>
    2s) & 3 (values 128c + 32s ..); Q2_K's 4-bit scales then mins as <32 x i32> (one each per
    16 values), None for TQ2_0 (unit scales)."""
    u64 = base.type
    qs = 16 if kind == "q2" else 0
    codes = []
    for c in range(2):
        q = _ld(builder, w, builder.add(base, ir.Constant(u64, qs + 32 * c)), _vec(_I8, 32))
        for s in range(4):
            codes.append(builder.and_(builder.lshr(q, _splat(builder, 2 * s, 32)),
                                      _splat(builder, 3, 32)))
    if kind == "tq2":
        return codes, None
    b = _ld(builder, w, base, _vec(_I8, 16))
    sc = builder.zext(builder.and_(b, _splat(builder, 15, 16)), _vec(_I32, 16))
    mins = builder.zext(builder.lshr(b, _splat(builder, 4, 16)), _vec(_I32, 16))
    return codes, _concat(builder, [sc, mins])


# IQ4_XS's levels as the vpdpbusd's u8 operand (level + 128; the -128 comes back through the
# activation's sums), or as they are for the sign trick (AVX2) and the generic lanes
_IQ4_CODES = tuple(int(v) + 128 if HAS_VNNI else int(v) for v in IQ4_LEVELS)


def _unpack_iq4_xs(builder: Any, w: Any, base: Any) -> tuple[list[Any], Any]:
    """IQ4_XS super-block at byte `base` (d f16 | scales_h u16 | scales_l[4] | qs[128]): its
    eight 32-code groups through the level table (`_IQ4_CODES`; each group's 16 bytes as
    IQ4_NL's: low nibbles the first 16 values) and the sub-block scales ls - 32 (6 bits: a
    nibble of scales_l, two bits of scales_h) as <16 x i32>, one per 16 values (each twice)."""
    u64 = base.type
    codes = [_lookup(builder, _nibbles(builder, _ld(builder, w, builder.add(
        base, ir.Constant(u64, 8 + 16 * g)), _vec(_I8, 16))), _IQ4_CODES) for g in range(8)]
    sh = builder.zext(_ld(builder, w, builder.add(base, ir.Constant(u64, 2)), _I16), _I32)
    sl = _ld(builder, w, builder.add(base, ir.Constant(u64, 4)), _I32)

    def c(vals: list[int]) -> Any:
        return ir.Constant(_vec(_I32, 16), vals)

    lo = builder.and_(builder.lshr(_splat(builder, sl, 16), c([4 * (k // 2) for k in range(16)])),
                      c([15] * 16))
    hi = builder.and_(builder.lshr(_splat(builder, sh, 16), c([2 * (k // 2) for k in range(16)])),
                      c([3] * 16))
    ls = builder.sub(builder.or_(lo, builder.shl(hi, c([4] * 16))), c([32] * 16))
    return codes, ls


def _dot_iq4_xs(builder: Any, codes: list[Any], ls: Any, x: Any, bs: Any, i: Any) -> Any:
    """One token's integer sum of IQ4_XS super-block i, sum over groups of ls_g * (levels .
    x), as <LANES x i32>. With VNNI: vpdpbusd of the levels + 128 (two groups per zmm on
    AVX512-VNNI) times the scales (vpmulld), plus -128 * ls . bsums as one pmaddwd (|128 ls|
    <= 4096, |bsum| <= 2032: exact). On AVX2: ggml's sign trick (pmaddubsw of |level| and x
    signed as the level: pair sums <= 2 * 127 * 128, no saturation), pmaddwd against the i16
    scales. Else the generic lane sums times the scales."""
    u64 = i.type
    xo = builder.mul(i, ir.Constant(u64, 256))
    per = codes[0].type.count
    acc = ir.Constant(_vec(_I32, per // 4 if DOT4 else LANES), None)
    for g, cd in enumerate(codes):
        xv = _ld(builder, x, builder.add(xo, ir.Constant(u64, per * g)), _vec(_I8, per))
        first = 2 * (per // 32) * g  # the group's scale lane (per 16 values)
        if HAS_VNNI:
            lanes = _vpdpbusd(builder, cd, xv)
            sc = _splat_lane(builder, ls, [first + 2 * (k // 8) for k in range(per // 4)])
            acc = builder.add(acc, builder.mul(lanes, sc))
        elif DOT4:
            ax = _x86(builder, "llvm.x86.avx2.psign.b", cd.type, [cd, cd])
            sx = _x86(builder, "llvm.x86.avx2.psign.b", cd.type, [xv, cd])
            sc = builder.trunc(_splat_lane(builder, ls, [first] * 16), _vec(_I16, 16))
            acc = builder.add(acc, _pmaddwd(builder, _pmaddubsw(builder, ax, sx), sc))
        else:
            lanes = _lane_sums(builder, cd, xv, 0, True)
            acc = builder.add(acc, builder.mul(lanes, _splat_lane(builder, ls, [first] * LANES)))
    if per == 64:  # even groups' lanes + odd groups' lanes (exact)
        acc = builder.add(_splat_lane(builder, acc, list(range(8))),
                          _splat_lane(builder, acc, list(range(8, 16))))
    if HAS_VNNI:
        bsv = _ld(builder, bs, builder.mul(i, ir.Constant(u64, 32)), _vec(_I16, 16))
        side = builder.mul(builder.trunc(ls, _vec(_I16, 16)), ir.Constant(_vec(_I16, 16),
                                                                          [-128] * 16))
        acc = builder.add(acc, _pmaddwd(builder, bsv, side))
    return acc


def _vpdpwssd(builder: Any, acc: Any, a: Any, b: Any) -> Any:
    """acc + sums of adjacent i16 x i16 products (<8 or 16 x i32>; one vpdpwssd, or without
    VNNI a pmaddwd and an add; <16 x i32> without zmm VNNI as two <8 x i32> halves)."""
    vn = acc.type
    if vn.count == 16 and not HAS_VNNI512:  # the 16-row interleaved dots on ymm: two halves
        return _concat(builder, [_vpdpwssd(builder, _half(builder, acc, k), _half(builder, a, k),
                                           _half(builder, b, k)) for k in (0, 1)])
    if not HAS_VNNI:
        return builder.add(acc, _pmaddwd(builder, a, b))
    return _x86(builder, f"llvm.x86.avx512.vpdpwssd.{32 * vn.count}", vn,
                [acc, builder.bitcast(a, vn), builder.bitcast(b, vn)])


def _scales16(builder: Any, sm: Any, kind: str) -> tuple[list[Any], Any]:
    """Per 32-code group the scales as <16 x i16> in pmaddubsw pair order (Q6_K / Q7_K /
    Q2_K: one per 16 values, so two halves), and the <16 x i16> the activation's bsums are
    pmaddwd-ed with: Q4_K/Q5_K's mins, each repeated for a bsums pair; Q2_K's 16 mins; Q6_K's
    scales times -32 (its code offset); TQ2_0: no scales (unit: its codes' sums are taken as
    they are), -1 for its code offset."""
    if kind == "tq2":
        return [], ir.Constant(_vec(_I16, 16), [-_OFFSET[kind]] * 16)
    sm16 = builder.trunc(sm, _vec(_I16, sm.type.count))
    if kind in _PER16:
        idx = [[2 * g] * 8 + [2 * g + 1] * 8 for g in range(8)]
        side = (_splat_lane(builder, sm16, list(range(16, 32))) if kind == "q2" else
                builder.mul(sm16, ir.Constant(_vec(_I16, 16), [-_OFFSET[kind]] * 16)))
    else:
        side = _splat_lane(builder, sm16, [8 + k // 2 for k in range(16)])
        idx = [[g] * 16 for g in range(8)]
    if HAS_VNNI512:  # two groups per zmm
        idx = [idx[g] + idx[g + 1] for g in range(0, 8, 2)]
    return [_splat_lane(builder, sm16, ix) for ix in idx], side


def _splat_lane(builder: Any, vec: Any, idx: list[int]) -> Any:
    return builder.shuffle_vector(vec, vec, ir.Constant(_vec(_I32, len(idx)), idx))


def _dot_super(builder: Any, codes: list[Any], sm: Any, x: Any, bs: Any, i: Any,
               kind: str, scales16: list[Any], side16: Any) -> tuple[Any, Any]:
    """One token's integer part of super-block i: (<LANES x i32> sum over sub-blocks of scale *
    lane sums of (code - offset) . x, <8 x i32> lanes of min * activation sums (Q4_K/Q5_K/Q2_K;
    None for Q6_K / Q7_K / TQ2_0)). With VNNI the lanes are pmaddubsw pair sums of the raw
    codes (<= 63, so no saturation) fed to vpdpwssd against the i16 scales (`_scales16`), plus
    Q6_K's offset term -32 * scales . bsums as one pmaddwd (exact: |bsum| <= 2032, |32 * scale|
    <= 4096). TQ2_0's unit scales: its codes (<= 3) go to vpdpbusd as they are (on AVX2, all
    eight groups' pmaddubsw pairs summed in int16, |sum| <= 8 * 768, then one pmaddwd), its -1
    offset as -bsums."""
    u64 = i.type
    xo = builder.mul(i, ir.Constant(u64, 256))
    bsv = _ld(builder, bs, builder.mul(i, ir.Constant(u64, 32)), _vec(_I16, 16))
    if DOT4:  # pmaddubsw pair sums, vpdpwssd (or pmaddwd + add) with scales
        per = codes[0].type.count  # codes per vector: 32, or 64 (two groups, zmm)
        acc = ir.Constant(_vec(_I32, per // 4), [0] * (per // 4))
        xs = [_ld(builder, x, builder.add(xo, ir.Constant(u64, per * g)), _vec(_I8, per))
              for g in range(len(codes))]
        if kind == "tq2" and not HAS_VNNI:
            acc = _dots_pairs16(builder, codes, xs, acc, 3)
        for cd, xv, sc in zip(codes, xs, scales16 or [None] * len(codes), strict=True):
            if kind == "tq2":
                if HAS_VNNI:
                    acc = _vpdpbusd(builder, cd, xv, acc)
                continue
            acc = _vpdpwssd(builder, acc, _pmaddubsw(builder, cd, xv), sc)
        if per == 64:  # even groups' lanes + odd groups' lanes (exact)
            acc = builder.add(_splat_lane(builder, acc, list(range(8))),
                              _splat_lane(builder, acc, list(range(8, 16))))
        side = _pmaddwd(builder, bsv, side16)
        if kind in _OFFSET:
            return builder.add(acc, side), None
        return acc, side
    acc = ir.Constant(_vec(_I32, LANES), [0] * LANES)
    for g, cd in enumerate(codes):
        xv = _ld(builder, x, builder.add(xo, ir.Constant(u64, 32 * g)), _vec(_I8, 32))
        lanes = _lane_sums(builder, cd, xv, _OFFSET.get(kind, 0), False)
        if kind == "tq2":
            acc = builder.add(acc, lanes)
            continue
        if kind in _PER16:
            half = LANES // 2
            sc = _splat_lane(builder, sm, [2 * g] * half + [2 * g + 1] * half)
        else:
            sc = _splat_lane(builder, sm, [g] * LANES)
        acc = builder.add(acc, builder.mul(lanes, sc))
    if kind in _OFFSET:
        return acc, None
    bs32 = builder.sext(bsv, _vec(_I32, 16))
    if kind == "q2":  # mins . the 16-value activation sums, folded to 8 lanes
        m = builder.mul(bs32, _splat_lane(builder, sm, list(range(16, 32))))
        return acc, builder.add(_splat_lane(builder, m, list(range(0, 16, 2))),
                                _splat_lane(builder, m, list(range(1, 16, 2))))
    # mins . (pair sums of the 16-value activation sums), as 8 lanes
    pairs = builder.add(_splat_lane(builder, bs32, list(range(0, 16, 2))),
                        _splat_lane(builder, bs32, list(range(1, 16, 2))))
    return acc, builder.mul(pairs, _splat_lane(builder, sm, list(range(8, 16))))


_KSIZE = {"q4": 144, "q5": 176, "q6": 210, "q7": 276, "iq4": 136, "q2": 84, "tq2": 66}
# byte offset of d (Q4_K/Q5_K/Q2_K: dmin follows)
_KD_OFF = {"q4": 0, "q5": 0, "q6": 208, "q7": 272, "iq4": 0, "q2": 80, "tq2": 64}
_OFFSET = {"q6": 32, "q7": 64, "tq2": 1}  # the code offset of Q6_K / Q7_K / TQ2_0 (no mins)
_NO_MINS = ("q6", "q7", "iq4", "tq2")
_PER16 = ("q6", "q7", "q2")  # one scale per 16 values (the others: per 32, or none)


def _row_dot_k(kind: str, ntok: int) -> Any:
    """An intrinsic rowdot(w, x, xd, bsums, t, out, r) -> None: out[t + j, r] for j < ntok, one
    K-quant weight row against Q8_K activation rows (2-D arrays). Each super-block is unpacked
    once and dotted against the ntok rows: per token d_x * d_w times float(int lanes) fused into
    an f32 register accumulator and -d_x * dmin_w times summ into a scalar one; a fixed-order
    horizontal sum at the end. A token's float operations do not depend on ntok."""
    size = _KSIZE[kind]

    def typer(typingctx: Any, w: Any, x: Any, xd: Any, bsums: Any, t: Any, out: Any,
              r: Any) -> Any:
        sig = types.void(w, x, xd, bsums, t, out, r)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            w_p, acts, t_v, (out_t, out_v), r_v, nb = _row_front(
                context, builder, signature, args, 1, 1)  # super-blocks: xd's width
            u64 = ir.IntType(64)
            toks = _token_rows(context, builder, t_v, ntok, acts)
            zero = ir.Constant(_vec(_F32, LANES), [0.0] * LANES)
            zm = ir.Constant(_vec(_F32, 8), [0.0] * 8)

            def body(i: Any, vals: list[Any]) -> list[Any]:
                base = builder.mul(i, ir.Constant(u64, size))
                _prefetch_span(builder, w_p, builder.add(base, ir.Constant(u64, PREFETCH)), size)
                codes, sm = _unpack_super(builder, w_p, base, kind)
                if HAS_VNNI512:  # two 32-code groups per zmm
                    codes = [_concat(builder, codes[g:g + 2]) for g in range(0, 8, 2)]
                d_at = builder.add(base, ir.Constant(u64, _KD_OFF[kind]))
                dw = (_ld(builder, w_p, d_at, _F32) if kind == "q7"
                      else half_to_float(builder, _ld(builder, w_p, d_at, _I16)))
                dmin = None
                if kind not in _NO_MINS:
                    dmin = half_to_float(builder, _ld(builder, w_p, builder.add(
                        d_at, ir.Constant(u64, 2)), _I16))
                new_acc, new_m = [], []
                scales16, side16 = (_scales16(builder, sm, kind) if DOT4 and kind != "iq4"
                                    else ([], None))
                for j, (x, xd, bs) in enumerate(toks):
                    if kind == "iq4":
                        lanes, mins = _dot_iq4_xs(builder, codes, sm, x, bs, i), None
                    else:
                        lanes, mins = _dot_super(builder, codes, sm, x, bs, i, kind, scales16,
                                                 side16)
                    dx = _ld(builder, xd, builder.mul(i, ir.Constant(u64, 4)), _F32)
                    d = _splat(builder, builder.fmul(dx, dw), LANES)
                    new_acc.append(_fma(builder, d, builder.sitofp(lanes, _vec(_F32, LANES)),
                                        vals[j]))
                    if dmin is not None:
                        dm = _splat(builder, builder.fmul(builder.fneg(dx), dmin), 8)
                        new_m.append(_fma(builder, dm, builder.sitofp(mins, _vec(_F32, 8)),
                                          vals[ntok + j]))
                return new_acc + new_m

            init = [zero] * ntok + ([zm] * ntok if kind not in _NO_MINS else [])
            vals = _phi_loop(builder, nb, init, body)
            totals = [_hsum(builder, vals[j]) for j in range(ntok)]
            if kind not in _NO_MINS:
                totals = [builder.fadd(tot, _hsum(builder, vals[ntok + j]))
                          for j, tot in enumerate(totals)]
            _store_totals(context, builder, out_t, out_v, t_v, r_v, totals)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


define_passes(globals(), "rowdot", lambda qt, n: _row_dot_k(qt[:2], n),
              ("q4_k", "q5_k", "q6_k", "q7_k"))
define_passes(globals(), "rowdot", lambda qt, n: _row_dot_k("iq4", n), ("iq4_xs",))
define_passes(globals(), "rowdot", lambda qt, n: _row_dot_k("q2", n), ("q2_k",))
define_passes(globals(), "rowdot", lambda qt, n: _row_dot_k("tq2", n), ("tq2_0",))
