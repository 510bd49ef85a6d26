"""The slot scheduler alone, with fake runner outputs, and the engine thread on a fake engine.

The fake engine (`HashEngine`) derives each row's logits from the KV cells the row reads, so any
scheduling mistake (a wrong cell or window, a stale prompt-cache hit, rows crossed between
sequences) changes the generated ids: every request must produce the ids it produces alone.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from minfer.engine.core.request import GenRequest
from minfer.engine.core.runner import build_batch
from minfer.engine.core.scheduler import (
    SHARE_MIN,
    CellCopy,
    Plan,
    QueueFullError,
    Scheduler,
    Sequence,
    Work,
)
from minfer.errors import MinferError
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from minfer.server.worker import Delta, Done, Handle, Worker
from tests.fake_engine import HashEngine

N_VOCAB = 97


def _seq(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id, list(prompt), len(prompt))


def _run_fake(s: Scheduler, plan: Plan, next_token: int = 7) -> None:
    """What the engine thread does after a forward: advance, then append sampled tokens."""
    s.advance(plan)
    for w in plan.works:
        if w.logits:
            s.append(w.seq_id, next_token)


def test_decodes_run_every_step_while_a_long_prompt_prefills_in_chunks() -> None:
    s = Scheduler(n_slots=2, n_ctx_slot=1024, chunk=64)
    s.add(_seq(1, [1, 2, 3]))
    _run_fake(s, s.schedule())  # seq 1 prefilled, samples its first token
    s.add(_seq(2, list(range(200))))
    fed = []
    for _ in range(4):
        plan = s.schedule()
        by_id = {w.seq_id: w for w in plan.works}
        assert len(by_id[1].tokens) == 1 and by_id[1].logits  # the decode never stalls
        fed.append(len(by_id[2].tokens))
        assert plan.n_tokens <= 64 + 1
        _run_fake(s, plan)
    assert fed == [64, 64, 64, 8]
    assert s.running[2].decoding and s.running[2].n_pending == 1


def test_a_step_with_nothing_decoding_takes_the_idle_chunk() -> None:
    """Nobody waits on a step without decodes: it prefills up to idle_chunk prompt tokens; as
    soon as a sequence decodes, the prompts beside it get the chunk again."""
    s = Scheduler(n_slots=2, n_ctx_slot=1024, chunk=64, idle_chunk=256)
    s.add(_seq(1, list(range(300))))
    plan = s.schedule()
    assert [len(w.tokens) for w in plan.works] == [256]
    _run_fake(s, plan)
    plan = s.schedule()  # still nothing decodes: the rest of the prompt at once
    assert [len(w.tokens) for w in plan.works] == [44] and plan.works[0].logits
    _run_fake(s, plan)
    s.add(_seq(2, list(range(1, 301))))  # nothing in common with seq 1's cells
    plan = s.schedule()
    assert sorted(len(w.tokens) for w in plan.works) == [1, 64]  # seq 1 decodes


def test_idle_chunk_defaults_to_the_chunk_and_must_be_positive() -> None:
    s = Scheduler(n_slots=1, n_ctx_slot=1024, chunk=32)
    s.add(_seq(1, list(range(100))))
    assert s.schedule().n_tokens == 32
    with pytest.raises(MinferError):
        Scheduler(n_slots=1, n_ctx_slot=64, chunk=8, idle_chunk=0)


def test_only_the_chunk_that_ends_the_prompt_asks_for_logits() -> None:
    s = Scheduler(n_slots=1, n_ctx_slot=64, chunk=4)
    s.add(_seq(1, list(range(10))))
    flags = []
    while not s.running.get(1) or not s.running[1].decoding:
        plan = s.schedule()
        flags.append(plan.works[0].logits)
        s.advance(plan)
    assert flags == [False, False, True]


def test_prompt_cache_picks_the_longest_prefix_and_recomputes_the_last_token() -> None:
    s = Scheduler(n_slots=3, n_ctx_slot=64, chunk=64)
    prompts = {1: [1, 2, 3, 4], 2: [1, 2, 9, 9, 9], 3: [5, 5]}
    for sid, p in prompts.items():
        s.add(_seq(sid, p))
    _run_fake(s, s.schedule())
    for sid in prompts:
        s.finish(sid)
    s.add(_seq(4, [1, 2, 9, 9, 8, 8]))
    plan = s.schedule()
    (w,) = plan.works
    assert w.slot == 1 and w.start_pos == 4 and w.tokens == (8, 8)
    assert s.running[4].n_cached == 4
    _run_fake(s, plan)
    s.finish(4)
    s.add(_seq(5, [1, 2, 9, 9, 8, 8]))  # the whole prompt is cached: its last token is redone
    (w,) = s.schedule().works
    assert w.start_pos == 5 and w.tokens == (8,) and w.logits


def test_a_prefix_another_slot_holds_is_copied_not_recomputed() -> None:
    """A prompt takes over the longest prefix of it any other slot's cells hold (a running
    sequence's computed tokens, not the ones still to come), copied from where its own cells
    end, up to its last prompt token, which is always computed."""
    s = Scheduler(n_slots=4, n_ctx_slot=64, chunk=3, idle_chunk=3)
    s.add(_seq(1, [1, 2, 3, 4, 5, 6]))
    _run_fake(s, s.schedule())  # sequence 1 (slot 0) has computed [1, 2, 3] of its prompt
    s.add(_seq(2, [1, 2, 3, 4, 9]))
    plan = s.schedule()  # the budget goes to sequence 1; sequence 2 copies what there is
    assert plan.copies == (CellCopy(0, 1, 0, 3),)
    assert [(w.slot, w.start_pos, w.tokens) for w in plan.works] == [(0, 3, (4, 5, 6))]
    assert s.running[2].n_computed == s.running[2].n_cached == 3
    _run_fake(s, plan)
    plan = s.schedule()  # sequence 1 decodes; its cells now hold [1, 2, 3, 4] of prompt 2
    assert plan.copies == (CellCopy(0, 1, 3, 1),)
    assert [(w.slot, w.start_pos, w.tokens) for w in plan.works] == [(0, 6, (7,)), (1, 4, (9,))]
    _run_fake(s, plan)
    assert s.schedule().copies == ()


def test_a_prompt_waits_a_step_for_the_prefix_an_earlier_prompt_computes() -> None:
    """A burst of requests with one system prompt: the first computes it, the others wait a
    step and copy it; a prompt sharing fewer than SHARE_MIN tokens does not wait."""
    system = list(range(1, SHARE_MIN + 5))
    s = Scheduler(n_slots=4, n_ctx_slot=64, chunk=64, idle_chunk=64)
    s.add(_seq(1, [*system, 70, 71]))
    s.add(_seq(2, [*system, 80]))
    s.add(_seq(3, [*system[:SHARE_MIN - 1], 90]))
    s.add(_seq(4, [50, 51]))
    plan = s.schedule()
    assert plan.copies == () and [w.seq_id for w in plan.works] == [1, 3, 4]
    _run_fake(s, plan)
    plan = s.schedule()
    assert plan.copies == (CellCopy(0, 1, 0, len(system)),)
    assert [(w.seq_id, w.start_pos, w.tokens) for w in plan.works if w.seq_id == 2] == \
        [(2, len(system), (80,))]


def test_copied_cells_give_the_texts_computed_cells_give() -> None:
    """Requests sharing a long prefix, side by side on the fake engine: cells were copied
    between slots and every text is the one the request gets alone."""
    rng = random.Random(3)
    system = [rng.randrange(1, N_VOCAB) for _ in range(30)]
    prompts = [system + [rng.randrange(1, N_VOCAB) for _ in range(rng.randrange(1, 9))]
               for _ in range(6)]
    engines: list[HashEngine] = []

    def engine(n: int) -> HashEngine:
        engines.append(HashEngine(n, N_VOCAB, avoid=frozenset({0})))
        return engines[-1]

    async def together() -> list[str]:
        w = Worker(engine, _Vocab(), n_slots=3, n_ctx_slot=96, chunk=16, max_waiting=64)
        w.start()
        assert w.ready.wait(5)
        try:
            return [t for t, _ in await asyncio.gather(*(_generate(w, p, 6) for p in prompts))]
        finally:
            w.stop()

    async def solo(p: list[int]) -> str:
        w = _worker(1, 1024)
        try:
            return (await _generate(w, p, 6))[0]
        finally:
            w.stop()

    texts = asyncio.run(together())
    assert engines[0].copies
    assert texts == [asyncio.run(solo(p)) for p in prompts]


def test_a_tie_goes_to_the_least_recently_used_slot() -> None:
    s = Scheduler(n_slots=2, n_ctx_slot=64)
    s.add(_seq(1, [1, 1]))
    s.add(_seq(2, [2, 2]))
    _run_fake(s, s.schedule())
    s.finish(2)
    s.finish(1)  # slot 0 used last
    s.add(_seq(3, [3, 3]))
    assert s.schedule().works[0].slot == 1


def test_queue_is_bounded_and_finish_frees_waiting_and_running() -> None:
    s = Scheduler(n_slots=1, n_ctx_slot=64, max_waiting=2)
    for i in range(3):  # one gets the slot, two wait
        s.add(_seq(i, [1]))
    with pytest.raises(QueueFullError):
        s.add(_seq(9, [1]))
    s.schedule()
    assert s.n_busy == 1 and s.n_waiting == 2
    s.finish(2)  # a waiting one leaves
    s.add(_seq(10, [1]))
    s.finish(0)  # the running one leaves: the next waiting one is admitted
    s.schedule()
    assert set(s.running) == {1} and s.n_waiting == 1


def test_prompt_longer_than_the_slot_is_refused() -> None:
    s = Scheduler(n_slots=1, n_ctx_slot=8)
    with pytest.raises(MinferError, match=r"1\.\.8"):
        s.add(_seq(1, list(range(9))))


def test_build_batch_places_each_slot_in_its_own_cells() -> None:
    plan = Plan((Work(1, 0, 5, (9,), True), Work(2, 2, 0, (4, 5, 6), False),
                 Work(3, 3, 2, (7, 8), True)))
    batch, ids = build_batch(plan, 16)
    assert batch.positions.tolist() == [5, 0, 1, 2, 2, 3]
    assert batch.cells.tolist() == [5, 32, 33, 34, 50, 51]
    assert batch.kv_start.tolist() == [0, 32, 32, 32, 48, 48]
    assert batch.kv_end.tolist() == [6, 33, 34, 35, 51, 52]
    assert batch.out_rows.tolist() == [0, 5] and ids == [1, 3]


# -- the engine thread on the fake engine ------------------------------------------------------

class _Vocab:
    eot_ids = frozenset({0})

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([65 + token_id % 26])


def _request(prompt: list[int], max_tokens: int) -> GenRequest:
    sampler = Sampler(SamplerParams.greedy(), N_VOCAB, seed=0)
    return GenRequest(prompt=prompt, max_tokens=max_tokens, sampler=sampler)


async def _generate(worker: Worker, prompt: list[int], max_tokens: int) -> tuple[str, Done]:
    handle = Handle(asyncio.get_running_loop())
    worker.submit(_request(prompt, max_tokens), handle)
    text = []
    while True:
        ev = await asyncio.wait_for(handle.events.get(), 10)
        if isinstance(ev, Delta):
            text.append(ev.text)
        else:
            assert isinstance(ev, Done)
            return "".join(text), ev


def _worker(n_slots: int, chunk: int) -> Worker:
    w = Worker(lambda n: HashEngine(n, N_VOCAB, avoid=frozenset({0})), _Vocab(),
               n_slots=n_slots, n_ctx_slot=96, chunk=chunk, max_waiting=64)
    w.start()
    assert w.ready.wait(5)
    return w


def test_each_request_gets_its_solo_text_under_batching_chunking_and_cache_hits() -> None:
    rng = random.Random(0)
    base = [rng.randrange(1, N_VOCAB) for _ in range(40)]
    prompts = [base[: rng.randrange(5, 40)] + [rng.randrange(1, N_VOCAB)
                                               for _ in range(rng.randrange(1, 20))]
               for _ in range(24)]
    lengths = [rng.randrange(1, 20) for _ in prompts]

    async def solo() -> list[str]:
        out = []
        for p, n in zip(prompts, lengths, strict=True):
            w = _worker(1, 1024)  # a fresh server each time: no cache, no neighbours
            out.append((await _generate(w, p, n))[0])
            w.stop()
        return out

    async def together() -> list[tuple[str, Done]]:
        w = _worker(3, 7)
        try:
            return await asyncio.gather(*(_generate(w, p, n)
                                          for p, n in zip(prompts, lengths, strict=True)))
        finally:
            assert w.scheduler.n_busy == 0 and w.scheduler.n_waiting == 0
            w.stop()

    alone = asyncio.run(solo())
    results = asyncio.run(together())
    assert [t for t, _ in results] == alone
    assert all(d.finish_reason == "length" for _, d in results)
    assert [d.usage.completion_tokens for _, d in results] == lengths
    assert sum(d.usage.cached_tokens for _, d in results) > 0  # the shared prefix was reused


def test_a_cancelled_request_frees_its_slot_at_the_next_step() -> None:
    async def main() -> None:
        w = _worker(1, 64)
        try:
            handle = Handle(asyncio.get_running_loop())
            w.submit(_request([1, 2, 3], 90), handle)
            await asyncio.wait_for(handle.events.get(), 5)
            w.cancel(handle)
            _, done = await _generate(w, [4, 5], 3)  # the only slot is free again
            assert done.usage.completion_tokens == 3
        finally:
            w.stop()

    asyncio.run(main())


def test_generation_stops_at_the_slot_context() -> None:
    async def main() -> None:
        w = _worker(1, 64)
        try:
            _, done = await _generate(w, list(range(1, 91)), 50)
            assert done.finish_reason == "length" and done.usage.completion_tokens == 7
            assert len(w.scheduler.slots[0].cached) == 96  # every cell of the slot used
        finally:
            w.stop()

    asyncio.run(main())


def test_an_image_block_is_fed_whole_and_taken_from_a_cache_only_when_the_same() -> None:
    """Prompt chunks end before a block of given rows (an image's) they would split, or take it
    whole where it starts the chunk; a cached prefix reaches past an image only where the
    cells hold the same rows at the same place (the same placeholder ids stand for different
    images); build_batch places the rows, non-causal."""
    import numpy as np

    from minfer.engine.core.request import PromptRows

    rows = np.ones((4, 8), np.float32)
    prompt = [1, 2, 3, 9, 9, 9, 9, 4, 5]
    s = Scheduler(n_slots=1, n_ctx_slot=64, chunk=5)
    s.add(Sequence(1, list(prompt), len(prompt), embd=(PromptRows(3, rows),)))
    plan = s.schedule()
    assert plan.works[0].tokens == (1, 2, 3) and not plan.works[0].embd  # stops before it
    _run_fake(s, plan)
    plan = s.schedule()
    (w,) = plan.works
    assert w.tokens == (9, 9, 9, 9, 4) and w.embd[0].at == 0
    batch, _ = build_batch(plan, 64)
    assert batch.embd_ids is not None and batch.embd_ids.tolist() == [0, 1, 2, 3, -1]
    assert batch.kv_end.tolist() == [7, 7, 7, 7, 8]
    _run_fake(s, plan)
    _run_fake(s, s.schedule())
    s.finish(1)
    other = Sequence(2, list(prompt), len(prompt), embd=(PromptRows(3, rows * 2),))
    s.add(other)
    s.schedule()
    assert other.n_cached == 3  # another image: the text before it, not the image's cells
    _run_fake(s, s.schedule())
    _run_fake(s, s.schedule())
    s.finish(2)
    follow_up = [*prompt, 6, 7]  # the same image, asked again: only the new text is fed
    again = Sequence(3, follow_up, len(follow_up), embd=(PromptRows(3, rows * 2),))
    s.add(again)
    plan = s.schedule()
    assert again.n_cached == 9 and plan.works[0].tokens == (6, 7)
