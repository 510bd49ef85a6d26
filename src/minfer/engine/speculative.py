"""Speculative decoding's proposers: cheap guesses at the next tokens, and how many to ask for.

A proposer looks at the whole sequence so far (context, prompt and output, from position 0) and
proposes up to k tokens that might follow. The target model then verifies them all in one
forward (minfer.engine.core): decode is memory-bound, so k+1 rows cost about one. The proposers
themselves (prompt lookup, the draft model) are the core's (minfer.engine.core.proposer); this
module holds what they share with the flags and the CLI:

- `lookup` (`--lookup-ngram N`, prompt lookup): finds the latest earlier occurrence of the
  sequence's last N tokens (then N-1, ..., 1) and returns what followed it. A point-mass guess:
  free to make, right whenever the output copies the prompt (code edits, quotes). `follow`
  keeps its place in what the output copies (`CopyCursor`), so an edit that changes a few
  tokens of each copied line costs a token or two of proposals, not the rest of the line.
- a draft model's stopping rule (`confident_top`, llama.cpp's --draft-p-min; `fills_bucket`), and
  `open_draft` / `check_same_vocab`, which refuse a draft whose vocabulary is not the target's.

`DraftLength` adapts k to what pays: it keeps the per-token acceptance rate (`Acceptance`) and
the measured costs (plain decode, verify of n rows, one drafted token) and picks the k, from a
few buckets (so the verify graphs stay in the graph cache), that maximises expected tokens per
second; k = 0 means plain decoding, probed again now and then. A proposal that carries its own
rate (prompt lookup rates each of its `COPY_KINDS`) is cut after it is made (`DraftLength.fit`).
Beside other streams (the server) `StepCost` caps k by what a proposed token costs the whole
batch, and `BatchPayoff` turns proposing off at a stream count where steps without proposals
measure faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minfer.engine.draft_file import QUANTS as DRAFT_QUANTS
from minfer.engine.draft_file import draft_file
from minfer.errors import MinferError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

# Verify shapes: proposals are cut down to one of these lengths, so a generation uses at most
# this many verify graphs besides the decode and prefill graphs. A verify forwards k + 1 rows:
# 2, 4, 8 or 16, whole passes of the integer dot kernels (8 rows per weight block, then 4, 2,
# 1). Measured on the 1.5B target (Intel SPR, 1 thread), relative to one row: 3 rows 1.52,
# 4 rows 1.29, 5 rows 1.71, 8 rows 2.16, 9 rows 2.55 -- four rows cost less than three.
BUCKETS = (1, 3, 7, 15)
DRAFT_MAX_LIMIT = 16  # --draft-max's range (llama.cpp's default is 16; proposals stop at 15)
DRAFT_VOCAB = 65536  # --draft-vocab's default (see SpecConfig.draft_vocab)
# What a proposal must promise over a plain step's tokens a second to be made. The acceptance
# it is weighed at is a short moving average, which a lucky run of tokens lifts for a while;
# where drafting barely pays (prose, acceptance ~0.6, on a CPU whose verify rows are dear:
# AVX2, 2 rows ~1.3 plain steps) that drafted at a loss.
PAYS = 1.05


class SpeculativeError(MinferError):
    """Speculative decoding that cannot run as asked (mismatched draft vocabulary, bad flags)."""


@dataclass(frozen=True)
class SpecConfig:
    """llama.cpp's flags: --draft-max, --draft-min, --draft-p-min; and --lookup-ngram."""

    draft_max: int = 16  # most tokens proposed per step
    draft_min: int = 0  # a proposal shorter than this is dropped (plain step instead)
    p_min: float = 0.3  # the draft model stops when its top probability is below this
    lookup_ngram: int = 0  # prompt lookup's longest n-gram (0: off)
    # the draft model's logits over the vocabulary's first N ids only (0: all): a cheaper draft
    # step (its output projection is a large part of a small model); a target token beyond N
    # can then not be proposed, only verified. Exactness is untouched either way. 65536:
    # 1.5B target, 0.5B draft, free code, 3 runs side by side with the whole vocabulary:
    # 1.28-1.82x plain against 1.08-1.61x (Intel SPR, 2 threads); a no-op below 65536 ids.
    draft_vocab: int = DRAFT_VOCAB
    # the draft's weights narrowed to Q4_0 when its file's are wider ("keep": the file as it
    # is): a cheaper draft step, the output unchanged (minfer.engine.draft_file)
    draft_quant: str = "q4_0"
    adaptive: bool = True  # choose k by measured cost and acceptance (else always draft_max)

    def __post_init__(self) -> None:
        if not 1 <= self.draft_max <= DRAFT_MAX_LIMIT:
            raise SpeculativeError(f"--draft-max must be in 1..{DRAFT_MAX_LIMIT}, "
                                   f"got {self.draft_max}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise SpeculativeError(f"--draft-min must be in 0..--draft-max, got {self.draft_min}")
        if self.draft_vocab < 0:
            raise SpeculativeError(f"--draft-vocab must be >= 0, got {self.draft_vocab}")
        if self.draft_quant not in DRAFT_QUANTS:
            raise SpeculativeError(f"--draft-quant must be one of {', '.join(DRAFT_QUANTS)}, "
                                   f"got {self.draft_quant!r}")
        if not 0.0 <= self.p_min <= 1.0:
            raise SpeculativeError(f"--draft-p-min must be in [0, 1], got {self.p_min}")
        if self.lookup_ngram < 0:
            raise SpeculativeError(f"--lookup-ngram must be >= 0, got {self.lookup_ngram}")


@dataclass
class Proposal:
    tokens: list[int]
    # q for each token when it was drawn from a distribution (dense [n_vocab] probabilities);
    # None: each token is a point-mass guess (prompt lookup, a greedy draft)
    q: list[np.ndarray] | None = None
    # the proposer's own per-token acceptance estimate for this proposal (prompt lookup: that of
    # its kind of guess); None: the sequence's DraftLength rate applies (see DraftLength.fit)
    rate: float | None = None

    def cut(self, n: int) -> Proposal:
        return Proposal(self.tokens[:n], None if self.q is None else self.q[:n], self.rate)


@dataclass
class SpecStats:
    """Counts of one generation (or a server slot's lifetime)."""

    steps: int = 0  # target forwards that carried proposals
    drafted: int = 0  # tokens proposed and verified
    accepted: int = 0  # proposed tokens the target kept

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.acceptance, 4), "verify_steps": self.steps}


