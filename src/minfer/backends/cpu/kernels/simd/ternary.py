"""TQ1_0's row dot product, read from the file's blocks, as LLVM vector IR intrinsics.

ggml's `block_tq1_0` (256 values in 54 bytes): qs[48] | qh[4] | d f16. Each byte holds base-3
digits, most significant first: qs[m] (m < 32) the digits of values m, 32 + m, .., 128 + m;
qs[32 + m] (m < 16) those of values 160 + m, 176 + m, .., 224 + m; qh[m] (m < 4) those of
values 240 + m, 244 + m, 248 + m, 252 + m. Value v = d * (digit - 1). ggml reads digit n of a
byte t as ((t * 3^n) mod 256) * 3 >> 8 (`ggml_vec_dot_tq1_0_q8_K`), that is
floor(3 frac(t 3^n / 256)) = A_n - 3 A_(n-1) with A_n = floor(t 3^(n+1) / 256) (A_-1 = 0): the
number the byte's first n + 1 digits make. So a byte's dot with its values' activations x_n is

    sum_n digit_n x_n = sum_n A_n (x_n - 3 x_(n+1))        (x past the byte's last digit: 0)

and A_n is one unsigned 16-bit high multiply, pmulhuw(t, 256 * 3^(n+1)) (t * 62208 < 2^32):
no digit is ever unpacked. The activation side y_v = x_v - 3 x_(v + step) (`linear.dots_tq1`,
made once per call from the Q8_K codes: |y| <= 508, int16) pairs with the A words in the
values' own order, and the row dot is per super-block 8 vpdpwssd of 32 words (AVX512-VNNI;
AVX2: pmaddwd and an add on ymm halves) against the A words made once for every token of a
pass: 8 pmulhuw of the zero-extended bytes (qs[0:32] by the five multipliers; qs[32:48]
twice per vector, and qh's 4 bytes 4 times beside its last digit, by per-lane multipliers).
The exact int32 lanes start from the activation's -sum(x) over the super-block (the -1 of
every value: ggml's subtraction of the bsums), then d_x * d_w * float(lanes) goes into an f32
register accumulator per token; one fixed-order horizontal sum per row. A token's float
operations do not depend on how many tokens a pass dots (batch-invariant, as `simd.kquants`).
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
    DOT4,
    _fma,
    _half,
    _hsum,
    _ld,
    _phi_loop,
    _prefetch_span,
    _row_front,
    _splat,
    _store_totals,
    _token_rows,
    _vec,
    define_passes,
)
from minfer.backends.cpu.kernels.simd.kquants import PREFETCH, _vpdpwssd
from minfer.backends.cpu.kernels.simd.llvm import half_to_float

SIZE = 54  # bytes of a 256-value block
_D_OFF = 52
# 256 * 3^(n+1): pmulhuw by it leaves A_n, the number a byte's first n + 1 digits make
_MUL = tuple(256 * 3 ** (n + 1) for n in range(5))
# qh byte m's digit k at word 16 + 2 m + k % 2 + 8 (k // 2) of the last group (i32 lanes
# 8 + m and 12 + m: all four in lanes = m mod 4, see `_row_dot_tq1`)
QH_SLOTS = tuple((m, k) for half in range(2) for m in range(4) for k in (2 * half, 2 * half + 1))
# the 8 groups of 32 words: (source bytes in the <32 x i8> at byte 22 of the block, or None for
# qs[0:32] as loaded; each word's multiplier). Groups 0..4: digit n of qs[0:32] (values 32 n + m);
# 5, 6: digits 0, 1 and 2, 3 of qs[32:48] (values 160 .. 223); 7: its digit 4 (224 .. 239), then
# qh's digits in the QH_SLOTS order (values 240 + 4 k + m)
_GROUPS: tuple[tuple[tuple[int, ...] | None, tuple[int, ...]], ...] = (
    *((None, (_MUL[n],) * 32) for n in range(5)),
    (tuple(range(10, 26)) * 2, (_MUL[0],) * 16 + (_MUL[1],) * 16),
    (tuple(range(10, 26)) * 2, (_MUL[2],) * 16 + (_MUL[3],) * 16),
    (tuple(range(10, 26)) + tuple(26 + m for m, _ in QH_SLOTS),
     (_MUL[4],) * 16 + tuple(_MUL[k] for _, k in QH_SLOTS)),
)


def _mulhi_u16(builder: Any, a: Any, mults: tuple[int, ...]) -> Any:
    """<n x i16> high halves of the unsigned products a * mults (one pmulhuw a vector)."""
    n = a.type.count
    wide = _vec(_I32, n)
    prod = builder.mul(builder.zext(a, wide), ir.Constant(wide, list(mults)))
    return builder.trunc(builder.lshr(prod, ir.Constant(wide, [16] * n)), _vec(_I16, n))


def _madd16(builder: Any, acc: Any, a: Any, b: Any) -> Any:
    """acc + sums of adjacent i16 x i16 products: vpdpwssd / pmaddwd (`simd.kquants`), or
    without AVX2 the same exact sums in i32 lanes."""
    if DOT4:
        return _vpdpwssd(builder, acc, a, b)
    n = a.type.count
    m = builder.mul(builder.sext(a, _vec(_I32, n)), builder.sext(b, _vec(_I32, n)))
    even = builder.shuffle_vector(m, m, ir.Constant(_vec(_I32, n // 2), list(range(0, n, 2))))
    odd = builder.shuffle_vector(m, m, ir.Constant(_vec(_I32, n // 2), list(range(1, n, 2))))
    return builder.add(acc, builder.add(even, odd))


def digit_numbers(builder: Any, w: Any, base: Any) -> list[Any]:
    """The block at byte `base` of the row at i8* `w` as its 8 groups of 32 values' A words
    (<32 x i16> each, in the values' order): A_n of the byte holding each value's digit."""
    u64 = base.type
    lo = _ld(builder, w, base, _vec(_I8, 32))  # qs[0:32]
    hi = _ld(builder, w, builder.add(base, ir.Constant(u64, 22)), _vec(_I8, 32))  # .. qh, d
    words = builder.zext(lo, _vec(_I16, 32))
    out = []
    for src, mults in _GROUPS:
        if src is not None:
            words = builder.zext(builder.shuffle_vector(hi, hi, ir.Constant(
                _vec(_I32, 32), list(src))), _vec(_I16, 32))
        out.append(_mulhi_u16(builder, words, mults))
    return out


def _row_dot_tq1(ntok: int) -> Any:
    """An intrinsic rowdot(w, xy, xd, xn, t, out, r) -> None: out[t + j, r] for j < ntok, one
    TQ1_0 weight row against the activation rows as `linear.dots_tq1.tq1_activation` leaves
    them (xy int16 [nt, n]: the y values in the A words' order; xd f32 [nt, n/256]: the Q8_K
    scales; xn int32 [nt, n/256]: -sum(x) per super-block). Each block's A words are made once
    for the ntok rows.

    A lane's sum of A_n y_n is a sum of digit x x products only where it holds every digit of
    its bytes (the telescoping); otherwise its terms are up to 242 x larger than the values
    they stand for, and the f32 steps would round at that scale. The 16 i32 lanes are added
    down to 4 before the float steps: lane j mod 4 then holds all digits of qs bytes 2j, 2j + 1
    (qs[0:32]: lane j of groups 0..4; qs[32:48]: lanes j and 8 + j of groups 5 .. 7) and of qh
    byte j mod 4 (`QH_SLOTS`), so each of the 4 is an exact partial sum of the block's
    digit x x products, as ggml's integer sum is."""
    lanes = 4

    def typer(typingctx: Any, w: Any, xy: Any, xd: Any, xn: Any, t: Any, out: Any,
              r: Any) -> Any:
        sig = types.void(w, xy, xd, xn, t, out, r)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            w_p, acts, t_v, (out_t, out_v), r_v, nb = _row_front(
                context, builder, signature, args, 1, 1)  # super-blocks: xd's width
            u64 = ir.IntType(64)
            toks = _token_rows(context, builder, t_v, ntok, acts)
            zero = ir.Constant(_vec(_F32, lanes), [0.0] * lanes)
            zi = ir.Constant(_vec(_I32, 16), [0] * 16)

            def body(i: Any, vals: list[Any]) -> list[Any]:
                base = builder.mul(i, ir.Constant(u64, SIZE))
                _prefetch_span(builder, w_p, builder.add(base, ir.Constant(u64, PREFETCH)), SIZE)
                nums = digit_numbers(builder, w_p, base)
                dw = half_to_float(builder, _ld(builder, w_p, builder.add(
                    base, ir.Constant(u64, _D_OFF)), _I16))
                yo = builder.mul(i, ir.Constant(u64, 512))
                fo = builder.mul(i, ir.Constant(u64, 4))
                new = []
                for j, (xy, xd, xn) in enumerate(toks):
                    acc = builder.insert_element(zi, _ld(builder, xn, fo, _I32),
                                                 ir.Constant(_I32, 0))
                    for k, a in enumerate(nums):
                        y = _ld(builder, xy, builder.add(yo, ir.Constant(u64, 64 * k)),
                                _vec(_I16, 32))
                        acc = _madd16(builder, acc, a, y)
                    while acc.type.count > lanes:  # halves added (exact)
                        acc = builder.add(_half(builder, acc, 0), _half(builder, acc, 1))
                    d = _splat(builder, builder.fmul(_ld(builder, xd, fo, _F32), dw), lanes)
                    new.append(_fma(builder, d, builder.sitofp(acc, _vec(_F32, lanes)),
                                    vals[j]))
                return new

            vals = _phi_loop(builder, nb, [zero] * ntok, body)
            _store_totals(context, builder, out_t, out_v, t_v, r_v,
                          [_hsum(builder, v) for v in vals])
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


define_passes(globals(), "rowdot", lambda qt, n: _row_dot_tq1(n), ("tq1_0",))
