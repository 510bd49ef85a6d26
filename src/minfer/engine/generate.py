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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from minfer.engine.stepper import Constraint, TokenSampler, TokenStepper, TokenText
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
    timings = Timings(prefill_tokens=len(prompt_ids))
    t0 = time.perf_counter()
    logits = prefill(engine, prompt_ids, start_pos, batch_size)
    timings.prefill_s = time.perf_counter() - t0
    pos = start_pos + len(prompt_ids)
    stepper = TokenStepper(sampler, vocab, stops, constraint)
    ids: list[int] = []
    text: list[str] = []
    tops: list[list[tuple[int, float]]] = []
    reason, eot = "length", None
    while len(ids) < max_tokens:
        if top_logits:
            tops.append(top_k_pairs(logits, top_logits))
        ts = time.perf_counter()
        step = stepper.step(logits)
        timings.sample_s += time.perf_counter() - ts
        if step.token is None or step.end == "eos":  # a finished grammar, or end-of-generation
            reason, eot = step.end or "grammar", step.token
            break
        ids.append(step.token)
        if step.text:
            text.append(step.text)
            yield Piece(step.text, step.token)
        if step.end == "stop":
            reason = "stop"
            break
        if len(ids) >= max_tokens:
            break
        if pos >= engine.n_ctx:
            reason = "context"
            break
        td = time.perf_counter()
        logits = engine.forward([step.token], pos)[0]
        timings.decode_s += time.perf_counter() - td
        timings.decode_tokens += 1
        pos += 1
    tail = stepper.finish(reason)
    if tail:
        text.append(tail)
        yield Piece(tail, ids[-1] if ids else -1)
    yield Finished(reason, ids, "".join(text), timings, tops, n_past=pos, eot_id=eot)
