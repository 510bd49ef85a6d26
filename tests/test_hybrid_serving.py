"""Hybrid recurrent models (LFM2, Qwen3.5) under the serving features built on the KV cache:
a hybrid draft model (its own state per slot, rolled back after each verify), the context
shift (refused for the state; a chat recomputes the kept window), a system prompt shared
across slots (another slot's state checkpoint copied), and batch invariance of every way a
token can be computed: alone, 8 streams, prefill chunks of 1 / 7 / 64, speculative (lookup,
draft, MTP), in the server's core and in `run`.

The tiny random fixtures of tests/fixtures/{lfm2,qwen35} share one 320-token vocabulary, so
each can draft for the other.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from minfer.engine.core.core import EngineCore
from minfer.engine.core.mtp import MtpProposer
from minfer.engine.core.proposer import (
    HybridProposer,
    LookupProposer,
    Proposer,
    SlotDrafter,
)
from minfer.engine.core.request import GenRequest, Request
from minfer.engine.core.runner import Runner
from minfer.engine.forward import Engine
from minfer.engine.speculative import SpecConfig
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from minfer.tokenizer.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
LFM2 = FIXTURES / "lfm2" / "lfm2.gguf"
QWEN35 = FIXTURES / "qwen35" / "qwen35.gguf"
QWEN35_MTP = FIXTURES / "qwen35" / "qwen35_mtp.gguf"
MODELS = {"lfm2": LFM2, "qwen35": QWEN35, "qwen35_mtp": QWEN35_MTP}
N_CTX_SLOT = 128
RNG = np.random.default_rng(11)
SYSTEM = RNG.integers(0, 300, 40).tolist()  # a system prompt every request repeats
_IDS = itertools.count(1)


def _engine(path: Path, n_ctx: int, **kw: object) -> Engine:
    f = GGUFFile.open(path)
    kw.setdefault("kv_type", "f32")
    return Engine(f, HParams.from_gguf(f), n_ctx=n_ctx, batch_invariant=True,
                  **kw)  # type: ignore[arg-type]


def _core(path: Path, n_slots: int = 2, *, chunk: int = 16,
          proposer: Proposer | None = None, draft_max: int = 4) -> EngineCore:
    engine = _engine(path, n_slots * N_CTX_SLOT)
    if isinstance(proposer, MtpProposer):
        proposer.attach(engine, N_CTX_SLOT)
    return EngineCore(Runner(engine, N_CTX_SLOT), Tokenizer.from_gguf(GGUFFile.open(path)),
                      n_slots=n_slots, n_ctx_slot=N_CTX_SLOT, chunk=chunk, proposer=proposer,
                      speculation=SpecConfig(draft_max=draft_max, adaptive=False)
                      if proposer is not None else None)


def _drafter(path: Path, n_slots: int = 2, **kw: object) -> SlotDrafter:
    """A draft model in `n_slots` slots; vocab_limit: it scores only the first ids (so its
    guesses differ from a same-file target's where the target's top lies beyond them)."""
    return SlotDrafter(_engine(path, n_slots * N_CTX_SLOT, **kw), N_CTX_SLOT, p_min=0.0)


def _add(core: EngineCore, prompt: list[int], max_tokens: int) -> Request:
    s = Sampler(SamplerParams(temp=0.0), 320, seed=1)
    s.reset(prompt)
    return core.add(next(_IDS), GenRequest(prompt, max_tokens, s, top_logits=4))


def _run(core: EngineCore, prompts: list[list[int]], max_tokens: int = 12) -> list[Request]:
    states = [_add(core, p, max_tokens) for p in prompts]
    while core.busy:
        assert all(o.error is None for o in core.step())
    return states


def _same(a: list[Request], b: list[Request]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.ids == y.ids and x.tops == y.tops


# -- 1. a hybrid draft model ---------------------------------------------------------------------
PROMPTS = [[*SYSTEM[:20], *SYSTEM[:20]], RNG.integers(0, 300, 24).tolist()]


@pytest.mark.parametrize(("target", "draft", "limit"), [
    ("lfm2", "lfm2", 160), ("qwen35", "qwen35", 160), ("lfm2", "qwen35", 0),
    ("qwen35", "lfm2", 0)])
def test_a_hybrid_draft_rolls_its_state_back_and_greedy_is_plain(
        target: str, draft: str, limit: int, caplog: pytest.LogCaptureFixture) -> None:
    """A hybrid draft model (`-md` with an LFM2 / Qwen3.5 file) keeps its own state per slot:
    after a verify its catch-up restarts from the state kept at the end of the last one and
    recomputes the accepted tokens, so it drafts every step (none fails), and the target's
    greedy output is plain decoding's, bitwise. A same-file draft scoring only the first 160
    ids is right at times and wrong at others."""
    plain = _run(_core(MODELS[target]), PROMPTS, max_tokens=20)
    drafter = _drafter(MODELS[draft], vocab_limit=limit)
    spec = _run(_core(MODELS[target], proposer=drafter), PROMPTS, max_tokens=20)
    _same(plain, spec)
    assert "the proposer failed" not in caplog.text
    drafted = sum(s.spec.drafted for s in spec)
    accepted = sum(s.spec.accepted for s in spec)
    assert drafted >= 20  # each of the 2 x 19 decode steps after the first drafted
    if limit:
        assert 0 < accepted < drafted  # some kept, some taken back
    # the draft's cells and state agree with its record: what a plain draft computes
    for slot, held in enumerate(drafter.cached):
        assert drafter.runner.engine.state_position(slot) == len(held)  # type: ignore


def test_a_hybrid_draft_takes_another_slots_prefix_with_its_state(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two requests with one system prompt: the second slot's draft copies the first's cells
    up to where that slot's draft kept its state, and the output stays plain."""
    prompts = [[*SYSTEM, *p] for p in PROMPTS]
    plain = _run(_core(LFM2), prompts, max_tokens=10)
    drafter = _drafter(LFM2, vocab_limit=160)
    core = _core(LFM2, proposer=drafter)
    first = _add(core, prompts[0], 10)
    while not first.ids:
        core.step()
    core.step()  # the first catch-up: the draft prefills slot 0
    second = _add(core, prompts[1], 10)
    while core.busy:
        assert all(o.error is None for o in core.step())
    _same(plain, [first, second])
    assert second.spec.drafted > 0 and "the proposer failed" not in caplog.text


