"""One generation core: greedy answers with speculation equal plain decoding's, on the server's
core under 4 concurrent streams and in `generate()` (what `minfer run`, chat and the API run)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QType

from minfer.engine.core.core import EngineCore
from minfer.engine.core.policy import Proposal
from minfer.engine.core.proposer import (
    DraftAsk,
    LookupProposer,
    Proposer,
    SlotDrafter,
    Speculator,
)
from minfer.engine.core.request import GenRequest
from minfer.engine.core.runner import Runner
from minfer.engine.forward import Engine
from minfer.engine.generate import Finished, generate
from minfer.engine.speculative import SpecConfig
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from minfer.tokenizer.tokenizer import Tokenizer
from minfer.tools.synth import write_tiny_model

N_SLOTS = 4
N_CTX_SLOT = 96
MAX_TOKENS = 32
# repeats inside each prompt give prompt lookup something to find
PROMPTS = [
    [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 11, 5, 17, 99, 3, 250, 42, 30, 31, 32],
    [11, 42, 7, 99, 3, 250, 17, 8, 11, 42, 7, 99, 3],
    [200, 150, 13, 9, 88, 21, 33, 200, 150, 13, 9, 88, 21, 34, 35, 36, 37, 200, 150],
    [64, 64, 65, 66, 64, 64, 65],
]


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen2's shape, other weights quantized differently: often right, sometimes not."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "draft.gguf", seed=7,
                            weight_types=QType.Q4_0)


def _engine(path: Path, n_ctx: int, *, batch_invariant: bool = False) -> Engine:
    f = GGUFFile.open(path)
    return Engine(f, HParams.from_gguf(f), n_ctx=n_ctx, batch_invariant=batch_invariant)


def _sampler(n_vocab: int, prompt: list[int], penalty: float) -> Sampler:
    s = Sampler(SamplerParams(temp=0.0, repeat_penalty=penalty), n_vocab, seed=1)
    s.reset(prompt)
    return s


def _plain(path: Path, prompt: list[int], penalty: float,
           speculator: Speculator | None = None) -> Finished:
    """`minfer run`'s loop: generate() on an engine of its own."""
    engine = _engine(path, N_CTX_SLOT)
    *_, done = generate(engine, Tokenizer.from_gguf(GGUFFile.open(path)),
                        _sampler(engine.hparams.n_vocab, prompt, penalty), prompt,
                        max_tokens=MAX_TOKENS, speculator=speculator)
    assert isinstance(done, Finished)
    return done


def _proposer(kind: str, draft: Path, n_ctx_slot: int, n_ctx: int) -> Proposer:
    if kind == "lookup":
        return LookupProposer(3)
    engine = _engine(draft, n_ctx)
    return SlotDrafter(engine, n_ctx_slot, p_min=0.0, n_vocab=engine.hparams.n_vocab)


def _served(path: Path, proposer: Proposer, penalty: float
            ) -> tuple[list[list[int]], int, int]:
    """The four prompts together on the server's core (a batch-invariant engine, as
    `minfer serve` makes it): each one's ids, and the proposals drafted and accepted."""
    n_ctx = N_SLOTS * N_CTX_SLOT
    engine = _engine(path, n_ctx, batch_invariant=True)
    core = EngineCore(Runner(engine, N_CTX_SLOT), Tokenizer.from_gguf(GGUFFile.open(path)),
                      n_slots=N_SLOTS, n_ctx_slot=N_CTX_SLOT, chunk=16, proposer=proposer,
                      speculation=SpecConfig(draft_max=8, adaptive=False))
    n_vocab = engine.hparams.n_vocab
    states = [core.add(i, GenRequest(p, MAX_TOKENS, _sampler(n_vocab, p, penalty)))
              for i, p in enumerate(PROMPTS)]
    steps = 0
    while core.busy:
        outputs = core.step()
        assert all(o.error is None for o in outputs)
        steps += 1
    assert steps < len(PROMPTS) * (MAX_TOKENS + 4)  # the streams ran side by side
    return ([s.ids for s in states], sum(s.spec.drafted for s in states),
            sum(s.spec.accepted for s in states))


