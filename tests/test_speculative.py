"""Speculative decoding (issue 17): proposers, the adaptive length, greedy identity with plain
decoding (ids and KV, bit for bit, through rejections), and the accept/reject scheme's output
distribution (sampled, many seeds, total-variation bound)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from minfer.chat.kv import KVMirror
from minfer.engine.core import proposer as proposer_mod
from minfer.engine.core.lookup import follow, lookup
from minfer.engine.core.policy import (
    PAYS,
    Acceptance,
    DraftLength,
    Proposal,
    StepCost,
    bucket_floor,
    fills_bucket,
)
from minfer.engine.core.proposer import (
    DraftAsk,
    HybridProposer,
    LookupProposer,
    SlotDrafter,
    Speculator,
    _Track,
)
from minfer.engine.core.request import Verifier
from minfer.engine.forward import Engine
from minfer.engine.generate import Finished, generate
from minfer.engine.speculative import SpecConfig, SpeculativeError, check_same_vocab
from minfer.engine.stepper import TokenStepper
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from minfer.tokenizer.tokenizer import Tokenizer
from minfer.tools.synth import write_tiny_model

N_CTX = 256
PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 11, 5, 17, 99, 3, 250, 42, 30, 31, 32]


def _engine(path: Path, n_ctx: int = N_CTX, vocab_limit: int = 0) -> Engine:
    f = GGUFFile.open(path)
    return Engine(f, HParams.from_gguf(f), n_ctx=n_ctx, vocab_limit=vocab_limit)


def _drafter(engine: Engine, *, p_min: float, temp: float | None = None,
             seed: int = 0) -> SlotDrafter:
    """A draft model for a one-slot core (run, chat, the API) on its own engine."""
    return SlotDrafter(engine, engine.n_ctx, p_min=p_min, temp=temp, seed=seed,
                       n_vocab=engine.hparams.n_vocab)


def _propose(drafter: SlotDrafter, history: Sequence[int], k: int, *, greedy: bool) -> Proposal:
    return drafter.propose([DraftAsk(0, 0, tuple(history), k, greedy)])[0]


@functools.cache
def _tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(path))


def _sampler(engine: Engine, prompt: Sequence[int], **params: float) -> Sampler:
    s = Sampler(SamplerParams(**{"temp": 0.0, **params}), engine.hparams.n_vocab, seed=1)
    s.reset(prompt)
    return s


def _run(path: Path, prompt: Sequence[int], spec: Speculator | None, *, max_tokens: int = 48,
         **params: float) -> tuple[Finished, Engine]:
    engine = _engine(path)
    events = generate(engine, _tokenizer(path), _sampler(engine, prompt, **params), prompt,
                      max_tokens=max_tokens, speculator=spec)
    return _finished(events), engine


def _finished(events: Iterable[object]) -> Finished:
    *_, last = events
    assert isinstance(last, Finished)
    return last


def _assert_same_kv(a: Engine, b: Engine, n: int) -> None:
    for layer in range(a.hparams.n_layer):
        assert np.array_equal(a.kv.k[layer][:n], b.kv.k[layer][:n]), layer
        assert np.array_equal(a.kv.v[layer][:n], b.kv.v[layer][:n]), layer


@pytest.fixture(scope="module")
def near_draft_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen3's weights quantized differently (Q4_0): a draft that agrees most of the time."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "near.gguf", arch="qwen3",
                            n_embd=256, n_ff=512, head_dim=32, weight_types=QType.Q4_0,
                            tied=False)


@pytest.fixture(scope="module")
def near_draft_qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen3moe's weights quantized differently (Q4_0): a MoE draft that mostly agrees."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "near-moe.gguf", arch="qwen3moe",
                            n_embd=256, n_ff=256, head_dim=32, n_expert=8, n_expert_used=2,
                            weight_types=QType.Q4_0, tied=False)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same vocabulary as the tiny models, other weights: its drafts are often rejected."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "draft.gguf", seed=7)


# -- proposers and the length policy -----------------------------------------------------------
def test_lookup_continues_the_longest_ngram_match() -> None:
    seq = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4])
    assert lookup(seq, 3, 2) == [7, 8]  # the latest [2, 3, 4] with two tokens after it
    assert lookup(seq, 3, 6) == [5, 9, 2, 3, 4, 7]  # only the first has six after it
    assert lookup(seq, 3, 20) == [5, 9, 2, 3, 4, 7, 8, 2, 3, 4]  # none has 20: the earliest
    assert lookup(np.array([1, 2, 3, 9]), 3, 4) == []  # 9 never occurred before
    assert lookup(np.array([6, 1, 2, 6]), 2, 3) == [1, 2, 6]  # falls back to the 1-gram


def _copy_steps(source: list[int], output: list[int], *, k: int = 8,
                use_follow: bool = True) -> int:
    """Greedy speculative steps to write `output` after `source` (+ a separator) with prompt
    lookup as the proposer: each step keeps the matching prefix of the proposal plus the
    target's own next token, as the verifier does."""
    seq, i, steps, cursor = [*source, 999], 0, 0, None
    while i < len(output):
        arr = np.array(seq, dtype=np.int64)
        if use_follow:
            proposal, cursor = follow(arr, cursor, 3, k)
        else:
            proposal = lookup(arr, 3, k)
        n = 0
        while n < len(proposal) and i + n < len(output) and proposal[n] == output[i + n]:
            n += 1
        take = min(n + 1, len(output) - i)
        seq += output[i:i + take]
        i, steps = i + take, steps + 1
    return steps


