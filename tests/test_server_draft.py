"""A draft model per server slot (`minfer serve -md FILE`) on fake engines: every greedy text
equals the text without speculation, batched, with a draft that is always right and one that is
often wrong, with requests cancelled midway; the draft steps are one forward across slots; the
draft KV follows rejections and catches up on long prompts a chunk a step; a failing draft
costs only its proposals; /metrics counts the proposals; a draft of another vocabulary is refused
at load."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from minfer.engine.config import EngineConfig
from minfer.engine.core.proposer import DraftAsk, SlotDrafter
from minfer.engine.speculative import SpecConfig
from minfer.server.metrics import Metrics
from minfer.server.state import ServerConfig, ServerState
from minfer.server.worker import Delta, Done, EngineFactory, Handle, Worker
from minfer.tools.synth import build_tiny_vocab, write_tiny_model
from tests.fake_engine import HashEngine
from tests.test_server_scheduler import N_VOCAB, _Vocab
from tests.test_server_speculative import CycleEngine, _request

if TYPE_CHECKING:
    from minfer.engine.forward import Batch

AVOID = frozenset({0})


class WeakDraft(CycleEngine):
    """The target's rows, except every third position, where another successor wins: a draft
    that is often right and sometimes wrong (rejections at known places)."""

    def row_logits(self, window: np.ndarray, position: int) -> np.ndarray:
        logits = super().row_logits(window, position)
        if position % 3 == 0:
            logits[(int(window[-1]) * 11 + 1) % N_VOCAB or 1] += 100.0
        return logits


def _target(n_ctx: int) -> HashEngine:
    return CycleEngine(n_ctx, N_VOCAB, avoid=AVOID)


def _worker(n_slots: int, draft: EngineFactory | None, metrics: Metrics | None = None,
            step_s: float = 0.0) -> Worker:
    w = Worker(lambda n: CycleEngine(n, N_VOCAB, avoid=AVOID, step_s=step_s), _Vocab(),
               n_slots=n_slots, n_ctx_slot=96, chunk=16, metrics=metrics,
               speculation=SpecConfig(draft_max=8, p_min=0.0) if draft else None,
               make_draft=draft)
    w.start()
    assert w.ready.wait(5)
    return w


async def _generate(w: Worker, prompt: list[int], n: int, *, temp: float = 0.0,
                    cancel_after: int | None = None) -> str:
    """The request's text; with cancel_after, the client goes away after that many deltas."""
    handle = Handle(asyncio.get_running_loop())
    w.submit(_request(prompt, n, temp), handle)
    text: list[str] = []
    while True:
        ev = await asyncio.wait_for(handle.events.get(), 10)
        if isinstance(ev, Done):
            assert ev.usage.completion_tokens == n
            return "".join(text)
        assert isinstance(ev, Delta)
        text.append(ev.text)
        if cancel_after is not None and len(text) >= cancel_after:
            w.cancel(handle)
            return ""


def _prompts(n: int = 10) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(1, N_VOCAB) for _ in range(rng.randrange(3, 40))]
               for _ in range(n)]
    return prompts, [rng.randrange(10, 40) for _ in prompts]


def _texts(n_slots: int, draft: EngineFactory | None, metrics: Metrics | None = None,
           cancel: frozenset[int] = frozenset(), step_s: float = 0.0
           ) -> tuple[list[str], Worker]:
    prompts, lengths = _prompts()
    box: list[Worker] = []

    async def main() -> list[str]:
        w = _worker(n_slots, draft, metrics, step_s)
        box.append(w)
        try:
            return await asyncio.gather(*(
                _generate(w, p, n, cancel_after=2 if i in cancel else None)
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))))
        finally:
            w.stop()
            assert w.scheduler.n_busy == 0 and w.scheduler.n_waiting == 0

    return asyncio.run(main()), box[0]


@pytest.fixture(scope="module")
def plain() -> list[str]:
    return _texts(1, None)[0]


