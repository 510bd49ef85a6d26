"""Row-group dots for Q4_0 / Q5_0 / Q8_0 / IQ4_NL / MXFP4 weights interleaved sixteen rows at a
time (`quant.repack.interleave_block32`), as LLVM vector IR intrinsics (AVX512-VNNI; IQ4_NL /
MXFP4: Q4_0's nibbles through the type's levels by one vpshufb, then Q8_0's dots, `LUTS`).

The interleaved layout stores, for each group of 16 weight rows and each block column b, the
16 rows' block b as one packed group (`_group`): vector j holds codes 4j..4j+3 of every row,
row i in int32 lane i. So the lanes of every vector
are the 16 rows, and one token's 16 exact block sums come from 8 vpdpbusd against the token's
activation dwords broadcast (no transposed activation, no horizontal sums). Per token and row
group the float work is, block after block:

    acc_(b % 2)[rows] = fma(d_w[rows] * d_x[b], float(sum[rows] - offset * xsum[b]), acc_(b % 2))

one FMA per block into one of two 16-lane accumulators (lane = row; even and odd blocks, which
halves the serial chain: one accumulator measured 1.3-2.3x the rounding error of the former
layout's 16 lanes, two 1.1-1.6x, at the same speed), whose sum is stored as the 16 outputs.

The per-token float operations do not depend on how many tokens share a pass (1, 2, 4 or 8), so
a token's result is bitwise the same alone (decode) or batched: batch-invariant by construction.
Against the former per-row layout (each row's groups of 16 blocks transposed) this drops
the activation transpose and the horizontal sums, and one token's 16 rows share one activation
broadcast. Measured on Intel Xeon (Sapphire Rapids), 2 threads, a 4864 x 896 weight in cache:
Q5_0 0.126 -> 0.061 ms at 1 token, 0.87 -> 0.46 at 16, 5.7 -> 3.4 at 128; Q8_0 0.105 -> 0.089,
0.52 -> 0.20, 3.9 -> 1.5. (AMX int8 tiles for the block sums measured no faster: with one float
fold per block and token, the fold is the limit, not the integer products. Measured again with
`tdpbsud` reading a Q8_0 group's eight code vectors as its B tile, bitwise these kernels' sums:
16 tokens a tile 1.19-1.29x for Q8_0 and 0.94x for Q5_0 (codes staged through memory), 2 x 2
tiles of 32 tokens 0.9-1.1x; the vector loads of a stored tile wait for the tile stores.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.quant.iq_grids import IQ4_LEVELS, MXFP4_LEVELS
from minfer.backends.cpu.kernels.simd.blocks import (
    _F32,
    _I1,
    _I8,
    _I16,
    _I32,
    HAS_VNNI,
    HAS_VNNI512,
    _concat,
    _dots_pairs16,
    _fma,
    _half,
    _ld,
    _lookup,
    _phi_loop,
    _prefetch_span,
    _splat,
    _vec,
    _vpdpbusd,
    _x86,
    define_passes,
    e8m0_floats,
)
from minfer.backends.cpu.kernels.simd.llvm import halves_to_floats, target_has

ROWS = 16  # weight rows per interleaved group (int32 lanes of a zmm)
# Software prefetch of the weight stream: this many bytes ahead, into L2 (prefetcht1). A decode
# step streams weights from DRAM; 1 KiB into L1 (the per-row kernels' setting then, see
# `simd.blocks.PREFETCH`) left a row group's stream short of it. Measured on weights three times the
# size of the L3 (Intel Xeon SPR, 2 threads, 1 and 4 tokens): Q5_0 1.19-1.30x, Q8_0
# 1.17-1.20x faster; 2 KiB ahead only 1.08-1.10x, 6-16 KiB like 4; the locality mattered less
# than the distance here.
ROWS_PREFETCH = 4096
PF_LOCALITY = 2
_U64 = ir.IntType(64)


# name: (block bytes, qh offset or None, code offset, signed codes)
LAYOUTS = {"q4_0": (18, None, 8, False), "q5_0": (22, 2, 16, False), "q8_0": (34, None, 128, True),
           "iq4_nl": (18, None, 128, True), "mxfp4": (17, None, 128, True)}
# IQ4_NL / MXFP4: 4-bit codes packed as Q4_0's, each vector of nibbles mapped through the
# type's 16 int8 levels by one vpshufb (`simd.blocks._lookup`) into Q8_0's signed codes (as
# level ^ 0x80 with VNNI, the offset 128 left to cb; int8 for the sign trick), then Q8_0's
# dots. MXFP4's scales are the rows' E8M0 bytes (one byte a row, not an f16).
LUTS = {"iq4_nl": tuple(int(v) for v in IQ4_LEVELS),
        "mxfp4": tuple(int(v) for v in MXFP4_LEVELS)}
E8M0 = frozenset({"mxfp4"})
# Q8_0 without VNNI: AVX2's pmaddubsw would saturate on the u8 form of its codes (255 x -128
# pairs), so the codes go back to int8 and each product takes the sign trick of ggml's AVX2
# dots: |w| . sign(x, w), pairs at most 2 x 128 x 127. Exact sums, no offset correction
# (`Q8_ROWS_OFFSET`: the driver's `block_corr` offset, 0 here).
SIGN_TRICK = not HAS_VNNI
Q8_ROWS_OFFSET = 0 if SIGN_TRICK else 128
# Q5_0's 5th bits where no mask registers are (AVX2, AVX-VNNI): the repacked group holds them
# bit-sliced, bit j of byte 4i + c that of row i's code 4j + c, so each code vector takes its
# bits with one 16-bit shift and an and (the 64-bit masks of AVX-512, a <64 x i1> a k-register
# reads at no cost, took a broadcast, a shuffle, an and and a compare per ymm). The same
# integers, so the same bits. AMD EPYC Zen 3, 2 threads, 4864 x 896 (in cache), best of 80:
# 1 token 0.083-0.092 -> 0.065-0.073 ms, 4 tokens 0.186-0.195 -> 0.140-0.144, 16 tokens
# 0.516-0.527 -> 0.454-0.470; pp512 of the dev model 328-330 -> 351-353 tok/s. A single-stream
# decode step streams these weights from DRAM and measured no faster.
QH_SLICED = not target_has("avx512bw")
# Without VNNI, Q4_0 / Q5_0 codes (<= 15 / 31) take `simd.blocks._dots_pairs16`: int16 pair
# sums added eight / four code vectors at a time before each pmaddwd (Q8_0's signed codes
# cannot: their pairs reach 2^15 alone).
PAIRS16 = not HAS_VNNI and not HAS_VNNI512
# Without zmm (AVX2, AVX-VNNI: 16 ymm registers) a pass of several tokens takes a group's 16
# rows as two 8-row halves, one block loop each (`row_spans`): one loop over the 16 rows kept
# their 8 code vectors (16 ymm) and each token's 4 accumulators live at once, and spilled (491
# stack accesses in the Q4_0 driver, 184 after). AMD EPYC Zen 3, 2 threads, 16 tokens, best of
# 30 over several alternations on a noisy host: Q4_K 896 x 4864 0.554 -> 0.409 ms, 8960 x 1536
# 1.72 -> 1.28, Q6_K 0.540 -> 0.504, Q5_0 0.542 -> 0.517. One token keeps the single loop
# (memory-bound: two loops stream a group twice, and measured no faster), and so does Q8_0 (no
# codes to unpack; 151936 x 896 at 16 tokens measured slower in two). Each lane's float steps
# are those of the single loop, so the bits are too.
@dataclass(frozen=True)
class RowSpan:
    """The rows of a group one block loop covers: `lanes` rows from row `first` (lanes first..
    of every interleaved vector and scale run); `prefetch`: this loop streams the weights in
    (a second half reads what the first brought in)."""

    lanes: int
    first: int
    prefetch: bool = True


WHOLE = RowSpan(ROWS, 0)
_HALVES = (RowSpan(ROWS // 2, 0), RowSpan(ROWS // 2, ROWS // 2, prefetch=False))


def row_spans(ntok: int) -> tuple[RowSpan, ...]:
    """The block loops of an ntok-token pass: the 16 rows at once, or (several tokens, no zmm)
    two halves."""
    return _HALVES if ntok > 1 and not HAS_VNNI512 else (WHOLE,)


def _data(context: Any, builder: Any, aryty: Any, ary: Any) -> Any:
    """i8* to an array's first byte."""
    arr = context.make_array(aryty)(context, builder, ary)
    return builder.bitcast(arr.data, _I8.as_pointer())


