"""LFM2 (`lfm2`): its gated short convolution, the recurrent state the backend keeps per
sequence, and the model against transformers.

tests/fixtures/lfm2/ comes from benchmarks/make_lfm2_fixtures.py: a tiny random checkpoint made
with transformers 5.x's Lfm2ForCausalLM (n_embd 64, layers conv | attention | conv | conv, GQA
4/2, 3 taps, norms away from 1, tied output, a byte-level BPE tokenizer with a ChatML template)
converted by llama.cpp 0.3.36's `convert_hf_to_gguf.py` to f32, with transformers' float32
logits of 40 token ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.chat.session import ChatConfig, ChatSession, TurnReport
from minfer.engine.core.core import EngineCore
from minfer.engine.core.policy import Proposal
from minfer.engine.core.request import GenRequest, Request
from minfer.engine.core.runner import Runner
from minfer.engine.core.scheduler import Held, _reach
from minfer.engine.core.scheduler import Sequence as SchedSequence
from minfer.engine.forward import Batch, Engine
from minfer.errors import MinferError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import ir
from minfer.graph.params import ContextParams, GraphParams
from minfer.models.registry import graph_builder_for
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from minfer.tokenizer.chat import ChatTemplate
from minfer.tokenizer.tokenizer import Tokenizer

from .oracle import short_conv as oracle_short_conv

FIXTURES = Path(__file__).parent / "fixtures" / "lfm2"
MODEL = FIXTURES / "lfm2.gguf"
REF = np.load(FIXTURES / "logits.npz")
IDS = REF["ids"].tolist()
RNG = np.random.default_rng(7)
LONG = RNG.integers(0, 300, 100).tolist()  # a prompt longer than the 64-row chunks
OTHER = RNG.integers(0, 300, 30).tolist()


def _model() -> tuple[GGUFFile, HParams]:
    f = GGUFFile.open(MODEL)
    return f, HParams.from_gguf(f)


def _engine(**kw: object) -> Engine:
    f, hp = _model()
    kw.setdefault("n_ctx", 256)
    kw.setdefault("kv_type", "f32")
    return Engine(f, hp, **kw)  # type: ignore[arg-type]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


# -- the op --------------------------------------------------------------------------------------
def _conv_case(nt: int, d: int = 80, taps: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(nt)
    return (rng.standard_normal((nt, 3 * d)).astype(np.float32),
            rng.standard_normal((d, taps)).astype(np.float32))


@pytest.mark.parametrize("taps", [2, 3, 4])
def test_short_conv_matches_the_float64_oracle(taps: int) -> None:
    bcx, w = _conv_case(23, taps=taps)
    state = K.new_state(2, taps, 80)
    out = np.empty((23, 80), np.float32)
    seq = np.ones(23, np.int32)
    K.short_conv(bcx, w, state, np.arange(23, dtype=np.int32), seq, out)
    want, want_state = oracle_short_conv(bcx, w)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state[1], want_state, rtol=1e-6, atol=1e-6)
    assert not state[0].any()  # the other sequence's row is untouched
    # a continuation from the carried state is the oracle's continuation
    more, _ = _conv_case(5, taps=taps)
    out2 = np.empty((5, 80), np.float32)
    K.short_conv(more, w, state, np.arange(23, 28, dtype=np.int32), seq[:5], out2)
    np.testing.assert_allclose(out2, oracle_short_conv(more, w, want_state)[0], rtol=1e-5,
                               atol=1e-5)


def test_short_conv_rows_are_bitwise_whatever_the_chunks_and_neighbours() -> None:
    """One sequence whole, in chunks of 1 and 7, and interleaved row by row with another
    sequence: the same bits, and the same final state."""
    bcx, w = _conv_case(40)
    other, _ = _conv_case(40)
    pos = np.arange(40, dtype=np.int32)

    def run(chunks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        state = K.new_state(1, 3, 80)
        outs, t = [], 0
        for n in chunks:
            out = np.empty((n, 80), np.float32)
            K.short_conv(bcx[t:t + n], w, state, pos[t:t + n], np.zeros(n, np.int32), out)
            outs.append(out)
            t += n
        return np.concatenate(outs), state[0].copy()

    whole, state = run([40])
    for chunks in ([1] * 40, [7, 7, 7, 7, 7, 5]):
        got, got_state = run(chunks)
        assert np.array_equal(got, whole) and np.array_equal(got_state, state)
    mixed = np.empty((80, 240), np.float32)
    mixed[0::2], mixed[1::2] = bcx, other
    states = K.new_state(2, 3, 80)
    out = np.empty((80, 80), np.float32)
    K.short_conv(mixed, w, states, np.repeat(pos, 2), np.tile([1, 0], 40).astype(np.int32), out)
    assert np.array_equal(out[0::2], whole) and np.array_equal(states[1], state)


def test_a_row_at_position_0_starts_from_a_zero_state() -> None:
    bcx, w = _conv_case(6)
    state = np.full((1, 2, 80), 5.0, np.float32)  # a finished sequence's leftovers
    out = np.empty((6, 80), np.float32)
    K.short_conv(bcx, w, state, np.arange(6, dtype=np.int32), np.zeros(6, np.int32), out)
    np.testing.assert_allclose(out, oracle_short_conv(bcx, w)[0], rtol=1e-5, atol=1e-5)


# -- the file and the graph ----------------------------------------------------------------------
def test_layer_pattern_and_state_are_read_as_llamacpp_reads_them() -> None:
    _, hp = _model()
    assert hp.arch == "lfm2" and hp.recurrent
    # llama.cpp: a layer is recurrent where its head_count_kv entry is 0
    assert hp.recurrent_layers == (True, False, True, True)
    assert (hp.n_head, hp.n_head_kv, hp.head_dim, hp.shortconv_l_cache) == (4, 2, 16, 3)
    assert (hp.has_qk_norm, hp.rope_style, hp.output_norm_name) == \
        (True, "neox", "token_embd_norm.weight")
    assert hp.state_width == 2 * 64
    e = _engine(n_ctx=64)
    assert [k.shape[0] for k in e.kv.k] == [0, 64, 0, 0]  # cells only where attention reads
    assert e.kv.state_bytes_per_seq == 3 * 2 * 64 * 4


def test_graph_runs_a_short_convolution_in_the_recurrent_layers() -> None:
    f, hp = _model()
    shapes = {n: tuple(t.shape) for n, t in f.tensors.items()}
    g = graph_builder_for("lfm2")(hp, GraphParams.for_batch(5, 1, ContextParams(n_ctx=64)),
                                  shapes)
    convs = [n for n in g.nodes if isinstance(n.op, ir.ShortConv)]
    assert [n.op for n in convs] == [ir.ShortConv(il, 64, 3) for il in (0, 2, 3)]
    assert {n.meta.layer for n in g.nodes if isinstance(n.op, ir.Attn)} == {1}
    assert ir.InputKind.STATE_SEQ in g.inputs
    tail = g.by_name("tail_attn_out")  # the last layer keeps the tail after its convolution
    assert g.nodes[tail.srcs[0]].name == "shortconv_out"


# -- the model -----------------------------------------------------------------------------------
def test_matches_transformers() -> None:
    got = _engine().forward(IDS, 0, n_out=len(IDS))
    ref = REF["hf"]
    assert _rel(got[-1], ref[-1]) < 1e-3  # the last position, as a prompt's next token reads
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


def test_state_continues_and_cannot_be_rewound() -> None:
    """Decoding continues the state (the same logits as one prefill); a forward that would
    need a rewind is refused by name; position 0 starts afresh."""
    e = _engine(batch_invariant=True)
    whole = e.forward(IDS, 0, n_out=len(IDS))
    e.forward(IDS[:30], 0)
    rows = [e.forward([t], 30 + i)[0] for i, t in enumerate(IDS[30:])]
    assert np.array_equal(np.stack(rows), whole[30:])
    assert e.state_position(0) == len(IDS)
    with pytest.raises(MinferError, match="cannot be rewound"):
        e.forward(IDS[20:], 20)
    with pytest.raises(MinferError, match="cannot continue at position 45"):
        e.forward([1], 45)
    assert np.array_equal(e.forward(IDS, 0, n_out=len(IDS)), whole)


def test_prefill_chunks_are_bitwise_the_whole_prompt() -> None:
    """Chunked prefill at 1, 7 and 64 rows gives each row the bits of the whole prompt's (and
    of its one-token decode row)."""
    e = _engine(batch_invariant=True)
    whole = e.forward(LONG, 0, n_out=len(LONG))
    for chunk in (1, 7, 64):
        rows = []
        for start in range(0, len(LONG), chunk):
            part = LONG[start:start + chunk]
            rows.append(e.forward(part, start, n_out=len(part)))
        assert np.array_equal(np.concatenate(rows), whole), chunk


def test_kv_shift_is_refused() -> None:
    from minfer.engine.kv_shift import shift_kv

    e = _engine()
    e.forward(IDS, 0)
    with pytest.raises(MinferError, match="recurrent state"):
        shift_kv(e, src_start=10, src_end=40, dst_start=4)


def test_a_batch_of_sequences_each_reads_its_own_state() -> None:
    """Two sequences in one engine (cells split in two ranges, one state each), fed together
    in one batch, give each the rows it gets alone."""
    alone = _engine(batch_invariant=True).forward(LONG, 0, n_out=len(LONG))
    other = _engine(batch_invariant=True).forward(OTHER, 0, n_out=len(OTHER))
    e = _engine(batch_invariant=True, n_ctx=256)
    e.hold_sequences(2)
    n = len(OTHER)
    tokens = np.array([*LONG[:n], *OTHER], np.int32)
    pos = np.concatenate([np.arange(n), np.arange(n)]).astype(np.int32)
    base = np.repeat([0, 128], n).astype(np.int32)
    batch = Batch(tokens=tokens, positions=pos, cells=base + pos, kv_start=base,
                  kv_end=base + pos + 1, out_rows=np.arange(2 * n, dtype=np.int32))
    rows = e.forward_batch(batch)
    assert np.array_equal(rows[:n], alone[:n]) and np.array_equal(rows[n:], other)
    rest = e.forward_batch(Batch(
        tokens=np.array(LONG[n:], np.int32), positions=np.arange(n, len(LONG), dtype=np.int32),
        cells=np.arange(n, len(LONG), dtype=np.int32), kv_start=np.zeros(len(LONG) - n, np.int32),
        kv_end=np.arange(n + 1, len(LONG) + 1, dtype=np.int32),
        out_rows=np.arange(len(LONG) - n, dtype=np.int32)))
    assert np.array_equal(rest, alone[n:])


# -- the generation core (what run / chat / the API / the server step) ---------------------------
N_CTX_SLOT = 128
_SEQ_IDS = 0


def _sampler(prompt: list[int]) -> Sampler:
    s = Sampler(SamplerParams(temp=0.0), 320, seed=1)
    s.reset(prompt)
    return s


def _core(n_slots: int = 2) -> EngineCore:
    engine = _engine(n_ctx=n_slots * N_CTX_SLOT, batch_invariant=True)
    return EngineCore(Runner(engine, N_CTX_SLOT), Tokenizer.from_gguf(GGUFFile.open(MODEL)),
                      n_slots=n_slots, n_ctx_slot=N_CTX_SLOT, chunk=16)


def _run(core: EngineCore, prompts: list[list[int]], max_tokens: int = 6) -> list[Request]:
    global _SEQ_IDS
    states = []
    for p in prompts:
        _SEQ_IDS += 1
        states.append(core.add(_SEQ_IDS, GenRequest(p, max_tokens, _sampler(p), top_logits=4)))
    while core.busy:
        assert all(o.error is None for o in core.step())
    return states


def test_core_batches_recurrent_rows_beside_each_other() -> None:
    """Prompts chunked 16 rows a step, side by side in one engine (one state per slot), draw
    what each draws alone, with the same logits bit for bit."""
    alone = [_run(_core(1), [p])[0] for p in (LONG, OTHER)]
    together = _run(_core(2), [LONG, OTHER])
    for a, b in zip(alone, together, strict=True):
        assert a.ids == b.ids and a.tops == b.tops


def test_a_chats_next_turn_reuses_the_slots_state() -> None:
    """The next turn (the previous prompt and reply, then more) takes the slot's whole cached
    sequence with its state: it prefills only the new tokens, and draws what a full recompute
    draws, with the same logits. A prompt that does not extend the cache recomputes from 0."""
    core = _core(1)
    (first,) = _run(core, [LONG[:40]])
    held = len(core.scheduler.slots[0].cached)
    assert held == 40 + len(first.ids) - 1  # the last drawn token is not computed yet
    turn = [*LONG[:40], *first.ids, *OTHER[:12]]
    (second,) = _run(core, [turn])
    assert second.n_cached == held
    (fresh,) = _run(_core(1), [turn])
    assert fresh.n_cached == 0
    assert second.ids == fresh.ids and second.tops == fresh.tops
    (edited,) = _run(core, [[*LONG[:30], *OTHER[:5]]])  # shares 30 tokens, not the whole cache
    assert edited.n_cached == 16  # from the state checkpointed after the first 16-row chunk
    (alone,) = _run(_core(1), [[*LONG[:30], *OTHER[:5]]])
    assert edited.ids == alone.ids and edited.tops == alone.tops


def test_scheduler_takes_a_recurrent_cache_only_whole() -> None:
    held = Held(tokens=[1, 2, 3, 4], n=4, scores=(), score_k=None)
    extends = SchedSequence(0, [1, 2, 3, 4, 5], 5)
    assert _reach(extends, held) == 4 and _reach(extends, held, recurrent=True) == 4
    partial = SchedSequence(0, [1, 2, 3, 9, 9], 5)
    assert _reach(partial, held) == 3 and _reach(partial, held, recurrent=True) == 0
    same = SchedSequence(0, [1, 2, 3, 4], 4)  # its last token must be computed again
    assert _reach(same, held, recurrent=True) == 0
    # with the slot's state checkpointed at 2 and 4: the furthest within the common prefix
    assert _reach(partial, held, recurrent=True, checkpoints=(2, 4)) == 2
    assert _reach(same, held, recurrent=True, checkpoints=(2, 4)) == 2


def _row_at(e: Engine, pos: int, base: int) -> np.ndarray:
    """The logits of LONG[pos] fed at position pos of the sequence whose cells start at base."""
    return e.forward_batch(Batch(tokens=np.array([LONG[pos]], np.int32),
                                 positions=np.array([pos], np.int32),
                                 cells=np.array([base + pos], np.int32),
                                 kv_start=np.array([base], np.int32),
                                 kv_end=np.array([base + pos + 1], np.int32),
                                 out_rows=np.array([0], np.int32)))[0]


def test_a_copied_prefix_brings_the_state_where_the_source_kept_it() -> None:
    """A copy of another sequence's cells brings its state where that state stood at the
    copy's end: its live state (the whole history) or a checkpoint there; elsewhere the
    destination's state is unknown and continuing is refused."""
    e = _engine(batch_invariant=True, n_ctx=256)
    e.hold_sequences(2)
    alone = _engine(batch_invariant=True).forward(LONG[:21], 0, n_out=21)
    e.forward(LONG[:16], 0)
    e.forward(LONG[16:20], 16)  # checkpoints at 16 and 20
    e.copy_cells(0, 128, 20)  # the source's whole sequence: its live state comes too
    assert e.state_position(1) == 20
    assert np.array_equal(_row_at(e, 20, 128), alone[20])
    e.copy_cells(0, 128, 16)  # up to the source's checkpoint at 16: that state comes
    assert e.state_position(1) == 16
    assert np.array_equal(_row_at(e, 16, 128), alone[16])
    e.copy_cells(0, 128, 10)  # part of it, no state kept there: unknown, continuing refused
    assert e.state_position(1) == -1
    with pytest.raises(MinferError, match="cannot continue at position 10"):
        _row_at(e, 10, 128)