def test_an_exact_draft_is_always_accepted_and_the_texts_are_unchanged(plain: list[str]) -> None:
    metrics = Metrics()
    texts, _ = _texts(3, _target, metrics)
    assert texts == plain
    drafted, kept = metrics.draft_tokens.total(), metrics.draft_accepted.total()
    assert drafted > 0 and kept == drafted  # the draft KV followed every sequence exactly
    assert "minfer_draft_tokens_total" in metrics.render()


def test_a_weak_draft_is_rejected_at_times_and_the_texts_are_unchanged(plain: list[str]) -> None:
    metrics = Metrics()
    texts, _ = _texts(3, lambda n: WeakDraft(n, N_VOCAB, avoid=AVOID), metrics)
    assert texts == plain
    drafted, kept = metrics.draft_tokens.total(), metrics.draft_accepted.total()
    assert 0 < kept < drafted


def test_draft_steps_are_one_forward_across_slots() -> None:
    # the target's forward costs 2 ms, as a real one costs more than the fake draft's: with
    # every forward free, the measured payoff of drafting (`BatchPayoff`) was noise and turned
    # proposals off in about one run of four
    _, w = _texts(3, _target, step_s=0.002)
    assert w.drafter is not None
    engine = w.drafter.runner.engine
    assert isinstance(engine, HashEngine)
    draft_steps = [b for b in engine.calls
                   if b.n_tokens > 1 and len(set(b.kv_start.tolist())) == b.n_tokens]
    assert draft_steps, "no draft step fed one token in each of several slots"


def test_cancelled_requests_leave_the_others_unchanged(plain: list[str]) -> None:
    cancel = frozenset({1, 4, 7})
    texts, _ = _texts(3, lambda n: WeakDraft(n, N_VOCAB, avoid=AVOID), cancel=cancel,
                      step_s=0.002)
    assert [t for i, t in enumerate(texts) if i not in cancel] == \
        [t for i, t in enumerate(plain) if i not in cancel]


class FlakyDraft(CycleEngine):
    """A draft engine whose every fifth forward fails."""

    def forward_batch(self, batch: Batch) -> np.ndarray:
        if len(self.calls) % 5 == 4:
            self.calls.append(batch)
            raise RuntimeError("draft engine failure")
        return super().forward_batch(batch)


def test_a_failing_draft_only_costs_its_proposals(plain: list[str]) -> None:
    metrics = Metrics()
    texts, _ = _texts(3, lambda n: FlakyDraft(n, N_VOCAB, avoid=AVOID), metrics)
    assert texts == plain
    assert metrics.draft_accepted.total() == metrics.draft_tokens.total() > 0


def test_sampled_requests_with_a_draft_finish() -> None:
    prompts, lengths = _prompts(4)

    async def main() -> list[str]:
        w = _worker(2, lambda n: WeakDraft(n, N_VOCAB, avoid=AVOID))
        try:
            return await asyncio.gather(*(_generate(w, p, n, temp=0.8)
                                          for p, n in zip(prompts, lengths, strict=True)))
        finally:
            w.stop()

    assert len(asyncio.run(main())) == 4  # each request checked its completion_tokens


# -- the drafter alone ---------------------------------------------------------------------------
def _drafter(p_min: float = 0.0) -> SlotDrafter:
    return SlotDrafter(CycleEngine(2 * 64, N_VOCAB), 64, p_min=p_min, chunk=8)


def _caught_up(d: SlotDrafter, ask: DraftAsk) -> tuple[list[int], int]:
    """The proposals once the draft has caught up, and how many steps that took."""
    for step in range(1, 20):
        got = d.propose([ask])[ask.seq_id].tokens
        if got:
            return got, step
    raise AssertionError("the draft never caught up")


def test_the_draft_kv_follows_rejections_and_new_requests() -> None:
    rng = random.Random(5)
    history = [rng.randrange(1, N_VOCAB) for _ in range(20)]
    d = _drafter()
    for step in range(12):
        ask = DraftAsk(1, step % 2, tuple(history), 6)
        got, steps = _caught_up(d, ask)
        if step == 0:
            assert steps == 3  # a new slot catches up on 20 tokens, 8 a step
        if step == 1:  # slot 1 copies the cells slot 0 shares with it, feeds the rest
            ((src, dst, n),) = d.runner.engine.copies  # type: ignore[attr-defined]
            assert steps == 1 and (src, dst) == (0, 64) and n >= 20
        assert got == _caught_up(_drafter(), ask)[0]  # a fresh draft KV proposes the same
        assert len(got) == 6 and d.cached[ask.slot][:len(history)] == history
        kept = rng.randrange(0, len(got))
        history = [*history, *got[:kept], rng.randrange(1, N_VOCAB)]  # then a rejection