def test_run_drafts_with_a_hybrid_model(caplog: pytest.LogCaptureFixture) -> None:
    """`minfer run -md` (the Python API's speculator): a hybrid draft for a hybrid target,
    greedy output plain decoding's, drafts counted."""
    import minfer
    from minfer.engine.generate import Finished

    prompt = PROMPTS[0]

    def generate(spec: SpecConfig | None) -> Finished:
        model = minfer.load(LFM2, n_ctx=128, kv_type="f32", threads=1)
        speculator = None if spec is None else model.speculator(spec)
        *_, done = model.stream(prompt, max_tokens=24, sampling=SamplerParams(temp=0.0),
                                speculator=speculator)
        assert isinstance(done, Finished)
        return done

    plain = generate(None)
    for draft in (LFM2, QWEN35):
        got = generate(SpecConfig(draft_model=draft, draft_quant="keep", draft_vocab=160,
                                  p_min=0.0, adaptive=False, draft_max=4))
        assert got.ids == plain.ids and got.n_past == plain.n_past
        assert got.speculation is not None and got.speculation.drafted > 0
    assert "the proposer failed" not in caplog.text


# -- 3. a system prompt shared across slots ------------------------------------------------------
@pytest.mark.parametrize("burst", [False, True])
def test_a_shared_system_prompt_is_copied_with_a_state_checkpoint(burst: bool) -> None:
    """A request whose prompt repeats another slot's system prompt (40 tokens) copies that
    slot's cells up to its state checkpoint at the last 16-row prompt chunk's end inside the
    shared part (32), not re-prefilling it: beside a running request (it decodes) or in a
    burst (the second prompt waits for the first's chunk, then copies). Its cached tokens
    say so, and it draws what it draws alone, bitwise."""
    prompts = [[*SYSTEM, *RNG.integers(0, 300, 10).tolist()] for _ in range(2)]
    alone = [_run(_core(LFM2, 1), [p])[0] for p in prompts]
    core = _core(LFM2)
    first = _add(core, prompts[0], 12)
    if not burst:
        while not first.ids:
            core.step()
    second = _add(core, prompts[1], 12)
    while core.busy:
        assert all(o.error is None for o in core.step())
    _same(alone, [first, second])
    assert first.n_cached == 0 and second.n_cached == 32


