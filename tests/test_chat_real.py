"""Multi-turn chat on the development model, greedy: delta prefill, and the same tenth reply as a
fresh run that prefills the whole history at once; the context-overflow cost on a long chat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minfer.chat.session import ChatConfig, ChatSession, TurnReport
from minfer.sampling.params import SamplerParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

QUESTIONS = [
    "Hi! Who are you?", "What is 2+2?", "Name a primary color.", "Say the word ok.",
    "What is the capital of France?", "Give a word that rhymes with cat.", "Count to three.",
    "What is Python?", "Is water wet?", "Now say goodbye.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(real_model_path: Path) -> Any:
    import minfer

    return minfer.load(real_model_path, n_ctx=1024, threads=2)


def _session(model: Any, **config: Any) -> ChatSession:
    engine = model.engine()
    sampler = model.sampler(SamplerParams.greedy(), 0, engine.n_ctx)
    return ChatSession(engine, model.tokenizer, model.chat_template, sampler,
                       config=ChatConfig(**{"max_tokens": MAX_TOKENS, **config}))


def _turn(events: Any) -> TurnReport:
    *_, report = list(events)
    assert isinstance(report, TurnReport)
    return report


def _render(model: Any, messages: list[dict[str, str]], gen: bool = True) -> list[int]:
    text = model.chat_template.render(messages, add_generation_prompt=gen)
    return list(model.tokenizer.encode_prompt(text))


def test_ten_turns_prefill_only_their_deltas_and_match_a_fresh_run(model: Any) -> None:
    from minfer.engine.generate import Finished, generate

    s = _session(model)
    for q in QUESTIONS:
        before = s.kv.cursor
        target = _render(model, [*s.messages, {"role": "user", "content": q}])
        r = _turn(s.say(q))
        assert r.n_prefilled == len(target) - before, (q, r)
        assert not r.re_rendered and r.n_re_renders == 0
        assert s.kv.tokens[: len(target)] == target  # the KV mirrors the canonical render
    tenth = s.reports[-1].ids

    history = _render(model, s.messages[:-1])
    engine = model.engine()
    sampler = model.sampler(SamplerParams.greedy(), 0, engine.n_ctx)
    sampler.reset(history)
    events = list(generate(engine, model.tokenizer, sampler, history, max_tokens=MAX_TOKENS,
                           batch_size=len(history), top_logits=2))
    fresh = events[-1]
    assert isinstance(fresh, Finished)
    print(f"\nper-turn (prefilled, in KV, reason): "
          f"{[(r.n_prefilled, r.n_kv, r.reason) for r in s.reports]}; "
          f"history {len(history)} tokens; tenth reply identical: {fresh.ids == tenth}")
    if fresh.ids != tenth:
        k = next(i for i, (a, b) in enumerate(zip(fresh.ids, tenth, strict=False)) if a != b)
        (_, top1), (_, top2) = fresh.top_logits[k]
        assert top1 - top2 < 0.05, (k, fresh.ids, tenth, fresh.top_logits[k])


@pytest.mark.parametrize("overflow", ["shift", "reprefill"])
def test_overflow_drops_old_turns_and_reports_the_re_prefill(model: Any, overflow: str) -> None:
    s = _session(model, max_tokens=16, overflow=overflow)
    n_ctx = 320
    s.kv.engine = _Window(model.engine(), n_ctx)  # a small context on the shared engine
    system = _render(model, [{"role": "user", "content": "x"}], gen=False)[:20]
    costs = []
    for i in range(24):
        r = _turn(s.say(f"Question {i}: name an animal."))
        assert s.kv.cursor <= n_ctx
        assert s.kv.tokens[:20] == system  # the (template's default) system prompt stays
        if r.n_dropped:
            costs.append(r.n_prefilled)
            assert not r.shift_fallback
            assert (r.n_shifted > 0) == (overflow == "shift")
    ordinary = [r.n_prefilled for r in s.reports if not r.n_dropped]
    print(f"\n{overflow}: overflowing turns: {len(costs)}, tokens prefilled on each: {costs}; "
          f"ordinary turns: {ordinary}")
    assert costs and max(costs) <= n_ctx // 2 + 40
    if overflow == "shift":  # an overflowing turn costs what an ordinary one does
        assert max(costs) <= max(ordinary[1:]) + 2


class _Window:
    """The real engine seen through a smaller n_ctx."""

    def __init__(self, engine: Any, n_ctx: int) -> None:
        self._engine = engine
        self.n_ctx = n_ctx

    def forward(self, tokens: Any, start_pos: int, n_out: int = 1) -> Any:
        assert start_pos + len(tokens) <= self.n_ctx
        return self._engine.forward(tokens, start_pos, n_out)

    def shift_kv(self, *, src_start: int, src_end: int, dst_start: int) -> None:
        from minfer.engine.kv_shift import shift_kv

        assert max(src_end, dst_start + src_end - src_start) <= self.n_ctx
        shift_kv(self._engine, src_start=src_start, src_end=src_end, dst_start=dst_start)