def test_a_long_prompt_catches_up_beside_the_others_drafts() -> None:
    d = _drafter()
    short, long = DraftAsk(1, 0, (3, 4), 4), DraftAsk(2, 1, tuple(range(1, 31)), 4)
    assert d.propose([short])[1].tokens
    rounds = []
    for _ in range(5):
        got = d.propose([long, DraftAsk(1, 0, (3, 4), 4)])
        assert len(got[1].tokens) == 4  # the decoding sequence drafts every step
        rounds.append(len(got[2].tokens))
    assert rounds == [0, 0, 0, 0, 4]  # 30 tokens lacking, 7 a step beside the other's 1


def test_the_draft_stops_where_it_is_unsure() -> None:
    ask = DraftAsk(1, 0, (5, 9, 12), 16)
    full = _caught_up(_drafter(), ask)[0]
    short = _caught_up(_drafter(p_min=0.9), ask)[0]
    assert 0 < len(short) < len(full) and short == full[:len(short)]


def test_a_draft_past_the_slot_is_cut_to_fit() -> None:
    ask = DraftAsk(1, 1, tuple(range(1, 61)), 16)  # cells 60.. of a 64-cell slot
    assert len(_caught_up(_drafter(), ask)[0]) == 5


def test_a_proposals_price_leaves_out_the_catch_up_that_resumes_drafting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward of n tokens takes 1 + n ticks of a fake clock. Right after the last proposal
    a proposal's time is its price; after 10 plain steps, the 11-token catch-up counts as one
    draft step (2 ticks); with no draft step to go by, there is no price."""
    import types

    import minfer.engine.core.proposer as proposer

    clock = [0.0]
    monkeypatch.setattr(proposer, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Ticking(CycleEngine):
        def forward_batch(self, batch: Batch) -> np.ndarray:
            clock[0] += 1 + len(batch.tokens)
            return super().forward_batch(batch)

    d = SlotDrafter(Ticking(64, N_VOCAB), 64, p_min=0.0, chunk=64)

    def propose(tokens: list[int], k: int) -> tuple[list[int], float | None]:
        t0 = clock[0]
        got = d.propose([DraftAsk(1, 0, tuple(tokens), k)])[1].tokens
        return got, d.price(clock[0] - t0)

    seq = [3, 4, 5]
    got, price = propose(seq, 4)  # the prompt: a 3-token catch-up, then 3 draft steps
    assert len(got) == 4 and price == 4 * 2
    seq += [*got, 7]  # all kept, and the target's own token: 2 tokens to catch up on
    got, price = propose(seq, 4)
    assert price == 3 + 3 * 2
    seq += got[:1] + [7] * 10  # one kept, then 10 tokens of plain steps
    got, price = propose(seq, 4)
    assert price == 4 * 2  # 12 ticks of catch-up, priced as one step
    seq += [8] * 10
    assert propose(seq, 1)[1] is None  # only a long catch-up: nothing to price by


# -- loading --------------------------------------------------------------------------------------
def test_a_draft_of_another_vocabulary_is_refused_at_load(tiny_qwen2: Path,
                                                          tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "other.gguf",
                             vocab=build_tiny_vocab(extra_tokens=("<x>",)))
    cfg = ServerConfig(model_path=tiny_qwen2, engine=EngineConfig.build(n_ctx=64), slots=1,
                       spec=SpecConfig(draft_model=other))
    state = ServerState(cfg, engine_factory=lambda n: HashEngine(n, 300),
                        draft_engine_factory=lambda n: HashEngine(n, 300))
    state.start()
    assert not state.wait_ready(30)
    assert state.status == "error" and "vocabulary does not match" in (state.error or "")