def test_a_prompt_beside_the_one_computing_its_prefix_waits_and_copies_it() -> None:
    """Two requests arriving together, the first's prompt (the system prompt alone, one 64-row
    chunk) a prefix of the second's: the second waits a step instead of prefilling beside it,
    then copies 39 of those 40 tokens with the first slot's state (the first's chunk stops a
    token short of its end, `TAIL_SPLIT`, where its state is checkpointed)."""
    prompts = [SYSTEM, [*SYSTEM, *RNG.integers(0, 300, 10).tolist()]]
    alone = [_run(_core(LFM2, 1, chunk=64), [p])[0] for p in prompts]
    both = _run(_core(LFM2, chunk=64), prompts)
    _same(alone, both)
    assert both[1].n_cached == 39


def test_two_prompts_sharing_a_system_prompt_inside_one_chunk_compute_it_once() -> None:
    """Two requests arriving together whose common system prompt (40 tokens) lies inside the
    first's one 64-row chunk: that chunk ends at 40 (its state checkpointed there), the second
    waits a step and copies those 40 tokens with the state; both draw what they draw alone."""
    prompts = [[*SYSTEM, *RNG.integers(0, 300, 10).tolist()] for _ in range(2)]
    assert prompts[0][len(SYSTEM)] != prompts[1][len(SYSTEM)]
    alone = [_run(_core(LFM2, 1, chunk=64), [p])[0] for p in prompts]
    both = _run(_core(LFM2, chunk=64), prompts)
    _same(alone, both)
    assert both[0].n_cached == 0 and both[1].n_cached == 40


# -- 4. batch invariance: every way a token is computed ------------------------------------------
STREAMS = [[*SYSTEM[:int(n) % 24], *RNG.integers(0, 300, int(n)).tolist()]
           for n in RNG.integers(5, 60, 8)]


def _mtp() -> MtpProposer:
    f = GGUFFile.open(QWEN35_MTP)
    hp = HParams.from_gguf(f)
    return MtpProposer(lambda n: Engine(f, hp.mtp_head(), n_ctx=n, kv_type="f32"), p_min=0.0,
                       chunk=16)


def test_server_rows_are_bitwise_alone_in_every_way() -> None:
    """On a hybrid model with an MTP head: each of 8 streams draws, with the same logits bit
    for bit, what it draws alone, whether the 8 run together with prefill chunks of 1, 7 or 64
    rows, or speculate with prompt lookup, a hybrid draft model, the MTP head or lookup and a
    draft together."""
    alone = [_run(_core(QWEN35_MTP, 1, chunk=64), [p])[0] for p in STREAMS]
    for chunk in (1, 7, 64):
        _same(alone, _run(_core(QWEN35_MTP, 8, chunk=chunk), STREAMS))
    proposers: list[Proposer] = [
        LookupProposer(2), _drafter(QWEN35_MTP, 8, vocab_limit=160), _mtp(),
        HybridProposer(LookupProposer(2), _drafter(LFM2, 8), 4)]  # lookup and a draft
    for proposer in proposers:
        spec = _run(_core(QWEN35_MTP, 8, chunk=7, proposer=proposer), STREAMS)
        _same(alone, spec)
        assert sum(s.spec.drafted for s in spec) > 0


