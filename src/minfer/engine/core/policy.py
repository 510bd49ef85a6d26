"""The speculation policy: per step, whether and how many tokens to propose, and what a
proposal is.

`DraftLength` adapts k to what pays: it keeps the per-token acceptance rate (`Acceptance`) and
the measured costs (plain decode, verify of n rows, one drafted token) and picks the k, from a
few buckets (so the verify graphs stay in the graph cache), that maximises expected tokens per
second; k = 0 means plain decoding, probed again now and then. A proposal that carries its own
rate (prompt lookup rates each of its `COPY_KINDS`) is cut after it is made (`DraftLength.fit`).
Beside other streams (the server) `StepCost` caps k by what a proposed token costs the whole
batch, and `BatchPayoff` turns proposing off at a stream count where steps without proposals
measure faster. A draft model's stopping rule (`confident_top`, llama.cpp's --draft-p-min;
`fills_bucket`) is here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minfer.engine.speculative import DRAFT_MAX_LIMIT

# Verify shapes: proposals are cut down to one of these lengths, so a generation uses at most
# this many verify graphs besides the decode and prefill graphs. A verify forwards k + 1 rows:
# 2, 4, 8 or 16, whole passes of the integer dot kernels (8 rows per weight block, then 4, 2,
# 1). Measured on the 1.5B target (Intel SPR, 1 thread), relative to one row: 3 rows 1.52,
# 4 rows 1.29, 5 rows 1.71, 8 rows 2.16, 9 rows 2.55 -- four rows cost less than three.
BUCKETS = (1, 3, 7, 15)
# What a proposal must promise over a plain step's tokens a second to be made. The acceptance
# it is weighed at is a short moving average, which a lucky run of tokens lifts for a while;
# where drafting barely pays (prose, acceptance ~0.6, on a CPU whose verify rows are dear:
# AVX2, 2 rows ~1.3 plain steps) that drafted at a loss.
PAYS = 1.05


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


# -- a draft's stopping rule -----------------------------------------------------------------------
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
