"""Prompt lookup per server slot (`minfer serve --lookup-ngram N`) on a fake engine: every
request's text equals the text it gets without speculation, alone or batched, and /metrics'
counters see proposals kept and rejected."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from minfer.engine.core.request import GenRequest
from minfer.engine.core.runner import build_batch
from minfer.engine.core.scheduler import Plan, Sequence, Work
from minfer.engine.speculative import SpecConfig
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from minfer.server.metrics import Metrics
from minfer.server.worker import Delta, Done, Handle, Worker
from tests.fake_engine import HashEngine
from tests.test_server_scheduler import N_VOCAB, _Vocab


class CycleEngine(HashEngine):
    """Rows mostly follow a fixed successor of the row's own token (so prompt lookup is often
    right), except at positions divisible by 5, where the hash takes over (so it is sometimes
    wrong). Still a function of the cells a row reads and its position only."""

    def row_logits(self, window: np.ndarray, position: int) -> np.ndarray:
        logits = super().row_logits(window, position)
        if position % 5:
            logits[(int(window[-1]) * 7 + 3) % N_VOCAB or 1] += 50.0
        return logits


def _request(prompt: list[int], max_tokens: int, temp: float) -> GenRequest:
    params = SamplerParams.greedy() if temp == 0 else SamplerParams(temp=temp)
    return GenRequest(prompt=prompt, max_tokens=max_tokens,
                      sampler=Sampler(params, N_VOCAB, seed=0))


def _worker(n_slots: int, lookup: int, metrics: Metrics | None = None) -> Worker:
    w = Worker(lambda n: CycleEngine(n, N_VOCAB, avoid=frozenset({0})), _Vocab(),
               n_slots=n_slots, n_ctx_slot=96, chunk=16, metrics=metrics,
               speculation=SpecConfig(lookup_ngram=lookup) if lookup else None)
    w.start()
    assert w.ready.wait(5)
    return w


async def _generate(w: Worker, prompt: list[int], n: int, temp: float = 0.0) -> tuple[str, Done]:
    handle = Handle(asyncio.get_running_loop())
    w.submit(_request(prompt, n, temp), handle)
    text = []
    while True:
        ev = await asyncio.wait_for(handle.events.get(), 10)
        if isinstance(ev, Delta):
            text.append(ev.text)
        else:
            assert isinstance(ev, Done)
            return "".join(text), ev


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1)
    cycle = [5]
    for _ in range(30):
        cycle.append((cycle[-1] * 7 + 3) % N_VOCAB or 1)
    prompts = [[*cycle[:rng.randrange(8, 30)], rng.randrange(1, N_VOCAB)] for _ in range(10)]
    return prompts, [rng.randrange(10, 40) for _ in prompts]


def test_lookup_in_slots_keeps_every_text_and_counts_drafts() -> None:
    prompts, lengths = _prompts()

    async def run(lookup: int, n_slots: int, metrics: Metrics | None) -> list[tuple[str, Done]]:
        w = _worker(n_slots, lookup, metrics)
        try:
            return await asyncio.gather(*(_generate(w, p, n)
                                          for p, n in zip(prompts, lengths, strict=True)))
        finally:
            assert w.scheduler.n_busy == 0 and w.scheduler.n_waiting == 0
            w.stop()

    plain = asyncio.run(run(0, 1, None))
    metrics = Metrics()
    spec = asyncio.run(run(3, 3, metrics))
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert [d.usage.completion_tokens for _, d in spec] == lengths
    drafted, kept = metrics.draft_tokens.total(), metrics.draft_accepted.total()
    assert 0 < kept < drafted
    assert "minfer_draft_tokens_accepted_total" in metrics.render()


def test_sampled_requests_verify_too_and_finish() -> None:
    prompts, lengths = _prompts()

    async def main() -> list[tuple[str, Done]]:
        w = _worker(2, 2)
        try:
            return await asyncio.gather(*(_generate(w, p, n, temp=0.7)
                                          for p, n in zip(prompts[:4], lengths[:4],
                                                          strict=True)))
        finally:
            w.stop()

    results = asyncio.run(main())
    assert [d.usage.completion_tokens for _, d in results] == lengths[:4]


def test_a_work_with_proposals_asks_for_every_row() -> None:
    w = Work(1, 0, 10, (7,), True, (8, 9))
    batch, ids = build_batch(Plan((Work(2, 1, 0, (1, 2, 3), True), w)), 32)
    assert batch.tokens.tolist() == [1, 2, 3, 7, 8, 9]
    assert batch.positions.tolist() == [0, 1, 2, 10, 11, 12]
    assert batch.out_rows.tolist() == [2, 3, 4, 5] and ids == [2, 1, 1, 1]
    assert Plan((w,)).n_tokens == 3
    seq = Sequence(1, [1, 2], 2)
    assert seq.n_pending == 2