def test_run_is_bitwise_the_same_in_every_way() -> None:
    """`minfer run` on a hybrid model (one sequence, its engine not batch-invariant): prompt
    batches of 1, 7 and 64 tokens and speculation (lookup, a hybrid draft, the MTP head) give
    the same tokens and final context."""
    import minfer
    from minfer.engine.generate import Finished

    def run(batch_size: int, spec: SpecConfig | None) -> tuple[list[int], int]:
        model = minfer.load(QWEN35_MTP, n_ctx=128, kv_type="f32", threads=1,
                            batch_size=batch_size)
        speculator = None if spec is None else model.speculator(spec)
        *_, done = model.stream(STREAMS[1] * 2, max_tokens=16,
                                sampling=SamplerParams(temp=0.0), speculator=speculator)
        assert isinstance(done, Finished)
        return done.ids, done.speculation.drafted if done.speculation else 0

    plain, _ = run(64, None)
    for batch_size in (1, 7):
        assert run(batch_size, None) == (plain, 0)
    some = {"p_min": 0.0, "adaptive": False, "draft_max": 4}
    for spec in (SpecConfig(lookup_ngram=2, **some),  # type: ignore[arg-type]
                 SpecConfig(draft_model=QWEN35_MTP, draft_quant="keep", draft_vocab=160,
                            **some),  # type: ignore[arg-type]
                 SpecConfig(mtp=True, **some)):  # type: ignore[arg-type]
        ids, drafted = run(7, spec)
        assert ids == plain and (drafted > 0 or spec.lookup_ngram)  # (this random model's
        # output repeats nothing of the prompt: lookup proposes in the server's test)


# -- 2. the context shift ------------------------------------------------------------------------
class _MergesOnly:
    """Greedy over the BPE merges only (ids 256..316: ASCII text), so a reply is whole text and
    the session keeps a turn's KV as it is."""

    seed = 0

    def sample(self, logits: np.ndarray) -> int:
        return 256 + int(np.argmax(logits[256:317]))

    def accept(self, token_id: int) -> None:
        pass

    def reset(self, prompt_tail: object = (), *, seed: int | None = None) -> None:
        pass


@pytest.mark.parametrize(("max_tokens", "reserve"), [(8, None), (60, 4)])
def test_a_chat_past_the_context_recomputes_the_kept_turns_state(max_tokens: int,
                                                                 reserve: int | None) -> None:
    """`minfer chat` on a hybrid model whose conversation outgrows the context (at a turn's
    start, or in the middle of a reply: 60 tokens, 4 cells kept free): the oldest turns are
    dropped and,
    since a recurrent state cannot be shifted, the kept window's state is recomputed — the
    report says so, no row is shifted — and the state is exactly a fresh prefill's of what
    the KV holds."""
    from minfer.chat.repl import format_report
    from minfer.chat.session import ChatConfig, ChatSession, TurnReport
    from minfer.engine.kv_shift import shift_kv
    from minfer.errors import MinferError
    from minfer.tokenizer.chat import ChatTemplate

    f = GGUFFile.open(LFM2)
    tok = Tokenizer.from_gguf(f)
    e = _engine(LFM2, 96)
    chat = ChatSession(e, tok, ChatTemplate.from_gguf(f, tok), _MergesOnly(),
                       config=ChatConfig(max_tokens=max_tokens, reserve=reserve),
                       system="Be brief.")
    assert not chat.kv.can_shift
    with pytest.raises(MinferError, match="recurrent state"):
        shift_kv(e, src_start=10, src_end=20, dst_start=4)
    dropped = []
    for text in ("Hello world!", "The quick brown fox", "jumps over the lazy dog", "Again?",
                 "And once more"):
        *_, report = chat.say(text)
        assert isinstance(report, TurnReport)
        if report.n_dropped:
            dropped.append(report)
            assert report.state_recomputed and report.n_shifted == 0
            assert "recurrent state recomputed" in format_report(report)
    assert dropped
    held = chat.kv.tokens
    assert e.state_position(0) == len(held)
    fresh = _engine(LFM2, 96)
    fresh.forward(held, 0)
    for mine, theirs in zip(e.kv.state_regions, fresh.kv.state_regions, strict=True):
        assert np.array_equal(mine[0], theirs[0])