# repeat penalty 2: runs of a token, then a change (proposals kept and rejected); 4: no token
# twice (lookup finds nothing to continue, the draft is never right)
@pytest.mark.parametrize("penalty", [2.0, 4.0])
@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_speculative_greedy_answers_equal_plain_decoding(tiny_qwen2: Path, draft_path: Path,
                                                         kind: str, penalty: float) -> None:
    plain = [_plain(tiny_qwen2, p, penalty).ids for p in PROMPTS]
    assert all(len(ids) == MAX_TOKENS for ids in plain)
    got, drafted, accepted = _served(tiny_qwen2, _proposer(
        kind, draft_path, N_CTX_SLOT, N_SLOTS * N_CTX_SLOT), penalty)
    assert got == plain
    if penalty == 2.0:
        assert 0 < accepted < drafted  # proposals were both kept and rejected
    elif kind == "draft":
        assert drafted > 0
    for prompt, ids in zip(PROMPTS, plain, strict=True):
        spec = Speculator(_proposer(kind, draft_path, N_CTX_SLOT, N_CTX_SLOT),
                          SpecConfig(draft_max=8, adaptive=False))
        done = _plain(tiny_qwen2, prompt, penalty, spec)
        assert done.ids == ids and done.speculation is not None


class _Slow:
    """A proposer that takes `seconds` per call on top of the one it wraps."""

    def __init__(self, inner: Proposer, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        time.sleep(self.seconds)
        return self.inner.propose(asks)

    def warm_up(self) -> None:
        self.inner.warm_up()

    def forget(self) -> None:
        self.inner.forget()


def test_a_verify_is_priced_without_the_proposals(tiny_qwen2: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """DraftLength prices proposals apart (`record_proposal`), so the verify it records is the
    forward alone: counted in both, a draft's cost was paid twice and drafting looked dearer
    than it was (a 1.5B target with a 0.5B draft stayed at ~1.0x plain where it makes 1.5x)."""
    from minfer.engine.core.policy import DraftLength

    verifies: list[float] = []
    proposals: list[float] = []
    record_verify, record_proposal = DraftLength.record_verify, DraftLength.record_proposal

    def on_verify(self: DraftLength, n: int, seconds: float) -> None:
        verifies.append(seconds)
        record_verify(self, n, seconds)

    def on_proposal(self: DraftLength, k: int, seconds: float) -> None:
        proposals.append(seconds)
        record_proposal(self, k, seconds)

    monkeypatch.setattr(DraftLength, "record_verify", on_verify)
    monkeypatch.setattr(DraftLength, "record_proposal", on_proposal)
    engine = _engine(tiny_qwen2, N_CTX_SLOT)
    prompt = PROMPTS[0]
    core = EngineCore(Runner(engine, N_CTX_SLOT), Tokenizer.from_gguf(GGUFFile.open(tiny_qwen2)),
                      n_slots=1, n_ctx_slot=N_CTX_SLOT, proposer=_Slow(LookupProposer(3), 0.2),
                      speculation=SpecConfig(draft_max=4))
    core.add(0, GenRequest(prompt, 12, _sampler(engine.hparams.n_vocab, prompt, 2.0)))
    while core.busy:
        core.step()
    assert verifies and proposals
    assert min(proposals) >= 0.2 > max(verifies)


class _Fixed:
    """A proposer that proposes `n` tokens (ids 1..n) for every ask."""

    def __init__(self, n: int) -> None:
        self.n = n

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        return {a.seq_id: Proposal(list(range(1, self.n + 1))) for a in asks}

    def warm_up(self) -> None:
        return None

    def forget(self) -> None:
        return None


@pytest.mark.parametrize(("n", "rows"), [(6, 4), (4, 0), (15, 16)])
def test_draft_min_drops_short_proposals_and_buckets_cut_the_rest(
        tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch, n: int, rows: int) -> None:
    """--draft-min 5: a proposal of fewer tokens is not verified; one of 5 or more is cut to
    its verify bucket (6 tokens: 3, four rows), as before proposals could carry rates."""
    from minfer.engine.core.policy import DraftLength

    seen: list[int] = []
    record_verify = DraftLength.record_verify

    def on_verify(self: DraftLength, n_rows: int, seconds: float) -> None:
        seen.append(n_rows)
        record_verify(self, n_rows, seconds)

    monkeypatch.setattr(DraftLength, "record_verify", on_verify)
    engine = _engine(tiny_qwen2, N_CTX_SLOT)
    prompt = PROMPTS[0]
    core = EngineCore(Runner(engine, N_CTX_SLOT), Tokenizer.from_gguf(GGUFFile.open(tiny_qwen2)),
                      n_slots=1, n_ctx_slot=N_CTX_SLOT, proposer=_Fixed(n),
                      speculation=SpecConfig(draft_max=16, draft_min=5, adaptive=False))
    core.add(0, GenRequest(prompt, 12, _sampler(engine.hparams.n_vocab, prompt, 2.0)))
    while core.busy:
        core.step()
    assert set(seen) == ({rows} if rows else set())