# -- prompt lookup -------------------------------------------------------------------------------
def lookup(seq: np.ndarray, max_n: int, k: int, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of seq's last n tokens, longest n
    first (down to min_n): the latest occurrence with k tokens after it, else the earliest (the
    most after it)."""
    start = _lookup_start(seq, max_n, k, min_n)
    return [] if start is None else [int(t) for t in seq[start:start + k]]


# Where a copy re-synchronises after an edit: n-gram matches ending up to RESYNC_AHEAD tokens
# after the divergence point (or RESYNC_BACK before it), nearest first; a one-token match only
# within RESYNC_NEAR. A rewrite copies its source in order: it resumes within a line or two.
RESYNC_AHEAD = 128
RESYNC_BACK = 4
RESYNC_NEAR = 16
# The most new tokens an edit may put in place of one source token (a renamed identifier: one
# to three) before the copy is given up for the plain lookup.
SUBSTITUTION_MAX = 4
# The situations `follow` proposes in (`CopyCursor.kind`), which are right at very different
# rates, so prompt lookup measures each apart (minfer.engine.core.proposer): "copy" goes on
# with a copy whose last tokens held; "guess" takes the token after an edit's first token for
# a substitution; "resync" resumes a copy after an insertion or deletion; "lookup" is the
# plain n-gram lookup; "repeat" is that lookup made across an edit (below). On a code edit
# that inserts type hints, copies are right at ~0.9 a token and guesses inside the inserted
# text near 0: one rate for both stops proposing through whole copied lines after each
# signature, or verifies rows wasted on each hint.
COPY_KINDS = ("copy", "guess", "resync", "lookup", "repeat")
# Across an edit ("guess", "resync") the output may be writing new text it wrote before (a type
# hint again, the same added argument): prompt lookup then also proposes what followed the
# latest earlier occurrence of the last REPEAT_MIN_N or more tokens ("repeat"), and of the two
# proposals makes the one whose kind is right more often. One-token matches are too loose here.
REPEAT_KINDS = ("guess", "resync")
REPEAT_MIN_N = 2


@dataclass
class CopyCursor:
    """Prompt lookup's memory of one sequence. Its last proposal said that the sequence's
    token `length` onwards copies the source from position `source` (an earlier part of the
    sequence) with `edits` applied; `origin`: when that proposal was a guess across an edit,
    the source position the copy diverged at (the output's tokens from `since` on replaced
    it). `edits`: substitutions seen so far, a source token -> the tokens the output put in
    its place (a rename, a changed quote), applied to every later copy of that token."""

    length: int
    source: int
    origin: int | None = None
    since: int = 0
    edits: dict[int, tuple[int, ...]] = field(default_factory=dict)
    offset: int = 0  # the proposal began at token `offset` of source's edit
    kind: str = "lookup"  # the last proposal's situation: one of COPY_KINDS


def follow(seq: np.ndarray, cursor: CopyCursor | None, max_n: int,
           k: int) -> tuple[list[int], CopyCursor | None]:
    """Prompt lookup that follows a copy through edits: up to k tokens after seq, and the
    cursor to pass with the next call (the same sequence, grown by the tokens accepted and
    the target's own next token).

    A rewrite of the prompt (rename a variable, change the quotes, add an argument, drop a
    line) copies its source in order, and the plain n-gram lookup loses its place at each
    change: the changed tokens' n-grams are nowhere in the source, and a short n-gram matches
    all over it. So the cursor remembers where in the source the copy stands. While the new
    tokens equal the source from there on (with the edits learnt so far), the copy goes on.
    At a difference, the copy resumes at the nearest match of the last tokens after that point
    (`_resync`: after an insertion or a deletion), or, at the edit's first token, at the
    latest match of the last N tokens anywhere (the copy was placed wrong); failing those, the
    difference is taken for a substitution of that one source token and the source after it
    is proposed; once the copy goes on after it, the substitution is learnt as an edit. A
    learnt edit the output does not make again is forgotten. Without a cursor, or when the
    copy is lost, the plain `lookup` (latest occurrence of the longest n-gram)."""
    size = seq.shape[0]
    edits = cursor.edits if cursor is not None else {}
    if cursor is not None and cursor.source < cursor.length < size:
        p, j, i = cursor.source, cursor.offset, cursor.length
        while i < size:
            expected = _expected(seq, p, edits)
            if seq[i] == expected[j]:
                i, j = i + 1, j + 1
                if j == len(expected):
                    p, j = p + 1, 0
            elif j == 0 and seq[i] == seq[p]:  # a learnt edit (expected) not made here
                del edits[int(seq[p])]
                i, p = i + 1, p + 1
            else:
                break
        guessing = cursor.origin is not None
        if guessing and i > cursor.length:  # the guess held: learn the substitution
            assert cursor.origin is not None
            made = tuple(int(t) for t in seq[cursor.since:cursor.length])
            if 0 < len(made) <= SUBSTITUTION_MAX:
                edits[int(seq[cursor.origin])] = made
        if i == size:  # every new token copied the source: go on copying
            if p < size - 1:
                return _copy(seq, p, j, k, edits, kind="copy")
        else:
            again = guessing and i == cursor.length
            origin = cursor.origin if again and cursor.origin is not None else p
            since = cursor.since if again else i
            found = _resync(seq, origin, max_n, strong=True)
            if found is None and not again:  # the copy's place was wrong: a whole n-gram's
                found = _lookup_start(seq, max_n, k, min_n=max_n)  # match elsewhere
            if found is None and origin + 1 < size - 1 and size - since <= SUBSTITUTION_MAX:
                return _copy(seq, origin + 1, 0, k, edits, origin, since, kind="guess")
            if found is None:
                found = _resync(seq, origin, max_n, strong=False)
            if found is not None:
                return _copy(seq, found, 0, k, edits, kind="resync")
    start = _lookup_start(seq, max_n, k)
    if start is None:
        return [], CopyCursor(size, size, edits=edits) if edits else None
    return _copy(seq, start, 0, k, edits)


def _expected(seq: np.ndarray, p: int, edits: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    """The tokens a copy of source position p puts out: the learnt edit of its token, or it."""
    t = int(seq[p])
    return edits.get(t, (t,))


def _copy(seq: np.ndarray, p: int, j: int, k: int, edits: dict[int, tuple[int, ...]],
          origin: int | None = None, since: int = 0, *,
          kind: str = "lookup") -> tuple[list[int], CopyCursor]:
    """Up to k tokens of the source from position p (token j of its edit), edits applied."""
    size, out = seq.shape[0], list[int]()
    q, skip = p, j
    while len(out) < k and q < size:
        out.extend(_expected(seq, q, edits)[skip:skip + k - len(out)])
        q, skip = q + 1, 0
    return out, CopyCursor(size, p, origin, since, edits, offset=j, kind=kind)


def _resync(seq: np.ndarray, origin: int, max_n: int, *, strong: bool) -> int | None:
    """Where the copy resumes after an edit at source position `origin`: the end e of an
    earlier match of seq's last tokens, e from origin - RESYNC_BACK to origin + RESYNC_AHEAD.
    strong: a match of the last two tokens or more (of max_n), the nearest after origin, else
    the nearest before it; otherwise a one-token match within RESYNC_NEAR after origin (a
    common token matches all over). None: no such match."""
    size = seq.shape[0]
    lo = max(1, origin - RESYNC_BACK)
    hi = min(size - 1, origin + (RESYNC_AHEAD if strong else RESYNC_NEAR))
    if lo >= hi:  # an end e < size - 1: seq[e] is proposed
        return None
    ends = np.arange(lo, hi)
    matched = np.zeros(ends.size, dtype=np.int64)  # trailing tokens equal, up to max_n
    live = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, size - 1) + 1):
        live &= (ends >= j) & (seq[np.maximum(ends - j, 0)] == seq[size - j])
        matched[live] = j
    hits = ends[matched >= min(2, max_n)] if strong else ends[(matched >= 1) & (ends >= origin)]
    if not hits.size:
        return None
    after = hits[hits >= origin]
    return int(after[0] if after.size else hits[-1])


def _lookup_start(seq: np.ndarray, max_n: int, k: int, min_n: int = 1) -> int | None:
    """Where `lookup`'s proposal starts in seq (None: no n-gram of min_n tokens or more
    matched)."""
    size = seq.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [size - n, n]
        hits = np.flatnonzero((windows == seq[size - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= size]
            return int(full[-1] if full.size else hits[0]) + n
    return None


# -- draft model ---------------------------------------------------------------------------------
def fills_bucket(n_drafted: int) -> bool:
    """Whether a greedy draft stopped by p_min after n_drafted tokens adds its unsure top token
    anyway: when that completes a verify bucket of 3, 7 or 15 proposals. Those logits are
    computed already, so the token costs no draft forward; without it the proposal would be
    cut to the bucket below (2 -> 1), throwing away a drafted token that passed p_min. The
    verify grows by one bucket (1.5B target, Intel SPR: 4 rows about 1.25x the cost of 2) for
    the kept token plus a chance at the unsure one."""
    return n_drafted + 1 in BUCKETS[1:]


def confident_top(logits: np.ndarray, p_min: float) -> int | None:
    """argmax of logits, or None when its softmax probability is below p_min (a greedy
    draft's stopping rule, llama.cpp's --draft-p-min)."""
    x = np.asarray(logits, dtype=np.float64)
    top = int(np.argmax(x))
    p_top = 1.0 / float(np.exp(x - x[top]).sum())
    return top if p_top >= p_min else None


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp((logits - logits.max()).astype(np.float64))
    out: np.ndarray = e / e.sum()
    return out


def open_draft(path: Path, target_tokens: Sequence[str], target_n_vocab: int,
               quant: str = "q4_0") -> tuple[GGUFFile, HParams]:
    """A draft model's file (its weights narrowed to `quant` when wider: `draft_file`) and
    hyper-parameters, refused unless its vocabulary is the target's (`check_same_vocab`)."""
    f = GGUFFile.open(draft_file(path, quant))
    hparams = HParams.from_gguf(f)
    check_same_vocab(target_tokens, list(f.metadata.get("tokenizer.ggml.tokens") or ()),
                     target_n_vocab=target_n_vocab, draft_n_vocab=hparams.n_vocab)
    return f, hparams


def check_same_vocab(target: Sequence[str], draft: Sequence[str], *, target_n_vocab: int,
                     draft_n_vocab: int) -> None:
    """Refuse a draft model whose token list or logit width differs from the target's."""
    if target_n_vocab != draft_n_vocab or len(target) != len(draft):
        raise SpeculativeError(
            f"the draft model's vocabulary does not match the target's ({len(draft)} tokens, "
            f"{draft_n_vocab} logits vs {len(target)} tokens, {target_n_vocab} logits): "
            "use a draft model of the same family")
    for i, (a, b) in enumerate(zip(target, draft, strict=True)):
        if a != b:
            raise SpeculativeError(
                f"the draft model's vocabulary does not match the target's: token {i} is "
                f"{b!r} in the draft, {a!r} in the target")


# -- how many to propose -------------------------------------------------------------------------
@dataclass
class Warmups:
    """The kinds of step timed once already. The first step of a kind (a verify of n rows, a
    batch of R rows) builds its graph and may compile: its time says nothing of later ones."""

    seen: set[object] = field(default_factory=set)

    def first(self, kind: object) -> bool:
        """Whether this is the first time of `kind` (then it is seen from now on)."""
        if kind in self.seen:
            return False
        self.seen.add(kind)
        return True


@dataclass
class Acceptance:
    """A moving estimate of how often proposed tokens are right. The model is geometric: each
    token right with probability `rate` given those before it were."""

    accepted_avg: float = 0.7  # moving averages of accepted tokens and of trials per record
    trials_avg: float = 1.0
    proposed_avg: float = 1.0  # moving average of tokens proposed per record (`kept_share`)
    alpha: float = 0.2

    @property
    def rate(self) -> float:
        return self.accepted_avg / self.trials_avg

    def record(self, n_proposed: int, n_accepted: int) -> None:
        """n_accepted successes, then one failure unless all n_proposed passed. The rate is the
        ratio of the moving averages of successes and trials (for acceptance that is the same
        at every token, their expected ratio is the rate; an average of per-step ratios is not:
        0.68 for a rate of 0.8 at k = 3, each step counting alike whether it tried one token or
        three). A proposal seen only in part (the tokens that followed it so far, all right)
        is recorded as that many proposed: the estimate stays unbiased."""
        if n_proposed:
            trials = n_accepted + (n_accepted < n_proposed)
            a = self.alpha
            self.accepted_avg = (1.0 - a) * self.accepted_avg + a * n_accepted
            self.trials_avg = (1.0 - a) * self.trials_avg + a * trials
            self.proposed_avg = (1.0 - a) * self.proposed_avg + a * n_proposed

    @property
    def kept_share(self) -> float:
        """The share of proposed tokens kept. Below `rate` when drafts are wholly right or wrong
        at their first token (a 15-token draft rejected at once is one failed trial but 15
        tokens of verify rows): what a batch's rows pay for (`StepCost.draft_cap`)."""
        return self.accepted_avg / self.proposed_avg


@dataclass
class DraftLength:
    """Chooses k per step from measured costs and the acceptance rate (see module docstring)."""

    draft_max: int = 16
    adaptive: bool = True
    acceptance: Acceptance = field(default_factory=Acceptance)  # of the proposals verified
    decode_s: float = 0.0  # EMA of a plain one-token forward
    verify_s: dict[int, float] = field(default_factory=dict)  # n_tokens -> EMA seconds
    draft_token_s: float = 0.0  # EMA of the proposer's cost per proposed token
    idle_steps: int = 0  # plain steps since k was last > 0
    probe_every: int = 16
    plain_every: int = 64  # a plain step this often keeps its price current (`_plain_due`)
    n_steps: int = 0  # choices made
    alpha: float = 0.2
    warmups: Warmups = field(default_factory=Warmups)  # kinds of step timed once
    rated: bool = False  # proposals carry their own rate: `fit` cuts them, `choose` asks the most

    @property
    def accept_rate(self) -> float:
        """P(a proposed token is accepted), from the proposals verified (`record_outcome`)."""
        return self.acceptance.rate

    def choose(self, room: int, *, rated_asks_most: bool = True) -> int:
        """k for the next step (0: plain decode); at most `room` and draft_max. For a proposer
        that rates its own proposals, the most (`fit` then cuts each by its rate), unless
        `rated_asks_most` is False (a proposer that sizes its rated proposals itself and asks
        a draft model for the k chosen here: `HybridProposer`)."""
        limit = min(room, self.draft_max)
        options = [b for b in BUCKETS if b <= limit]
        if not options:
            return 0
        if not self.adaptive:
            return options[-1]
        self.n_steps += 1
        if self._plain_due():
            return 0
        if self.rated and rated_asks_most:
            return options[-1]
        best_k = self._best(options)
        if best_k == 0:
            self.idle_steps += 1
            if self.idle_steps >= self.probe_every:  # look again: the text may have changed
                self.idle_steps = 0
                return options[min(1, len(options) - 1)]
        else:
            self.idle_steps = 0
        return best_k

    def _plain_due(self) -> bool:
        """Whether this step decodes plainly to price plain decoding. Without a measured plain
        step a proposal is weighed against the cheapest verify (a 1.5B target on Intel SPR:
        62 ms against a plain 50), which keeps a poor proposer (prose, acceptance 0.69)
        drafting at 0.95x plain. So from the fourth step on, plain steps until one is measured
        (the first is a warm-up), then one in `plain_every`, as the machine's load drifts."""
        if not self.decode_s:
            return self.n_steps >= 4
        return self.n_steps % self.plain_every == 0

    def fit(self, proposal: Proposal) -> int:
        """How many of a proposal's tokens to verify: a bucket, or 0 (a plain step pays more).
        A proposal with its own rate (prompt lookup's, per kind of guess) is cut to the length
        that pays most at that rate; any other to the largest bucket in it (its length was
        chosen, by `choose`, before it was made)."""
        n = bucket_floor(len(proposal.tokens))
        if proposal.rate is None or not self.adaptive:
            return n
        self.rated = True
        return self._best([b for b in BUCKETS if b <= n], proposal.rate)

    def _best(self, options: list[int], accept: float | None = None) -> int:
        """The k of `options` (or 0, a plain step) with the most expected tokens per second at
        per-token acceptance `accept` (None: the measured rate); the shortest on a tie. A
        proposal must promise PAYS times a plain step's rate (see there)."""
        best_k, best_rate = 0, self.step_rate(0) * PAYS
        for k in options:
            rate = self.step_rate(k, accept)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def step_rate(self, k: int, accept: float | None = None, token_s: float | None = None
                  ) -> float:
        """Expected tokens per second of a step proposing k at per-token acceptance `accept`
        (None: the measured rate; unknown costs: optimistic), each proposed token costing
        `token_s` seconds to make (None: the proposer's measured cost). A proposer with two
        kinds of guess (`HybridProposer`) weighs one against the other with it."""
        # a plain step, unmeasured yet, costs about the cheapest verify (decode is memory-bound)
        base = self.decode_s or min(self.verify_s.values(), default=1.0)
        if k == 0:
            return 1.0 / base
        made = self.draft_token_s if token_s is None else token_s
        tokens = step_tokens(self.accept_rate if accept is None else accept, k)
        return tokens / (self._verify_cost(k + 1, base) + k * made)

    def _verify_cost(self, n: int, base: float) -> float:
        """A verify of n rows: measured, else a prior. The prior starts from the largest
        measured verify below n (else a plain step) and adds the rows beyond it at a quarter of
        that verify's cost per row, capped by any measured larger verify. Rows are not free: on
        a CPU a verify of 8 or 16 rows is compute-bound (1.5B target, Intel SPR: 16 rows cost
        5x a plain step), and a free-rows prior sent the first steps of every generation to
        the largest bucket. A quarter still lets a length be tried once acceptance is high."""
        if n in self.verify_s:
            return self.verify_s[n]
        below = max((m for m in self.verify_s if m < n), default=1)
        prior = self.verify_s.get(below, base) * (1.0 + 0.25 * (n / below - 1.0))
        return min([prior, *(s for m, s in self.verify_s.items() if m > n)])

    def record_plain(self, seconds: float) -> None:
        if not self.warmups.first("plain"):
            self.decode_s = _ema(self.decode_s, seconds, self.alpha)

    def record_verify(self, n_tokens: int, seconds: float) -> None:
        if not self.warmups.first(f"verify{n_tokens}"):
            self.verify_s[n_tokens] = _ema(self.verify_s.get(n_tokens, 0.0), seconds, self.alpha)

    def record_proposal(self, k: int, seconds: float) -> None:
        """The proposer took `seconds` when asked for k tokens (it may have given fewer)."""
        if k and not self.warmups.first("propose"):
            self.draft_token_s = _ema(self.draft_token_s, seconds / k, self.alpha)

    def record_outcome(self, n_proposed: int, n_accepted: int) -> None:
        """A verify of n_proposed tokens kept n_accepted (see `Acceptance.record`)."""
        self.acceptance.record(n_proposed, n_accepted)

    @property
    def kept_share(self) -> float:
        """The share of proposed tokens kept (see `Acceptance.kept_share`)."""
        return self.acceptance.kept_share


@dataclass
class StepCost:
    """What a forward of R rows costs the whole batch: T(R) = fixed + per_row * R, fitted by
    least squares over recent steps (weights decaying by `decay` a step). A server's decode
    step streams the weights once (the fixed part) and computes every row (the per-row part):
    with one stream it is memory-bound and a verify row costs little; with 16 it is
    compute-bound and each extra row costs every stream about a row's time.

    `draft_cap` turns that into the batch's limit on a sequence's proposal. With n streams
    each proposing, the j-th proposed token of every stream costs the batch n verify rows
    (n * per_row) and one batched draft step (`draft_step_s`, every stream waits for it), and
    gains n * p tokens where p is a token's chance of being kept, each worth T(n) / n seconds
    of a plain step: it pays only while kept ** j > share = (n * per_row + draft_step_s) / T(n),
    kept being the share of proposed tokens kept (`DraftLength.kept_share`; `DraftLength`
    then weighs the request's own costs below that cap).
    Until the fit has seen rows vary (`MIN_STEPS` steps) there is no cap."""

    decay: float = 0.97
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wR, wT, wRR, wRT
    steps: int = 0
    fixed: float = 0.0
    per_row: float = 0.0
    draft_step_s: float = 0.0  # EMA of one batched draft step (0 for a free proposer)
    warmups: Warmups = field(default_factory=Warmups)  # row counts timed once

    MIN_STEPS = 8

    def record(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds`; the first of each row count is not counted
        (it builds that shape's graph, and may compile)."""
        if self.warmups.first(rows):
            return
        d = self.decay
        w, wr, wt, wrr, wrt = (d * v for v in self.sums)
        self.sums = [w + 1.0, wr + rows, wt + seconds, wrr + rows * rows, wrt + rows * seconds]
        self.steps += 1
        w, wr, wt, wrr, wrt = self.sums
        det = w * wrr - wr * wr
        if det > 1e-9 * w * w:  # rows varied: both parts identifiable
            self.per_row = max(0.0, (w * wrt - wr * wt) / det)
            self.fixed = max(0.0, (wt - self.per_row * wr) / w)

    def record_proposal(self, draft_steps: int, seconds: float) -> None:
        """The proposer took `seconds` for proposals of at most `draft_steps` tokens."""
        if draft_steps > 0:
            self.draft_step_s = _ema(self.draft_step_s, seconds / draft_steps, 0.2)

    def share(self, n_streams: int) -> float:
        """What one more proposed token for every stream costs the batch, as a share of a
        plain step of n_streams rows (0: unknown)."""
        if self.steps < self.MIN_STEPS or not self.per_row:
            return 0.0
        rows_time = self.per_row * n_streams
        return (rows_time + self.draft_step_s) / (self.fixed + rows_time)

    def draft_cap(self, n_streams: int, kept: float) -> int:
        """The most tokens a sequence should propose beside n_streams - 1 others (at most
        DRAFT_MAX_LIMIT: no cap)."""
        share = self.share(n_streams)
        if share <= 0.0:
            return DRAFT_MAX_LIMIT
        a = min(max(kept, 1e-6), 0.999)
        if share >= 1.0 or a <= share:
            return 0
        return min(DRAFT_MAX_LIMIT, int(np.log(share) / np.log(a)))


@dataclass
class BatchPayoff:
    """Whether proposing pays for a batch of n decoding streams, as measured: the tokens a
    step yields per second of the step (proposals included), in steps with proposals and in
    plain ones, per stream-count class (2-3, 4-7, 8-15, 16 and more; one stream is its
    DraftLength's to decide). Where both are known and the plain steps yield more, no stream
    proposes, except one step in `probe_every` of that class, which drafts again to keep the
    comparison fresh (and while drafting, one in `probe_every` is plain). The cost model
    (`StepCost.draft_cap`) prices each proposal; this checks the result, so that a draft model
    never lowers a busy server's throughput by what the model leaves out (catch-up forwards,
    acceptance that is not geometric)."""

    alpha: float = 0.2
    probe_every: int = 16
    draft_rate: dict[int, float] = field(default_factory=dict)
    plain_rate: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def kind(n_streams: int) -> int:
        """The class of a stream count: 2, 4, 8 or 16 (0: one stream, not judged here)."""
        return 0 if n_streams < 2 else min(16, 1 << (n_streams.bit_length() - 1))

    def propose(self, n_streams: int) -> bool:
        """Whether this step's streams may propose (counts the step)."""
        k = self.kind(n_streams)
        if not k:
            return True
        n = self.steps.get(k, 0) + 1
        self.steps[k] = n
        probe = n % self.probe_every == 0
        d, p = self.draft_rate.get(k), self.plain_rate.get(k)
        if d is None or p is None:  # not both measured: draft, with a plain step as a probe
            return not (probe and p is None and d is not None)
        return (d >= p) != probe

    def record(self, n_streams: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step of n_streams yielded `tokens` in `seconds` (proposals included)."""
        k = self.kind(n_streams)
        if not k or seconds <= 0.0:
            return
        rates = self.draft_rate if drafted else self.plain_rate
        rates[k] = _ema(rates.get(k, 0.0), tokens / seconds, self.alpha)


def _ema(old: float, new: float, alpha: float) -> float:
    """Exponential moving average; one sample counts for at most 3x the average (a stall of
    the machine, a graph rebuild) so it cannot lock a length out for long."""
    return new if old == 0.0 else (1.0 - alpha) * old + alpha * min(new, 3.0 * old)


def step_tokens(accept: float, k: int) -> float:
    """Expected tokens a step proposing k yields, each proposed token right with probability
    `accept` given those before it were, the target's own token included: 1 + accept + ... +
    accept^k."""
    a = min(accept, 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def bucket_floor(n: int) -> int:
    """The largest verify bucket <= n (0 when n < 1)."""
    return max((b for b in BUCKETS if b <= n), default=0)
