"""Row dots that read the file's IQ2_XXS / IQ3_XXS / IQ3_S / IQ2_XS / IQ2_S blocks (ggml's
`ggml_vec_dot_<type>_q8_K` arithmetic against the Q8_K activation) as LLVM vector IR
intrinsics, and the expansion of 16 such rows into one Q7_K_PACKED row group (`expand_*`).

The types share one path, generated per type from its layout (`_indices`, `_ksign_indices`,
`_SIGN_BYTES`, `_SCALES`, `SIZES`, `_D_FACTOR`; the layouts in `quant.iquants`). Per 256-value
super-block and 32-value group the grid rows are fetched per index from a constant table
(IQ2_XXS / IQ2_XS / IQ2_S: 8 values an index of 8 / 9 / 10 bits; IQ3_XXS / IQ3_S: 4 values an
index of 8 / 9 bits, IQ3_XXS's halved as `quant.iquants.iq_form` does: its grid is all even,
q = g / 2 with d / 2), the signs as a byte mask: per 7-bit ksigns index from a second table (the
parity bit the 8th sign; IQ2_XXS, IQ3_XXS, IQ2_XS) or from the block's explicit sign bits
(IQ3_S, IQ2_S: each byte spread over 8 lanes and tested against its bit), and the codes made
q + 64 (21..107: vpdpbusd's u8 operand, or pmaddubsw's without VNNI: pair sums <= 2 * 107 * 128,
no saturation; the offset comes back as -64 x the activation's 16-value sums). The codes are
dotted with the Q8_K activation as Q7_K's in `simd.kquants._dot_super` (exact int32 lanes times
the sub-block scales 2 ls + 1, per 16 or 32 values as the type has them, the offset as -64 x
scales . bsums), the lanes summed (exact: |sum| <= 31 * 256 * 43 * 128 < 2^31), and one float
step per super-block, as ggml's: acc = fma(d_w * d_x, float(sum), acc) (d_w ggml's d over 8 for
the IQ2 types: a power of two, so ggml's d * sum * 0.125 the same value). The expanded row
groups run the same steps (`simd.interleaved_k`'s integer-scale Q7_K step, `rowsdotx*_q7_ki`,
lanes = rows), so a row's value is the same bits from either path, whatever the batch. The CPU
backend runs these for `quant.reencode.READ_DIRECT` by default, not under MINFER_IQ_WIDEN
(`reads_direct`; docs/performance.md has the measurements). (The float-scale steps of the
widened Q7_K_PACKED copy, s = fma(d * sc_k, float(sum_k), s) per sub-block, are a chain of 16
dependent fmas per row and super-block: on one row they made the 1.5B's IQ2_XXS ffn_gate 5.0 ms
a token against 1.8 for this, 2 threads, Intel SPR.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from minfer.backends.cpu.kernels.quant.iq_grids import (
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    KSIGNS,
)
from minfer.backends.cpu.kernels.simd.blocks import (
    _F32,
    _I8,
    _I16,
    _I32,
    DOT4,
    HAS_VNNI512,
    _concat,
    _fma,
    _hfold,
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
from minfer.backends.cpu.kernels.simd.kquants import PREFETCH, _dot_super, _scales16
from minfer.backends.cpu.kernels.simd.llvm import half_to_float

_I64 = ir.IntType(64)
OFFSET = 64  # the code offset (Q7_K's)
# The row drivers' rule (`linear.row_drivers.IQDriver`): from this many tokens on, expand each
# group of 16 rows into Q7_K_PACKED's layout and run its passes (AVX2 at least, as they need)
EXPAND_MIN_TOKENS = 8
EXPANDS = DOT4
Q7_SIZE = 276  # bytes of a Q7_K super-block (one row's share of a packed column)


def _grid_words(grid: np.ndarray, dtype: type) -> np.ndarray:
    """A grid's rows as little-endian words (the values as bytes)."""
    return np.ascontiguousarray(grid.astype(np.uint8)).view(dtype).reshape(-1)