def test_the_server_reports_a_shared_system_prompts_cached_tokens() -> None:
    """`minfer serve` (its worker on the real tiny engine, 2 slots, 16-row chunks): a request
    that repeats a running request's system prompt reports the tokens it copied with that
    slot's state checkpoint as cached, and gets the text it gets alone."""
    import asyncio

    from minfer.engine.assembly import Assembly, ModelConfig
    from minfer.server.metrics import Metrics
    from minfer.server.worker import Delta, Done, Handle, Worker

    prompts = [[*SYSTEM, *RNG.integers(0, 300, 10).tolist()] for _ in range(2)]

    def serve(n_slots: int, together: bool) -> list[tuple[str, int]]:
        parts = Assembly(LFM2, ModelConfig.build(n_ctx=128, kv_type="f32", threads=1,
                                                 batch_invariant=True))
        w = Worker(parts.engine, parts.tokenizer, n_slots=n_slots, n_ctx_slot=128, chunk=16,
                   metrics=Metrics())
        w.start()
        assert w.ready.wait(60) and w.error is None

        async def one(prompt: list[int], started: asyncio.Event | None) -> tuple[str, int]:
            handle = Handle(asyncio.get_running_loop())
            w.submit(GenRequest(prompt=prompt, max_tokens=24, sampler=Sampler(
                SamplerParams.greedy(), parts.hparams.n_vocab, seed=0)), handle)
            text = []
            while True:
                ev = await asyncio.wait_for(handle.events.get(), 60)
                if isinstance(ev, Delta):
                    text.append(ev.text)
                    if started is not None:
                        started.set()
                else:
                    assert isinstance(ev, Done)
                    return "".join(text), ev.usage.cached_tokens

        async def main() -> list[tuple[str, int]]:
            if not together:
                return [await one(p, None) for p in prompts]
            started = asyncio.Event()
            first = asyncio.create_task(one(prompts[0], started))
            await started.wait()  # the first request decodes: its prompt is in its slot
            return [await first, await one(prompts[1], None)]
        try:
            return asyncio.run(main())
        finally:
            w.stop()

    alone = serve(1, together=False)
    got = serve(2, together=True)
    assert [t for t, _ in got] == [t for t, _ in alone]
    assert got[0][1] == 0 and got[1][1] == 32


@pytest.mark.parametrize(("chunk", "cached"), [(128, 99), (64, 99), (96, 96)])
@pytest.mark.parametrize("model", ["lfm2", "qwen35"])
def test_a_regenerated_reply_prefills_only_the_last_prompt_token(model: str, chunk: int,
                                                                 cached: int) -> None:
    """The same 100-token prompt again (a /regen) after its reply: the first time, its last
    chunk (all 100 rows, or the 36 after a 64-row one) stops a token short (its state
    checkpointed at 99), so the second request restores that checkpoint and computes only the
    last token (99 cached; was 0: the only checkpoint stood at 100, past the token whose logits
    are wanted; after a 64-row chunk 64 while `TAIL_SPLIT` was 64), and both draw what a fresh
    core draws, bitwise. A last chunk of 4 rows (after 96) is not split: its 4 are computed
    again."""
    prompt = [*SYSTEM, *RNG.integers(0, 300, 60).tolist()]
    alone = _run(_core(MODELS[model], 1, chunk=chunk), [prompt])[0]
    core = _core(MODELS[model], chunk=chunk)
    first = _run(core, [prompt])[0]
    again = _run(core, [prompt])[0]
    _same([alone, alone], [first, again])
    assert first.n_cached == 0 and again.n_cached == cached