def _dim(context: Any, builder: Any, aryty: Any, ary: Any, k: int) -> Any:
    """Dimension k of an array, as i64."""
    arr = context.make_array(aryty)(context, builder, ary)
    d = builder.extract_value(arr.shape, k)
    return builder.zext(d, _U64) if d.type.width < 64 else d


def _c(v: int) -> ir.Constant:
    return ir.Constant(_U64, v)


class _Front:
    """The intrinsics' arguments (w, x, xd, cb, t, out, g[, wg]) as pointers and i64 values: the
    outputs are row group g's, the weight rows group wg's of w (g's without wg)."""

    def __init__(self, context: Any, builder: Any, sig: Any, args: Any) -> None:
        wt, xt, xdt, cbt, tt, outt, gt = sig.args[:7]
        w, x, xd, cb, t, out, g = args[:7]
        self.w = _data(context, builder, wt, w)
        self.row_bytes = _dim(context, builder, wt, w, 1)
        self.x = _data(context, builder, xt, x)
        self.n_in = _dim(context, builder, xt, x, 1)
        self.nb = builder.udiv(self.n_in, _c(32))
        self.xd = _data(context, builder, xdt, xd)
        self.cb = _data(context, builder, cbt, cb)
        self.out = _data(context, builder, outt, out)
        self.n_out = _dim(context, builder, outt, out, 1)
        self.t = context.cast(builder, t, tt, types.int64)
        self.g = context.cast(builder, g, gt, types.int64)
        wg = self.g if len(args) < 8 else context.cast(builder, args[7], sig.args[7], types.int64)
        self.slab = builder.mul(builder.mul(wg, _c(ROWS)), self.row_bytes)

    def token(self, builder: Any, j: int) -> tuple[Any, ...]:
        """Byte offsets of token t + j's rows in x, in xd / cb (4-byte items), and of its 16
        outputs out[t + j, 16 g ..]."""
        tj = builder.add(self.t, _c(j))
        return (builder.mul(tj, self.n_in), builder.mul(tj, builder.mul(self.nb, _c(4))),
                builder.mul(_c(4), builder.add(builder.mul(tj, self.n_out),
                                               builder.mul(self.g, _c(ROWS)))))

    def group(self, builder: Any, b: Any, size: int) -> Any:
        """Byte offset of block column b's packed group in the row group's slab."""
        return builder.add(self.slab, builder.mul(b, _c(ROWS * size)))