def _lines(n: int, seed: int = 0) -> list[list[int]]:
    """n code-like lines: an indent token, a variable (50), distinct tokens, a newline (10)."""
    rng = np.random.default_rng(seed)
    return [[7, 50, *rng.integers(100, 900, 6).tolist(), 10] for _ in range(n)]


def test_follow_learns_a_rename_and_applies_it_to_every_later_line() -> None:
    lines = _lines(30)
    source = [t for line in lines for t in line]
    renamed = [t for line in lines for t in ([51, 52] if t == 50 else [t] for t in line)
               for t in t]  # 50 -> the two tokens 51 52 on every line
    plain, followed = _copy_steps(source, renamed, use_follow=False), _copy_steps(source, renamed)
    # the plain lookup loses its place at every renamed token (70 steps); the cursor learns
    # the edit at its first line or two (45: 300 tokens at most 9 a step take 34)
    assert followed <= 0.7 * plain


def test_follow_resyncs_after_deleted_and_inserted_lines() -> None:
    lines = _lines(30, seed=1)
    source = [t for line in lines for t in line]
    edited = [t for n, line in enumerate(lines) if n % 7 != 3 for t in line]  # lines dropped
    edited[40:40] = [5, 6, 7, 8]  # and a few new tokens
    assert _copy_steps(source, edited) <= len(edited) / 8 + 6  # 33: 238 tokens, 7 edits


def test_follow_forgets_an_edit_the_output_stops_making_and_keeps_lookup_otherwise() -> None:
    lines = _lines(24, seed=2)
    source = [t for line in lines for t in line]
    half = len(source) // 2  # renamed in the first half only
    output = [u for t in source[:half] for u in ([51] if t == 50 else [t])] + source[half:]
    assert _copy_steps(source, output) < _copy_steps(source, output, use_follow=False)  # 35, 40
    seq = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4])
    assert follow(seq, None, 3, 2)[0] == lookup(seq, 3, 2)  # no cursor: the plain lookup
    assert follow(np.array([1, 2, 3, 9]), None, 3, 4) == ([], None)


def test_lookup_proposer_keeps_one_cursor_per_sequence() -> None:
    prop = LookupProposer(3)
    seq = tuple(t for line in _lines(4) for t in line)
    out = prop.propose([DraftAsk(1, 0, (*seq, *seq[:3]), 4), DraftAsk(2, 1, (1, 2), 4)])
    assert out[1].tokens == list(seq[3:7]) and out[2].tokens == []
    assert set(prop.tracks) == {1, 2}
    prop.MAX_TRACKS = 1
    prop.propose([DraftAsk(3, 0, (*seq, *seq[:2]), 4)])
    assert set(prop.tracks) == {3}
    prop.forget()
    assert not prop.tracks


def _hinted(n: int, seed: int, hints: int = 0, at: int = 2) -> tuple[list[int], list[int]]:
    """A source of n code-like lines and an edit of it that inserts eight new tokens (type
    hints) at token `at` of every fourth line (2: after its variable), copying the rest;
    hints > 0: each insert is one of that many fixed snippets (the same hint again), else new
    tokens each time."""
    rng = np.random.default_rng(seed)
    lines = _lines(n, seed)
    snippets = rng.integers(1000, 1100, (hints, 8)).tolist()
    output = [t for i, line in enumerate(lines)
              for t in (line[:at] + (snippets[rng.integers(hints)] if hints else
                                     rng.integers(1000, 1100, 8).tolist()) + line[at:]
                        if i % 4 == 0 else line)]
    return [t for line in lines for t in line], output


def _lookup_cost(source: list[int], output: list[int], *, rated: bool) -> tuple[float, int]:
    """(the cost of writing `output` after `source` with prompt lookup through a DraftLength
    with measured costs: a plain step 1, a verify of n rows 1 + 0.12 (n - 1), the rows wasted
    on rejected tokens); rated False drops the proposals' own rates (one rate for all)."""
    length, prop = DraftLength(16), LookupProposer(3)
    for _ in range(2):
        length.record_plain(1.0)
        for n in (2, 4, 8, 16):
            length.record_verify(n, 1.0 + 0.12 * (n - 1))
    seq, i, cost, wasted = [*source, 999], 0, 0.0, 0
    while i < len(output):
        k = length.choose(len(output) - i)
        p = prop.propose([DraftAsk(1, 0, tuple(seq), k)])[1] if k else Proposal([])
        if not rated:
            p.rate = None
        draft = p.tokens[:length.fit(p)]
        n = 0
        while n < len(draft) and i + n < len(output) and draft[n] == output[i + n]:
            n += 1
        if draft:
            length.record_outcome(len(draft), n)
        cost += 1.0 + 0.12 * len(draft)
        wasted += len(draft) - n
        seq += output[i:i + n + 1]
        i += n + 1
    return cost, wasted


