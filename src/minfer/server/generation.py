"""One request's generation state on the engine thread: logits row in, text and events out.

A `Generation` steps its sequence with the same `TokenStepper` as the CLI's loop (grammar,
end-of-generation, stop strings on the byte stream, incremental UTF-8), adds the request's
limits and logprobs when asked (log-softmax of the raw logits, before any sampler stage), then
posts events to the request's `Handle`. The handle lives on the event
loop; `post` crosses threads with `call_soon_threadsafe`, and `cancel` (a client gone) is a flag
the engine thread reads before each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from minfer.engine.spec_generate import Verifier
from minfer.engine.speculative import DraftLength
from minfer.engine.stepper import Constraint, TokenStepper, TokenText
from minfer.sampling.sampler import Sampler

Vocab = TokenText  # what a Generation needs of the tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    """Text that became safe to show, and the tokens sampled in this step (with logprobs)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length"
    usage: Usage


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500


Event = Delta | Done | Failed


class Handle:
    """The event loop's end of a request: an asyncio queue fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False
        self.seq_id = -1

    def post(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class GenRequest:
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stops: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: off; k: the chosen token plus k alternatives
    constraint: Constraint | None = None  # the sampler's grammar mask, if any


def log_softmax_top(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """log-softmax of the raw logits at token, and the k most likely ids with theirs."""
    x = np.asarray(logits, dtype=np.float32)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum(dtype=np.float64)))
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, x.shape[0])
        idx = np.argpartition(x, x.shape[0] - k)[-k:]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        top = [(int(i), float(x[i]) - lse) for i in idx]
    return TokenLogprob(token, float(x[token]) - lse, top)


class Generation:
    """Sampling, stop strings and text for one running request (engine thread only)."""

    def __init__(self, req: GenRequest, handle: Handle, vocab: Vocab, *, n_ctx_slot: int) -> None:
        self.req = req
        self.handle = handle
        self.vocab = vocab
        self.n_ctx_slot = n_ctx_slot
        self.stepper = TokenStepper(req.sampler, vocab, req.stops, req.constraint)
        self.verifier: Verifier | None = None  # set when the server verifies proposals
        self.length = DraftLength(adaptive=True)  # its acceptance rate picks the draft length
        self.drafted = 0
        self.accepted = 0
        self.n_generated = 0
        self.n_cached = 0
        self.t_submit = time.perf_counter()
        self.t_last: float | None = None
        self.first_token_s: float | None = None
        self.last_gap: float | None = None  # seconds since the previous token (None: first)

    def enable_speculation(self) -> None:
        """Let this request verify proposals (minfer.engine.spec_generate.Verifier)."""
        self.verifier = Verifier(self.stepper, self.req.sampler)

    def step(self, logits: np.ndarray, proposed: int | None = None
             ) -> tuple[int | None, str | None]:
        """Sample one token and post what it makes visible; (token, finish reason or None).
        With `proposed` (a token whose row the forward also computed) the draw is the
        speculative verifier's: the proposal is kept or replaced, as minfer.engine.spec_generate.

        Under a grammar that allows no further token the request ends with "stop" and no token
        is drawn: the text so far is a valid prefix (the check is also made right after each
        accepted token, so a finished grammar costs no extra forward)."""
        if proposed is not None and self.verifier is not None:
            step = self.verifier.step(logits, proposed, None)
        else:
            step = self.stepper.step(logits)
        if step.token is None:
            self._post(self.stepper.finish(step.end), [])
            return None, "stop"
        token = step.token
        self.n_generated += 1
        now = time.perf_counter()
        if self.t_last is not None:
            self.last_gap = now - self.t_last
        else:
            self.first_token_s = now - self.t_submit
        self.t_last = now
        lps = []
        if self.req.logprobs is not None:
            lps.append(log_softmax_top(logits, token, self.req.logprobs))
        reason: str | None = None if step.end is None else "stop"  # eos or a stop string
        if reason is None and self.stepper.grammar_done():
            reason = "stop"
        if reason is None and (self.n_generated >= self.req.max_tokens
                               or len(self.req.prompt) + self.n_generated > self.n_ctx_slot):
            reason = "length"
        text = step.text
        if reason is not None:
            text += self.stepper.finish(step.end)
        self._post(text, lps)
        return token, reason

    def _post(self, text: str, lps: list[TokenLogprob]) -> None:
        if text or lps:
            self.handle.post(Delta(text, lps))

    def done(self, reason: str) -> Done:
        usage = Usage(len(self.req.prompt), self.n_generated, self.n_cached)
        return Done("stop" if reason == "stop" else "length", usage)
