"""EngineCore alone: synchronous, no threads, no model (a HashEngine stands in); scored
prompts (echo with logprobs) and the prompt cache."""

from __future__ import annotations

import random

import numpy as np
import pytest

from minfer.engine.core.core import EngineCore
from minfer.engine.core.proposer import LookupProposer
from minfer.engine.core.request import GenRequest, Request, TokenLogprob, log_softmax_top
from minfer.engine.core.runner import Runner
from minfer.engine.core.scheduler import QueueFullError
from minfer.engine.speculative import SpecConfig
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from tests.fake_engine import HashEngine
from tests.test_server_scheduler import N_VOCAB, _Vocab
from tests.test_server_speculative import CycleEngine

N_CTX_SLOT = 64


def _core(n_slots: int, *, lookup: int = 0, max_waiting: int = 8) -> EngineCore:
    engine = CycleEngine(n_slots * N_CTX_SLOT, N_VOCAB, avoid=frozenset({0}))
    return EngineCore(Runner(engine, N_CTX_SLOT), _Vocab(), n_slots=n_slots,
                      n_ctx_slot=N_CTX_SLOT, chunk=8, max_waiting=max_waiting,
                      proposer=LookupProposer(lookup) if lookup else None,
                      speculation=SpecConfig(lookup_ngram=lookup, adaptive=False)
                      if lookup else None)


def _request(prompt: list[int], max_tokens: int = 40) -> GenRequest:
    return GenRequest(prompt, max_tokens, Sampler(SamplerParams.greedy(), N_VOCAB, seed=0))


def _drain(core: EngineCore) -> int:
    steps = 0
    while core.busy:
        core.step()
        steps += 1
    return steps


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, N_VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


@pytest.mark.parametrize("lookup", [0, 2])
def test_requests_together_draw_what_each_draws_alone(lookup: int) -> None:
    prompts = _prompts(5)
    alone = []
    for p in prompts:
        core = _core(1, lookup=lookup)
        state = core.add(0, _request(p))
        _drain(core)
        alone.append(state.ids)
    core = _core(3, lookup=lookup)  # five requests, three slots: two wait for a free one
    states = [core.add(i, _request(p)) for i, p in enumerate(prompts)]
    _drain(core)
    assert [s.ids for s in states] == alone
    assert all(s.finish == "length" and len(s.ids) == 40 for s in states)
    if lookup:
        assert sum(s.spec.accepted for s in states) > 0


def test_abort_frees_the_slot_and_keeps_its_cells_for_the_prompt_cache() -> None:
    core = _core(1)
    prompt = _prompts(1)[0]
    core.add(1, _request(prompt, max_tokens=30))
    for _ in range(6):
        core.step()
    state = core.abort(1)
    assert state is not None and not core.busy and state.finish is None
    again = core.add(2, _request(prompt))
    _drain(core)
    assert again.n_cached == len(prompt) - 1  # all but the last prompt token came from cache


def test_a_full_queue_refuses_and_a_cancelled_request_draws_nothing_more() -> None:
    core = _core(1, max_waiting=1)
    core.add(1, _request([3, 4, 5]))
    core.add(2, _request([6, 7]))
    with pytest.raises(QueueFullError):
        core.add(3, _request([8]))
    core.step()
    core.cancel(1)
    outputs = core.step()
    assert all(o.seq_id != 1 for o in outputs)
    assert core.reap() == [1]
    _drain(core)
    assert not core.busy


def test_the_slot_context_ends_a_request() -> None:
    core = EngineCore(Runner(HashEngine(N_CTX_SLOT, N_VOCAB, avoid=frozenset({0})), N_CTX_SLOT),
                      _Vocab(), n_slots=1, n_ctx_slot=N_CTX_SLOT, chunk=32)
    state = core.add(1, _request(list(range(1, 61)), max_tokens=50))
    _drain(core)
    assert state.finish == "context" and state.n_generated == N_CTX_SLOT - 60 + 1


