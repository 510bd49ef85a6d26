"""The engine's forward pass: params → reuse or build → fill inputs → execute → logits.

An `Engine` owns one session's context: n_ctx fixed at creation, the persistent KV regions, the
allocator, the graph cache and the backends. `forward` takes a batch as plain data (token ids,
RoPE positions, the KV cell each token writes, the KV window each token reads, the rows whose
logits are wanted) and returns an owned `[n_out, n_vocab]` float32 array. A single sequence is
the common case (`forward(tokens, positions)`); several sequences batched together only change
the data, never the graph.

A model with recurrent layers (LFM2) also holds, per sequence, a state the backend owns beside
the KV cells (`KVRegions.states`: the cells split into `hold_sequences(n)` equal ranges, a
row's sequence is its cell's range, given to the graph as data). That state holds every token
so far and cannot be rewound by truncation: a sequence's rows continue exactly where its state
stands, restart at position 0 (which zeroes it), or continue from a state checkpoint (kept
per sequence at the end of each multi-row forward and on request: `StateCheckpoints`, restored
when the rows start there); anything else is refused loudly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, cast

import numba
import numpy as np
from numba.core import config

from minfer import env, jit_cache
from minfer.backends.base import Backend, ExecContext, KVHost
from minfer.backends.checkpoints import StateCheckpoints
from minfer.backends.cpu.backend import CpuBackend
from minfer.engine.config import EngineConfig
from minfer.engine.threads import ThreadTuner
from minfer.engine.trace import StepTracer, tracer_from_env
from minfer.engine.weights import ModelWeights
from minfer.errors import ContextOverflowError, MinferError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import scheduler
from minfer.graph.alloc import Allocator, KVRegions, plan_buffers
from minfer.graph.cache import GraphCache, PreparedGraph
from minfer.graph.fusion import fuse
from minfer.graph.ir import ComputeGraph, InputKind
from minfer.graph.params import ContextParams, GraphParams
from minfer.models.registry import graph_builder_for

# Steps of up to this many rows (decode, several sequences' decode) choose their thread count by
# measured step times (`engine.threads`); larger ones (prefill) take every thread.
TUNED_MAX_TOKENS = 16
# Tapes of up to this many rows run their steps as parallel regions (`backends.cpu.regions`);
# larger ones call each step on its own. Measured side by side in one process (Intel Xeon SPR,
# 2 threads, the dev model, batch-invariant): 1 row +7% (0.5B) / +10% (1.5B) tok/s, 16 rows
# 38.9 against 40.2 ms a step, 128-row prefill chunks 325 against 295 ms (the row drivers'
# parts each recompute the activation's per-call corrections, and f16-KV attention over more
# than 64 rows is a Python step that splits the tape into a region per layer anyway).
REGION_MAX_ROWS = 32


def regions_pay(n_rows: int) -> bool:
    """Whether a tape of n_rows rows runs its steps as parallel regions (REGION_MAX_ROWS)."""
    return n_rows <= REGION_MAX_ROWS


@dataclass(frozen=True)
class Batch:
    """One forward's worth of tokens; every field is input data, none is topology."""

    tokens: np.ndarray  # [nt] int32
    positions: np.ndarray  # [nt] RoPE positions
    cells: np.ndarray  # [nt] KV cell written by each token
    kv_start: np.ndarray  # [nt] first readable cell per token
    kv_end: np.ndarray  # [nt] one past the last readable cell per token
    out_rows: np.ndarray  # [n_out] rows whose logits are returned (ascending)
    # Several whole inputs packed together (`Batch.sequences`): each token's sequence bounds in
    # the batch (an encoder's attention), its token type, and the rows pooled per output row.
    seq_start: np.ndarray | None = None
    seq_end: np.ndarray | None = None
    token_types: np.ndarray | None = None
    out_start: np.ndarray | None = None
    out_end: np.ndarray | None = None
    # Given embedding rows (an image's, `with_rows`): each row's row of `embd` in place of its
    # token's embedding (-1: its token's), and the rows [k, n_embd] float32.
    embd_ids: np.ndarray | None = None
    embd: np.ndarray | None = None
    # Each row's hidden state from a target model [nt, n_embd] float32: an MTP head's input.
    hidden: np.ndarray | None = None
    # M-RoPE (a model with rope sections): [4, nt] t / h / w / e rope positions of each row
    # (None: each text row's position thrice, then 0, as llama.cpp's)
    rope_pos: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def mrope_positions(self) -> np.ndarray:
        """The [4 nt] section-major positions an M-RoPE graph reads."""
        if self.rope_pos is not None:
            return np.ascontiguousarray(self.rope_pos, np.int32).reshape(-1)
        p = np.asarray(self.positions, np.int32)
        return np.concatenate([p, p, p, np.zeros_like(p)])

    def with_rows(self, at: int, rows: np.ndarray, *, causal: bool = False) -> Batch:
        """This batch with `rows` in place of the token embeddings of batch rows [at, at + k)
        (an image's), which read each other both ways: each one's KV window ends at the
        block's end (llama.cpp decodes a Gemma 3 image chunk non-causally; `causal`: as text,
        as it decodes the others). The rows enter unscaled."""
        k = int(rows.shape[0])
        if not 0 <= at <= self.n_tokens - k or k == 0:
            raise MinferError(f"{k} given rows at batch row {at} do not fit {self.n_tokens} rows")
        ids = np.full(self.n_tokens, -1, np.int32) if self.embd_ids is None \
            else self.embd_ids.copy()
        if np.any(ids[at:at + k] >= 0):
            raise MinferError("given rows overlap")
        base = 0 if self.embd is None else int(self.embd.shape[0])
        ids[at:at + k] = np.arange(base, base + k, dtype=np.int32)
        kv_end = self.kv_end.copy()
        if not causal:
            kv_end[at:at + k] = kv_end[at + k - 1]
        embd = np.asarray(rows, np.float32)
        return replace(self, embd_ids=ids, kv_end=kv_end,
                       embd=embd if self.embd is None else np.concatenate([self.embd, embd]))

    @classmethod
    def sequences(cls, seqs: Sequence[Sequence[int]], *, pooling: str,
                  types: Sequence[Sequence[int]] | None = None) -> Batch:
        """Whole inputs packed one after another, each from position 0 in the cells of its
        rows, reading only itself (causally through the KV cache in a decoder; all of itself
        in an encoder). The output rows are one per input (its first row for cls pooling, its
        last for last / rank... as `out_rows`, its whole range as out_start / out_end), or every
        row for pooling "none"."""
        if not seqs or any(len(s) == 0 for s in seqs):
            raise MinferError("every packed input needs at least one token")
        lens = np.array([len(s) for s in seqs], np.int32)
        ends = np.cumsum(lens, dtype=np.int32)
        starts = ends - lens
        nt = int(ends[-1])
        rows = np.arange(nt, dtype=np.int32)
        seq_start = np.repeat(starts, lens)
        seq_end = np.repeat(ends, lens)
        if pooling == "none":
            out_rows = rows.copy()
        elif pooling in ("cls", "rank"):
            out_rows = starts.copy()
        else:  # last, and mean (whose graph keeps every row; out_rows only sizes the output)
            out_rows = ends - 1
        return cls(
            tokens=np.concatenate([np.asarray(s, np.int32) for s in seqs]),
            positions=rows - seq_start,
            cells=rows.copy(),
            kv_start=seq_start.copy(),
            kv_end=rows + 1,
            out_rows=out_rows,
            seq_start=seq_start,
            seq_end=seq_end,
            token_types=(np.concatenate([np.asarray(t, np.int32) for t in types])
                         if types is not None else np.zeros(nt, np.int32)),
            out_start=starts,
            out_end=ends,
        )

    @classmethod
    def single(cls, tokens: Sequence[int], start_pos: int, n_out: int = 1) -> Batch:
        """Tokens of one sequence at positions start_pos.. in cells of the same index."""
        nt = len(tokens)
        pos = np.arange(start_pos, start_pos + nt, dtype=np.int32)
        return cls(
            tokens=np.asarray(tokens, dtype=np.int32),
            positions=pos,
            cells=pos.copy(),
            kv_start=np.zeros(nt, np.int32),
            kv_end=pos + 1,
            out_rows=np.arange(nt - n_out, nt, dtype=np.int32),
        )