def prefetch_span(builder: Any, w: Any, start: Any, n_bytes: int) -> None:
    """Prefetch n_bytes of i8* `w` from byte `start` on into L2 (PF_LOCALITY): the weight
    stream ahead of a row group's dots (`simd.blocks._prefetch_span`)."""
    _prefetch_span(builder, w, start, n_bytes, PF_LOCALITY)


def halves(builder: Any, w: Any, at: Any, lanes: int = ROWS) -> Any:
    """`lanes` rows' f16 scales at byte `at` of i8* `w`, as <lanes x f32>."""
    return halves_to_floats(builder, _ld(builder, w, at, _vec(_I16, lanes)))


def _group(builder: Any, w: Any, base: Any, has_qh: bool, signed: bool,
           rows: RowSpan = WHOLE, name: str = "") -> tuple[list[Any], Any]:
    """Block column b of a row group, its packed group at byte `base` of i8* `w`: eight
    <64 x i8> code vectors (vector j = codes 4j..4j+3 of every row, row i at dword i) and the
    rows' scales as <16 x f32>; for a half `rows` only its 8 rows (<32 x i8> vectors,
    <8 x f32> scales). Group bytes (`quant.repack._repack_group` with
    block i = row i): 16 f16 scales, then
    - Q4_0 / Q5_0: (Q5_0) eight 64-bit masks, bit 4i + c of mask j = 5th bit of code 4j + c of
      row i (`QH_SLICED`: 64 bytes, bit j of byte 4i + c = that bit) | four 64-byte chunks,
      byte 4i + c of chunk j = qs byte 4j + c of row i (low nibble: code 4j + c, high nibble:
      code 16 + 4j + c);
    - Q8_0 (`signed`): the eight vectors themselves, codes stored as code ^ 0x80 (the u8
      operand of vpdpbusd);
    - IQ4_NL / MXFP4 (`name` in LUTS): as Q4_0 (MXFP4: 16 E8M0 bytes in place of the f16
      scales), the nibbles then mapped to Q8_0's codes through the type's levels."""
    lanes, first = rows.lanes, rows.first
    n = 4 * lanes  # bytes per code vector
    if name in E8M0:
        dw = e8m0_floats(builder, _ld(builder, w, builder.add(base, _c(first)), _vec(_I8, lanes)))
    else:
        dw = halves(builder, w, builder.add(base, _c(2 * first)), lanes)
    if signed and name not in LUTS:
        codes = [_ld(builder, w, builder.add(base, _c(2 * ROWS + 4 * ROWS * j + 4 * first)),
                     _vec(_I8, n)) for j in range(8)]
        if SIGN_TRICK:  # back to int8 codes (see SIGN_TRICK)
            codes = [builder.xor(v, _splat(builder, 0x80, n)) for v in codes]
        return codes, dw
    qs = (ROWS if name in E8M0 else 2 * ROWS) + (4 * ROWS if has_qh else 0)
    wt: list[Any] = [None] * 8
    for j in range(4):
        q = _ld(builder, w, builder.add(base, _c(qs + 4 * ROWS * j + 4 * first)), _vec(_I8, n))
        wt[j] = builder.and_(q, _splat(builder, 15, n))
        wt[j + 4] = builder.lshr(q, _splat(builder, 4, n))
    if has_qh and QH_SLICED:  # bit j of byte 4i + c: moved to bit 4 (16-bit lane shifts)
        words = _vec(_I16, n // 2)
        sliced = builder.bitcast(_ld(builder, w, builder.add(base, _c(2 * ROWS + 4 * first)),
                                     _vec(_I8, n)), words)
        for j in range(8):
            by = ir.Constant(words, [abs(4 - j)] * (n // 2))
            moved = sliced if j == 4 else (builder.shl if j < 4 else builder.lshr)(sliced, by)
            bits = builder.and_(builder.bitcast(moved, _vec(_I8, n)), _splat(builder, 16, n))
            wt[j] = builder.or_(wt[j], bits)
    elif has_qh:
        for j in range(8):
            m = _ld(builder, w, builder.add(base, _c(2 * ROWS + ROWS // 2 * j + first // 2)),
                    ir.IntType(n))
            bits = builder.zext(builder.bitcast(m, _vec(_I1, n)), _vec(_I8, n))
            wt[j] = builder.or_(wt[j], builder.shl(bits, _splat(builder, 4, n)))
    if name in LUTS:  # Q8_0's form of the levels: int8 for the sign trick, else level ^ 0x80
        table = tuple(v if SIGN_TRICK else v ^ -128 for v in LUTS[name])
        wt = [_lookup(builder, v, table) for v in wt]
    return wt, dw


def _psign(builder: Any, a: Any, b: Any) -> Any:
    """a with each byte's sign taken from b's (negated where b < 0, zero where b == 0):
    AVX2's psignb, a <64 x i8> as two ymm halves."""
    if a.type.count == 64:
        return _concat(builder, [_psign(builder, _half(builder, a, k), _half(builder, b, k))
                                 for k in (0, 1)])
    return _x86(builder, "llvm.x86.avx2.psign.b", a.type, [a, b])


def _fold(builder: Any, front: _Front, tok: tuple[Any, Any, Any], b: Any, isum: Any, dw: Any,
          acc: Any) -> Any:
    """acc + (d_w * d_x) * float(isum - offset * xsum): the one float step per token and block,
    emitted identically for every token count (isum: the exact sum, correction included)."""
    so = tok[1]
    lanes = dw.type.count
    dx = _ld(builder, front.xd, builder.add(so, builder.mul(b, _c(4))), _F32)
    d = builder.fmul(dw, _splat(builder, dx, lanes))
    return _fma(builder, d, builder.sitofp(isum, _vec(_F32, lanes)), acc)


def _corr(builder: Any, front: _Front, tok: tuple[Any, Any, Any], b: Any,
          lanes: int = ROWS) -> Any:
    """The token's -offset * (block b's activation sum), splat over `lanes` rows."""
    c = _ld(builder, front.cb, builder.add(tok[1], builder.mul(b, _c(4))), _I32)
    return _splat(builder, c, lanes)


def _store(builder: Any, front: _Front, toks: list[tuple[Any, ...]], acc: list[Any],
           first: int = 0) -> None:
    """Each token's outputs for rows first.. of the group (as many as `acc`'s lanes), at the
    byte offset its `token` tuple holds third."""
    for tok, a in zip(toks, acc, strict=True):
        at = builder.add(tok[2], _c(4 * first))
        p = builder.bitcast(builder.gep(front.out, [at]), a.type.as_pointer())
        builder.store(a, p, align=4)


def rows_dot(name: str, ntok: int, weight_group: bool = False) -> Any:
    """An intrinsic (w, x, xd, cb, t, out, g) -> None: out[t + j, 16 g + i] for j < ntok and the
    16 rows i of row group g, from the interleaved weight w (uint8 [n_out, row bytes]), the Q8_0
    activation codes x (int8 [nt, n]), their scales xd (f32 [nt, n/32]) and cb (int32
    [nt, n/32], -offset * block sums, `linear.dots32.block_corr`). vpdpbusd against broadcast
    activation dwords; each block's codes unpacked once for the ntok tokens. `weight_group`:
    an eighth argument wg, the row group of w to read (`expand_rows`' copy: 0)."""
    size, qh, offset, signed = LAYOUTS[name]

    def typed(sig: Any) -> Any:

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            f = _Front(context, builder, signature, args)
            toks = [f.token(builder, j) for j in range(ntok)]
            trick = signed and SIGN_TRICK
            pairs16 = PAIRS16 and not signed  # small codes only (not Q8_0's)
            code_max = 2 * offset - 1  # Q4_0: 15, Q5_0: 31

            def block_loop(rows: RowSpan) -> None:
                """The block loop over those rows of the group, stored."""
                lanes = rows.lanes
                n = 4 * lanes

                def body(b: Any, pair: list[Any]) -> list[Any]:
                    acc = pair[:ntok]  # this block's accumulators; the other set waits a block
                    base = f.group(builder, b, size)
                    if rows.prefetch:
                        prefetch_span(builder, f.w, builder.add(base, _c(ROWS_PREFETCH)),
                                      ROWS * size)
                    wt, dw = _group(builder, f.w, base, qh is not None, signed, rows, name)
                    mags = [_psign(builder, v, v) for v in wt] if trick else wt  # |w|, once
                    new = []
                    for tok, a in zip(toks, acc, strict=True):
                        xo = builder.add(tok[0], builder.mul(b, _c(32)))
                        xs = []
                        for k in range(8):
                            xw = _ld(builder, f.x, builder.add(xo, _c(4 * k)), _I32)
                            xv = builder.bitcast(_splat(builder, xw, lanes), _vec(_I8, n))
                            xs.append(_psign(builder, xv, wt[k]) if trick else xv)
                        zero = ir.Constant(_vec(_I32, lanes), None)
                        if pairs16:
                            isum = _dots_pairs16(builder, wt, xs,
                                                 _corr(builder, f, tok, b, lanes), code_max)
                        else:
                            # one chain per token (the tokens' chains run side by side): two,
                            # added at the end, were 15-18% slower on 8 and 16 tokens (Q5_0
                            # 4864 x 896, Intel SPR); the same integers, so the same bits
                            isum = zero if trick else _corr(builder, f, tok, b, lanes)
                            for k in range(8):
                                isum = _vpdpbusd(builder, mags[k], xs[k], isum)
                        new.append(_fold(builder, f, tok, b, isum, dw, a))
                    return pair[ntok:] + new  # even and odd blocks alternate

                zero = ir.Constant(_vec(_F32, lanes), [0.0] * lanes)
                pair = _phi_loop(builder, f.nb, [zero] * (2 * ntok), body)
                _store(builder, f, toks, [builder.fadd(a, b) for a, b in zip(
                    pair[:ntok], pair[ntok:], strict=True)], rows.first)

            for rows in row_spans(ntok) if not signed or name in LUTS else (WHOLE,):
                block_loop(rows)
            return context.get_dummy_value()

        return sig, codegen

    def typer(typingctx: Any, w: Any, x: Any, xd: Any, cb: Any, t: Any, out: Any, g: Any
              ) -> Any:
        return typed(types.void(w, x, xd, cb, t, out, g))

    def typer_wg(typingctx: Any, w: Any, x: Any, xd: Any, cb: Any, t: Any, out: Any, g: Any,
                 wg: Any) -> Any:
        return typed(types.void(w, x, xd, cb, t, out, g, wg))

    return intrinsic(typer_wg if weight_group else typer)


define_passes(globals(), "rowsdot", rows_dot, ("q4_0", "q5_0", "q8_0", "iq4_nl", "mxfp4"))
# Q8_0's passes over a row group held elsewhere (`expand_rows`' copy of a Q4_0 / Q5_0 group)
define_passes(globals(), "rowsdotx", lambda qt, n: rows_dot(qt, n, True), ("q8_0",))


def expand_rows(name: str) -> Any:
    """An intrinsic (w, g, dst) -> None: row group g of the interleaved Q4_0 / Q5_0 weight w
    written into dst (uint8 [16, n/32 * 34]) as an interleaved Q8_0 group, which
    `rowsdotx*_q8_0(dst, x, xd, cb, t, out, g, 0)` reads with the Q4_0 / Q5_0 driver's own cb:
    the same f16 scales, each code as it is (0..15 / 0..31: vpdpbusd's u8 operand, the offset
    left to cb). The integer block sums are exact, so every output keeps the bits of
    `rowsdot*_<name>` on w. Unpacked once for all the passes over a token tile, where each pass
    of the Q4_0 / Q5_0 kernels unpacks every block again. VNNI targets only: with the sign
    trick Q8_0's passes read signed codes and no cb (the drivers expand only without it)."""
    size, qh, _, _ = LAYOUTS[name]
    q8_size = LAYOUTS["q8_0"][0]

    def typer(typingctx: Any, w: Any, g: Any, dst: Any) -> Any:
        sig = types.void(w, g, dst)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wt, gt, dt = signature.args
            wp = _data(context, builder, wt, args[0])
            row_bytes = _dim(context, builder, wt, args[0], 1)
            nb = builder.udiv(row_bytes, _c(size))
            gv = context.cast(builder, args[1], gt, types.int64)
            slab = builder.mul(builder.mul(gv, _c(ROWS)), row_bytes)
            dp = _data(context, builder, dt, args[2])

            def body(b: Any, vals: list[Any]) -> list[Any]:
                base = builder.add(slab, builder.mul(b, _c(ROWS * size)))
                to = builder.mul(b, _c(ROWS * q8_size))
                codes, _ = _group(builder, wp, base, qh is not None, False, name=name)
                scales = _ld(builder, wp, base, _vec(_I8, 2 * ROWS))
                builder.store(scales, builder.bitcast(builder.gep(dp, [to]),
                                                      scales.type.as_pointer()), align=1)
                for j, v in enumerate(codes):
                    at = builder.gep(dp, [builder.add(to, _c(2 * ROWS + 4 * ROWS * j))])
                    builder.store(v, builder.bitcast(at, v.type.as_pointer()), align=1)
                return vals

            _phi_loop(builder, nb, [], body)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


expand_q4_0: Any = None if SIGN_TRICK else expand_rows("q4_0")
expand_q5_0: Any = None if SIGN_TRICK else expand_rows("q5_0")
expand_iq4_nl: Any = None if SIGN_TRICK else expand_rows("iq4_nl")
