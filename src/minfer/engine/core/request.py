"""One request's state in the core: logits rows in, drawn tokens and text out.

A `Request` steps its sequence with `TokenStepper` (grammar, end-of-generation, stop strings on
the byte stream, incremental UTF-8), adds the request's limits, logprobs (log-softmax of the raw
logits, before any sampler stage) and raw top logits when asked, and keeps the record a caller
reads at the end: the ids, the timings, the speculation counts and why it ended. With proposals
the draw is `Verifier`'s: a proposed token is kept or replaced so that the output is exactly the
target's (greedy: token for token; sampled: in distribution).

Why a request ends (`finish`): "eos" (an end-of-generation id, never shown), "stop" (a stop
string), "grammar" (the grammar allows no further token: the text so far is a valid prefix; the
check is also made right after each accepted token, so a finished grammar costs no extra
forward), "length" (max_tokens, or `t_max_predict_ms` passed at a newline), "context" (the next
token would pass the slot's context).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from minfer.engine.core.policy import DraftLength, SpecStats
from minfer.engine.stepper import Constraint, Step, TokenSampler, TokenStepper, TokenText

if TYPE_CHECKING:
    from minfer.sampling.sampler import Sampler

Vocab = TokenText  # what a Request needs of the tokenizer


@dataclass(frozen=True)
class Piece:
    """Text that became safe to show, and the token that completed it."""

    text: str
    token_id: int


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    sample_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "prefill_tokens_per_s": _rate(self.prefill_tokens, self.prefill_s),
            "decode_tokens_per_s": _rate(self.decode_tokens, self.decode_s),
        }


def _rate(n: int, s: float) -> float:
    return n / s if s > 0 else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob), most likely first (ties: the lower id first)

    def upto(self, k: int) -> TokenLogprob:
        """The same score with at most k alternatives: what `log_softmax_top` gives for k (its
        order is total, so a smaller k's alternatives are a prefix of a larger k's)."""
        return self if len(self.top) <= k else TokenLogprob(self.token_id, self.logprob,
                                                            self.top[:k])


@dataclass(frozen=True)
class PromptRows:
    """Embedding rows given for prompt tokens [at, at + n) (an image's), in place of theirs;
    the block is computed in one forward, its rows reading each other both ways (Gemma 3's) or
    causally as text (`causal`: Idefics3's, as llama.cpp's mtmd decodes them). `grid` (rows,
    cols): an M-RoPE image's merged tokens (Qwen3-VL; `mrope_positions`), (0, 0) otherwise."""

    at: int
    rows: np.ndarray  # [n, n_embd] float32
    causal: bool = False
    grid: tuple[int, int] = (0, 0)

    @property
    def n(self) -> int:
        return int(self.rows.shape[0])

    @property
    def n_pos(self) -> int:
        """Rope positions the block takes: max(rows, cols) for an M-RoPE image (mtmd's
        `mtmd_image_tokens_get_n_pos`), else one per row."""
        return max(self.grid) if self.grid[0] else self.n

    def shifted(self, by: int) -> PromptRows:
        return PromptRows(self.at + by, self.rows, self.causal, self.grid)

    @cached_property
    def key(self) -> bytes:
        """What the block's cells depend on besides its place: a digest of its rows, how they
        attend and its grid (the same image, encoded by the same projector, has the same key)."""
        h = hashlib.blake2b(np.ascontiguousarray(self.rows).tobytes(), digest_size=16)
        h.update(f"{self.causal}{self.grid}{self.rows.shape}".encode())
        return h.digest()


# a block of given rows some cells hold: (its first token, its rows, `PromptRows.key`)
Block = tuple[int, int, bytes]


def held_blocks(blocks: Sequence[PromptRows], n: int) -> frozenset[Block]:
    """The blocks among the first n tokens, as cells that computed those tokens hold them."""
    return frozenset((e.at, e.n, e.key) for e in blocks if e.at + e.n <= n)


def reach_past_blocks(blocks: Sequence[PromptRows], common: int,
                      held: frozenset[Block]) -> int:
    """How much of a common token prefix of `common` cells serves a sequence with these blocks
    (in order): up to the first block before `common` that the cells do not hold whole and the
    same (equal placeholder ids stand for different images), else all of it."""
    for e in blocks:
        if e.at >= common:
            break
        if e.at + e.n > common or (e.at, e.n, e.key) not in held:
            return e.at
    return common


def mrope_positions(blocks: Sequence[PromptRows], start: int, n: int) -> np.ndarray:
    """[4, n] int32 t / h / w / e rope positions of a sequence's rows [start, start + n), its
    M-RoPE image blocks at `at` from the sequence's row 0, as llama.cpp's mtmd gives them: an
    image at rope position p has its token (y, x) at (p, p + y, p + x, 0) and the row after it at
    p + max(rows, cols); a text row's position, thrice, then 0."""
    rows = np.arange(start, start + n, dtype=np.int64)
    shift = np.zeros(n, np.int64)  # rows taken minus rope positions taken, by the blocks before
    out = np.zeros((4, n), np.int64)
    inside = np.zeros(n, bool)
    taken = 0
    for b in sorted(blocks, key=lambda b: b.at):
        in_b = (rows >= b.at) & (rows < b.at + b.n)
        if b.grid[0] and in_b.any():
            p = b.at - taken
            y, x = np.divmod(rows[in_b] - b.at, b.grid[1])
            out[0, in_b], out[1, in_b], out[2, in_b] = p, p + y, p + x
            inside |= in_b
        taken += b.n - b.n_pos
        shift[rows >= b.at + b.n] = taken
    text = rows - shift
    out[:3, ~inside] = text[~inside]
    return out.astype(np.int32)


@dataclass
class GenRequest:
    prompt: list[int]  # the whole sequence from position 0 (a chat's KV rows first)
    max_tokens: int
    sampler: TokenSampler
    stops: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: off; k: the chosen token plus k alternatives
    constraint: Constraint | None = None  # the sampler's grammar mask, if any
    top_logits: int = 0  # k > 0: the k largest raw logits of every draw (`Request.tops`)
    # > 0: once this many ms passed since the first token, end at the next newline (llama.cpp's
    # t_max_predict_ms, for editor completions that should not run on)
    t_max_predict_ms: int = 0
    # None: off; k: each prompt token after the first scored as `logprobs` scores a draw
    # (`Request.prompt_logprobs`; a cached prefix is taken only with the scores of its tokens)
    prompt_logprobs: int | None = None
    # rows given for some prompt tokens (images), in prompt order
    embd: tuple[PromptRows, ...] = ()


@dataclass(frozen=True)
class Emitted:
    """One token drawn in a step (an end-of-generation id included), and what it showed."""

    token: int
    text: str
    logprob: TokenLogprob | None = None


def log_softmax_top(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """log-softmax of the raw logits at token, and the k most likely ids with theirs (ties in
    id order: the same k ids however they came, and a smaller k's a prefix of them)."""
    x = np.asarray(logits, dtype=np.float32)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum(dtype=np.float64)))
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, x.shape[0])
        kth = np.partition(x, x.shape[0] - k)[x.shape[0] - k]
        idx = np.flatnonzero(x >= kth)  # the k largest, and any tied with the k-th
        idx = idx[np.argsort(-x[idx], kind="stable")][:k]
        top = [(int(i), float(x[i]) - lse) for i in idx]
    return TokenLogprob(token, float(x[token]) - lse, top)