def _check_invariant(prepared: PreparedGraph) -> None:
    """A forward asked to be batch-invariant must run on the CPU kernels only: backends are
    chosen per graph (by its row counts), and a backend such as torch's (bf16 GEMMs whose rows
    depend on the batch) would give rows of other bits, silently."""
    others = sorted({name for name, _ in prepared.splits if name != "cpu"})
    if others:
        raise MinferError(f"a batch-invariant forward of {prepared.params.n_tokens} rows would "
                          f"run nodes on {', '.join(others)}; only the CPU kernels are "
                          "batch-invariant")


class Engine:
    def __init__(self, gguf_file: GGUFFile, hparams: HParams,
                 config: EngineConfig | None = None, *,
                 backends: Sequence[Backend] | None = None, kv_type: str | None = None,
                 **fields: Any) -> None:
        """An engine for `config` (`EngineConfig`'s defaults when None). Keyword fields
        (`n_ctx=64`, `batch_invariant=True`, …; `kv_type` sets both caches) replace single
        fields of it: the short form tests and tools use."""
        if kv_type is not None:
            fields.setdefault("k_type", kv_type)
            fields.setdefault("v_type", kv_type)
        config = replace(config or EngineConfig(), **fields)
        self.config = config
        n_ctx, k_type, v_type = config.n_ctx, config.k_type, config.v_type
        self._backends = list(backends) if backends else [CpuBackend()]
        self.kv_host = host = kv_host(self._backends)  # the KV's formats (`kv_shift`)
        self.encoder = not hparams.causal  # no KV cache: each forward reads only itself
        host.check_kv_types(k_type, v_type, hparams.head_dim)
        if hparams.attn_softcap and (host.kv_quantized(k_type) or host.kv_quantized(v_type)):
            raise MinferError("this model soft-caps its attention scores, which the quantized "
                              "KV cache kernels do not do; use an f16 or f32 cache")
        if n_ctx < 1:
            raise MinferError(f"n_ctx must be positive, got {n_ctx}")
        self.hparams = hparams
        self.batch_invariant = config.batch_invariant
        self.batched = config.batch_invariant if config.batched is None else config.batched
        host.check_weight_types({name: gguf_file.tensors[name].ggml_type
                                 for name, _ in hparams.expected_shapes()})
        self.weights = ModelWeights(gguf_file)
        vocab_limit = config.vocab_limit
        self.ctx_params = ContextParams(
            n_ctx=n_ctx,
            k_type=k_type,
            v_type=v_type,
            fuse_swiglu=config.fuse_swiglu,
            fuse_gate_up=config.fuse_gate_up,
            fuse_add_norm=config.fuse_add_norm,
            fuse_norm_quant=config.fuse_norm_quant,
            fuse_bias=config.fuse_bias,
            fuse_rope_store=config.fuse_rope_store,
            fuse_attn_quant=config.fuse_attn_quant,
            backends=tuple(b.name for b in self._backends),
            # whole groups of 16 output rows: the unit of the CPU backend's interleaved weights
            vocab_limit=limit if 0 < (limit := -(-vocab_limit // 16) * 16) < hparams.n_vocab
            else 0,
            pooling=(hparams.pooling if self.encoder else "") if config.pooling is None
            else config.pooling,
        )
        self.kv = KVRegions(n_layer=0 if self.encoder else hparams.n_layer, n_ctx=n_ctx,
                            n_kv_embd=0 if self.encoder else
                            [hparams.layer_kv_embd(il) for il in range(hparams.n_layer)],
                            new_cache=host.new_kv_cache, k_type=k_type, v_type=v_type,
                            recurrent=hparams.recurrent_layers,
                            new_state=partial(host.new_conv_state,
                                              l_cache=hparams.shortconv_l_cache,
                                              n_embd=hparams.conv_channels),
                            new_matrix_state=partial(host.new_delta_state,
                                                     n_v_heads=hparams.ssm_v_heads,
                                                     head_dim=hparams.ssm_head_dim)
                            if hparams.ssm_head_dim else None)
        # per sequence, the positions its recurrent state has taken in (-1: unknown)
        self._state_pos = np.zeros(1, np.int64)
        # copies of each sequence's state at positions its cells still hold (prefix reuse)
        self.checkpoints = StateCheckpoints(host, self.kv, config.state_checkpoints)
        self.allocator = Allocator(self.kv)
        # one-row graphs (a decode step) take their buffers from a pool of their own: a prefill
        # that grows the shared pool then leaves the decode tape bound (re-binding it cost
        # ~15 ms on a warm `minfer run`'s first step); it holds one row's activations and
        # logits (0.7 MB for the 0.5B development model)
        self._row_allocator = Allocator(self.kv)
        self.cache = GraphCache(self._prepare)
        self._build_fn = graph_builder_for(hparams.arch)
        self._shapes = self.weights.shapes()
        self._by_name = {b.name: b for b in self._backends}
        jit_cache.mark_used()
        # seconds per `op:role` when profiling (MINFER_PROFILE): the tape's steps, node by node
        self.profile: dict[str, float] | None = {} if env.flag("MINFER_PROFILE") else None
        self.n_threads = n_threads = config.n_threads
        # the per-step trace (minfer viz, MINFER_TRACE=FILE): the tape walked node by node
        self.tracer: StepTracer | None = tracer_from_env()
        # with adaptive_threads, n_threads is the most a small repeated step (decode) may take
        self.tuner = ThreadTuner(n_threads) if config.adaptive_threads and n_threads else None
        self._warming: threading.Thread | None = None
        self._warm_error: BaseException | None = None
        # Called after each forward with the batch and the graph's second output: every row's
        # final normed hidden state (GraphParams.hidden_out, asked while a sink is set), or an
        # MTP head's normed output rows. An MTP proposer's record (`engine.core.mtp`).
        self.hidden_sink: Callable[[Batch, np.ndarray], None] | None = None

    @property
    def n_ctx(self) -> int:
        return self.ctx_params.n_ctx

    @property
    def pooling(self) -> str:
        """"" when the forward returns logits; else how its embeddings are pooled."""
        return self.ctx_params.pooling

    def params_for(self, n_tokens: int, n_out: int, *, embd_input: bool = False) -> GraphParams:
        return GraphParams.for_batch(n_tokens, n_out, self.ctx_params, self.weights.version,
                                     embd_input=embd_input,
                                     hidden_out=self.hidden_sink is not None)

    def _prepare(self, params: GraphParams) -> PreparedGraph:
        graph = self._build_fn(self.hparams, params, self._shapes)
        fuse(graph, params)
        scheduler.assign_backends(graph, self._backends,
                                  (params.ctx.k_type, params.ctx.v_type))
        graph.topo_order()
        plan = plan_buffers(graph)
        return PreparedGraph(params, graph, plan, scheduler.make_splits(graph, plan.live))

    # -- getting ready in the background -------------------------------------------------------
    def warm_in_background(self) -> None:
        """Bind the decode graph's op tape on another thread while the caller does other work
        (a CLI builds its tokenizer meanwhile): numba's contexts are built, every weight is made
        ready as its kernels read it (repacked outside the GIL, or mapped from its file), and
        binding loads the tape's kernels from numba's cache without running them
        (`jit_cache.direct`). The next call that runs a graph waits for it; an error it met is
        raised there. Results do not change: the first decode would bind the same tape."""
        if self._warming is not None:
            return
        self._warming = threading.Thread(target=self._warm, name="minfer-warm", daemon=True)
        self._warming.start()

    def _warm(self) -> None:
        try:
            jit_cache.prime()
            if self.n_threads:
                set_threads(self.n_threads)
            prepared = self.cache.get(self.params_for(1, 1))
            buffers = self._buffers(prepared)
            self._tape(prepared, buffers, self.batch_invariant)
        except BaseException as exc:  # re-raised on the caller's thread
            self._warm_error = exc

    def wait_ready(self) -> None:
        """Wait for `warm_in_background` (a no-op without one); raise what it met."""
        if self._warming is None:
            return
        self._warming.join()
        self._warming = None
        if self._warm_error is not None:
            exc, self._warm_error = self._warm_error, None
            raise exc

    # -- the forward ---------------------------------------------------------------------------
    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1, *,
                batch_invariant: bool = False,
                embd: Sequence[tuple[int, np.ndarray] | tuple[int, np.ndarray, bool]] = (),
                rope_pos: np.ndarray | None = None) -> np.ndarray:
        """One sequence's tokens at start_pos..; logits of the last n_out rows.
        batch_invariant: this forward's rows are bitwise their one-token decode rows (a
        speculative verify), even on an engine made without `batch_invariant`.
        embd: (row, rows) blocks given in place of those tokens' embeddings (`Batch.with_rows`:
        an image's; a third element True: the block is causal). rope_pos: the rows' [4, nt]
        M-RoPE positions (`Batch.rope_pos`)."""
        batch = Batch.single(tokens, start_pos, n_out)
        if rope_pos is not None:
            batch = replace(batch, rope_pos=rope_pos)
        for at, rows, *causal in embd:
            batch = batch.with_rows(at, rows, causal=bool(causal and causal[0]))
        return self.forward_batch(batch, batch_invariant=batch_invariant)

    @property
    def recurrent(self) -> bool:
        """Whether the model carries recurrent state (rewinding it means recomputing)."""
        return self.hparams.recurrent

    def hold_sequences(self, n_seq: int) -> None:
        """Split the cells into n_seq equal ranges, each a sequence with its own recurrent
        state (the server's slots); states start empty. A model without recurrent layers
        needs nothing: its sequences are their cells."""
        if not self.recurrent or n_seq == self.kv.n_seq:
            return
        self.wait_ready()
        self.kv.hold_sequences(n_seq)
        self._state_pos = np.zeros(n_seq, np.int64)
        self.checkpoints.reset()
        self.cache = GraphCache(self._prepare)  # tapes bound to the old state regions

    def state_position(self, seq: int) -> int:
        """How many tokens sequence seq's recurrent state has taken in (-1: unknown)."""
        return int(self._state_pos[seq])

    def checkpoint_positions(self, seq: int) -> list[int]:
        """Positions sequence seq's rows may restart from besides 0: its checkpoints and where
        its state stands."""
        live = int(self._state_pos[seq])
        return sorted({*self.checkpoints.positions(seq), *([live] if live > 0 else [])})

    def restart_point(self, seq: int, upto: int) -> int:
        """The furthest position <= upto that sequence seq's rows may start at: 0, where its
        state stands, a checkpoint or its spare (a draft model rolls back to the last token the
        target accepted: `SlotDrafter`)."""
        live = int(self._state_pos[seq])
        held = [*self.checkpoints.positions(seq, spare=True), *([live] if live > 0 else [])]
        return max((p for p in held if p <= upto), default=0)

    def save_state(self, seq: int, *, spare: bool = False) -> None:
        """Checkpoint sequence seq's state where it stands (spare: in its one spare, the state
        a speculative verify starts from, which counts against no limit)."""
        pos = int(self._state_pos[seq])
        if pos < 0:
            return
        if spare:
            self.checkpoints.save_spare(seq, pos)
        else:
            self.checkpoints.save(seq, pos)

    def copy_cells(self, src: int, dst: int, n: int) -> None:
        """The KV of cells [src, src + n) into cells [dst, dst + n) (`KVRegions.copy_cells`):
        the server's slots share a prompt prefix one of them computed. A recurrent model's
        state comes too where the source sequence's state stood at the copy's end (its
        positions are the source's): its live state when the cells end its history, else its
        checkpoint there (`StateCheckpoints.restore(into=)`; a state cannot be cut to a
        prefix). Without either, the destination's state no longer matches its cells past
        dst: it is unknown (-1) until it restarts at 0 or a checkpoint before dst."""
        self.kv.copy_cells(src, dst, n)
        if not self.recurrent:
            return
        width = self.kv.seq_cells
        s_seq, d_seq, start = src // width, dst // width, src % width
        end = start + n
        self.checkpoints.invalidate(d_seq, dst % width)
        aligned = start == dst % width
        if aligned and end == self._state_pos[s_seq]:
            self.kv.copy_state(s_seq, d_seq)
        elif aligned and self.checkpoints.has(s_seq, end):
            self.checkpoints.restore(s_seq, end, into=d_seq)
        elif self._state_pos[d_seq] > dst % width:
            self._state_pos[d_seq] = -1
            return
        else:
            return
        self._state_pos[d_seq] = end

    def forward_batch(self, batch: Batch, *, batch_invariant: bool = False,
                      checkpoint: Sequence[int] | None = None) -> np.ndarray:
        """The batch's logits. On a recurrent model, each sequence's state is checkpointed
        after its rows if it is in `checkpoint` (None: every sequence fed more than one row,
        unless batch_invariant: a speculative verify, whose rows may be rejected)."""
        self._check(batch)
        if self.recurrent:
            self._enter_states(batch)
        self.wait_ready()
        key = (batch.n_tokens, len(batch.out_rows))
        tuner = self.tuner if batch.n_tokens <= TUNED_MAX_TOKENS else None
        n_threads = tuner.choose(key) if tuner else self.n_threads
        if n_threads:  # numba's thread count is per calling thread: set it where we run
            set_threads(n_threads)
        t0 = time.perf_counter()
        prepared = self.cache.get(self.params_for(batch.n_tokens, len(batch.out_rows),
                                                  embd_input=batch.embd is not None))
        buffers = self._buffers(prepared)
        graph = prepared.graph
        self._fill(prepared, buffers, batch, self.kv.seq_cells)
        tape = self._tape(prepared, buffers, self.batch_invariant or batch_invariant)
        if self.tracer is not None:
            self.tracer.trace_forward(prepared, tape, buffers, batch, self.weights)
        elif self.profile is not None:
            tape.run_observed(self._profiled(graph))
        else:
            tape.run()
        if self.recurrent:
            self._advance_states(batch, checkpoint, batch_invariant)
        logits = buffers[graph.outputs[0]]
        assert logits is not None
        if self.hidden_sink is not None and len(graph.outputs) > 1:
            hidden = buffers[graph.outputs[1]]
            assert hidden is not None
            self.hidden_sink(batch, hidden)
        if tuner and n_threads:
            tuner.record(key, n_threads, time.perf_counter() - t0)
        return logits.copy()

    def execute_nodes(self, params: GraphParams, node_ids: Sequence[int]) -> None:
        """Run just these nodes of the graph for `params`, on placeholder inputs (token 0 at
        position 0, each query reading KV cell 0): the first-run warm-up, which only wants their
        kernels compiled. Results are meaningless, and KV cell 0 is written."""
        self.wait_ready()
        prepared = self.cache.get(params)
        buffers = self._buffers(prepared)
        graph = prepared.graph
        for node_id in node_ids:
            node = graph.nodes[node_id]
            for src in node.srcs:  # a reused buffer may hold anything: zeros, then the inputs
                buf = buffers[src]
                if buf is not None and buf.dtype.kind == "f":
                    buf.fill(0)
            for kind, input_id in graph.inputs.items():
                buf = buffers[input_id]
                if buf is not None:  # (None: an input no live node reads)
                    buf[:] = 1 if kind is InputKind.KV_END else 0
            ctx = self._context(params, self.batch_invariant)
            scheduler.build_tape(graph, prepared.splits, buffers, self._by_name, ctx,
                                 [node_id]).run()
        self._state_pos[0] = -1  # sequence 0's state took in placeholders
        self.checkpoints.invalidate(0, 0)

    def _profiled(self, graph: ComputeGraph) -> Callable[[int, float], None]:
        assert self.profile is not None
        return profiler(graph, self.profile)

    def _context(self, params: GraphParams, batch_invariant: bool) -> ExecContext:
        """The binding context of a tape for these params: the warm-up binds its single nodes
        as the forward binds the whole graph (regions up to REGION_MAX_ROWS rows included)."""
        return ExecContext(weights=self.weights, kv=self.kv, batch_invariant=batch_invariant,
                           dense_f32=self.encoder, batched=self.batched,
                           composed=regions_pay(params.n_tokens))

    def _tape(self, prepared: PreparedGraph, buffers: list[np.ndarray | None],
              batch_invariant: bool) -> scheduler.Tape:
        """The prepared graph's op tape over these buffers, bound on first use (one per
        batch-invariance setting: it decides the paths the binding takes)."""
        key = "tape-invariant" if batch_invariant else "tape"
        cached = prepared.scratch.get(key)
        if cached is None or cached[0] is not buffers:
            if batch_invariant:
                _check_invariant(prepared)
            ctx = self._context(prepared.params, batch_invariant)
            tape = scheduler.build_tape(prepared.graph, prepared.splits, buffers, self._by_name,
                                        ctx)
            prepared.scratch[key] = cached = (buffers, tape)
        result: scheduler.Tape = cached[1]
        return result

    @staticmethod
    def _fill(prepared: PreparedGraph, buffers: list[np.ndarray | None], batch: Batch,
              seq_cells: int) -> None:
        """The batch's data into the graph's input nodes (a row's recurrent-state row: the
        range of seq_cells cells its cell lies in)."""
        fills = {
            InputKind.TOKEN_IDS: batch.tokens,
            InputKind.POSITIONS: batch.positions,
            InputKind.KV_CELLS: batch.cells,
            InputKind.KV_START: batch.kv_start,
            InputKind.KV_END: batch.kv_end,
            InputKind.TAIL_IDS: batch.out_rows,
            InputKind.TOKEN_TYPES: batch.token_types,
            InputKind.SEQ_START: batch.seq_start,
            InputKind.SEQ_END: batch.seq_end,
            InputKind.OUT_START: batch.out_start,
            InputKind.OUT_END: batch.out_end,
            InputKind.STATE_SEQ: batch.cells // seq_cells,
            InputKind.EMBD_IDS: batch.embd_ids,
            InputKind.HIDDEN: batch.hidden,
        }
        for kind, node_id in prepared.graph.inputs.items():
            buf = buffers[node_id]
            if buf is None:  # read by nothing (an M-RoPE model's one-per-row positions)
                continue
            if kind is InputKind.EMBD:  # the given rows first; the rest is never read
                assert batch.embd is not None
                buf[:len(batch.embd)] = batch.embd
                continue
            data = batch.mrope_positions() if kind is InputKind.ROPE_POS else fills[kind]
            if data is None:
                raise MinferError(f"this graph reads {kind.value}, which this batch lacks (whole "
                                  "inputs: Batch.sequences; hidden rows: an MTP head's)")
            buf[:] = data

    def _buffers(self, prepared: PreparedGraph) -> list[np.ndarray | None]:
        allocator = self._row_allocator if prepared.params.n_tokens == 1 else self.allocator
        cached = prepared.scratch.get("buffers")
        if cached is None or cached[0] != allocator.generation:
            views = allocator.buffers(prepared.graph, prepared.plan)
            prepared.scratch["buffers"] = cached = (allocator.generation, views)
        buffers: list[np.ndarray | None] = cached[1]
        return buffers

    def _check(self, b: Batch) -> None:
        nt, n_ctx = b.n_tokens, self.n_ctx
        if nt == 0:
            raise MinferError("empty batch")
        if self.encoder:
            self._check_encoder(b)
            return
        for name in ("positions", "cells", "kv_start", "kv_end"):
            if getattr(b, name).shape != (nt,):
                raise MinferError(f"batch field {name} must have {nt} entries")
        if int(b.cells.max()) >= n_ctx or int(b.positions.max()) >= n_ctx:
            raise ContextOverflowError(
                f"position {int(max(b.cells.max(), b.positions.max()))} is outside the context "
                f"(n_ctx = {n_ctx})"
            )
        if int(b.cells.min()) < 0 or int(b.positions.min()) < 0:
            raise MinferError("negative position or KV cell")
        if np.any(b.kv_start < 0) or np.any(b.kv_end > n_ctx) or np.any(b.kv_start > b.cells) \
                or np.any(b.kv_end <= b.cells):
            raise MinferError("a token's KV window must lie in the context and include its cell")
        rows = b.out_rows
        if len(rows) == 0 or int(rows.min()) < 0 or int(rows.max()) >= nt:
            raise MinferError("output rows must index the batch")
        if len(rows) == nt and not np.array_equal(rows, np.arange(nt)):
            raise MinferError("a batch returning every row returns them in order")
        if b.embd is not None:
            self._check_embd(b)
        if b.hidden is not None and b.hidden.shape != (nt, self.hparams.n_embd):
            raise MinferError(f"hidden rows must be [{nt}, {self.hparams.n_embd}]")
        if self.recurrent:
            self._check_states(b)

    def _check_embd(self, b: Batch) -> None:
        assert b.embd is not None  # a recurrent model's too (LFM2-VL's causal image rows)
        ids = b.embd_ids
        width = self.hparams.n_embd * (1 + self.hparams.n_deepstack)  # Qwen3-VL's deepstack
        if b.embd.shape[1:] != (width,) or ids is None \
                or ids.shape != (b.n_tokens,) or int(ids.max()) >= len(b.embd):
            raise MinferError(f"given embedding rows must be [k, {width}], each used at one "
                              "batch row")

    def _sequences(self, b: Batch) -> list[tuple[int, np.ndarray]]:
        """(sequence, its rows in batch order) of each sequence the batch feeds."""
        seqs = b.cells // self.kv.seq_cells
        return [(int(s), np.flatnonzero(seqs == s)) for s in np.unique(seqs)]

    def _check_states(self, b: Batch) -> None:
        """Each sequence's rows must take consecutive positions from where its recurrent state
        stands, from 0 (a fresh start) or from a checkpoint: a state cannot otherwise be
        rewound or skip tokens."""
        for seq, rows in self._sequences(b):
            pos = b.positions[rows]
            first = int(pos[0])
            if not np.array_equal(pos, np.arange(first, first + len(rows))):
                raise MinferError(f"a recurrent model takes each sequence's tokens in order: "
                                  f"sequence {seq} got positions {pos.tolist()[:8]}...")
            have = int(self._state_pos[seq])
            if first not in (0, have) and not self.checkpoints.has(seq, first):
                raise MinferError(
                    f"{self.hparams.arch}'s recurrent state of sequence {seq} holds "
                    + (f"{have} tokens" if have >= 0 else "no known tokens")
                    + f"; it cannot continue at position {first} (it cannot be rewound: "
                    "recompute from position 0)")

    def _enter_states(self, b: Batch) -> None:
        """Each sequence's state where its rows start (a checkpoint restored); its cells from
        there on are rewritten, so the checkpoints past that go."""
        for seq, rows in self._sequences(b):
            first = int(b.positions[rows[0]])
            if first not in (0, int(self._state_pos[seq])):
                self.checkpoints.restore(seq, first)
                self._state_pos[seq] = first
            self.checkpoints.invalidate(seq, first)

    def _advance_states(self, b: Batch, checkpoint: Sequence[int] | None,
                        batch_invariant: bool) -> None:
        for seq, rows in self._sequences(b):
            self._state_pos[seq] = int(b.positions[rows[-1]]) + 1
            if (seq in checkpoint if checkpoint is not None
                    else len(rows) > 1 and not batch_invariant):
                self.checkpoints.save(seq, int(self._state_pos[seq]))

    def _check_encoder(self, b: Batch) -> None:
        """An encoder's batch: whole inputs, each within the learned positions."""
        if b.seq_start is None or b.out_start is None:
            raise MinferError("an encoder runs whole inputs (Batch.sequences)")
        limit = min(self.n_ctx, self.hparams.n_ctx_train)
        if int(b.positions.max()) >= limit or int(b.positions.min()) < 0:
            raise ContextOverflowError(
                f"an input of {int(b.positions.max()) + 1} tokens is longer than this model's "
                f"context ({limit} tokens)")
        ids = b.tokens
        if int(ids.min()) < 0 or int(ids.max()) >= self.hparams.n_vocab:
            raise MinferError("a token id is outside the vocabulary")
        types = b.token_types
        if self.hparams.n_token_types and types is not None and (
                int(types.min()) < 0 or int(types.max()) >= self.hparams.n_token_types):
            raise MinferError(f"token types must be below {self.hparams.n_token_types}")


def kv_host(backends: Sequence[Backend]) -> KVHost:
    """The backend that owns the KV cache's formats (the host CPU backend, always present)."""
    for backend in backends:  # by its class: a deferred backend is not made by asking
        if callable(getattr(type(backend), "new_kv_cache", None)):
            return cast(KVHost, backend)
    raise MinferError("no backend owns the KV cache (the CPU backend must be among them)")


def profiler(graph: ComputeGraph, profile: dict[str, float]) -> Callable[[int, float], None]:
    """A tape's observer (`Tape.run_observed`) that adds each node's seconds to
    `profile[op:role]` (MINFER_PROFILE)."""
    nodes = graph.nodes

    def observe(node_id: int, seconds: float) -> None:
        node = nodes[node_id]
        key = f"{node.op.kind}:{node.meta.role}"
        profile[key] = profile.get(key, 0.0) + seconds

    return observe


def set_threads(n_threads: int) -> None:
    limit = int(config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    want = max(1, min(n_threads, limit))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