def test_lookup_rates_each_kind_of_guess_and_verifies_only_what_pays() -> None:
    """An edit inserting new text into every fourth line: copies are right, guesses inside the
    inserted text are not. Rated per kind, the copies are verified whole and the guesses
    dropped (plain steps there); one rate for both pays for rows rejected at every hint."""
    source, output = _hinted(40, seed=3)
    prop = LookupProposer(3)
    seq, i = [*source, 999], 0
    while i < len(output):  # every step proposes; the target keeps what matches
        p = prop.propose([DraftAsk(1, 0, tuple(seq), 15)])[1]
        n = 0
        while n < len(p.tokens) and i + n < len(output) and p.tokens[n] == output[i + n]:
            n += 1
        seq += output[i:i + n + 1]
        i += n + 1
    kinds = prop.tracks[1].kinds
    assert kinds["copy"].rate > 0.8 and kinds["guess"].rate < 0.5
    rated, unrated = _lookup_cost(source, output, rated=True), _lookup_cost(source, output,
                                                                            rated=False)
    assert rated[0] < 0.85 * unrated[0] and rated[1] < 0.5 * unrated[1]  # 179 / 242, 130 / 413


def test_lookup_repeats_new_text_an_edit_wrote_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inserted snippets that recur (the same return hint ending many lines): across an edit
    the n-gram lookup of the output's own new text ("repeat") is proposed where it rates better
    than the copy's guess. (Recurring snippets followed by different code: 146 against 138,
    the repeat's rate learns that its continuations miss; the real edits measured gain.)"""
    source, output = _hinted(40, seed=4, hints=2, at=-1)
    both = _lookup_cost(source, output, rated=True)
    monkeypatch.setattr(proposer_mod, "REPEAT_KINDS", ())
    guess_only = _lookup_cost(source, output, rated=True)
    assert both[0] < 0.9 * guess_only[0]  # 137 / 157


def test_lookup_proposes_nothing_rather_than_failing_at_any_step() -> None:
    """Every prefix of an edit with repeated snippets, asked in order and at random: a
    proposal (maybe empty) for each, never an exception (the core would drop every track)."""
    source, output = _hinted(12, seed=5, hints=2)
    prop, rng = LookupProposer(3), np.random.default_rng(0)
    seq = [*source, 999]
    for i in range(len(output)):
        for k in (1, 15):
            p = prop.propose([DraftAsk(1, 0, tuple(seq + output[:i]), k)])[1]
            assert len(p.tokens) <= k and p.rate is not None
        cut = int(rng.integers(1, len(seq) + i))
        prop.propose([DraftAsk(2, 0, tuple((seq + output)[:cut]), 7)])


class _StubDrafter:
    """A draft that always guesses `guess` (k of it), recording what it was asked."""

    def __init__(self, guess: int) -> None:
        self.guess = guess
        self.asked: list[DraftAsk] = []
        self.n_forwards = self.n_forwarded = 0
        self.behind = 1  # tokens a proposal would first catch up on (`SlotDrafter.lacking`)

    def lacking(self, ask: DraftAsk) -> int:
        return self.behind

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        self.asked.extend(asks)
        self.n_forwards += max(a.k for a in asks)
        self.n_forwarded += sum(a.k for a in asks)
        return {a.seq_id: Proposal([self.guess] * a.k) for a in asks}

    def price(self, seconds: float) -> float | None:
        return seconds

    def warm_up(self) -> None:
        return None

    def forget(self) -> None:
        return None


def test_hybrid_takes_lookup_where_it_is_rated_above_the_draft_and_the_draft_elsewhere() -> None:
    """A copy going on (rated high) is lookup's, as long as lookup_k whatever k the core asked;
    a sequence with nothing to copy asks the draft for the core's k (the core's DraftLength
    keeps choosing k from the draft's costs: `rated_asks_most`); a draft that keeps missing
    loses the sequence to lookup's weaker guesses."""
    source = list(range(100, 140))
    drafter = _StubDrafter(guess=7)
    hybrid = HybridProposer(LookupProposer(3), drafter, lookup_k=15)  # type: ignore[arg-type]
    assert not hybrid.rated_asks_most
    for n in range(12, 20):  # the output copies `source`
        seq = [1, 2, *source, 9, *source[:n]]
        got = hybrid.propose([DraftAsk(0, 0, tuple(seq), 3)])[0]
    assert got.tokens == source[19:34] and got.rate is not None and drafter.asked == []
    fresh = [50, 51, 52, 53]  # nothing earlier to copy: the draft, for the core's k
    got = hybrid.propose([DraftAsk(1, 1, tuple(fresh), 3)])[1]
    assert got.tokens == [7] * 3 and got.rate is None
    assert [a.seq_id for a in drafter.asked] == [1]
    rate = Acceptance().rate
    for step in range(40):  # the draft is always wrong here: its rate falls below lookup's
        fresh = [*fresh, 60 + step % 5]
        hybrid.propose([DraftAsk(1, 1, tuple(fresh), 15)])
    assert hybrid.tracks[1].rate("draft") < 0.3 < rate
    drafter.asked.clear()
    got = hybrid.propose([DraftAsk(1, 1, tuple([*fresh, 60 + 40 % 5]), 15)])[1]
    assert drafter.asked == [] and got.tokens  # the repeating cycle's n-gram lookup instead


