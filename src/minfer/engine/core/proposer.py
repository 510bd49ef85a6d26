"""The core's proposers: guesses at each decoding sequence's next tokens, batched across slots.

A `Proposer` takes the step's `DraftAsk`s (a decoding sequence, its slot, up to k tokens wanted)
and returns each sequence's `Proposal`; the core cuts it to a verify bucket and the target checks
it in the step's forward (`core.py`). A `Speculator` is what `minfer run`, chat and the Python
API hand to `generate()`: a proposer, its flags, a `DraftLength` and counts that outlive one
generation (a chat's turns share them).

- `LookupProposer` (`--lookup-ngram N`, prompt lookup): continue the copy of an earlier part of
  the sequence, through the edits a rewrite makes to it (minfer.engine.core.lookup.follow);
  else the latest earlier occurrence of the sequence's last n-gram. Free to make.
- `SlotDrafter` (`-md FILE` / `--model-draft FILE`): a draft model, one draft sequence per slot.
- `HybridProposer` (both flags): prompt lookup where its guess is rated at least as well as the
  draft model's measured acceptance (a copy going on), the draft model elsewhere (the text an
  edit inserts, free code). The draft catches up on the tokens lookup's proposals brought.

The draft runs its own engine and KV with the target's slot layout (slot s: cells
[s * n_ctx_slot, (s + 1) * n_ctx_slot)), through the same `Runner`. For the decoding sequences of
a step (`DraftAsk`s, each its whole sequence with the pending token last), `propose`

1. catches each slot's draft KV up to the sequence: the tokens past the common prefix of what
   the slot holds and the sequence (the prompt at the first decode, then the tokens accepted since)
   are fed in one multi-sequence forward of at most `chunk` tokens, fewest first. A sequence not
   caught up in it (a long prompt) proposes nothing this step and continues at the next, so
   streams never stall behind a long prompt, as with the target's chunked prefill;
2. drafts greedily, one multi-sequence forward per draft step over every slot still drafting: a
   slot stops at its k tokens, or when the draft's top probability falls under `p_min`
   (llama.cpp's --draft-p-min; a greedy draft stopped one short of a verify bucket adds its
   unsure top, `fills_bucket`). With a `temp` (run, chat, the API) an ask of a sampled request
   draws from the draft's own distribution q instead and hands q to the verifier.

Rejected proposals need no undo: the slot's record (`cached`) keeps every token it forwarded, and
the next catch-up starts at the common prefix, so the write position simply moves back and the
stale cells are overwritten (as `KVMirror` does for `minfer run`). A hybrid draft (LFM2,
Qwen3.5: `recurrent`) holds a state per slot that took in the rejected drafts too: each
catch-up keeps the state at its end in the slot's spare (`Engine.save_state(spare=True)`), and
the next one starts from the furthest position at or before the common prefix its state can
restart from (`Engine.restart_point`: where it stands, a checkpoint, that spare), recomputing
the accepted tokens from there; another slot's prefix is taken only up to a position whose
state that slot kept (`Engine.copy_cells` brings it). A greedy draft is a point-mass
guess, so the target's verifier stays exact for sampled requests too (the server drafts greedily).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from minfer.engine.core.lookup import REPEAT_KINDS, REPEAT_MIN_N, CopyCursor, follow, lookup
from minfer.engine.core.policy import (
    Acceptance,
    DraftLength,
    Proposal,
    SpecStats,
    bucket_floor,
    confident_top,
    fills_bucket,
    softmax,
    step_tokens,
)
from minfer.engine.core.runner import BatchEngine, Runner
from minfer.engine.core.scheduler import CellCopy, Plan, Work, common_prefix, longest_held
from minfer.engine.speculative import SpecConfig, SpeculativeError

if TYPE_CHECKING:
    from minfer.engine.forward import Engine


@dataclass(frozen=True)
class DraftAsk:
    """Propose up to k tokens after `tokens` (a sequence from position 0) in `slot`; greedy:
    the target draws greedily (a sampled request may take a sampled draft); length: the
    sequence's DraftLength, whose measured costs a proposer may weigh its guesses by."""

    seq_id: int
    slot: int
    tokens: tuple[int, ...]
    k: int
    greedy: bool = True
    length: DraftLength | None = field(default=None, compare=False, repr=False)


