"""The slot scheduler: who runs in the next forward and how many tokens each feeds.

Pure bookkeeping, no model and no threads (vLLM v1's split): the scheduler decides, a runner
executes (`runner.py`), and two small dataclasses, `Work` and `Plan`, are the whole interface.
`EngineCore` (core.py) drives both.

A sequence's progress is one counter: `n_computed` of its `tokens` (prompt, then every sampled
token) have their KV in the slot. Each step feeds `tokens[n_computed:]`, capped by a token budget,
so chunked prefill and decode are one mechanism: a decoding sequence simply has one token left.
Running decodes are scheduled first (one token each, so streams never stall behind a long prompt);
the rest of the step's budget (`chunk` prompt tokens) goes to prompts in arrival order. While no
sequence decodes, nobody waits on the step, and the budget is `idle_chunk`: a lone prompt (an
editor's completion request after a keystroke) is prefilled in fewer, larger forwards, whose
matmuls run faster per token (0.5B, 315 tokens at depth 1,200: ~5% less time in one forward of
315 than in chunks of 128, Intel Xeon SPR, 2 threads).

Slots own disjoint KV ranges (slot s: cells [s * n_ctx_slot, (s + 1) * n_ctx_slot)), positions
restart at 0 in each slot. A slot remembers the tokens its cells hold after its sequence ends; a
new request takes the free slot whose cache shares the longest prefix with its prompt and prefills
only the rest (the prompt cache). At least the last prompt token is always recomputed, because its
logits are needed to sample the first token.

A sequence whose prompt is scored (`score_k`: each prompt token's logprob is wanted, with its k
most likely alternatives) asks for every fed token's logits (`Work.rows`). A slot keeps the scores
of the tokens its cells hold (`Slot.scores`, those of the scored prompt that last ran there) next
to them, so a scored prompt takes a cached or copied prefix of h tokens only with the scores of
tokens 1..h: h is at most the number of cached scores, token h (whose score row h - 1 gave) must
be common too, and the scores must have been computed with at least its k alternatives (then cut
to its k; with fewer nothing is taken: those scores need their rows again, and so their tokens).
Rows are batch-invariant, so the scores taken are the very ones its rows would give. An unscored
sequence takes the cells alone; the slot's scores end with it. The scheduler only moves the
score records; the request computes them (`Request.score_prompt`, into `Sequence.scores`).

A model with recurrent layers (`recurrent`: LFM2) keeps per slot a state of every token so far,
which cannot be cut back to a prefix: a slot's cache (or another slot's cells, copied with their
state) serves a prompt whole when the prompt extends the whole cached sequence by at least one
token (a chat's next turn); else a slot's cache, its own or another's, serves up to that slot's
furthest state checkpoint within the common prefix (`checkpoints`: the positions the runner's
engine kept the slot's state at, `minfer.backends.checkpoints`; the forward restores the own
slot's, `Engine.copy_cells` brings another slot's with the cells), or nothing (position 0). So
a system prompt every request repeats is prefilled once, up to its last prompt-chunk boundary,
on a hybrid model too: a prompt admitted beside another that computes it waits for that
prompt's chunk to end inside their common prefix, then copies up to there (the other prompt's
chunk ends where the shared part does, when that lies inside it: `_end_at_shared`). A
prompt's last chunk (longer than `TAIL_SPLIT`) stops a token short, its state checkpointed at
n_prompt - 1 (`_end_before_last`, as llama.cpp's server checkpoints near a prompt's end): the
same prompt again (a regenerated reply) prefills only its last token.

Speculative decoding: a decoding sequence's work may carry proposed tokens after its one pending
token (the core attaches them, `proposer.py`); the forward computes their rows too, the core keeps
the verified prefix (`accept_drafted`) and the rest of those cells are simply overwritten later.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

import numpy as np

from minfer.engine.core.request import (
    Block,
    PromptRows,
    TokenLogprob,
    held_blocks,
    reach_past_blocks,
)
from minfer.errors import MinferError

# prompt tokens of a step in which nothing decodes, where the server's chunk is not set
# (llama.cpp's server prefills up to its n_batch, 2048, a step)
IDLE_CHUNK = 512
# a prompt waits a step for an earlier prompt of the same step to compute its next tokens (then
# copies them) when at least this many of them are shared
SHARE_MIN = 16
# a recurrent prompt's last chunk longer than this stops a token short of the prompt's end,
# its state checkpointed there (`Scheduler._end_before_last`): repeating a prompt then reuses
# all of it but the last token, which is computed again for its logits. The split costs the
# prompt one more forward (a one-row one); a /regen of a tail left whole recomputes up to this
# many rows (the 0.8B Qwen3.5 at depth 4,000, 2 threads: 4 rows cost 1.1x one row, 8 rows
# 1.5x, 16 2.3x, 64 9.6x; llama.cpp's server always computes its last 4 apart)
TAIL_SPLIT = 8


class QueueFullError(MinferError):
    """The waiting queue is at capacity: the request is refused, not parked."""


@dataclass
class Sequence:
    seq_id: int
    tokens: list[int]
    n_prompt: int
    n_computed: int = 0
    n_cached: int = 0  # prompt tokens found in the slot's cache at admission
    slot: int | None = None
    # k: each prompt token after the first scored with its k most likely alternatives (every
    # prompt row's logits wanted); None: not scored
    score_k: int | None = None
    # the scores of tokens 1..len(scores) so far: those a cached prefix brought, then those its
    # rows gave (one list with the request's, `Request.prompt_logprobs`)
    scores: list[TokenLogprob] = field(default_factory=list)
    # rows given for some prompt tokens (images): each block is fed whole in one work, and a
    # cached prefix reaches past one only where the cells hold the same block (`Block`: equal
    # placeholder ids stand for different images)
    embd: tuple[PromptRows, ...] = ()

    def blocks(self, n: int) -> frozenset[Block]:
        """The given-row blocks within its first n tokens."""
        return held_blocks(self.embd, n)

    def chunk(self, n: int) -> int:
        """n tokens from n_computed, cut before a block of given rows they would split (or
        taken to its end where the block starts the chunk)."""
        start = self.n_computed
        for e in self.embd:
            if e.at < start + n < e.at + e.n:
                return e.at - start if e.at > start else e.at + e.n - start
        return n

    @property
    def prompt_rows(self) -> bool:
        return self.score_k is not None

    @property
    def n_pending(self) -> int:
        return len(self.tokens) - self.n_computed

    @property
    def decoding(self) -> bool:
        return self.n_computed >= self.n_prompt


@dataclass
class Slot:
    index: int
    # tokens in cells [0, len) of a free slot (a busy slot's cells are its sequence's, written at
    # `finish`: no copy per step)
    cached: list[int] = field(default_factory=list)
    seq_id: int | None = None
    last_used: int = 0
    # the scores of tokens 1..len(scores) of `cached` (a scored prompt's), each with its top
    # score_k alternatives
    scores: tuple[TokenLogprob, ...] = ()
    score_k: int | None = None
    # the blocks of given rows among `cached`
    blocks: frozenset[Block] = frozenset()


@dataclass(frozen=True)
class Work:
    """Feed `tokens` of one sequence at positions start_pos.. of its slot."""

    seq_id: int
    slot: int
    start_pos: int
    tokens: tuple[int, ...]
    logits: bool  # the last token's logits are wanted (the sequence samples after this step)
    draft: tuple[int, ...] = ()  # proposed continuation, fed after `tokens` to be verified
    rows: bool = False  # every fed token's logits are wanted (a prompt scored token by token)
    embd: tuple[PromptRows, ...] = ()  # given rows of the fed tokens, `at` counted from start_pos
    # the sequence's M-RoPE image blocks, `at` from its row 0 (`request.mrope_positions`): its
    # rows' rope positions, for every work of a sequence holding any
    mrope: tuple[PromptRows, ...] = ()


@dataclass(frozen=True)
class CellCopy:
    """Copy the KV of positions [start, start + n) of slot `src` to the same positions of slot
    `dst`: a prompt prefix another slot already holds (the same tokens at the same positions,
    so the same bits as computing them: a row's KV does not depend on its batch)."""

    src: int
    dst: int
    start: int
    n: int


@dataclass(frozen=True)
class Plan:
    works: tuple[Work, ...]
    copies: tuple[CellCopy, ...] = ()  # run before the forward, in order (a plan that copies
    # has work: the copying prompt's, or the earlier prompt's it waits for)

    @property
    def n_tokens(self) -> int:
        return sum(len(w.tokens) + len(w.draft) for w in self.works)


def longest_held(tokens: Tokens[int], held: Iterable[tuple[int, Tokens[int], int]],
                 length: int) -> tuple[int, int]:
    """(slot, n): of the slots `held` lists as (slot, its tokens, how many of them its cells
    hold), the one whose cells hold the longest prefix of `tokens`, if longer than `length`
    (else (-1, length)). A slot holding no more than the best so far is not compared."""
    best = -1
    for slot, cells, n_held in held:
        if n_held > length:
            n = min(common_prefix(cells, tokens), n_held)
            if n > length:
                best, length = slot, n
    return best, length


def common_prefix(a: Tokens[int], b: Tokens[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class Held:
    """What a slot's cells hold: tokens[:n], with the scores of tokens 1..len(scores) computed
    with score_k alternatives each (None: not scored)."""

    tokens: Tokens[int]
    n: int
    scores: Tokens[TokenLogprob]
    score_k: int | None
    blocks: frozenset[Block] = frozenset()


def _scores_serve(have: int | None, want: int | None) -> bool:
    """Scores computed with `have` alternatives serve a sequence that wants `want` (None: an
    unscored one, served by any)."""
    return want is None or (have is not None and have >= want)


def _reach(seq: Sequence, held: Held, recurrent: bool = False,
           checkpoints: Tokens[int] = ()) -> int:
    """How many of seq's first tokens held cells give it: their common prefix; for a scored
    prompt at most h tokens such that the scores of tokens 1..h come too (token h is common,
    its score known: h <= len(scores)), and none if those lack alternatives it asks for.
    recurrent: all the held tokens, where the prompt extends them (its last token, whose
    logits are wanted, still to compute), or the furthest of `checkpoints` (the positions the
    slot's state was kept at) within them: a recurrent state is not cut to a prefix."""
    common = reach_past_blocks(seq.embd, common_prefix(held.tokens, seq.tokens), held.blocks)
    if seq.score_k is None:
        n = min(common, held.n)
    elif not _scores_serve(held.score_k, seq.score_k):
        n = 0
    else:
        n = max(0, min(common - 1, held.n, len(held.scores)))
    if recurrent and not (n == held.n < seq.n_prompt):
        return max((c for c in checkpoints if c <= n and c < seq.n_prompt), default=0)
    return n


def _take_scores(seq: Sequence, scores: Tokens[TokenLogprob], start: int, end: int) -> None:
    """A scored seq takes the scores of tokens start + 1..end with the cells start..end - 1,
    cut to its own k."""
    if seq.score_k is not None:
        assert len(seq.scores) == start, "a prompt's scores match its computed tokens"
        seq.scores.extend(lp.upto(seq.score_k) for lp in scores[start:end])


class Scheduler:
    def __init__(self, *, n_slots: int, n_ctx_slot: int, chunk: int = 128,
                 max_waiting: int = 64, idle_chunk: int | None = None,
                 recurrent: bool = False) -> None:
        """idle_chunk: the prompt tokens of a step in which nothing decodes (None: chunk);
        recurrent: the model's slots carry recurrent state (reused whole or from a
        checkpoint: `checkpoints(slot)` lists the positions a slot's state was kept at)."""
        idle_chunk = chunk if idle_chunk is None else idle_chunk
        if n_slots < 1 or n_ctx_slot < 1 or min(chunk, idle_chunk) < 1 or max_waiting < 0:
            raise MinferError("slots, context, chunk must be positive and the queue >= 0")
        self.n_ctx_slot = n_ctx_slot
        self.chunk = chunk
        self.idle_chunk = idle_chunk
        self.max_waiting = max_waiting
        self.recurrent = recurrent
        self.checkpoints: Callable[[int], Tokens[int]] | None = None
        self.slots = [Slot(i) for i in range(n_slots)]
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # in admission order
        self._tick = itertools.count(1)

    # -- requests in and out -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; QueueFullError when more than max_waiting would have to wait."""
        if not 1 <= seq.n_prompt <= self.n_ctx_slot or seq.n_prompt != len(seq.tokens):
            raise MinferError(f"a prompt needs 1..{self.n_ctx_slot} tokens, got {seq.n_prompt}")
        if len(self.waiting) - self.n_free >= self.max_waiting:
            raise QueueFullError(f"the request queue is full ({self.max_waiting} waiting)")
        self.waiting.append(seq)

    def append(self, seq_id: int, token: int) -> None:
        """A sampled token becomes known; the next step computes it."""
        self.running[seq_id].tokens.append(token)

    def finish(self, seq_id: int) -> None:
        """Drop a sequence (done, cancelled or failed); its slot keeps the computed tokens."""
        seq = self.running.pop(seq_id, None)
        if seq is None:
            self.waiting = deque(s for s in self.waiting if s.seq_id != seq_id)
            return
        assert seq.slot is not None
        slot = self.slots[seq.slot]
        slot.seq_id = None
        slot.cached = seq.tokens[: seq.n_computed]
        slot.blocks = seq.blocks(seq.n_computed)
        slot.scores, slot.score_k = tuple(seq.scores), seq.score_k
        slot.last_used = next(self._tick)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> Plan:
        """Admit what fits, then plan the next forward (empty when there is nothing to run).

        A prompt first takes over the longest prefix of it that another slot's cells hold,
        copied (`CellCopy`: a running sequence's computed tokens, a free slot's cache); a
        system prompt every request repeats is computed once, not once per slot. A prompt
        whose next `SHARE_MIN` or more tokens an earlier prompt computes in this very step
        waits a step and copies them then (a burst of requests with one system prompt)."""
        if self.waiting:
            self._admit()
        works: list[Work] = []
        prompts: list[Sequence] = []
        for seq in self.running.values():
            if not seq.decoding:
                prompts.append(seq)
            elif seq.n_pending > 0:
                works.append(self._work(seq, 1))
        budget = self.chunk if works else self.idle_chunk
        copies: list[CellCopy] = []
        # each planned prompt's tokens once this step is done, and the k of its scores
        planned: list[tuple[list[int], int | None]] = []
        for i, seq in enumerate(prompts):
            copy = self._take_prefix(seq)
            if copy is not None:
                copies.append(copy)
            if budget == 0 or self._waits(seq, planned):
                continue
            n = seq.chunk(min(seq.n_pending, budget))
            if self.recurrent:
                n = self._end_before_last(seq, self._end_at_shared(seq, n, prompts[i + 1:]))
            works.append(self._work(seq, n))
            planned.append((seq.tokens[: seq.n_computed + n], seq.score_k))
            budget = max(0, budget - n)
        if len(works) > 1:
            works.sort(key=lambda w: w.slot)
        assert works or not copies, "copies ride on a forward: a plan without work is skipped"
        return Plan(tuple(works), tuple(copies))

    def _end_at_shared(self, seq: Sequence, n: int, later: Iterable[Sequence]) -> int:
        """n, or fewer: a recurrent prompt's chunk ends where a later prompt's shared part
        (SHARE_MIN or more tokens it still lacks) ends inside it, so the state is checkpointed
        there and that prompt copies it (`_waits`) instead of prefilling it again."""
        start = seq.n_computed
        ends = [shared for other in later
                if start < (shared := common_prefix(seq.tokens[:seq.n_prompt],
                                                    other.tokens[:other.n_prompt])) < start + n
                and shared < other.n_prompt and other.n_computed + SHARE_MIN <= shared]
        return seq.chunk(min(ends) - start) if ends else n

    def _end_before_last(self, seq: Sequence, n: int) -> int:
        """n, or n - 1: a recurrent prompt's last chunk, when longer than `TAIL_SPLIT`, stops
        one token short, so its state is checkpointed at n_prompt - 1 and the same prompt
        again (a regenerated reply, a retried request) or one that differs only in its last
        token prefills one token, not that whole chunk (llama.cpp's server checkpoints 4
        tokens before a prompt's end); the last token is the next step's one-row forward. Only
        where slots keep checkpoints the scheduler reads (`checkpoints`: the server's runner;
        a one-slot run would pay the extra forward for nothing)."""
        if (self.checkpoints is not None and seq.n_computed + n == seq.n_prompt and n > TAIL_SPLIT
                and seq.chunk(n - 1) == n - 1):
            return n - 1
        return n

    def _waits(self, seq: Sequence, planned: list[tuple[list[int], int | None]]) -> bool:
        """Whether seq's next SHARE_MIN or more prompt tokens are computed this step by an
        earlier prompt (`planned`: its tokens once the step is done, its scores' k), to be
        copied next step. A recurrent model's state comes only where that prompt's chunk ends
        (its state checkpointed there: `Runner.run`), so that end must lie inside seq's
        prompt, past those tokens."""
        upto = seq.n_computed + SHARE_MIN
        if upto >= seq.n_prompt:
            return False
        for done, k in planned:
            if not _scores_serve(k, seq.score_k):
                continue
            if self.recurrent:
                if upto <= len(done) < seq.n_prompt \
                        and common_prefix(done, seq.tokens) == len(done):
                    return True
            elif common_prefix(done, seq.tokens[:upto]) == upto:
                return True
        return False

    def _take_prefix(self, seq: Sequence) -> CellCopy | None:
        """Copy the rest of the longest prefix of seq's prompt another slot's cells hold (at
        most up to its last prompt token, always computed: its logits are needed), with its
        scores for a scored prompt (`_reach`)."""
        assert seq.slot is not None
        best, length = -1, seq.n_computed
        for s in self.slots:
            if s.index == seq.slot:
                continue
            held = self._holding(s)
            if held.n > length:  # no reach is longer than the cells
                n = _reach(seq, held, self.recurrent, self._checkpoints(s))
                if n > length:
                    best, length = s.index, n
        length = min(length, seq.n_prompt - 1)
        if length <= seq.n_computed:
            return None
        copy = CellCopy(best, seq.slot, seq.n_computed, length - seq.n_computed)
        _take_scores(seq, self._holding(self.slots[best]).scores, copy.start, length)
        seq.n_cached += copy.n
        seq.n_computed = length
        return copy

    def _holding(self, s: Slot) -> Held:
        """What slot s's cells hold: a free slot's cache, a busy one's computed tokens."""
        seq = None if s.seq_id is None else self.running.get(s.seq_id)
        if seq is None:
            return Held(s.cached, len(s.cached), s.scores, s.score_k, s.blocks)
        return Held(seq.tokens, seq.n_computed, seq.scores, seq.score_k,
                    seq.blocks(seq.n_computed))

    def advance(self, plan: Plan) -> None:
        """The runner computed plan: the fed tokens now have KV in their slots."""
        for w in plan.works:
            seq = self.running.get(w.seq_id)
            if seq is None:
                continue
            assert w.start_pos == seq.n_computed
            seq.n_computed += len(w.tokens)

    def accept_drafted(self, seq_id: int, tokens: list[int]) -> None:
        """Proposed tokens the target verified: known, and their KV rows already computed."""
        seq = self.running[seq_id]
        assert seq.n_computed == len(seq.tokens)
        seq.tokens.extend(tokens)
        seq.n_computed += len(tokens)

    def _work(self, seq: Sequence, n: int) -> Work:
        assert seq.slot is not None
        start = seq.n_computed
        if start + n > self.n_ctx_slot:
            raise MinferError(f"sequence {seq.seq_id} would pass the slot's context")
        return Work(seq.seq_id, seq.slot, start, tuple(seq.tokens[start : start + n]),
                    logits=start + n == len(seq.tokens),
                    rows=seq.prompt_rows and start < seq.n_prompt,
                    embd=tuple(e.shifted(-start) for e in seq.embd
                               if start <= e.at < start + n),
                    mrope=tuple(e for e in seq.embd if e.grid[0]))

    def _admit(self) -> None:
        while self.waiting and self.n_free:
            seq = self.waiting.popleft()
            slot, reach = self._pick_slot(seq)
            hit = min(reach, seq.n_prompt - 1)
            _take_scores(seq, slot.scores, 0, hit)
            slot.cached = slot.cached[:hit]
            slot.blocks = frozenset(b for b in slot.blocks if b[0] + b[1] <= hit)
            slot.seq_id = seq.seq_id
            seq.slot, seq.n_computed, seq.n_cached = slot.index, hit, hit
            self.running[seq.seq_id] = seq

    def _checkpoints(self, s: Slot) -> Tokens[int]:
        """The positions slot s's recurrent state was kept at (none without a model's)."""
        return self.checkpoints(s.index) if self.recurrent and self.checkpoints else ()

    def _pick_slot(self, seq: Sequence) -> tuple[Slot, int]:
        """The free slot whose cache reaches furthest into seq (`_reach`), and how far; on a
        tie the least recently used."""
        free = [(s, _reach(seq, self._holding(s), self.recurrent, self._checkpoints(s)))
                for s in self.slots if s.seq_id is None]
        return max(free, key=lambda f: (f[1], -f[0].last_used))

    # -- gauges --------------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        return sum(1 for s in self.slots if s.seq_id is None)

    @property
    def n_busy(self) -> int:
        return len(self.slots) - self.n_free

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cells_used(self) -> int:
        n = 0
        for s in self.slots:
            seq = None if s.seq_id is None else self.running.get(s.seq_id)
            n += len(s.cached) if seq is None else seq.n_computed
        return n