def test_hybrid_weighs_lookup_and_the_draft_by_the_sequences_step_costs() -> None:
    """With a DraftLength's costs, a draft as sure as lookup's copy loses to it (its tokens
    cost draft steps, lookup's nothing), and wins where lookup's guess is poor."""
    length = DraftLength(16)
    for _ in range(2):
        length.record_plain(1.0)
        for n in (2, 4, 8, 16):
            length.record_verify(n, 1.0 + 0.12 * (n - 1))
    hybrid = HybridProposer(LookupProposer(3), _StubDrafter(7), 15)  # type: ignore[arg-type]
    hybrid.draft_step_s = 0.3
    ask = DraftAsk(0, 0, (1, 2, 3), 7, length=length)
    track = _Track(kinds={"draft": Acceptance(accepted_avg=0.95, trials_avg=1.0)})
    assert hybrid._lookup_pays(ask, Proposal(list(range(15)), rate=0.95), track)
    assert not hybrid._lookup_pays(ask, Proposal(list(range(15)), rate=0.4), track)
    hybrid.draft_step_s = 0.0  # unmeasured: a third of a plain step, as good a draft loses
    assert hybrid._lookup_pays(ask, Proposal(list(range(7)), rate=0.95), track)
    track = _Track(kinds={"draft": Acceptance(accepted_avg=0.9, trials_avg=1.0)})
    poor = Proposal(list(range(7)), rate=0.6)
    assert not hybrid._lookup_pays(ask, poor, track)  # the draft is caught up: it pays
    hybrid.drafter.behind = 400  # ... not when it would first prefill a whole prompt
    assert hybrid._lookup_pays(ask, poor, track)


def test_draft_length_fits_a_rated_proposal_to_what_pays() -> None:
    length = DraftLength(16)
    for _ in range(2):
        length.record_plain(1.0)
        for n in (2, 4, 8, 16):
            length.record_verify(n, 1.0 + 0.12 * (n - 1))
    tokens = list(range(15))
    assert length.fit(Proposal(tokens)) == 15  # unrated: its length was chosen before
    assert length.choose(100) in (1, 3, 7, 15) and not length.rated
    assert length.fit(Proposal(tokens, rate=0.1)) == 0  # a plain step pays more
    assert length.fit(Proposal(tokens, rate=0.97)) == 15
    assert length.fit(Proposal(tokens[:5], rate=0.97)) == 3
    assert length.rated and length.choose(100) == 15  # rated proposals: ask the most
    # ... unless the proposer sizes its rated proposals itself (a hybrid's draft gets the k
    # its measured acceptance and costs pay for, as before any rated proposal)
    unrated = DraftLength(16)
    unrated.decode_s, unrated.verify_s = length.decode_s, dict(length.verify_s)
    for d in (length, unrated):
        d.n_steps, d.acceptance = 10, Acceptance(accepted_avg=0.5, trials_avg=1.0)
    assert length.choose(100, rated_asks_most=False) == unrated.choose(100) == 3
    assert DraftLength(16, adaptive=False).fit(Proposal(tokens, rate=0.1)) == 15


def test_draft_length_follows_cost_and_acceptance() -> None:
    length = DraftLength(16)
    for _ in range(2):  # the first time of each kind of step is a warm-up: not counted
        length.record_plain(0.010)
    assert length.decode_s == 0.010
    for _ in range(20):
        length.record_verify(16, 0.012)
        length.record_outcome(15, 15)
    assert length.choose(100) == 15
    assert length.choose(5) == 3  # bounded by the room left, rounded down to a bucket
    for _ in range(30):  # drafts that never pass, verified at a cost: plain decoding wins
        for n in (2, 4, 8, 16):
            length.record_verify(n, 0.02)
        length.record_outcome(4, 0)
    picks = [length.choose(100) for _ in range(length.probe_every)]
    assert picks[:-1] == [0] * (length.probe_every - 1) and picks[-1] > 0  # and a probe
    assert [bucket_floor(n) for n in (0, 1, 2, 3, 7, 15, 16, 40)] == [0, 1, 1, 3, 7, 15, 15, 15]


def test_a_proposal_that_barely_pays_is_not_made() -> None:
    """A verify of 2 rows at 1.3 plain steps and a draft token at 0.3: one token proposed at
    acceptance a yields (1 + a) / 1.6 plain steps' tokens. At 0.65 that is 1.03x plain (within
    PAYS, a moving average's luck); at 0.75, 1.09x: drafted."""
    length = DraftLength(16)
    for _ in range(2):
        length.record_plain(1.0)
        length.record_verify(2, 1.3)
        for n in (4, 8, 16):
            length.record_verify(n, 1.3 * n)
    length.draft_token_s, length.n_steps = 0.3, 10
    length.acceptance = Acceptance(accepted_avg=0.65, trials_avg=1.0)
    assert length.step_rate(1) > length.step_rate(0) and length.choose(100) == 0
    length.acceptance = Acceptance(accepted_avg=0.75, trials_avg=1.0)
    assert length.step_rate(1) > PAYS * length.step_rate(0) and length.choose(100) == 1