# the grid tables (IQ3_XXS's halved, `quant.iquants.iq_form`: its grid is all even), their
# element type; the ksigns masks (0xFF where the value is negated) as i64
_GRIDS = {
    "iq2_xxs": (_I64, _grid_words(IQ2XXS_GRID, np.int64)),
    "iq2_xs": (_I64, _grid_words(IQ2XS_GRID, np.int64)),
    "iq2_s": (_I64, _grid_words(IQ2S_GRID, np.int64)),
    "iq3_xxs": (_I32, _grid_words(IQ3XXS_GRID // 2, np.int32)),
    "iq3_s": (_I32, _grid_words(IQ3S_GRID, np.int32)),
}
_SIGN_MASKS = np.array([sum(0xFF << (8 * j) for j in range(8) if (int(s) >> j) & 1)
                        for s in KSIGNS], np.uint64).view(np.int64)


def _table(builder: Any, name: str, elem: ir.IntType, values: np.ndarray) -> Any:
    """The module's constant array `name` (made on first use)."""
    mod = builder.module
    try:
        return mod.get_global(name)
    except KeyError:
        arr = ir.ArrayType(elem, len(values))
        gv = ir.GlobalVariable(mod, arr, name)
        gv.linkage = "internal"
        gv.global_constant = True
        gv.initializer = ir.Constant(arr, [int(v) for v in values])
        return gv


def _fetch(builder: Any, table: Any, idx: Any) -> Any:
    return builder.load(builder.gep(table, [ir.Constant(_I32, 0), idx]))


def _bits(builder: Any, word: Any, shift: int, mask: int) -> Any:
    """(word >> shift) & mask, as an i64 index."""
    v = builder.and_(builder.lshr(word, ir.Constant(word.type, shift)),
                     ir.Constant(word.type, mask))
    return builder.zext(v, _I64) if word.type.width < 64 else v


def _at(builder: Any, w: Any, base: Any, off: int, ty: ir.Type) -> Any:
    """The `ty` at byte base + off of i8* w."""
    return _ld(builder, w, builder.add(base, ir.Constant(base.type, off)), ty)


# Per type, what group g (values 32 g .. 32 g + 31) of the super-block at byte `base` indexes:
# its grid rows' indices (8 or 4 values a row, in value order), and which of its values are
# negated: either 4 ksigns indices (8 values each; the parity bit the 8th sign) or 32 explicit
# sign bits (4 bytes, value j: bit j % 8 of byte j // 8).
def _indices(builder: Any, w: Any, base: Any, g: int, kind: str) -> list[Any]:
    if kind == "iq2_xxs":  # u8 grid[4], then the word of ksigns indices and ls
        q = _at(builder, w, base, 2 + 8 * g, _I64)
        return [_bits(builder, q, 8 * k, 255) for k in range(4)]
    if kind == "iq3_xxs":  # qs[64]: 8 indices a group
        q = _at(builder, w, base, 2 + 8 * g, _I64)
        return [_bits(builder, q, 8 * k, 255) for k in range(8)]
    if kind == "iq2_xs":  # u16 qs[32]: 9-bit index | 7-bit ksigns index << 9
        q = _at(builder, w, base, 2 + 8 * g, _I64)
        return [_bits(builder, q, 16 * k, 511) for k in range(4)]
    # IQ3_S: qs[64] the low 8 bits, qh[8] (byte g, bit k) the 9th; IQ2_S: qs[32] the low 8
    # bits, qh[8] (byte g, bits 2k, 2k + 1) the 9th and 10th. The indices made as u16 lanes of
    # one vector (the qs bytes widened, or'ed with qh's bits moved to 8 and up), then read from
    # its 64-bit words as IQ2_XS's from its block (scalar, they were twice the instructions)
    n, hi_bits = (8, 1) if kind == "iq3_s" else (4, 2)
    v16 = _vec(ir.IntType(16), n)
    low = builder.zext(_at(builder, w, base, 2 + n * g, _vec(_I8, n)), v16)
    qh = _splat(builder, builder.zext(_at(builder, w, base, 66 + g, _I8), ir.IntType(16)), n)
    high = builder.shl(builder.and_(qh, ir.Constant(v16, [((1 << hi_bits) - 1) << (hi_bits * k)
                                                          for k in range(n)])),
                       ir.Constant(v16, [8 - hi_bits * k for k in range(n)]))
    words = builder.bitcast(builder.or_(low, high), _vec(_I64, n // 4))
    return [_bits(builder, builder.extract_element(words, ir.Constant(_I32, k // 4)),
                  16 * (k % 4), 0xFFFF) for k in range(n)]


def _ksign_indices(builder: Any, w: Any, base: Any, g: int, kind: str) -> list[Any] | None:
    """The group's 4 ksigns indices, or None where its signs are explicit bits."""
    if kind == "iq2_xxs":
        aux = _at(builder, w, base, 6 + 8 * g, _I32)
    elif kind == "iq3_xxs":
        aux = _at(builder, w, base, 66 + 4 * g, _I32)
    elif kind == "iq2_xs":
        q = _at(builder, w, base, 2 + 8 * g, _I64)
        return [_bits(builder, q, 16 * k + 9, 127) for k in range(4)]
    else:
        return None
    return [_bits(builder, aux, 7 * k, 127) for k in range(4)]


_SIGN_BYTES = {"iq3_s": 74, "iq2_s": 34}  # where the explicit sign bits start (4 a group)


def _sign_mask(builder: Any, w: Any, base: Any, g: int, kind: str) -> Any:
    """<32 x i8>: -1 where the group's value is negated, else 0."""
    ks = _ksign_indices(builder, w, base, g, kind)
    if ks is not None:
        sign_t = _table(builder, "minfer_ksign_masks", _I64, _SIGN_MASKS)
        signs = ir.Constant(_vec(_I64, 4), None)
        for k, sk in enumerate(ks):
            signs = builder.insert_element(signs, _fetch(builder, sign_t, sk),
                                           ir.Constant(_I32, k))
        return builder.bitcast(signs, _vec(_I8, 32))
    b4 = _at(builder, w, base, _SIGN_BYTES[kind] + 4 * g, _vec(_I8, 4))
    spread = builder.shuffle_vector(b4, b4, ir.Constant(_vec(_I32, 32),
                                                        [j // 8 for j in range(32)]))
    bit = ir.Constant(_vec(_I8, 32), [((1 << (j % 8)) ^ 0x80) - 0x80 for j in range(32)])
    hit = builder.icmp_unsigned("!=", builder.and_(spread, bit), ir.Constant(_vec(_I8, 32), 0))
    return builder.sext(hit, _vec(_I8, 32))


def _group(builder: Any, w: Any, base: Any, g: int, kind: str) -> Any:
    """Group g (values 32g..32g+31) of the super-block at byte `base` of i8* w: its codes
    q + 64 as <32 x i8>."""
    elem, values = _GRIDS[kind]
    grid_t = _table(builder, f"minfer_{kind}_grid", elem, values)
    idx = _indices(builder, w, base, g, kind)
    grid = ir.Constant(_vec(elem, len(idx)), None)
    for k, ik in enumerate(idx):
        grid = builder.insert_element(grid, _fetch(builder, grid_t, ik), ir.Constant(_I32, k))
    gv = builder.bitcast(grid, _vec(_I8, 32))
    mv = _sign_mask(builder, w, base, g, kind)
    return builder.add(builder.sub(builder.xor(gv, mv), mv), _splat(builder, OFFSET, 32))


# Per type, the 4-bit ls of the 16 sub-blocks (16 values each): (byte offset, i32 words
# loaded, word of sub-block k, its shift). IQ2_XXS: the top 4 bits of its 8 groups' odd words
# from byte 2; IQ3_XXS: of the 8 words from byte 66 (one ls per group, so per two sub-blocks);
# IQ3_S: nibble per group (32 values) from byte 106; IQ2_XS / IQ2_S: nibble per sub-block from
# byte 66 / 74.
_SCALES = {
    "iq2_xxs": (2, 16, [2 * (k // 2) + 1 for k in range(16)], [28] * 16),
    "iq3_xxs": (66, 8, [k // 2 for k in range(16)], [28] * 16),
    "iq3_s": (106, 1, [0] * 16, [4 * (k // 2) for k in range(16)]),
    "iq2_xs": (66, 2, [k // 8 for k in range(16)], [4 * (k % 8) for k in range(16)]),
    "iq2_s": (74, 2, [k // 8 for k in range(16)], [4 * (k % 8) for k in range(16)]),
}
# block bytes; the scale d's factor on ggml's f16 d (`iq_form`)
SIZES = {"iq2_xxs": 66, "iq3_xxs": 98, "iq3_s": 110, "iq2_xs": 74, "iq2_s": 82}
_D_FACTOR = {"iq2_xxs": 0.125, "iq3_xxs": 0.5, "iq3_s": 1.0, "iq2_xs": 0.125, "iq2_s": 0.125}


def _super(builder: Any, w: Any, base: Any, kind: str) -> tuple[list[Any], Any, Any]:
    """The super-block at byte `base`: its eight groups' codes, the 16 sub-block scales 2 ls + 1
    as <16 x i32> and d (f32, ggml's f16 times `_D_FACTOR`)."""
    codes = [_group(builder, w, base, g, kind) for g in range(8)]
    at, n_words, pick, shifts = _SCALES[kind]
    words = _at(builder, w, base, at, _vec(_I32, n_words))
    picked = builder.shuffle_vector(words, words, ir.Constant(_vec(_I32, 16), pick))
    ls = builder.lshr(picked, ir.Constant(_vec(_I32, 16), shifts))
    if kind not in ("iq2_xxs", "iq3_xxs"):  # the nibble's bits above it
        ls = builder.and_(ls, ir.Constant(_vec(_I32, 16), [15] * 16))
    sc = builder.add(builder.shl(ls, ir.Constant(_vec(_I32, 16), [1] * 16)),
                     ir.Constant(_vec(_I32, 16), [1] * 16))
    d = half_to_float(builder, _ld(builder, w, base, _I16))
    if _D_FACTOR[kind] != 1.0:
        d = builder.fmul(d, ir.Constant(_F32, _D_FACTOR[kind]))
    return codes, sc, d


def _row_dot_iq(kind: str, ntok: int) -> Any:
    """An intrinsic rowdot(w, x, xd, bsums, t, out, r) -> None: out[t + j, r] for j < ntok, one
    row of the file's `kind` blocks against Q8_K activation rows (2-D arrays). Each super-block
    is unpacked once for the ntok tokens; per token one float step per super-block (module
    docstring), none depending on ntok."""
    size = SIZES[kind]

    def typer(typingctx: Any, w: Any, x: Any, xd: Any, bsums: Any, t: Any, out: Any,
              r: Any) -> Any:
        sig = types.void(w, x, xd, bsums, t, out, r)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            w_p, acts, t_v, (out_t, out_v), r_v, nb = _row_front(
                context, builder, signature, args, 1, 1)  # super-blocks: xd's width
            u64 = ir.IntType(64)
            toks = _token_rows(context, builder, t_v, ntok, acts)

            def body(i: Any, vals: list[Any]) -> list[Any]:
                base = builder.mul(i, ir.Constant(u64, size))
                _prefetch_span(builder, w_p, builder.add(base, ir.Constant(u64, PREFETCH)), size)
                codes, sc, d = _super(builder, w_p, base, kind)
                if HAS_VNNI512:  # two groups per zmm
                    codes = [_concat(builder, codes[g:g + 2]) for g in range(0, 8, 2)]
                scales16, side16 = _scales16(builder, sc, "q7") if DOT4 else ([], None)
                new = []
                for j, (x, xd, bs) in enumerate(toks):
                    lanes = _dot_super(builder, codes, sc, x, bs, i, "q7", scales16, side16)[0]
                    isum = _hfold(builder, lanes, builder.add)
                    dx = _ld(builder, xd, builder.mul(i, ir.Constant(u64, 4)), _F32)
                    new.append(_fma(builder, builder.fmul(d, dx), builder.sitofp(isum, _F32),
                                    vals[j]))
                return new

            vals = _phi_loop(builder, nb, [ir.Constant(_F32, 0.0)] * ntok, body)
            _store_totals(context, builder, out_t, out_v, t_v, r_v, vals)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


def _expand(kind: str) -> Any:
    """An intrinsic expand(w, g, dst) -> None: rows 16 g .. 16 g + 15 of the file's `kind`
    weight w (uint8 [n_out, nb * size]) written into dst (uint8 [16, nb * 276]) as one
    Q7_K_PACKED row group (`quant.repack.interleave_kquant`'s layout of the rows `widen` made):
    per super-block column the 16 rows' f32 d, their 16 scales side by side, then per 16-value
    sub-block k and code dword m the 16 rows' dwords (byte c of lane i: code 4m + c of row i,
    q + 64). `rowsdotx*_q7_ki(dst, x, xd, aux, t, out, g, 0)` reads it."""
    size = SIZES[kind]

    def typer(typingctx: Any, w: Any, g: Any, dst: Any) -> Any:
        sig = types.void(w, g, dst)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wt, gt, dt = signature.args
            w_a = context.make_array(wt)(context, builder, args[0])
            d_a = context.make_array(dt)(context, builder, args[2])
            w_p = builder.bitcast(w_a.data, _I8.as_pointer())
            d_p = builder.bitcast(d_a.data, _I8.as_pointer())
            row_bytes = builder.extract_value(w_a.shape, 1)
            row_bytes = builder.zext(row_bytes, _I64) if row_bytes.type.width < 64 else row_bytes
            nb = builder.udiv(row_bytes, ir.Constant(_I64, size))
            g_v = context.cast(builder, args[1], gt, types.int64)
            first = builder.mul(builder.mul(g_v, ir.Constant(_I64, 16)), row_bytes)

            def c(v: int) -> Any:
                return ir.Constant(_I64, v)

            def column(s: Any, keep: list[Any]) -> list[Any]:
                col = builder.mul(s, c(16 * Q7_SIZE))
                for row in range(16):
                    base = builder.add(first, builder.add(builder.mul(c(row), row_bytes),
                                                          builder.mul(s, c(size))))
                    codes, sc, d = _super(builder, w_p, base, kind)
                    builder.store(d, builder.bitcast(builder.gep(
                        d_p, [builder.add(col, c(4 * row))]), _F32.as_pointer()), align=1)
                    for k in range(16):
                        builder.store(builder.trunc(builder.extract_element(
                            sc, ir.Constant(_I32, k)), _I8),
                            builder.gep(d_p, [builder.add(col, c(64 + 16 * k + row))]))
                    for gi, cd in enumerate(codes):
                        words = builder.bitcast(cd, _vec(_I32, 8))
                        for j in range(8):  # sub-block 2 gi + j // 4, dword m = j % 4
                            at = 320 + 256 * (2 * gi + j // 4) + 64 * (j % 4) + 4 * row
                            builder.store(builder.extract_element(words, ir.Constant(_I32, j)),
                                          builder.bitcast(builder.gep(
                                              d_p, [builder.add(col, c(at))]),
                                              _I32.as_pointer()), align=1)
                return keep

            _phi_loop(builder, nb, [ir.Constant(_I32, 0)], column)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


define_passes(globals(), "rowdot", _row_dot_iq, tuple(SIZES))
for _kind in SIZES:
    globals()[f"expand_{_kind}"] = _expand(_kind)