def test_step_cost_fits_the_fixed_and_per_row_parts_and_caps_proposals() -> None:
    """`StepCost` recovers T(R) = fixed + per_row * R from the steps it sees (the first step of
    each row count, a graph's build, left out); memory-bound steps (a row is cheap) leave
    proposals uncapped, compute-bound ones (16 streams, a row ~ a quarter of the fixed part
    each) allow none unless nearly every proposal is kept."""
    from minfer.engine.core.policy import StepCost
    from minfer.engine.speculative import DRAFT_MAX_LIMIT

    cost = StepCost()
    assert cost.draft_cap(16, 0.9) == DRAFT_MAX_LIMIT  # nothing seen yet: no cap
    rng = random.Random(0)
    cost.record(17, 5.0)  # a warm-up outlier: not counted
    for _ in range(60):
        rows = rng.choice([1, 2, 4, 8, 16, 17, 20, 32])
        cost.record(rows, 0.020 + 0.005 * rows)
    assert abs(cost.fixed - 0.020) < 1e-6 and abs(cost.per_row - 0.005) < 1e-7
    assert cost.share(1) == pytest.approx(0.2)
    assert cost.draft_cap(1, 0.7) == 4  # 0.7 ** 4 > 0.2 > 0.7 ** 5
    assert cost.share(16) == pytest.approx(0.8)
    assert cost.draft_cap(16, 0.7) == 0 and cost.draft_cap(16, 0.95) == 4
    # a draft model's batched step (every stream waits for it) is part of a token's price
    cost.record_proposal(3, 0.030)  # proposals of up to 3 tokens took 30 ms: 10 ms a step
    assert cost.draft_step_s == pytest.approx(0.010)
    assert cost.share(4) == pytest.approx((0.020 + 0.010) / 0.040)
    assert cost.draft_cap(4, 0.9) == 2  # 0.9 ** 2 > 0.75 > 0.9 ** 3
    cost.record_proposal(0, 1.0)  # nothing proposed: nothing learnt
    assert cost.draft_step_s == pytest.approx(0.010)


def test_a_compute_bound_batch_asks_for_no_proposals() -> None:
    """Beside other streams the core caps each sequence's proposal by the batch's row price
    (`EngineCore._asks`); alone, the sequence's DraftLength decides."""
    from minfer.engine.core.policy import StepCost

    core = _core(4, lookup=2)
    for i, p in enumerate(_prompts(4)):
        core.add(i, _request([*p, *p]))
    for _ in range(12):  # prompts in, every sequence decoding
        core.step()
    plan = core.scheduler.schedule()
    core.step_cost = StepCost()
    assert len(core._asks(plan)) == 4  # rows cost nothing known: every sequence proposes
    expensive = StepCost(fixed=0.01, per_row=0.05, steps=StepCost.MIN_STEPS)
    core.step_cost = expensive
    assert core._asks(plan) == []


def test_batch_payoff_turns_proposals_off_where_plain_steps_yield_more() -> None:
    """Per stream-count class: drafting until both rates are measured (a plain probe every
    `probe_every` steps), then whichever yields more tokens a second, the other as a probe."""
    from minfer.engine.core.policy import BatchPayoff

    pay = BatchPayoff(probe_every=4)
    assert [pay.kind(n) for n in (1, 2, 3, 4, 7, 8, 16, 40)] == [0, 2, 2, 4, 4, 8, 16, 16]
    assert all(pay.propose(1) for _ in range(10))  # one stream: its DraftLength decides
    choices = []
    for _ in range(12):
        drafting = pay.propose(16)
        choices.append(drafting)
        # drafting steps: 20 tokens in 0.25 s (80 tok/s); plain: 16 in 0.1 s (160 tok/s)
        pay.record(16, drafting, 20 if drafting else 16, 0.25 if drafting else 0.1)
    assert choices[:3] == [True] * 3 and choices[3] is False  # the first plain probe
    assert choices[4:7] == [False] * 3 and choices[7] is True  # plain wins; a draft probe
    assert pay.propose(4)  # another class is measured on its own


# -- scored prompts (echo with logprobs) and the prompt cache ----------------------------------