def test_draft_length_prior_prices_unmeasured_rows() -> None:
    length = DraftLength(16)
    for _ in range(2):
        length.record_plain(0.010)
    # nothing verified yet: more rows are priced above a plain step, so the first proposal is
    # a middle length, not the largest bucket (a free-rows prior picked 15)
    assert length.choose(100) == 3
    length.acceptance.accepted_avg, length.draft_token_s = 0.9, 0.004
    for _ in range(2):  # compute-bound: 4 rows cost 1.5 plain steps
        length.record_verify(4, 0.015)
    assert length._verify_cost(8, 0.010) == pytest.approx(0.015 * 1.25)
    assert length.choose(100) == 3  # 8 rows are not worth trying at this cost
    length.verify_s[4], length.draft_token_s = 0.010, 0.001  # memory-bound: 4 rows cost 1
    assert length.choose(100) == 7  # so a longer proposal is tried
    for _ in range(2):
        length.record_verify(16, 0.011)
    assert length._verify_cost(8, 0.010) == pytest.approx(0.011)  # capped by a measured 16


def test_config_and_vocab_checks_are_loud() -> None:
    with pytest.raises(SpeculativeError, match="draft-max"):
        SpecConfig(draft_max=0)
    with pytest.raises(SpeculativeError, match="draft-p-min"):
        SpecConfig(p_min=1.5)
    with pytest.raises(SpeculativeError, match="token 1 is 'x' in the draft"):
        check_same_vocab(["a", "b"], ["a", "x"], target_n_vocab=2, draft_n_vocab=2)
    with pytest.raises(SpeculativeError, match="does not match"):
        check_same_vocab(["a", "b"], ["a", "b"], target_n_vocab=2, draft_n_vocab=64)


