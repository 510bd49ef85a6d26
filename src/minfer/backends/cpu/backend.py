"""The CPU backend: runs every op with the compiled kernels in `kernels/`.

It supports every node, so it is also the backend of last resort in assignment. Matmuls read
weights in their GGUF block format (zero-copy from the file) and quantize their activation once
per input node (memoised in the ExecContext), so q/k/v and gate/up share one quantization of the
same input; only the latest input's quantizations are held (for 512 prefill rows, keeping every
layer's would cost ~100 MB).

Matmuls take the integer-dot path, whose rows are bitwise independent of the batch. Q4_0, Q5_0,
Q8_0, Q4_K and Q6_K weights with a multiple of 16 rows are repacked for it on first use
(`kernels.repack_weight`, kept by the weights in place of the file's pages): an exact
rearrangement, 16 rows interleaved at a time (`kernels.simd_rows`, `simd.interleaved_k`), that
spares
the dots their per-call unpacking.
Only from `prefill_min_tokens(type)` rows on (float weights; quantized ones without an
interleaved copy on CPUs without AVX512-VNNI) do they dequantize weight tiles into BLAS sgemm,
whose per-row rounding depends on the batch shape. A batch-invariant context keeps every
matmul on the integer path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import cast

import numpy as np

from minfer import env, jit_cache
from minfer.backends.base import ExecContext
from minfer.backends.cpu import kernels as K
from minfer.backends.cpu import regions
from minfer.backends.cpu.kernels.attn.kv_formats import (
    BLOCK_BYTES,
    KV_TYPES,
    QK,
    QUANT_TYPES,
    cache_type,
    dequantize_rows,
    is_quant,
    k_rotation,
    new_cache,
    store_rows,
)
from minfer.backends.cpu.kernels.quant.types import (
    KQUANT_TYPES,
    PACKED_TYPES,
    RUNNABLE_TYPE_NAMES,
    qtype_of,
    type_name,
)
from minfer.errors import GraphError, MinferError
from minfer.graph import ir
from minfer.graph.ir import ComputeGraph, Node


class CpuBackend:
    name = "cpu"
    kv_types = KV_TYPES  # KV cache formats its kernels read and write (it owns them: KVHost)

    def supports_op(self, node: Node, graph: ComputeGraph) -> bool:
        return True

    # -- the KV cache's formats (minfer.backends.base.KVHost) -------------------------------
    def check_weight_types(self, types: dict[str, int]) -> None:
        """Refuse weights (tensor name -> GGML type id) of a type the kernels cannot run,
        naming each such type with one of its tensors, before anything is built or compiled."""
        bad: dict[str, str] = {}
        for name, qtype in types.items():
            try:
                qtype_of(qtype)
            except MinferError:
                bad.setdefault(type_name(qtype), name)
        if bad:
            found = ", ".join(f"{t} (such as {n})" for t, n in bad.items())
            raise MinferError(f"this model's weights include {found}, which minfer cannot run; "
                              f"it runs {', '.join(RUNNABLE_TYPE_NAMES)} (minfer quantize "
                              "or llama-quantize makes one of those from the original weights)")

    def check_kv_types(self, k_type: str, v_type: str, head_dim: int) -> None:
        """Refuse an unknown format, or quantized blocks that would straddle attention heads."""
        for what, t in (("K", k_type), ("V", v_type)):
            if t not in KV_TYPES:
                raise MinferError(f"unknown {what} cache type {t!r} (use one of "
                                  f"{', '.join(KV_TYPES)})")
            if t in QUANT_TYPES and head_dim % QK:
                raise MinferError(f"a {t} {what} cache needs head_dim a multiple of {QK} "
                                  f"(this model's is {head_dim})")

    def kv_quantized(self, kv_type: str) -> bool:
        return kv_type in QUANT_TYPES

    def new_kv_cache(self, kv_type: str, n_ctx: int, width: int) -> np.ndarray:
        return new_cache(kv_type, n_ctx, width)

    def new_conv_state(self, n_seq: int, l_cache: int, n_embd: int) -> np.ndarray:
        return K.new_state(n_seq, l_cache, n_embd)

    def new_delta_state(self, n_seq: int, n_v_heads: int, head_dim: int) -> np.ndarray:
        return K.new_delta_state(n_seq, n_v_heads, head_dim)

    def snapshot_state(self, state: np.ndarray, seq: int) -> np.ndarray:
        return state[seq].copy()

    def restore_state(self, state: np.ndarray, seq: int, snapshot: np.ndarray) -> None:
        state[seq] = snapshot

    def move_kv(self, k: np.ndarray, v: np.ndarray, *, src_start: int, src_end: int,
                dst_start: int, head_dim: int,
                rekey: Callable[[np.ndarray], np.ndarray] | None) -> None:
        """A quantized K cache's rows are dequantized with their Hadamard rotation undone,
        re-keyed, rotated again and quantized (one more quantization of the keys, as llama.cpp's
        build_rope_shift does); a float cache's are re-keyed as stored and written back in its
        dtype. V's rows, whatever their format, are copied byte for byte."""
        n = src_end - src_start
        if rekey is None:
            k[dst_start:dst_start + n] = k[src_start:src_end].copy()
        elif is_quant(k):
            kv_type = cache_type(k)
            rot = k_rotation(kv_type, head_dim)
            width = k.shape[1] // BLOCK_BYTES[kv_type] * QK
            rows = rekey(dequantize_rows(k[src_start:src_end], width, rot=rot))
            store_rows(rows.astype(np.float32), k, np.arange(dst_start, dst_start + n), rot=rot)
        else:
            k[dst_start:dst_start + n] = rekey(k[src_start:src_end]).astype(k.dtype)
        v[dst_start:dst_start + n] = v[src_start:src_end].copy()  # the ranges may overlap

    def bind_node(
        self, node: Node, srcs: list[np.ndarray | None], out: np.ndarray | None, ctx: ExecContext
    ) -> list[Callable[[], None]]:
        """The node as calls with everything resolved that stays fixed for this graph and its
        buffers (weights and their bound kernels, op fields, the path a shape takes, the checks
        of shapes): its steps of the op tape. No steps for nodes that do nothing (KV loads:
        attention reads the persistent region itself; `Written` buffers: a later node fills
        them)."""
        if isinstance(node.op, ir.KvcacheLoad | ir.Written):
            return []
        binder = _BINDERS.get(type(node.op))
        if binder is None:
            raise GraphError(f"cpu backend has no kernel for {node.op.kind}")
        # each compiled kernel called past numba's per-call typing
        return [jit_cache.direct(step)
                for step in binder(node, cast(Srcs, srcs), cast(np.ndarray, out), ctx)]


    def compose(self, steps: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """Each run of steps with a region form as one parallel region (`cpu.regions`)."""
        return regions.compose(steps)


Srcs = list[np.ndarray]  # KV loads/stores are the only nodes with a None buffer


_FLOATS = frozenset({K.QType.F32, K.QType.F16, K.QType.BF16})


def _activation_form(qtype: int) -> int | str:
    """Which quantized activation a weight type reads: Q8_K, Q8_0(+sums), or a float form."""
    if qtype in KQUANT_TYPES:
        return "q8_k"
    return qtype if qtype in _FLOATS else "q8_0"


@dataclass(frozen=True)
class _Projection:
    """A weight as the CPU backend runs it, resolved once per model weights: the file's tensor
    for the sgemm path, and the integer kernel bound to the (possibly repacked) copy."""

    raw: np.ndarray
    raw_type: int
    sgemm_from: int  # rows from which the sgemm path is taken (outside batch-invariant use)
    form: int | str  # the quantized activation it reads (shared by weights of one input)
    quant_type: int  # the type `quantize_activation` is asked for
    packed: np.ndarray  # the weight as the integer kernel reads it (raw, or repacked)
    run: K.PrequantKernel


def _projection(ctx: ExecContext, w_name: str, n_in: int, rows: int = 0) -> _Projection:
    """The weight as run, or (rows > 0) its first `rows` output rows: views of the same
    arrays, with the kernel bound to the slice."""
    key = ("cpu-projection", w_name, rows, ctx.batched)
    p = ctx.weights.state.get(key)
    if p is None and rows:
        whole = _projection(ctx, w_name, n_in)
        p = ctx.weights.state[key] = replace(
            whole, raw=whole.raw[:rows], packed=whole.packed[:rows],
            run=K.bind_prequant(whole.packed[:rows], whole.quant_type))
    if p is None:
        raw, qtype = ctx.weights.matrix(w_name)
        w, qt = raw, qtype
        packed = K.packable(qtype, n_in, raw.shape[0], ctx.batched)
        if packed:
            w, qt = ctx.weights.derived(w_name, K.PACKED_FORM, _repack_into)
        w, qt = _widened(w, qt, n_in, raw.shape[0], ctx.batched)
        packed = packed or qt in PACKED_TYPES.values()
        # an interleaved copy runs every batch size (its dots beat the sgemm path throughout,
        # and the file's pages then stay out of memory)
        p = ctx.weights.state[key] = _Projection(
            raw, qtype, K.prefill_min_tokens(qt if packed else qtype), _activation_form(qt), qt,
            w, K.bind_prequant(w, qt))
    assert isinstance(p, _Projection)
    return p


def bound_matrix_nbytes(weights_state: dict[object, object]) -> dict[str, int]:
    """Bytes of each matrix the integer kernels have been bound to so far (`_projection`, whole
    weights), by name, from a `ModelWeights.state`: the array a matmul reads, i.e. the file's
    bytes, its repacked copy, or the copy `K.integer_weight` widened (Q3_K, IQ3/IQ2/IQ1 but
    IQ2_XXS / IQ3_XXS, which stay the file's blocks unless MINFER_IQ_WIDEN)."""
    return {str(key[1]): p.packed.nbytes for key, p in weights_state.items()
            if isinstance(p, _Projection) and isinstance(key, tuple) and not key[2]}


def _shared_scratch(ctx: ExecContext, kind: str, size: int) -> np.ndarray:
    """A scratch buffer of at least `size` f32 values that every node of this kind shares, in
    every graph of the engine (one forward runs at a time): kept with the model's weights,
    replaced by a larger one when a node needs more (tapes bound earlier keep theirs)."""
    key = ("cpu-scratch", kind)
    buf = ctx.weights.state.get(key)
    if buf is None or buf.size < size:
        buf = ctx.weights.state[key] = np.empty(size, np.float32)
    assert isinstance(buf, np.ndarray)
    return buf


def _f32_rows(ctx: ExecContext, w_name: str, n_in: int, rows: int) -> np.ndarray:
    """The weight (its first `rows` outputs when rows > 0) dequantized to f32."""
    raw, qtype = ctx.weights.matrix(w_name)
    return K.dequantize(raw[:rows] if rows else raw, qtype, n_in)


def _dense_weight(ctx: ExecContext, w_name: str, n_in: int, rows: int = 0) -> K.DenseWeight:
    """The weight (its first `rows` outputs when rows > 0) dequantized to f32 in `K.gemm`'s
    layout, made once per model weights."""
    key = ("cpu-dense-f32", w_name, rows)
    dw = ctx.weights.state.get(key)
    if dw is None:
        dw = ctx.weights.state[key] = K.dense_weight(_f32_rows(ctx, w_name, n_in, rows))
    assert isinstance(dw, K.DenseWeight)
    return dw


def _amx_weight(ctx: ExecContext, w_name: str, n_in: int, rows: int = 0) -> K.AmxWeight | None:
    """The weight in `K.bind_gemm_amx`'s bf16 layout where an encoder runs it on AMX tiles:
    the process may use them and the file stores the weight below f32 (an f32 file keeps the
    exact f32 GEMM; so does every file under MINFER_ENCODER_F32). None otherwise. Made once
    per model weights."""
    key = ("cpu-amx-bf16", w_name, rows)
    if key not in ctx.weights.state:
        below_f32 = (ctx.weights.matrix(w_name)[1] != K.QType.F32
                     and not env.flag("MINFER_ENCODER_F32"))
        ctx.weights.state[key] = (K.amx_weight(_f32_rows(ctx, w_name, n_in, rows))
                                  if below_f32 and K.amx_usable() else None)
    aw = ctx.weights.state[key]
    assert aw is None or isinstance(aw, K.AmxWeight)
    return aw


def _i16_weight(ctx: ExecContext, w_name: str, n_in: int, rows: int = 0) -> K.I16Weight | None:
    """The weight in `K.bind_gemm_i16`'s layout where an encoder runs it on the int16 x int8
    GEMM: the file stores it in a block type (Q8_0's own codes; any other re-encoded to int8
    codes per 32 values from its f32 values), K is whole blocks, AMX tiles are not usable and
    neither MINFER_ENCODER_F32 nor MINFER_ENCODER_INT8 is set. None otherwise. Made once per
    model weights."""
    key = ("cpu-encoder-i16", w_name, rows)
    if key not in ctx.weights.state:
        raw, qtype = ctx.weights.matrix(w_name)
        use = (qtype not in _FLOATS and n_in % 32 == 0 and not env.flag("MINFER_ENCODER_F32")
               and not env.flag("MINFER_ENCODER_INT8") and not K.amx_usable())
        codes = None
        if use and qtype == K.QType.Q8_0:
            codes = K.q8_0_codes(raw[:rows] if rows else raw)
        elif use:
            codes = K.int8_codes(_f32_rows(ctx, w_name, n_in, rows))
        ctx.weights.state[key] = None if codes is None else K.i16_weight(*codes)
    iw = ctx.weights.state[key]
    assert iw is None or isinstance(iw, K.I16Weight)
    return iw


def _expert_weight(ctx: ExecContext, w_name: str) -> K.ExpertWeight:
    """A stacked expert tensor ([n_expert, n_out, ...] in numpy order) as the expert drivers
    read it: repacked 16 rows at a time where the dense weight would be (each expert's rows a
    multiple of 16, so the flat repack is every expert's), widened where `integer_weight`
    widens; made once per model weights."""
    key = ("cpu-experts", w_name, ctx.batched)
    ew = ctx.weights.state.get(key)
    if ew is None:
        n_in, n_out, n_expert = ctx.weights.file.tensors[w_name].shape
        raw, qtype = ctx.weights.matrix(w_name)
        w, qt = raw.reshape(n_expert * n_out, -1), qtype
        if K.packable(qtype, n_in, n_out, ctx.batched):
            w, qt = ctx.weights.derived(w_name, K.PACKED_FORM, _repack_into)
        w, qt = _widened(w, qt, n_in, n_out, ctx.batched)
        ew = ctx.weights.state[key] = K.ExpertWeight(w.reshape(n_expert, n_out, -1), qt)
    assert isinstance(ew, K.ExpertWeight)
    return ew


def _expert_halves(ctx: ExecContext, w_name: str) -> tuple[K.ExpertWeight, K.ExpertWeight]:
    """A stacked [gate | up] expert tensor as two (contiguous copies of its halves, made once
    per model weights)."""
    key = ("cpu-expert-halves", w_name, ctx.batched)
    halves = ctx.weights.state.get(key)
    if halves is None:
        both = _expert_weight(ctx, w_name)
        n_ff = both.w3.shape[1] // 2
        halves = ctx.weights.state[key] = tuple(
            K.ExpertWeight(np.ascontiguousarray(both.w3[:, part]), both.qtype)
            for part in (slice(0, n_ff), slice(n_ff, 2 * n_ff)))
    assert isinstance(halves, tuple)
    return halves


def _widened(w: np.ndarray, qt: int, n_in: int, n_out: int, batched: bool
              ) -> tuple[np.ndarray, int]:
    """`K.integer_weight`'s copy (Q3_K, the i-quants below 4 bits: widened once, shared by
    both paths; IQ4_NL / IQ4_XS / MXFP4 / TQ1_0 / TQ2_0, IQ2_XXS / IQ3_XXS unless
    MINFER_IQ_WIDEN, and the rest: the weight itself),
    repacked where its type packs (the packed copy replaces the widened one): the widened Q6_K
    rows run 2.2x faster at 64 tokens interleaved (896 x 4864, 2 threads, Intel SPR: IQ3_XXS
    2.00 -> 0.92 ms) and ~10% faster at one; the Q7_K rows (the 1.5B's IQ2_XXS / IQ2_S
    weights, and its IQ3_XXS FFN, `quant.reencode`) 2.2-3.2x faster at 512 tokens, alike at
    one."""
    w, wt = K.integer_weight(w, qt)
    if wt != qt and K.packable(wt, n_in, n_out, batched):  # n_out: one expert's rows
        return K.repack_weight(w, wt)
    return w, wt


def _repack_into(rows: np.ndarray, qtype: int, out: np.ndarray) -> int:
    """`ModelWeights.derived`'s maker for the repacked layout."""
    return int(K.repack_weight(rows, qtype, out)[1])


def _encoder_integer(ctx: ExecContext, w_name: str) -> bool:
    """Whether an encoder (a dense-f32 context) runs this weight on the integer dots, as a
    decoder does: only under MINFER_ENCODER_INT8, where AMX tiles are not usable (where they are,
    the bf16 GEMM is faster) and the file stores the weight in a block type the dots read (Q8_0,
    Q4_K, ...). The activation is then rounded to Q8_0 as llama.cpp rounds it, each row's value
    the same bits in any batch. Not the default: that rounding costs all-MiniLM q8_0 a cosine of
    0.9989 to sentence-transformers (0.9996 on the f32 GEMM, the tests' bound 0.999), and on AVX2
    the int8 dots' sign trick runs at the f32 GEMM's speed (87-101 against 93 GFLOP/s, round 18).
    Without either flag such a weight runs on `_i16_weight`'s int16-activation GEMM instead."""
    key = ("cpu-encoder-integer", w_name)
    if key not in ctx.weights.state:
        ctx.weights.state[key] = (env.flag("MINFER_ENCODER_INT8")
                                  and ctx.weights.matrix(w_name)[1] not in _FLOATS
                                  and not env.flag("MINFER_ENCODER_F32") and not K.amx_usable())
    return bool(ctx.weights.state[key])


def _bind_project(w_name: str, x_node: int, x: np.ndarray, out: np.ndarray,
                  ctx: ExecContext, rows: int = 0, bias: np.ndarray | None = None,
                  epilogue: bool = False) -> list[Callable[[], None]]:
    """`_project` with its decisions taken once: the path this shape takes, the kernel bound to
    its arrays, and the activation's quantization where this is the first reader of x; then
    the bias, if any: in the kernel's epilogue where `epilogue` (`fusion.fuse_bias`) and the
    kernel has one, else an add step after it (the same bits)."""
    if ctx.dense_f32 and not _encoder_integer(ctx, w_name):
        raise GraphError("a dense-f32 context runs its projections as MatMul nodes only")
    p = _projection(ctx, w_name, x.shape[1], rows)
    steps: list[Callable[[], None]]
    if x.shape[0] >= p.sgemm_from and not ctx.batch_invariant:
        steps = [partial(K.matmul_sgemm, p.raw, p.raw_type, x, out)]
    else:
        xq, quantize = _activation_slot(ctx, x_node, x, p)
        if xq is None:  # a float weight: its rounded activation is made per call
            run, qt = p.run, p.quant_type
            steps = [lambda: run(K.quantize_activation(x, qt), out)]
        elif bias is not None and epilogue and K.takes_bias(p.quant_type):
            return [*quantize, K.bind_prequant_into(p.packed, p.quant_type, xq, out, bias)]
        else:
            steps = [*quantize, K.bind_prequant_into(p.packed, p.quant_type, xq, out)]
    if bias is not None:
        steps.append(K.bind_add(out, bias, out))
    return steps


def _activation_slot(ctx: ExecContext, x_node: int, x: np.ndarray, p: _Projection
                     ) -> tuple[K.Q8Blocks | K.Q8KBlocks | None, list[Callable[[], None]]]:
    """The tape's buffer for x in p's quantized form, and the quantize call to emit before this
    reader (none when the buffer already holds x: the readers of one input run one after
    another in build order, as q/k/v and gate/up do). One buffer per shape and form, reused by
    every input of that shape, so a prefill graph holds one activation's quantizations at a
    time, as the interpreter does."""
    slots = ctx.memo.setdefault("tape-activations", {})
    key = (x.shape, p.form)
    slot = slots.get(key)
    if slot is None:
        xq = K.new_activation(x.shape[0], x.shape[1], p.quant_type)
        if xq is None:
            return None, []
        slot = slots[key] = [None, xq]
    if slot[0] == x_node:
        return slot[1], []
    slot[0] = x_node
    return slot[1], [K.bind_quantize(x, slot[1])]


_UP_SCRATCH_MAX_ROWS = 64  # rows up to which the fused gate/up keeps up apart from its output


# -- binders: the op tape's form of the handlers: each node's calls with everything resolved ----

Binder = Callable[[Node, Srcs, np.ndarray, ExecContext], list[Callable[[], None]]]


def _bind_matmul(node: Node, srcs: Srcs, out: np.ndarray,
                 ctx: ExecContext) -> list[Callable[[], None]]:
    assert isinstance(node.op, ir.MatMul)
    x, w_name = srcs[0], node.meta.weights[0]
    if ctx.dense_f32 and not _encoder_integer(ctx, w_name):  # the bias added tile by tile
        bias = ctx.weights.vector(node.meta.weights[1]) if len(node.meta.weights) > 1 else None
        aw = _amx_weight(ctx, w_name, x.shape[1], node.op.rows)
        if aw is not None:
            return [K.bind_gemm_amx(x, aw, out, bias)]
        iw = _i16_weight(ctx, w_name, x.shape[1], node.op.rows)
        if iw is not None:
            return K.bind_gemm_i16(x, iw, out, _shared_scratch(
                ctx, "gemm", K.gemm_i16_scratch_size(x.shape[0], x.shape[1])), bias)
        scratch = _shared_scratch(ctx, "gemm", K.gemm_scratch_size(x.shape[0], x.shape[1]))
        return [K.bind_gemm(x, _dense_weight(ctx, w_name, x.shape[1], node.op.rows), out,
                            scratch, bias)]
    bias = ctx.weights.vector(node.meta.weights[1]) if len(node.meta.weights) > 1 else None
    return _bind_project(w_name, node.srcs[0], x, out, ctx, node.op.rows, bias=bias,
                         epilogue=node.op.fused_bias)


def _bind_fused_gate_up(node: Node, srcs: Srcs, out: np.ndarray,
                        ctx: ExecContext) -> list[Callable[[], None]]:
    assert isinstance(node.op, ir.FusedGateUp)
    fused = _fused_gate_up_step(node, srcs[0], out, ctx)
    if fused is not None:
        return fused
    # the tape's own scratch, held as long as the tape. With its output aliasing an input, the
    # activation's element loop fails LLVM's runtime overlap check and runs scalar (0.5B decode:
    # 24 us a layer, 3 us vectorised, the same bits): a third buffer where rows are few
    gate = np.empty_like(out)
    up = np.empty_like(out) if out.shape[0] <= _UP_SCRATCH_MAX_ROWS else out
    act = (partial(K.geglu, gate, up, out) if node.op.act == "gelu"
           else K.bind_swiglu(gate, up, out))
    return [*_bind_project(node.meta.weights[0], node.srcs[0], srcs[0], gate, ctx),
            *_bind_project(node.meta.weights[1], node.srcs[0], srcs[0], up, ctx), act]


def _fused_gate_up_step(node: Node, x: np.ndarray, out: np.ndarray,
                        ctx: ExecContext) -> list[Callable[[], None]] | None:
    """Gate, up, SwiGLU and the down activation's quantization as one step (`K.bind_gate_up`,
    `fusion.fuse_gate_up_quant`), after x's quantize step where the tape still needs one; None
    where it cannot stand for the separate steps: GeGLU, the sgemm path or a float weight for
    any of the three projections, gate and up reading different activations, the down activation's
    slot being the input's (one shape and form), out's rows not whole blocks of that form: the
    caller binds those."""
    op = node.op
    assert isinstance(op, ir.FusedGateUp)
    if not op.quant_for or op.act != "silu" or ctx.dense_f32:
        return None
    pg, pu = (_projection(ctx, w, x.shape[1]) for w in node.meta.weights[:2])
    pd = _projection(ctx, op.quant_for, out.shape[1])
    integer = all(isinstance(p.form, str) and (x.shape[0] < p.sgemm_from or ctx.batch_invariant)
                  for p in (pg, pu, pd))
    if not integer or not isinstance(pd.form, str) or pg.form != pu.form \
            or out.shape[1] % K.block_values(pd.form) or (x.shape, pg.form) == (out.shape, pd.form):
        return None
    xq, quantize = _activation_slot(ctx, node.srcs[0], x, pg)
    down = _activation_slot(ctx, node.id, out, pd)[0]  # claimed: down emits no quantize step
    assert xq is not None and down is not None
    return [*quantize, K.bind_gate_up(pg.packed, pg.quant_type, pu.packed, pu.quant_type, xq,
                                      out, down)]


def _bind_get_rows(node: Node, srcs: Srcs, out: np.ndarray,
                   ctx: ExecContext) -> list[Callable[[], None]]:
    if node.meta.weights:
        w, qtype = ctx.weights.matrix(node.meta.weights[0])
        return [K.bind_get_rows(w, qtype, srcs[0], out)]
    x, rows = srcs
    return [partial(np.take, x, rows, axis=0, out=out)]


def _replace_rows(x: np.ndarray, ids: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, x)
    given = np.flatnonzero(ids >= 0)
    if len(given):
        out[given] = rows[ids[given]]


def _bind_slice(node: Node, srcs: Srcs, out: np.ndarray,
                ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.Slice)
    x = srcs[0]
    if op.n_head > 1:  # each head's columns: through [nt, n_head, head] views
        heads = x.reshape(x.shape[0], op.n_head, -1)[:, :, op.start:op.start + op.width]
        return [partial(np.copyto, out.reshape(heads.shape), heads)]
    return [partial(np.copyto, out, x[:, op.start:op.start + op.width])]


def _fused_activation(node: Node, out: np.ndarray,
                      ctx: ExecContext) -> K.Q8Blocks | K.Q8KBlocks | None:
    """The quantized activation a norm's or an attention's step fills for the projections
    reading its rows (`fusion.fuse_norm_quant` / `fuse_attn_quant`: the op's `quant_for`),
    claiming its tape slot so that they emit no quantize step; None where they would not read
    one (a float weight, the sgemm path)."""
    op = node.op
    assert isinstance(op, ir.RmsNorm | ir.AddRmsNorm | ir.Attn)
    if not op.quant_for or ctx.dense_f32:
        return None
    p = _projection(ctx, op.quant_for, out.shape[1])
    if not isinstance(p.form, str) or (out.shape[0] >= p.sgemm_from
                                       and not ctx.batch_invariant):
        return None
    return _activation_slot(ctx, node.id, out, p)[0]


def _bind_rms_norm(node: Node, srcs: Srcs, out: np.ndarray,
                   ctx: ExecContext) -> list[Callable[[], None]]:
    assert isinstance(node.op, ir.RmsNorm)
    w = ctx.weights.vector(node.meta.weights[0])
    xq = _fused_activation(node, out, ctx)
    if xq is not None:
        return [K.bind_norm_quant(srcs[0], None, w, node.op.eps, None, out, xq)]
    return [K.bind_rms_norm(srcs[0], w, node.op.eps, out)]


def _bind_add_rms_norm(node: Node, srcs: Srcs, out: np.ndarray,
                       ctx: ExecContext) -> list[Callable[[], None]]:
    assert isinstance(node.op, ir.AddRmsNorm)
    w = ctx.weights.vector(node.meta.weights[0])
    xq = _fused_activation(node, out, ctx)
    if xq is not None:
        return [K.bind_norm_quant(srcs[0], srcs[1], w, node.op.eps, srcs[2], out, xq)]
    return [K.bind_add_rms_norm(srcs[0], srcs[1], w, node.op.eps, srcs[2], out)]


def _bind_rope(node: Node, srcs: Srcs, out: np.ndarray,
               ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.Rope)
    factors = ctx.weights.vector(node.meta.weights[0]) if node.meta.weights else None
    return [K.bind_rope(srcs[0], srcs[1], n_head=op.n_head, head_dim=op.head_dim,
                        rope_dim=op.rope_dim, base=op.base, style=op.style,
                        freq_scale=op.freq_scale, factors=factors, yarn=op.yarn, out=out,
                        mrope=op.mrope, sections=op.sections)]


def _bind_qk_norm(node: Node, srcs: Srcs, out: np.ndarray,
                  ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.QkNorm)
    weight = ctx.weights.vector(node.meta.weights[0]) if node.meta.weights \
        else np.ones(op.head_dim, np.float32)  # a norm without a weight (Gemma 4's of V)
    return [K.bind_head_rms_norm(srcs[0], weight, n_head=op.n_head, head_dim=op.head_dim,
                                 eps=op.eps, out=out)]


def _bind_kv_store(node: Node, srcs: Srcs, out: np.ndarray,
                   ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.KvcacheStore)
    layer = op.layer
    if op.rope_q is not None and op.rope_k is not None:  # `fusion.fuse_rope_store`
        k, v, cells, q, positions, q_out = srcs
        rq = op.rope_q
        factors = ctx.weights.vector(node.meta.weights[0]) if node.meta.weights else None
        return [K.bind_rope_store(q, k, v, positions, q_out, ctx.kv.k[layer], ctx.kv.v[layer],
                                  cells, n_head=rq.n_head, n_head_kv=op.rope_k.n_head,
                                  head_dim=rq.head_dim, rope_dim=rq.rope_dim, base=rq.base,
                                  style=rq.style, freq_scale=rq.freq_scale, factors=factors,
                                  yarn=rq.yarn, mrope=rq.mrope, sections=rq.sections)]
    return [K.bind_store_kv(srcs[0], srcs[1], ctx.kv.k[layer], ctx.kv.v[layer], srcs[2],
                            head_dim=op.head_dim)]


def _bind_attn(node: Node, srcs: Srcs, out: np.ndarray,
               ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.Attn)
    blocked = not ctx.batch_invariant and srcs[0].shape[0] >= K.ATTN_BLOCKED_MIN_TOKENS
    k_cache, v_cache = ctx.kv.k[op.cache_layer], ctx.kv.v[op.cache_layer]
    sinks = ctx.weights.vector(node.meta.weights[0]) if op.sinks else None
    return K.bind_attention(srcs[0], k_cache, v_cache, srcs[2], srcs[3],
                            n_head=op.n_head, n_head_kv=op.n_head_kv, head_dim=op.head_dim,
                            scale=op.scale, out=out, blocked=blocked, window=op.window,
                            softcap=op.softcap, sinks=sinks, quant=_fused_activation(node, out,
                                                                                       ctx))


def _bind_short_conv(node: Node, srcs: Srcs, out: np.ndarray,
                     ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.ShortConv)
    taps = ctx.weights.vector(node.meta.weights[0]).reshape(op.n_embd, op.l_cache)
    bcx, positions, seq = srcs
    return [K.bind_short_conv(bcx, taps, ctx.kv.states[op.layer], positions, seq, out)]


def _bind_ssm_conv(node: Node, srcs: Srcs, out: np.ndarray,
                   ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.SsmConv)
    taps = ctx.weights.vector(node.meta.weights[0]).reshape(op.channels, op.d_conv)
    x, positions, seq = srcs
    return [K.bind_ssm_conv(x, taps, ctx.kv.states[op.layer], positions, seq, out)]


def _bind_delta_net(node: Node, srcs: Srcs, out: np.ndarray,
                    ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.DeltaNet)
    dt_bias, a = (ctx.weights.vector(w) for w in node.meta.weights)
    qkv, alpha, beta, positions, seq = srcs
    return [K.bind_delta_net(qkv, alpha, beta, dt_bias, a, ctx.kv.matrix_states[op.layer],
                             positions, seq, out, n_k_heads=op.n_k_heads, eps=op.eps)]


def _bind_seq_attn(node: Node, srcs: Srcs, out: np.ndarray,
                   ctx: ExecContext) -> list[Callable[[], None]]:
    op = node.op
    assert isinstance(op, ir.SeqAttn)
    q, k, v, start, end = srcs
    scratch = _shared_scratch(ctx, "attn", K.sequence_attention_scratch_size(*k.shape))
    return [K.bind_sequence_attention(q, k, v, start, end, n_head=op.n_head,
                                      n_head_kv=op.n_head_kv, head_dim=op.head_dim,
                                      scale=op.scale, out=out, scratch=scratch)]


def _bind_moe(node: Node, srcs: Srcs, out: np.ndarray,
              ctx: ExecContext) -> list[Callable[[], None]]:
    """The routed experts over buffers every MoE node of the engine shares (one forward runs at
    a time; 512 prefill rows x 8 experts of a 2048-wide model need ~100 MB)."""
    op = node.op
    assert isinstance(op, ir.Moe)
    if ctx.dense_f32:
        raise GraphError("a dense-f32 context has no mixture-of-experts kernels")

    def scratch(kind: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buf = _shared_scratch(ctx, kind, (n + 3) // 4)
        return buf.view(np.uint8)[:n].view(dtype).reshape(shape)

    def activation(kind: str, x: np.ndarray, qtype: int) -> K.Q8Blocks | K.Q8KBlocks | None:
        empty = K.new_activation(x.shape[0], x.shape[1], qtype)
        if empty is None:
            return None
        form = type(empty).__name__
        parts = {name: scratch(f"{kind}-{form}-{name}", arr.shape, arr.dtype.type)
                 for name, arr in vars(empty).items()}
        return type(empty)(**parts)

    names = node.meta.weights
    if op.fused_gate_up:  # Gemma 4: [gate | up] in one tensor, its halves copied apart once
        gate, up = _expert_halves(ctx, names[0])
    else:
        gate, up = (_expert_weight(ctx, name) for name in names[:2])
    down = _expert_weight(ctx, names[2])
    biases = None
    if op.biased:
        gate_b, up_b, down_b = (ctx.weights.vector(name) for name in names[3:6])
        biases = (gate_b, up_b, down_b)
    scale = ctx.weights.vector(names[-1]) if op.down_scale else None
    return K.bind_moe(srcs[0], srcs[1], gate, up, down, n_used=op.n_used, norm=op.norm,
                      act=op.act, out=out, scratch=scratch, activation=activation,
                      gating=op.gating, biases=biases, expert_scale=scale)


def moe_routes(ctx: ExecContext, n_rows: int, n_used: int,
               n_ff: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the MoE node that ran last left in the scratch its kernels share (read before the
    next MoE node runs; `minfer imatrix`'s per-expert statistics): each row's experts
    ids [n_rows, n_used] int32, where each (row, slot) pair went among the grouped rows
    pos [n_rows * n_used] int64, and the grouped down projections' input act [pairs, n_ff]
    f32 (the gate applied)."""
    pairs = n_rows * n_used

    def view(kind: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        buf = ctx.weights.state[("cpu-scratch", kind)]
        n = int(np.prod(shape))
        return cast(np.ndarray, buf.view(np.uint8)[:n * np.dtype(dtype).itemsize]
                    .view(dtype).reshape(shape))

    return (view("moe-ids", (n_rows, n_used), np.int32), view("moe-pos", (pairs,), np.int64),
            view("moe-act", (pairs, n_ff), np.float32))


def _bind_sigmoid_gate(node: Node, srcs: Srcs, out: np.ndarray,
                       ctx: ExecContext) -> list[Callable[[], None]]:
    w = ctx.weights.vector(node.meta.weights[0])
    return [partial(K.sigmoid_gate, srcs[0], srcs[1], w, out)]


def _bind_layer_norm(node: Node, srcs: Srcs, out: np.ndarray,
                     ctx: ExecContext) -> list[Callable[[], None]]:
    assert isinstance(node.op, ir.LayerNorm)
    w, b = (ctx.weights.vector(name) for name in node.meta.weights)
    return [K.bind_layer_norm(srcs[0], w, b, node.op.eps, out)]


def _bind_pool(node: Node, srcs: Srcs, out: np.ndarray,
               ctx: ExecContext) -> list[Callable[[], None]]:
    assert isinstance(node.op, ir.Pool)
    return [K.bind_pool(srcs[0], srcs[1], srcs[2], node.op.mode, out)]


def _concat(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    width = a.shape[1]
    out[:, :width] = a
    out[:, width:] = b


def _join_rows(x: np.ndarray, out: np.ndarray) -> None:
    out[:] = x.reshape(out.shape)


def _bind_scale(node: Node, srcs: Srcs, out: np.ndarray,
                ctx: ExecContext) -> list[Callable[[], None]]:
    assert isinstance(node.op, ir.Scale)
    return [partial(K.scale, srcs[0], node.op.factor, out)]


def _bind_softcap(node: Node, srcs: Srcs, out: np.ndarray,
                  ctx: ExecContext) -> list[Callable[[], None]]:
    assert isinstance(node.op, ir.Softcap)
    return [partial(K.softcap, srcs[0], node.op.cap, out)]


def _bind_call(kernel: Callable[..., None]) -> Binder:
    """A kernel without a `bind_*` twin, called with the node's sources and output."""
    def bind(node: Node, srcs: Srcs, out: np.ndarray,
             ctx: ExecContext) -> list[Callable[[], None]]:
        return [partial(kernel, *srcs, out)]

    return bind


def _bind_kernel(kernel: Callable[..., Callable[[], None]]) -> Binder:
    def bind(node: Node, srcs: Srcs, out: np.ndarray,
             ctx: ExecContext) -> list[Callable[[], None]]:
        return [kernel(*srcs, out)]

    return bind


_BINDERS: dict[type, Binder] = {
    ir.GetRows: _bind_get_rows,
    ir.Slice: _bind_slice,
    ir.ReplaceRows: _bind_call(_replace_rows),
    ir.RmsNorm: _bind_rms_norm,
    ir.AddRmsNorm: _bind_add_rms_norm,
    ir.MatMul: _bind_matmul,
    ir.FusedGateUp: _bind_fused_gate_up,
    ir.Add: _bind_kernel(K.bind_add),
    ir.Mul: _bind_kernel(K.bind_mul),
    ir.SwiGLU: _bind_kernel(K.bind_swiglu),
    ir.Silu: _bind_kernel(K.bind_silu),
    ir.Rope: _bind_rope,
    ir.QkNorm: _bind_qk_norm,
    ir.KvcacheStore: _bind_kv_store,
    ir.Attn: _bind_attn,
    ir.ShortConv: _bind_short_conv,
    ir.SsmConv: _bind_ssm_conv,
    ir.DeltaNet: _bind_delta_net,
    ir.SigmoidMul: _bind_call(K.sigmoid_mul),
    ir.Gelu: _bind_call(K.gelu),
    ir.GeGLU: _bind_call(K.geglu),
    ir.GeluErf: _bind_call(K.gelu_erf),
    ir.Tanh: _bind_call(K.tanh),
    ir.Softmax: _bind_call(K.softmax_rows),
    ir.LayerNorm: _bind_layer_norm,
    ir.SeqAttn: _bind_seq_attn,
    ir.Pool: _bind_pool,
    ir.JoinRows: _bind_call(_join_rows),
    ir.RoundF16: _bind_call(K.round_f16),
    ir.Concat: _bind_call(_concat),
    ir.Moe: _bind_moe,
    ir.SigmoidGate: _bind_sigmoid_gate,
    ir.Scale: _bind_scale,
    ir.Softcap: _bind_softcap,
}