def _scoring_core(n_slots: int) -> tuple[EngineCore, HashEngine]:
    engine = HashEngine(n_slots * N_CTX_SLOT, N_VOCAB, avoid=frozenset({0}))
    return EngineCore(Runner(engine, N_CTX_SLOT), _Vocab(), n_slots=n_slots,
                      n_ctx_slot=N_CTX_SLOT, chunk=8), engine


def _score(core: EngineCore, seq_id: int, prompt: list[int], k: int) -> Request:
    state = core.add(seq_id, GenRequest(prompt, 0, Sampler(SamplerParams.greedy(), N_VOCAB,
                                                           seed=0), prompt_logprobs=k))
    _drain(core)
    assert state.finish == "length" and len(state.prompt_logprobs) == len(prompt) - 1
    return state


def _fresh(prompt: list[int], k: int) -> list[TokenLogprob]:
    return _score(_scoring_core(1)[0], 0, prompt, k).prompt_logprobs


def test_a_scored_prompt_takes_the_cached_prefix_with_its_scores() -> None:
    """A repeated scored prompt computes only its last row; one that shares a prefix computes
    from the last common token on (its score needs that token's row). The scores taken are
    the ones computing them gives, bit for bit (rows are batch-invariant)."""
    core, engine = _scoring_core(1)
    prompt = _prompts(1)[0] + list(range(1, 20))
    first = _score(core, 1, prompt, 3)
    assert first.n_cached == 0 and first.prompt_logprobs == _fresh(prompt, 3)
    fed = sum(b.n_tokens for b in engine.calls)
    again = _score(core, 2, prompt, 3)
    assert again.n_cached == len(prompt) - 1
    assert sum(b.n_tokens for b in engine.calls) - fed == 1
    assert again.prompt_logprobs == first.prompt_logprobs
    other = [*prompt[:12], 90, 91, *prompt[14:]]
    shared = _score(core, 3, other, 3)
    assert shared.n_cached == 11 and shared.prompt_logprobs == _fresh(other, 3)
    assert shared.prompt_logprobs[:11] == first.prompt_logprobs[:11]


def test_cached_scores_serve_a_smaller_k_cut_and_never_a_larger_one() -> None:
    core, _ = _scoring_core(1)
    prompt = _prompts(1)[0] + list(range(1, 20))
    _score(core, 1, prompt, 4)
    fewer = _score(core, 2, prompt, 1)  # the cache now holds scores with 1 alternative
    assert fewer.n_cached == len(prompt) - 1 and fewer.prompt_logprobs == _fresh(prompt, 1)
    assert all(len(lp.top) == 1 for lp in fewer.prompt_logprobs)
    more = _score(core, 3, prompt, 2)  # those cannot give 2: every row computed again
    assert more.n_cached == 0 and more.prompt_logprobs == _fresh(prompt, 2)
    plain = core.add(4, _request(prompt, max_tokens=1))  # the cells serve an unscored prompt
    _drain(core)
    assert plain.n_cached == len(prompt) - 1
    after = _score(core, 5, prompt, 2)  # ... whose cache holds no scores
    assert after.n_cached == 0 and after.prompt_logprobs == _fresh(prompt, 2)


def test_scored_prompts_together_copy_a_shared_prefix_with_its_scores() -> None:
    """Two scored prompts of one context (a multiple-choice question's continuations) in two
    slots: the second waits for the first's prefix and copies its cells and scores."""
    core, engine = _scoring_core(2)
    context = list(range(1, 40))
    a, b = [*context, 50, 51, 52], [*context, 60, 61]
    states = [core.add(i, GenRequest(p, 0, Sampler(SamplerParams.greedy(), N_VOCAB, seed=0),
                                     prompt_logprobs=2)) for i, p in enumerate((a, b))]
    _drain(core)
    assert engine.copies and states[1].n_cached == len(context) - 1  # its last token: scored
    assert [s.prompt_logprobs for s in states] == [_fresh(a, 2), _fresh(b, 2)]


def test_the_top_alternatives_break_ties_by_id() -> None:
    row = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 3.0], dtype=np.float32)
    four = log_softmax_top(row, 0, 4)
    assert [t for t, _ in four.top] == [1, 3, 5, 2]
    assert four.upto(2) == log_softmax_top(row, 0, 2) and four.upto(9) is four