def top_k_pairs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    idx = np.argpartition(logits, -k)[-k:]
    idx = idx[np.argsort(-logits[idx], kind="stable")]
    return [(int(i), float(logits[i])) for i in idx]


class Verifier:
    """Draws a position's token, deciding on the proposal there.

    - greedy (temp 0): the stepper's own draw; the proposal is kept iff it is that token;
    - sampling: kept with probability min(1, p(d) / q(d)), p the sampler chain's distribution
      (`Sampler.distribution`), q the proposer's (None: a point mass); a rejection draws from
      normalise(max(0, p - q)) (Leviathan et al. 2023, Chen et al. 2023);
    - mirostat or a sampler without `distribution`: drawn as usual, kept iff it is that token.
    """

    def __init__(self, stepper: TokenStepper, sampler: Any) -> None:
        self.stepper = stepper
        self.sampler = sampler
        self.greedy = bool(getattr(sampler, "greedy", True))
        # accept/reject needs the distribution; without one (mirostat, whose distribution moves
        # with its own draws, or a foreign sampler) the token is drawn as usual and the proposal
        # kept iff it is that token: exact as well (each emitted token is one ordinary draw, so
        # a seed gives plain decoding's output), only accepted less often
        self.accept_reject = (not self.greedy and hasattr(sampler, "distribution")
                              and getattr(sampler, "mirostat", None) is None)

    def step(self, logits: np.ndarray, proposed: int | None, q: np.ndarray | None) -> Step:
        if proposed is None or not self.accept_reject or self.stepper.grammar_done():
            return self.stepper.step(logits)
        s: Sampler = self.sampler
        ids, probs = s.distribution(logits)
        hit = np.flatnonzero(ids == proposed)
        p_d = float(probs[hit[0]]) if hit.size else 0.0
        q_d = 1.0 if q is None else float(q[proposed])
        if q_d > 0.0 and s.random() < min(1.0, p_d / q_d):
            return self.stepper.commit(proposed)
        residual = probs.astype(np.float64)
        if q is None:
            residual[hit] = 0.0  # p - (point mass at d), clipped at 0
        else:
            residual = np.maximum(residual - q[ids], 0.0)
        if not residual.sum() > 0.0:  # p == q: nothing is left over, draw from p
            residual = probs.astype(np.float64)
        return self.stepper.commit(int(ids[s.choose(residual)]))


