"""One sequence's step after a forward: the core that `generate` and the server share.

Given the logits of a sequence's last position, `TokenStepper.step`:
- ends the sequence, drawing nothing, when a grammar allows no further token (the text so far
  is a valid prefix);
- draws a token with the sampler and commits it;
- ends on an end-of-generation id (never shown);
- otherwise pushes the token's bytes through the stop-string matcher and an incremental UTF-8
  decoder and returns the text that became safe to show, ending when a stop string completed.

`finish(end)` returns the text still held back at the end: the matcher's tail, unless a stop
string ended the sequence, and any partial character, decoded as final. Length and context
limits, timings, logprobs and where the text goes stay with the caller.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from minfer.engine.stops import StopMatcher


class TokenSampler(Protocol):
    def sample(self, logits: np.ndarray) -> int: ...

    def accept(self, token_id: int) -> None: ...


@runtime_checkable
class Constraint(Protocol):
    """A grammar mask asked before each draw (minfer.sampling.grammar.GrammarMask)."""

    def is_stopped(self) -> bool: ...


class TokenText(Protocol):
    eot_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True)
class Step:
    token: int | None  # the drawn token; None when the grammar allowed nothing
    text: str  # text that became safe to show
    end: str | None  # "grammar", "eos" or "stop" (a stop string); None: go on


class TokenStepper:
    def __init__(self, sampler: TokenSampler, vocab: TokenText, stops: Sequence[str] = (),
                 constraint: Constraint | None = None) -> None:
        self.sampler = sampler
        self.vocab = vocab
        self.constraint = constraint
        self.matcher = StopMatcher(list(stops))
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def grammar_done(self) -> bool:
        """The grammar allows no further token (asked again right after a token is accepted,
        a finished grammar costs no extra forward)."""
        return self.constraint is not None and self.constraint.is_stopped()

    def step(self, logits: np.ndarray) -> Step:
        if self.grammar_done():
            return Step(None, "", "grammar")
        return self.commit(self.sampler.sample(logits))

    def commit(self, token: int) -> Step:
        """Take `token` as the sequence's next one (drawn by `step`, or by a speculative
        verifier from the sampler's distribution): accept it, then the end and stop gates."""
        self.sampler.accept(token)
        if token in self.vocab.eot_ids:
            return Step(token, "", "eos")
        emit, stopped = self.matcher.push(self.vocab.token_bytes(token))
        return Step(token, self._utf8.decode(emit), "stop" if stopped else None)

    def finish(self, end: str | None) -> str:
        """The held-back text at the end of the sequence (`end` as `Step.end`, or the caller's
        own reason such as a length limit)."""
        tail = b"" if end == "stop" else self.matcher.flush()
        return self._utf8.decode(tail, final=True)
