"""The generation loop: chunked prefill, then sample first, forward second.

`generate` prefills the prompt (in chunks of `batch_size` so memory stays bounded), then loops:
sample from the current logits, pass the stop gates, and only then run the forward for the
sampled token. The per-token gates (grammar, end-of-generation, stop strings cut on the byte
stream, so a stop that straddles tokens or splits a multi-byte character is still found and never
printed) are `stepper.TokenStepper`'s, shared with the server; length and context limits are the
loop's. It yields `Piece`s while it runs and a final `Finished` with the ids, the reason and the
timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from minfer.engine.stepper import Constraint, Step, TokenSampler, TokenStepper, TokenText
from minfer.errors import ContextOverflowError

if TYPE_CHECKING:
    from minfer.engine.spec_generate import Speculator
    from minfer.engine.speculative import SpecStats

__all__ = ["Constraint", "Finished", "Forward", "Piece", "Timings", "TokenSampler", "TokenText",
           "generate", "prefill", "top_k_pairs"]


class Forward(Protocol):
    """What the loop needs of an engine (an Engine, or a wrapper that records the KV)."""

    @property
    def n_ctx(self) -> int: ...

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1) -> np.ndarray: ...


@dataclass(frozen=True)
class Piece:
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


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "eos" | "context" | "grammar" (no token allowed)
    ids: list[int]
    text: str
    timings: Timings
    top_logits: list[list[tuple[int, float]]] = field(default_factory=list)
    n_past: int = 0  # tokens in the KV when the loop ended
    eot_id: int | None = None  # the end-of-generation token sampled, if any
    speculation: SpecStats | None = None  # drafted / accepted counts of a speculative run


def _rate(n: int, s: float) -> float:
    return n / s if s > 0 else 0.0


def prefill(engine: Forward, tokens: Sequence[int], start_pos: int, batch_size: int) -> np.ndarray:
    """Feed tokens at start_pos.. in chunks; return the logits of the last token."""
    if not tokens:
        raise ValueError("nothing to prefill")
    if start_pos + len(tokens) > engine.n_ctx:
        raise ContextOverflowError(
            f"prompt of {len(tokens)} tokens at position {start_pos} does not fit in the context "
            f"(n_ctx = {engine.n_ctx})"
        )
    logits = np.empty(0, np.float32)
    for i in range(0, len(tokens), batch_size):
        chunk = tokens[i : i + batch_size]
        logits = engine.forward(chunk, start_pos + i, n_out=1)
    return logits[0]


def top_k_pairs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    idx = np.argpartition(logits, -k)[-k:]
    idx = idx[np.argsort(-logits[idx], kind="stable")]
    return [(int(i), float(logits[i])) for i in idx]


def generate(
    engine: Forward,
    vocab: TokenText,
    sampler: TokenSampler,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    stops: Sequence[str] = (),
    start_pos: int = 0,
    batch_size: int = 512,
    top_logits: int = 0,
    constraint: Constraint | None = None,
    speculator: Speculator | None = None,
    context: Sequence[int] = (),
) -> Iterator[Piece | Finished]:
    """Generate after prompt_ids (prefilled at start_pos). With a `speculator`, proposals are
    verified in batches (minfer.engine.spec_generate); `context` then holds the start_pos
    tokens already in the KV, which the proposers read."""
    if speculator is not None:
        from minfer.engine.spec_generate import generate_speculative

        yield from generate_speculative(
            engine, vocab, sampler, prompt_ids, speculator=speculator,  # type: ignore[arg-type]
            context=context, max_tokens=max_tokens, stops=stops, start_pos=start_pos,
            batch_size=batch_size, top_logits=top_logits, constraint=constraint)
        return
    logits, run = start(engine, vocab, sampler, prompt_ids, start_pos=start_pos,
                        batch_size=batch_size, stops=stops, constraint=constraint,
                        top_logits=top_logits)
    pos = start_pos + len(prompt_ids)
    while len(run.ids) < max_tokens:
        step = run.draw(run.stepper.step, logits)
        if step is None:
            break
        piece = run.take(step)
        if piece is not None:
            yield piece
        if run.ends(step, max_tokens):
            break
        if pos >= engine.n_ctx:
            run.reason = "context"
            break
        td = time.perf_counter()
        logits = engine.forward([run.ids[-1]], pos)[0]
        run.timings.decode_s += time.perf_counter() - td
        run.timings.decode_tokens += 1
        pos += 1
    yield from run.finish(pos)


class Run:
    """One generation's record, kept the same way by this loop and the speculative one
    (`spec_generate`): the stepper's gates, the ids and text so far, the top logits, the
    timings, and why it ended. The loops keep only how they reach the next logits."""

    def __init__(self, stepper: TokenStepper, timings: Timings, top_logits: int) -> None:
        self.stepper = stepper
        self.timings = timings
        self.top_logits = top_logits
        self.ids: list[int] = []
        self.text: list[str] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.reason = "length"
        self.eot: int | None = None

    def draw(self, draw: Callable[..., Step], logits: np.ndarray, *args: Any) -> Step | None:
        """The next step, `draw(logits, *args)`, timed; None when it ends the generation
        without a token to show (a finished grammar, end-of-generation)."""
        if self.top_logits:
            self.tops.append(top_k_pairs(logits, self.top_logits))
        ts = time.perf_counter()
        step = draw(logits, *args)
        self.timings.sample_s += time.perf_counter() - ts
        if step.token is None or step.end == "eos":
            self.reason, self.eot = step.end or "grammar", step.token
            return None
        return step

    def take(self, step: Step) -> Piece | None:
        """Record the step's token; the Piece to yield when it made text safe to show."""
        assert step.token is not None
        self.ids.append(step.token)
        if not step.text:
            return None
        self.text.append(step.text)
        return Piece(step.text, step.token)

    def ends(self, step: Step, max_tokens: int) -> bool:
        """Whether the generation ends after this taken step: a stop string, or the length."""
        if step.end == "stop":
            self.reason = "stop"
            return True
        return len(self.ids) >= max_tokens

    def finish(self, n_past: int, speculation: SpecStats | None = None
               ) -> Iterator[Piece | Finished]:
        """The text held back until the end, then the Finished record."""
        tail = self.stepper.finish(self.reason)
        if tail:
            self.text.append(tail)
            yield Piece(tail, self.ids[-1] if self.ids else -1)
        yield Finished(self.reason, self.ids, "".join(self.text), self.timings, self.tops,
                       n_past=n_past, eot_id=self.eot, speculation=speculation)


def start(engine: Forward, vocab: TokenText, sampler: TokenSampler, prompt_ids: Sequence[int], *,
          start_pos: int, batch_size: int, stops: Sequence[str], constraint: Constraint | None,
          top_logits: int, prepared: Callable[[], None] | None = None) -> tuple[np.ndarray, Run]:
    """Prefill the prompt (then `prepared()`, inside the prefill's timing): the last logits and
    a fresh Run."""
    timings = Timings(prefill_tokens=len(prompt_ids))
    t0 = time.perf_counter()
    logits = prefill(engine, prompt_ids, start_pos, batch_size)
    if prepared is not None:
        prepared()
    timings.prefill_s = time.perf_counter() - t0
    return logits, Run(TokenStepper(sampler, vocab, stops, constraint), timings, top_logits)