# -- greedy identity and rollback ---------------------------------------------------------------
@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_qwen3", "tiny_qwen3moe"])
@pytest.mark.parametrize("proposer", ["lookup", "draft", "both"])
def test_greedy_output_and_kv_equal_plain_decoding(fixture: str, proposer: str, other_draft: Path,
                                                   request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    # settings where proposals are sometimes right and sometimes wrong (lookup needs repeats)
    penalty = {"repeat_penalty": 1.0 if fixture != "tiny_qwen2" and proposer == "lookup"
               else 1.3}
    plain, plain_engine = _run(path, PROMPT, None, **penalty)
    if proposer == "lookup":
        spec = Speculator(LookupProposer(3), SpecConfig(adaptive=False))
    else:
        near = {"tiny_qwen3": "near_draft_qwen3", "tiny_qwen3moe": "near_draft_qwen3moe"}
        draft = request.getfixturevalue(near[fixture]) if fixture in near else other_draft
        drafter = _drafter(_engine(draft), p_min=0.0)
        spec = Speculator(drafter if proposer == "draft" else
                          HybridProposer(LookupProposer(3), drafter, 16),
                          SpecConfig(adaptive=False))
    got, engine = _run(path, PROMPT, spec, **penalty)
    assert got.ids == plain.ids and got.reason == plain.reason
    assert got.n_past == plain.n_past
    stats = got.speculation
    assert stats is not None and 0 < stats.accepted < stats.drafted  # both paths were taken
    _assert_same_kv(engine, plain_engine, plain.n_past)


def test_draft_of_the_same_model_is_always_accepted(tiny_qwen2: Path) -> None:
    plain, _ = _run(tiny_qwen2, PROMPT, None)
    spec = Speculator(_drafter(_engine(tiny_qwen2), p_min=0.0),
                      SpecConfig(draft_max=8, adaptive=False))
    got, _ = _run(tiny_qwen2, PROMPT, spec)
    assert got.ids == plain.ids
    assert got.speculation is not None and got.speculation.accepted == got.speculation.drafted > 0


def test_a_kv_mirror_is_rolled_back_to_the_plain_cells(tiny_qwen3: Path, other_draft: Path
                                                       ) -> None:
    """Through a KVMirror (as chat uses): the mirror ends holding exactly plain decoding's
    cells, and a stop string or the length cap right after an accepted proposal keeps its row
    out, as plain decoding never forwards the last token."""
    for max_tokens in (9, 17, 30):
        plain, _ = _run(tiny_qwen3, PROMPT, None, max_tokens=max_tokens, repeat_penalty=1.3)
        mirror = KVMirror(_engine(tiny_qwen3))
        spec = Speculator(LookupProposer(2), SpecConfig(adaptive=False))
        events = generate(mirror, _tokenizer(tiny_qwen3),  # type: ignore[arg-type]
                          _sampler(mirror.engine, PROMPT, repeat_penalty=1.3),  # type: ignore
                          PROMPT, max_tokens=max_tokens, speculator=spec)
        got = _finished(events)
        assert got.ids == plain.ids
        assert mirror.cursor == plain.n_past == got.n_past
        assert mirror.tokens == PROMPT + plain.ids[:-1]


def test_speculation_needs_the_tokens_before_the_prompt(tiny_qwen2: Path) -> None:
    engine = _engine(tiny_qwen2)
    events = generate(engine, _tokenizer(tiny_qwen2), _sampler(engine, PROMPT), PROMPT,
                      max_tokens=4, start_pos=3, speculator=Speculator(LookupProposer(2)))
    with pytest.raises(SpeculativeError, match="3 tokens before the prompt"):
        list(events)


# -- sampling: the output is distributed as the target's -----------------------------------------
def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return float(0.5 * np.abs(counts / counts.sum() - probs).sum())


def test_a_draft_scoring_the_first_ids_only_keeps_the_output(tiny_qwen2: Path) -> None:
    """--draft-vocab: the draft's head covers the first ids only. Its proposals stay below the
    limit, a target token above it is rejected and then decoded, and greedy output is plain
    decoding's; sampled speculation gets the draft's q padded with zeros to the whole vocab."""
    plain, _ = _run(tiny_qwen2, PROMPT, None, repeat_penalty=1.3)
    # part of the output lies beyond the draft's head (whole groups of 16 ids, as the engine
    # rounds a limit)
    limit = (int(np.median(plain.ids)) + 1) // 16 * 16
    assert 0 < limit < max(plain.ids)
    draft = _drafter(_engine(tiny_qwen2, vocab_limit=limit), p_min=0.0)
    history = [*PROMPT, *plain.ids[:5]]
    proposal = _propose(draft, history, 7, greedy=True)
    assert proposal.tokens and max(proposal.tokens) < limit
    got, _ = _run(tiny_qwen2, PROMPT, Speculator(draft, SpecConfig(draft_max=8, adaptive=False)),
                  repeat_penalty=1.3)
    assert got.ids == plain.ids
    assert got.speculation is not None and 0 < got.speculation.accepted < got.speculation.drafted
    sampled = _drafter(_engine(tiny_qwen2, vocab_limit=limit), p_min=0.0, temp=0.8)
    proposal = _propose(sampled, history, 3, greedy=False)
    assert proposal.q is not None and all(q.shape == (plain_vocab(tiny_qwen2),) and
                                          not q[limit:].any() for q in proposal.q)
    spec = Speculator(sampled, SpecConfig(draft_max=4, adaptive=False))
    got, _ = _run(tiny_qwen2, PROMPT, spec, max_tokens=24, temp=0.8, top_k=40)
    assert len(got.ids) == 24


def plain_vocab(path: Path) -> int:
    return HParams.from_gguf(GGUFFile.open(path)).n_vocab


@pytest.mark.parametrize("q_kind", ["draft", "point"])
def test_accept_reject_keeps_the_target_distribution(tiny_qwen2: Path, q_kind: str) -> None:
    """The token at a verified position, over many seeds, follows the target's distribution p
    (the sampler chain's: top-k 6, temperature 1) whether the proposal came from a draft
    distribution q (here: the same logits at temperature 0.4, sharper than p and not truncated)
    or was a point-mass guess. The naive 'always accept' would follow q instead."""
    engine = _engine(tiny_qwen2)
    engine.forward(PROMPT, 0)
    logits = engine.forward([PROMPT[-1]], len(PROMPT))[0]
    params = {"temp": 1.0, "top_k": 6, "min_p": 0.0, "top_p": 1.0}
    vocab = _tokenizer(tiny_qwen2)
    p_ids, p = _sampler(engine, PROMPT, **params).distribution(logits)
    q = np.exp((logits - logits.max()) / 0.4).astype(np.float64)
    q /= q.sum()
    guess = int(p_ids[np.argsort(p)[-2]])  # the point mass: the second most likely token
    rng = np.random.default_rng(0)
    n = 3000
    counts = np.zeros(len(p_ids))
    naive = np.zeros(len(p_ids))
    accepted = 0
    for seed in range(n):
        sampler = Sampler(SamplerParams(**params), engine.hparams.n_vocab, seed=seed)
        sampler.reset(PROMPT)
        verifier = Verifier(TokenStepper(sampler, vocab), sampler)
        d = int(rng.choice(q.shape[0], p=q)) if q_kind == "draft" else guess
        step = verifier.step(logits, d, q if q_kind == "draft" else None)
        accepted += step.token == d
        assert step.token in p_ids
        counts[np.flatnonzero(p_ids == step.token)[0]] += 1
        naive[np.flatnonzero(p_ids == d)] += 1
    assert 100 < accepted < n - 100  # both branches of the scheme ran
    assert _tv(counts, p) < 0.04  # 3000 draws over 6 outcomes: sampling noise is ~0.02
    if q_kind == "draft":
        assert _tv(naive, p) > 0.1  # the test can tell q from p


def test_sampled_speculative_generation_runs(tiny_qwen2: Path, other_draft: Path) -> None:
    # the same model as its own draft: every drawn proposal passes, then the bonus row decides
    proposers: list[LookupProposer | SlotDrafter] = [
        LookupProposer(2), _drafter(_engine(other_draft), p_min=0.0, temp=0.8, seed=3),
        _drafter(_engine(tiny_qwen2), p_min=0.0, temp=0.8, seed=3)]
    for proposer in proposers:
        spec = Speculator(proposer, SpecConfig(draft_max=4, adaptive=False))
        got, _ = _run(tiny_qwen2, PROMPT, spec, max_tokens=24, temp=0.8, top_k=40)
        assert len(got.ids) == 24 and got.speculation is not None
        assert got.speculation.drafted > 0


def test_mirostat_draws_and_compares_so_a_seed_gives_the_plain_output(tiny_qwen2: Path) -> None:
    """Mirostat has no fixed distribution to accept against: each token is drawn as usual and a
    proposal kept iff it is that token, so the output is plain decoding's for the seed."""
    def run(spec: Speculator | None) -> Finished:
        engine = _engine(tiny_qwen2)
        sampler = Sampler(SamplerParams(temp=0.8, mirostat=2), engine.hparams.n_vocab, seed=5)
        sampler.reset(PROMPT)
        return _finished(generate(engine, _tokenizer(tiny_qwen2), sampler, PROMPT,
                                  max_tokens=24, speculator=spec))

    got = run(Speculator(LookupProposer(1), SpecConfig(adaptive=False)))
    assert got.ids == run(None).ids
    assert got.speculation is not None and got.speculation.drafted > 0


def test_proposal_cut_keeps_q_aligned() -> None:
    q = [np.full(3, i, np.float64) for i in range(4)]
    cut = Proposal([1, 2, 0, 1], q).cut(2)
    assert cut.tokens == [1, 2] and cut.q is not None and len(cut.q) == 2


# -- the development model ---------------------------------------------------------------------
class _Corrupting:
    """A draft-model proposer whose every third proposal gets a wrong last token: rejections
    at known places on the real model."""

    def __init__(self, inner: SlotDrafter) -> None:
        self.inner = inner
        self.calls = 0

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        out = self.inner.propose(asks)
        for p in out.values():
            self.calls += 1
            if self.calls % 3 == 0 and p.tokens:
                p.tokens[-1] = (p.tokens[-1] + 1) % 1000
        return out

    def warm_up(self) -> None:
        self.inner.warm_up()

    def forget(self) -> None:
        self.inner.forget()


@pytest.mark.real_model
@pytest.mark.slow
def test_dev_model_greedy_identity_on_reference_prompts(real_model_path: Path) -> None:
    cases = json.loads((Path(__file__).parent / "fixtures" / "greedy.json").read_text())["cases"]
    for case in (cases[1], cases[2]):  # code and prose
        prompt = case["prompt_ids"]
        plain, plain_engine = _run(real_model_path, prompt, None, max_tokens=20)
        for name, spec in (
                ("lookup", Speculator(LookupProposer(3), SpecConfig(draft_max=4, adaptive=False))),
                ("draft", Speculator(_Corrupting(_drafter(_engine(real_model_path, 64),
                                                          p_min=0.5)),
                                     SpecConfig(draft_max=4, adaptive=False)))):
            got, engine = _run(real_model_path, prompt, spec, max_tokens=20)
            assert got.ids == plain.ids, (case["prompt"], name)
            _assert_same_kv(engine, plain_engine, plain.n_past)


# -- the surfaces: the Python API and chat --------------------------------------------------------
def test_api_refuses_a_draft_with_another_vocabulary(tiny_qwen2: Path, tmp_path: Path) -> None:
    import minfer
    from minfer.tools.synth import build_tiny_vocab

    model = minfer.load(tiny_qwen2, n_ctx=128)
    other = write_tiny_model(tmp_path / "other.gguf", vocab=build_tiny_vocab(extra_tokens=("<x>",)))
    with pytest.raises(SpeculativeError, match="vocabulary does not match"):
        model.speculator(SpecConfig(), draft=other)
    with pytest.raises(SpeculativeError, match="needs a proposer"):
        model.speculator(SpecConfig())


def test_chat_turns_and_regen_are_unchanged_by_speculation(tiny_qwen2: Path,
                                                           other_draft: Path) -> None:
    import minfer
    from minfer.chat.session import ChatConfig, ChatSession, TurnReport

    def replies(spec: str | None) -> tuple[list[list[int]], int]:
        model = minfer.load(tiny_qwen2, n_ctx=256)
        speculator = None
        if spec == "lookup":
            speculator = model.speculator(SpecConfig(lookup_ngram=2, adaptive=False))
        elif spec == "draft":
            speculator = model.speculator(SpecConfig(p_min=0.0, adaptive=False),
                                          draft=other_draft)
        sampler = model.sampler(SamplerParams(temp=0.0, repeat_penalty=1.3), 0, 256)
        session = ChatSession(model.engine(), model.tokenizer, model.chat_template, sampler,
                              config=ChatConfig(max_tokens=12), speculator=speculator)
        out, drafted = [], 0
        for turn in (lambda: session.say("the quick brown fox"),
                     lambda: session.say("the lazy dog"), session.regen):
            *_, report = turn()
            assert isinstance(report, TurnReport)
            out.append(report.ids)
            drafted += report.drafted
        assert session.kv.tokens == session.kv.tokens[: session.kv.cursor]
        out.append(session.kv.tokens)  # the KV holds the same cells too
        return out, drafted

    plain, _ = replies(None)
    for spec in ("lookup", "draft"):
        got, drafted = replies(spec)
        assert got == plain and drafted > 0, spec


def test_cli_run_reports_acceptance_and_keeps_the_ids(tiny_qwen2: Path, other_draft: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    def run(*extra: str) -> dict[str, object]:
        assert main(["run", "--json", str(tiny_qwen2), "the fox and the dog", "--raw",
                     "--temp", "0", "-n", "24", *extra]) == 0
        out: dict[str, object] = json.loads(capsys.readouterr().out)
        return out

    plain = run()
    assert "speculative" not in plain
    for extra in (("--lookup-ngram", "2"), ("-md", str(other_draft), "--draft-p-min", "0"),
                  ("-md", str(other_draft), "--lookup-ngram", "2"),
                  ("-md", str(other_draft), "--draft-p-min", "0", "--draft-fixed")):
        got = run(*extra)
        spec = got["speculative"]
        assert got["ids"] == plain["ids"] and isinstance(spec, dict)
        assert set(spec) >= {"drafted", "accepted", "acceptance_rate"}
    # fixed lengths: every step proposes the most --draft-max allows, 3 of 4 (a proposal of k
    # takes k + 1 verify rows, in 2s, 4s, 8s, 16s); p_min 0: the draft never stops early
    spec = run("-md", str(other_draft), "--draft-p-min", "0", "--draft-fixed",
               "--draft-max", "4")["speculative"]
    assert isinstance(spec, dict) and spec["verify_steps"] >= 5
    assert spec["drafted"] == 3 * spec["verify_steps"]
    assert main(["run", str(tiny_qwen2), "hi", "--draft-max", "99", "--lookup-ngram", "2"]) == 2
    assert "--draft-max must be in 1..16" in capsys.readouterr().err


def test_a_draft_stopped_one_short_of_a_bucket_adds_its_top(tiny_qwen2: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """p_min stops a greedy draft after 2 tokens: the unsure third (the draft's argmax, no
    further forward) fills the 3-proposal bucket; stopped after 1 it is not padded (2 is no
    bucket), nor is an empty proposal."""
    whole = _propose(_drafter(_engine(tiny_qwen2), p_min=0.0), PROMPT, 3, greedy=True)
    assert len(whole.tokens) == 3
    for passing, expect in ((2, whole.tokens), (1, whole.tokens[:1]), (0, [])):
        calls = {"n": 0}

        def top(logits: np.ndarray, p_min: float, passing: int = passing,
                calls: dict[str, int] = calls) -> int | None:
            calls["n"] += 1
            return int(np.argmax(logits)) if calls["n"] <= passing else None

        monkeypatch.setattr(proposer_mod, "confident_top", top)
        draft = _drafter(_engine(tiny_qwen2), p_min=0.5)
        got = _propose(draft, PROMPT, 7, greedy=True)
        assert got.tokens == expect
        assert draft.n_forwarded == len(PROMPT) + passing  # the filled token: no forward
    assert [n for n in range(16) if fills_bucket(n)] == [2, 6, 14]


def test_draft_length_prices_plain_decoding_by_measuring_it() -> None:
    """Always proposing never times a plain step: from the fourth choice plain steps run until
    one is measured (the first is a warm-up), then one in `plain_every`."""
    length = DraftLength(16)
    picks = []
    for _ in range(length.plain_every):
        k = length.choose(100)
        picks.append(k)
        if k == 0:
            length.record_plain(0.05)
    assert all(picks[:3]) and picks[3:5] == [0, 0] and all(picks[5:-1]) and picks[-1] == 0
    assert length.decode_s == pytest.approx(0.05)


def test_draft_length_estimates_the_per_token_acceptance() -> None:
    """Each proposed token accepted with probability 0.8, proposals of 3: the estimate centres
    on 0.8 (averaging per-step ratios centred on 0.68)."""
    rng = np.random.default_rng(7)
    length, seen = DraftLength(16), []
    for _ in range(4000):
        passed = rng.random(3) < 0.8
        length.record_outcome(3, int(np.argmin(passed)) if not passed.all() else 3)
        seen.append(length.accept_rate)
    assert abs(float(np.mean(seen)) - 0.8) < 0.02


def test_kept_share_sees_drafts_that_are_wholly_right_or_wrong() -> None:
    """Drafts of 15 either all kept or rejected at their first token (2 in 3 kept): the
    per-token rate of the geometric model reads ~0.97, the share of proposed tokens kept (what
    a batch's verify rows pay for, `StepCost.draft_cap`) 2/3."""
    length = DraftLength(16)
    for i in range(300):
        length.record_outcome(15, 0 if i % 3 == 2 else 15)
    assert length.accept_rate > 0.95
    assert length.kept_share == pytest.approx(2 / 3, abs=0.1)
    cost = StepCost(fixed=0.05, per_row=0.004, steps=StepCost.MIN_STEPS)  # share 0.56 at 16
    assert cost.draft_cap(16, length.accept_rate) >= 10
    assert cost.draft_cap(16, length.kept_share) <= 2