def test_an_edit_near_the_end_restarts_from_a_checkpoint_bitwise() -> None:
    """Prefill chunks checkpoint the state (at most `state_checkpoints`, the furthest kept: the
    memory is bounded); a prompt edited near its end continues from the checkpoint before the
    edit with every row bitwise a full recompute's; a position with no checkpoint is refused."""
    e = _engine(batch_invariant=True, state_checkpoints=2)
    for start in range(0, len(LONG), 32):
        e.forward(LONG[start:start + 32], start)
    assert e.checkpoints.positions(0) == [96, 100]
    assert e.checkpoints.nbytes == 2 * e.kv.state_bytes_per_seq
    edited = [*LONG[:98], 5, 6, 7]
    rows = e.forward(edited[96:], 96, n_out=5)
    fresh = _engine(batch_invariant=True).forward(edited, 0, n_out=len(edited))
    assert np.array_equal(rows, fresh[96:])
    assert e.checkpoints.positions(0) == [96, 101]  # 100's cells were rewritten
    with pytest.raises(MinferError, match="cannot continue at position 50"):
        e.forward(edited[50:], 50)


def test_no_checkpoints_keeps_the_whole_only_rule() -> None:
    e = _engine(batch_invariant=True, state_checkpoints=0)
    e.forward(LONG[:64], 0)
    e.forward(LONG[64:], 64)
    assert e.checkpoints.positions(0) == [] and e.checkpoints.nbytes == 0
    with pytest.raises(MinferError, match="cannot continue at position 64"):
        e.forward(LONG[64:], 64)