class Request:
    """Sampling, limits and the record of one running request (the core's thread only)."""

    def __init__(self, req: GenRequest, vocab: Vocab, *, n_ctx_slot: int,
                 length: DraftLength | None = None) -> None:
        self.req = req
        self.n_ctx_slot = n_ctx_slot
        self.stepper = TokenStepper(req.sampler, vocab, req.stops, req.constraint)
        self.verifier = Verifier(self.stepper, req.sampler) if length is not None else None
        self.length = length  # speculation on: its acceptance rate picks the draft length
        self.spec = SpecStats()
        self.timings = Timings()
        self.ids: list[int] = []  # drawn tokens, an end-of-generation id excluded
        self.tops: list[list[tuple[int, float]]] = []
        self.n_generated = 0  # drawn tokens, an end-of-generation id included
        self.n_cached = 0  # prompt tokens found in the slot's cache
        self.finish: str | None = None
        self.eot: int | None = None  # the end-of-generation id drawn, if any
        self.tail = ""  # text held back until the end
        self.texts: list[str] = []  # the text shown so far, in pieces (the tail included)
        self.cancelled = False
        self.t_first: float | None = None  # when the first token was drawn
        # prompt tokens 1.. (`score_prompt`); the list is the sequence's `Sequence.scores` too,
        # whose first ones the scheduler takes from a slot's cache with the prefix's cells
        self.prompt_logprobs: list[TokenLogprob] = []

    def score_prompt(self, rows: np.ndarray, start: int) -> None:
        """Score the prompt tokens the logits rows of positions start.. predict (each row the
        next position's token; a last row past the prompt predicts the first draw)."""
        prompt, k = self.req.prompt, self.req.prompt_logprobs or 0
        assert len(self.prompt_logprobs) == start, "rows scored in order"
        for i, row in enumerate(rows):
            at = start + i + 1
            if at < len(prompt):
                self.prompt_logprobs.append(log_softmax_top(row, prompt[at], k))

    def step(self, logits: np.ndarray, proposed: int | None = None,
             q: np.ndarray | None = None) -> Emitted | None:
        """Draw one token from a logits row (deciding on `proposed` when given); None when the
        request ended without a token to show. Sets `finish` when the request ends."""
        if self.n_generated >= self.req.max_tokens:  # max_tokens 0: nothing is drawn
            self._end("length", None)
            return None
        if self.req.top_logits:
            self.tops.append(top_k_pairs(logits, self.req.top_logits))
        ts = time.perf_counter()
        if proposed is not None and self.verifier is not None:
            step = self.verifier.step(logits, proposed, q)
        else:
            step = self.stepper.step(logits)
        self.timings.sample_s += time.perf_counter() - ts
        if step.token is None:
            self._end("grammar", None)
            return None
        token = step.token
        self.n_generated += 1
        if self.t_first is None:
            self.t_first = time.perf_counter()
        lp = None
        if self.req.logprobs is not None:
            lp = log_softmax_top(logits, token, self.req.logprobs)
        if step.end == "eos":
            self.eot = token
            self._end("eos", "eos")
            return Emitted(token, "", lp)
        self.ids.append(token)
        if step.text:
            self.texts.append(step.text)
        if step.end == "stop":
            self._end("stop", "stop")
        elif self.stepper.grammar_done():
            self._end("grammar", None)
        elif len(self.ids) >= self.req.max_tokens:
            self._end("length", None)
        elif len(self.req.prompt) + self.n_generated > self.n_ctx_slot:
            self._end("context", None)
        elif "\n" in step.text and self._past_time_limit():
            self._end("length", None)
        return Emitted(token, step.text, lp)

    def _past_time_limit(self) -> bool:
        limit = self.req.t_max_predict_ms
        return limit > 0 and self.t_first is not None and \
            (time.perf_counter() - self.t_first) * 1e3 > limit

    def _end(self, reason: str, end: str | None) -> None:
        self.finish = reason
        self.tail = self.stepper.finish(end)
        if self.tail:
            self.texts.append(self.tail)