class Proposer(Protocol):
    """What the core asks for guesses. A proposer may also define `price(seconds) -> float |
    None`: what the last `propose`, which took `seconds`, says a proposal costs (None:
    nothing), which the core records in its stead (`SlotDrafter.price`)."""

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        """Up to ask.k tokens that may follow each ask's tokens."""
        ...

    def warm_up(self) -> None:
        """Build what the first proposals need (before the first request)."""
        ...

    def forget(self) -> None:
        """Drop any record of the KV (after a failed forward its state is unknown)."""
        ...


@dataclass
class Speculator:
    """A proposer with its flags, length policy and counts; reusable across generations."""

    proposer: Proposer
    config: SpecConfig = field(default_factory=SpecConfig)
    stats: SpecStats = field(default_factory=SpecStats)
    length: DraftLength = field(init=False)

    def __post_init__(self) -> None:
        self.length = DraftLength(self.config.draft_max, adaptive=self.config.adaptive)

    def add(self, one: SpecStats) -> None:
        """Count one generation's proposals."""
        self.stats.steps += one.steps
        self.stats.drafted += one.drafted
        self.stats.accepted += one.accepted


@dataclass
class _Track:
    """Prompt lookup's record of one sequence: its copy cursor, its last proposals (each one's
    kind and tokens, and the sequence's length when they were made) and each kind's
    acceptance."""

    cursor: CopyCursor | None = None
    last: tuple[int, list[tuple[str, list[int]]]] | None = None
    kinds: dict[str, Acceptance] = field(default_factory=dict)

    def rate(self, kind: str) -> float:
        return self.kinds.get(kind, Acceptance()).rate

    def score(self, seq: np.ndarray, everyone: dict[str, Acceptance]) -> None:
        """Count the last proposals against the tokens that followed them, verified or not:
        the lookup is free to make, so every step measures each kind (one rated too low to
        verify still learns when its guesses come right again). `everyone`: the same counts
        over all sequences, where a new sequence's start."""
        if self.last is None:
            return
        at, candidates = self.last
        for kind, tokens in candidates:
            seen = min(len(tokens), seq.shape[0] - at)
            if seen > 0:
                right = int(np.argmin(np.append(seq[at:at + seen] == tokens[:seen], False)))
                for kinds in (self.kinds, everyone):
                    kinds.setdefault(kind, Acceptance()).record(min(right + 1, seen), right)
        self.last = None