class _Guesses:
    """A proposer that knows plain greedy's continuation and spoils every third guess, so
    verifies keep some proposals and reject the rest."""

    def __init__(self, plain: dict[tuple[int, ...], list[int]]) -> None:
        self.plain = plain
        self.n = 0

    def propose(self, asks: object) -> dict[int, Proposal]:
        out = {}
        for a in asks:  # type: ignore[attr-defined]
            for prompt, ids in self.plain.items():
                if a.tokens[:len(prompt)] == prompt:
                    done = len(a.tokens) - len(prompt)
                    guess = list(ids[done:done + a.k])
                    self.n += 1
                    if guess and self.n % 3 == 0:
                        guess[len(guess) // 2] = (guess[len(guess) // 2] + 1) % 300
                    out[a.seq_id] = Proposal(guess)
        return out

    def warm_up(self) -> None:
        pass

    def forget(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["lookup", "guesses"])
def test_speculation_greedy_is_plain_greedy(kind: str) -> None:
    """Speculation on the hybrid target (prompt lookup; a proposer right at times, wrong at
    others): a rejected proposal's state is taken back (the verify's start restored, the kept
    tokens recomputed), so every drawn token and its logits are plain greedy's, bitwise."""
    from minfer.engine.core.proposer import LookupProposer
    from minfer.engine.speculative import SpecConfig

    prompts = [[*LONG[:20], *LONG[:20]], OTHER[:24]]
    plain = _run(_core(2), prompts, max_tokens=20)
    proposer = (LookupProposer(2) if kind == "lookup" else
                _Guesses({tuple(p): s.ids for p, s in zip(prompts, plain, strict=True)}))
    engine = _engine(n_ctx=2 * N_CTX_SLOT, batch_invariant=True)
    core = EngineCore(Runner(engine, N_CTX_SLOT), Tokenizer.from_gguf(GGUFFile.open(MODEL)),
                      n_slots=2, n_ctx_slot=N_CTX_SLOT, chunk=16, proposer=proposer,
                      speculation=SpecConfig(draft_max=4, adaptive=False))
    spec = _run(core, prompts, max_tokens=20)
    for a, b in zip(plain, spec, strict=True):
        assert a.ids == b.ids and a.tops == b.tops
    drafted = sum(s.spec.drafted for s in spec)
    accepted = sum(s.spec.accepted for s in spec)
    assert drafted > 0
    if kind == "guesses":
        assert 0 < accepted < drafted  # some kept, some taken back


# -- a chat session (minfer chat, the REPL) ------------------------------------------------------
class _MergesOnly:
    """Greedy over the BPE merges only (ids 256..316: pieces of ASCII text), so a reply is
    always whole text and a turn's KV is kept as it is (a random model's byte tokens would
    spell broken UTF-8, which the session trims away)."""

    seed = 0

    def sample(self, logits: np.ndarray) -> int:
        return 256 + int(np.argmax(logits[256:317]))

    def accept(self, token_id: int) -> None:
        pass

    def reset(self, prompt_tail: object = (), *, seed: int | None = None) -> None:
        pass


def _chat(engine: Engine) -> ChatSession:
    f = GGUFFile.open(MODEL)
    tok = Tokenizer.from_gguf(f)
    return ChatSession(engine, tok, ChatTemplate.from_gguf(f, tok), _MergesOnly(),
                       config=ChatConfig(max_tokens=8))


def _turn(chat: ChatSession, text: str) -> TurnReport:
    *_, report = chat.say(text)
    assert isinstance(report, TurnReport)
    return report


def test_chat_turns_prefill_the_delta_and_regen_prefills_only_the_turn() -> None:
    e = _engine()
    chat = _chat(e)
    _turn(chat, "Hello world!")
    second = _turn(chat, "The quick brown fox")
    n_kv = chat.kv.cursor
    assert 0 < second.n_prefilled < n_kv  # only the new turn's tokens
    assert e.state_position(0) == n_kv
    fresh = _chat(_engine())
    _turn(fresh, "Hello world!")
    assert _turn(fresh, "The quick brown fox").ids == second.ids
    *_, again = chat.regen()  # from the state checkpointed at the turn's start
    assert isinstance(again, TurnReport) and again.n_prefilled == second.n_prefilled
    assert again.ids == second.ids  # greedy: the same reply
    assert chat.kv.tokens == fresh.kv.tokens


def test_info_shows_the_layer_pattern_and_the_state(capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    assert main(["info", str(MODEL)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "CACC (C: short conv, 3 taps, 3 layers" in out
    state = _engine(n_ctx=16).kv.state_bytes_per_seq
    assert f"recurrent state per sequence │ 1.5 KiB ({state:,} bytes)" in out
    assert "f32 256 B" in out  # K and V of the one attention layer: 2 x 32 f32 a token


def test_the_python_api_generates() -> None:
    import minfer

    model = minfer.load(MODEL, n_ctx=128)
    ids = model.tokenizer.encode("The quick brown fox")
    first = list(model.generate(ids, max_tokens=6, temp=0.0))
    assert first and list(model.generate(ids, max_tokens=6, temp=0.0)) == first


def test_the_server_reuses_a_chats_state_and_reports_it() -> None:
    """`minfer serve` on the real tiny engine: a chat's next turn is answered from the slot's
    state (usage's cached tokens) with the reply a full recompute gives (the same body again,
    which does not extend the cache, continues from the state checkpointed at the end of the
    first turn's prompt until `TAIL_SPLIT` went from 64 to 8; now from the second turn's own
    last token but one: the chunk of its new tokens, over 8, stops a token short)."""
    from minfer.engine.config import EngineConfig
    from minfer.server.state import ServerConfig, ServerState

    from .test_server_app import call

    st = ServerState(ServerConfig(model_path=MODEL, slots=2,
                                  engine=EngineConfig.build(n_ctx=128, threads=1)))
    st.start()
    try:
        assert st.wait_ready(60)
        opts = {"max_tokens": 6, "temperature": 0, "logit_bias": {str(i): -100
                                                                   for i in range(256)}}
        msgs = [{"role": "user", "content": "The quick brown fox"}]
        first = call(st, "POST", "/v1/chat/completions", json={"messages": msgs, **opts}).json()
        reply = first["choices"][0]["message"]["content"]
        msgs += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "Hello world!"}]
        got = [call(st, "POST", "/v1/chat/completions", json={"messages": msgs, **opts}).json()
               for _ in range(2)]
    finally:
        st.stop()
    cached = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
    assert cached[0] > first["usage"]["prompt_tokens"]
    assert cached[1] == got[1]["usage"]["prompt_tokens"] - 1
    assert got[0]["choices"][0]["message"] == got[1]["choices"][0]["message"]