class _Tracks(dict[int, _Track]):
    """A proposer's `_Track` per sequence (the latest kept: `trim`), with
    each kind's acceptance over every sequence (`kinds`), where a new sequence's start."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[str, Acceptance] = {}

    def scored(self, seq_id: int, seq: np.ndarray) -> _Track:
        """The sequence's track (a new one seeded from `kinds`), its last proposals scored
        against seq, now the latest."""
        track = self.pop(seq_id, None) or _Track(
            kinds={kind: replace(rate) for kind, rate in self.kinds.items()})
        track.score(seq, self.kinds)
        self[seq_id] = track
        return track

    def trim(self, limit: int) -> None:
        """Drop the oldest tracks past `limit` (finished sequences)."""
        while len(self) > limit:
            del self[next(iter(self))]


class LookupProposer:
    """Prompt lookup for every ask, following each sequence's copy through edits
    (`lookup.follow`: one `CopyCursor` per sequence, the latest MAX_TRACKS kept). Each
    proposal carries the acceptance its kind (`COPY_KINDS`) has measured in that sequence
    (starting from what it measured over the sequences before), so `DraftLength.fit` verifies
    a copy's 15 tokens and skips a guess inside inserted text. Across an edit the n-gram
    lookup is a second candidate (`REPEAT_KINDS`): the better-rated kind is proposed."""

    MAX_TRACKS = 1024

    def __init__(self, n: int) -> None:
        if n < 1:
            raise SpeculativeError(f"--lookup-ngram must be >= 1, got {n}")
        self.n = n
        self.tracks = _Tracks()

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        out: dict[int, Proposal] = {}
        for a in asks:
            seq = np.asarray(a.tokens, dtype=np.int64)
            track = self.tracks.scored(a.seq_id, seq)
            tokens, track.cursor = follow(seq, track.cursor, self.n, a.k)
            kind = track.cursor.kind if track.cursor is not None else "lookup"
            candidates = [(kind, tokens)] if tokens else []
            if tokens and kind in REPEAT_KINDS:
                again = lookup(seq, self.n, a.k, REPEAT_MIN_N)
                if again and again[0] != tokens[0]:
                    candidates.append(("repeat", again))
            if candidates:
                track.last = (seq.shape[0], candidates)
                kind, tokens = max(candidates, key=lambda c: track.rate(c[0]))
            out[a.seq_id] = Proposal(tokens, rate=track.rate(kind))
        self.tracks.trim(self.MAX_TRACKS)
        return out

    def warm_up(self) -> None:
        return None

    def forget(self) -> None:
        self.tracks.clear()


class SlotDrafter:
    """A draft engine with one draft sequence per slot (the core's thread only)."""

    def __init__(self, engine: BatchEngine, n_ctx_slot: int, *, p_min: float, chunk: int = 512,
                 temp: float | None = None, seed: int = 0, n_vocab: int = 0) -> None:
        """temp: draft sampled requests from the draft's distribution at this temperature (None:
        every draft greedy); n_vocab: the target's logit width, q's (the draft may score fewer)."""
        self.runner = Runner(engine, n_ctx_slot)
        self.recurrent = self.runner.recurrent  # a hybrid draft (LFM2, Qwen3.5): see module
        self.n_ctx_slot = n_ctx_slot
        self.p_min = p_min
        self.chunk = chunk
        self.temp = temp
        self.n_vocab = n_vocab
        self._rng = np.random.default_rng(seed)
        self.cached: list[list[int]] = [[] for _ in range(engine.n_ctx // n_ctx_slot)]
        self.n_forwarded = 0  # tokens the draft engine computed (catch-up and drafts)
        self.n_forwards = 0
        self._resume_s: float | None = 0.0  # see `price`

    def warm_up(self) -> None:
        """Build the draft's first graphs in slot 0 (its record stays empty: never reused)."""
        self.runner.warm_up()

    def forget(self) -> None:
        """Drop every slot's record (after a failed forward the KV state is unknown)."""
        self.cached = [[] for _ in self.cached]

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        """Up to ask.k draft tokens per ask (fewer where the draft is unsure)."""
        asks = [a for a in asks if a.tokens and self._room(a) > 0]
        t0, fed = time.perf_counter(), self.n_forwarded
        logits = self._catch_up(asks)
        catch_up_s, fed = time.perf_counter() - t0, self.n_forwarded - fed
        out = {a.seq_id: Proposal([], None if self._greedy(a) else []) for a in asks}
        live = [a for a in asks if a.seq_id in logits]
        t1, forwards = time.perf_counter(), self.n_forwards
        while live:
            works: list[Work] = []
            for a in live:
                drafted = out[a.seq_id]
                if not self._draw(a, logits[a.seq_id], drafted):
                    continue
                if len(drafted.tokens) < self._room(a):  # its logits give the next token
                    works.append(Work(a.seq_id, a.slot, len(a.tokens) + len(drafted.tokens) - 1,
                                      (drafted.tokens[-1],), True))
            going = {w.seq_id for w in works}
            live = [a for a in live if a.seq_id in going]
            if works:
                logits = self._forward(works)
        forwards = self.n_forwards - forwards
        if fed <= 2 * len(asks):  # the catch-up a proposal right after the last one makes
            self._resume_s = 0.0
        elif forwards:  # the catch-up beyond one draft step's time
            self._resume_s = max(0.0, catch_up_s - (time.perf_counter() - t1) / forwards)
        else:
            self._resume_s = None
        return out

    def price(self, seconds: float) -> float | None:
        """What the last `propose`, which took `seconds`, says a proposal costs: its time less
        the part that resumed drafting (None: nothing but that part to go by). A catch-up
        forward of more than 2 tokens a sequence (the prompt, or the tokens of the plain steps
        since the sequence's last proposal) costs more than the one draft step a proposal made
        right after the last one takes (the correction, or the last drafted token and the
        next), and drafting pays it once when it resumes, not per proposal. Priced in, a probe
        after 16 plain steps (a 17-token catch-up: 3 draft tokens in 73-98 ms against ~40 ms
        otherwise, 1.5B target, AMD EPYC Zen 3) kept the draft looking too dear to resume."""
        return None if self._resume_s is None else seconds - self._resume_s

    def _greedy(self, ask: DraftAsk) -> bool:
        return ask.greedy or self.temp is None

    def _draw(self, ask: DraftAsk, logits: np.ndarray, drafted: Proposal) -> bool:
        """Append the next draft token to `drafted`; False when drafting stops here."""
        if drafted.q is None:
            token = confident_top(logits, self.p_min)
            if token is None:
                if fills_bucket(len(drafted.tokens)):
                    drafted.tokens.append(int(np.argmax(logits)))
                return False
            drafted.tokens.append(token)
            return True
        assert self.temp is not None
        q = softmax(logits if self.temp == 1.0 else logits / self.temp)
        if q.max() < self.p_min:
            return False
        drafted.tokens.append(int(self._rng.choice(q.shape[0], p=q)))
        drafted.q.append(np.pad(q, (0, max(0, self.n_vocab - q.shape[0]))))  # 0 beyond
        return True

    def lacking(self, ask: DraftAsk) -> int:
        """The tokens of ask its slot's draft has not computed: what a proposal would first
        catch up on (a prefix another slot holds would be copied instead)."""
        return len(ask.tokens) - self._restart(ask.slot, common_prefix(self.cached[ask.slot],
                                                                       ask.tokens))

    def _restart(self, slot: int, n: int) -> int:
        """Where slot's draft may resume feeding a sequence whose first n tokens its cells
        hold: n, or on a recurrent draft the furthest position <= n its state can restart
        from (`Engine.restart_point`: where it stands, a checkpoint, the spare kept at the
        end of the last catch-up)."""
        return cast("Engine", self.runner.engine).restart_point(slot, n) if self.recurrent \
            else n

    def _room(self, ask: DraftAsk) -> int:
        """ask.k, capped so that no draft token's cell passes the slot."""
        return min(ask.k, self.n_ctx_slot - len(ask.tokens) + 1)

    def _catch_up(self, asks: Sequence[DraftAsk]) -> dict[int, np.ndarray]:
        """Feed the tokens each ask's slot lacks, fewest first, in one forward of at most
        `chunk` tokens; the logits row after the last token of each ask caught up. A prefix
        another slot's draft cells hold (a system prompt every request repeats) is copied
        first, as the target's scheduler does (`CellCopy`)."""
        copies: list[CellCopy] = []
        lacking = sorted(((self._take_prefix(a, copies), a) for a in asks),
                         key=lambda sa: len(sa[1].tokens) - sa[0])
        works: list[Work] = []
        budget = self.chunk
        for start, a in lacking:
            if budget == 0:
                break
            n = min(len(a.tokens) - start, budget)
            works.append(Work(a.seq_id, a.slot, start, a.tokens[start:start + n],
                              start + n == len(a.tokens)))
            budget -= n
        assert works or not copies  # the first ask lacks at least its last token
        logits = self._forward(works, copies) if works else {}
        if self.recurrent:  # the state the next catch-up rolls back to (drafts rejected)
            engine = cast("Engine", self.runner.engine)
            for w in works:
                if w.logits:
                    engine.save_state(w.slot, spare=True)
        return logits

    def _take_prefix(self, ask: DraftAsk, copies: list[CellCopy]) -> int:
        """Where ask's catch-up starts: after the longest prefix of its tokens (all but the
        last, whose logits are wanted) that its slot's cells or another slot's hold; another
        slot's are copied (appended to `copies`, run before the forward in order)."""
        last = len(ask.tokens) - 1
        own = self._restart(ask.slot, min(common_prefix(self.cached[ask.slot], ask.tokens), last))
        others = [(slot, held, len(held)) for slot, held in enumerate(self.cached)
                  if slot != ask.slot]
        if self.recurrent:  # another slot's state where it stood (`Engine.copy_cells`)
            best, length = -1, own
            for slot, held, _ in others:
                reach = self._restart(slot, min(common_prefix(held, ask.tokens), last))
                if reach > length:
                    best, length = slot, reach
        else:
            best, length = longest_held(ask.tokens, others, own)
            length = min(length, last)
        if length > own:
            copies.append(CellCopy(best, ask.slot, own, length - own))
            self.cached[ask.slot][own:] = ask.tokens[own:length]
        return length

    def _forward(self, works: list[Work], copies: Sequence[CellCopy] = ()
                 ) -> dict[int, np.ndarray]:
        """One multi-sequence draft forward (after `copies`); each slot's record follows what
        it wrote."""
        for w in works:
            held = self.cached[w.slot]
            del held[w.start_pos:]
            held.extend(w.tokens)
        out = self.runner.run(Plan(tuple(works), tuple(copies)))
        self.n_forwarded += sum(len(w.tokens) for w in works)
        self.n_forwards += 1
        return out


class HybridProposer:
    """Prompt lookup and a draft model together. For each ask, lookup's proposal (free to
    make, rated by its kind of guess, as long as `lookup_k`) or the draft's (ask.k tokens, the
    length the core's DraftLength chose from the draft's costs: `rated_asks_most` is False,
    so a rated lookup guess does not make the core ask the most of the draft), whichever is
    expected to yield more tokens a second: each at its acceptance (lookup's kind's rate; the
    draft's measured in that sequence), verified at the sequence's measured step costs
    (`DraftLength.step_rate`), the draft's tokens also costing a draft step each (timed here;
    priced at DRAFT_STEP_PRIOR of a plain step until then) and the tokens its slot lacks a
    catch-up forward. Where both copy as surely, lookup's long free copy wins, and a draft that
    would first prefill the prompt does not take a copy over; new text goes to the draft.
    Without costs (an ask with no DraftLength) the expected accepted tokens decide. Every step
    scores the draft's last proposal of each sequence against the tokens that followed it, as
    lookup scores its own, so a sequence whose text turns from copied to new moves to the
    draft, and back."""

    rated_asks_most = False
    ALPHA = 0.2  # the draft step's moving average
    # A draft step's seconds before one is timed, as a share of the target's plain step (the
    # 0.5B draft, narrowed to Q4_0, for the 1.5B Q4_K_M target: about a third).
    DRAFT_STEP_PRIOR = 1 / 3
    # Tokens a catch-up forward takes in the time of one draft step: the 0.5B prefills at
    # ~12x its decode rate on 2 threads (Intel SPR: pp512 ~600, tg ~45 tok/s).
    CATCH_UP_ROWS = 12

    def __init__(self, lookup: LookupProposer, drafter: SlotDrafter, lookup_k: int) -> None:
        self.lookup = lookup
        self.drafter = drafter
        self.lookup_k = lookup_k
        self.tracks = _Tracks()  # the draft's record per sequence (kind "draft")
        self.draft_step_s = 0.0  # a draft forward's seconds (long catch-ups left out)
        self._drafted_last = False  # whether the last `propose` asked the draft

    def price(self, seconds: float) -> float | None:
        """What the last `propose` says a proposal costs (`SlotDrafter.price`)."""
        return self.drafter.price(seconds) if self._drafted_last else seconds

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, Proposal]:
        self._drafted_last = False
        looked = self.lookup.propose([replace(a, k=max(a.k, self.lookup_k)) for a in asks])
        out: dict[int, Proposal] = {}
        rest: list[DraftAsk] = []
        for a in asks:
            track = self.tracks.scored(a.seq_id, np.asarray(a.tokens, dtype=np.int64))
            guess = looked.get(a.seq_id)
            if guess is not None and guess.tokens and self._lookup_pays(a, guess, track):
                out[a.seq_id] = guess
            else:
                rest.append(a)
        if rest:
            out.update(self._drafted(rest))
        self.tracks.trim(LookupProposer.MAX_TRACKS)
        return out

    def _lookup_pays(self, ask: DraftAsk, guess: Proposal, track: _Track) -> bool:
        rate, draft_rate = guess.rate or 0.0, track.rate("draft")
        n = bucket_floor(len(guess.tokens))
        length = ask.length
        if length is None or not length.adaptive:
            return step_tokens(rate, n) >= step_tokens(draft_rate, ask.k)
        # a draft step, until timed here: a share of the target's plain step; the tokens its
        # slot lacks (the prompt at first, then what lookup's guesses brought) cost a forward
        step = self.draft_step_s or length.decode_s * self.DRAFT_STEP_PRIOR
        behind = max(0, self.drafter.lacking(ask) - 1)
        token_s = step * (1.0 + behind / (self.CATCH_UP_ROWS * max(1, ask.k)))
        return length.step_rate(n, rate, 0.0) >= length.step_rate(ask.k, draft_rate, token_s)

    def _drafted(self, asks: list[DraftAsk]) -> dict[int, Proposal]:
        """The draft's proposals for asks, each recorded to be scored; the draft step timed."""
        forwards = self.drafter.n_forwards
        t0 = time.perf_counter()
        drafted = self.drafter.propose(asks)
        priced = self.drafter.price(time.perf_counter() - t0)  # a long catch-up left out
        forwards = self.drafter.n_forwards - forwards
        self._drafted_last = True
        if forwards and priced is not None:
            step = priced / forwards
            self.draft_step_s = step if not self.draft_step_s else (
                (1.0 - self.ALPHA) * self.draft_step_s + self.ALPHA * step)
        lengths = {a.seq_id: len(a.tokens) for a in asks}
        for seq_id, proposal in drafted.items():
            if proposal.tokens:
                self.tracks[seq_id].last = (lengths[seq_id], [("draft", proposal.tokens)])
        return drafted

    def warm_up(self) -> None:
        self.drafter.warm_up()

    def forget(self) -> None:
        self.lookup.forget()
        self.drafter.forget()
        self.tracks.clear()
