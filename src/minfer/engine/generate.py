"""The generation loop: chunked prefill, then sample first, forward second.

`generate` prefills the prompt (in chunks of `batch_size` so memory stays bounded), then loops:
sample from the current logits, pass the stop gates, and only then run the forward for the
sampled token. Text is cut at stop strings on the byte stream, so a stop that straddles tokens or
splits a multi-byte character is still found and never printed. The loop yields `Piece`s while it
runs and a final `Finished` with the ids, the reason and the timings.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from minfer.engine.stops import StopMatcher
from minfer.errors import ContextOverflowError


class Forward(Protocol):
    """What the loop needs of an engine (an Engine, or a wrapper that records the KV)."""

    @property
    def n_ctx(self) -> int: ...

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1) -> np.ndarray: ...


class TokenSampler(Protocol):
    def sample(self, logits: np.ndarray) -> int: ...

    def accept(self, token_id: int) -> None: ...


@runtime_checkable
class Constraint(Protocol):
    """A grammar mask the loop asks before sampling (minfer.sampling.grammar.GrammarMask)."""

    def is_stopped(self) -> bool: ...


class TokenText(Protocol):
    eot_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...


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
) -> Iterator[Piece | Finished]:
    timings = Timings(prefill_tokens=len(prompt_ids))
    t0 = time.perf_counter()
    logits = prefill(engine, prompt_ids, start_pos, batch_size)
    timings.prefill_s = time.perf_counter() - t0
    pos = start_pos + len(prompt_ids)
    matcher = StopMatcher(list(stops))
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    ids: list[int] = []
    text: list[str] = []
    tops: list[list[tuple[int, float]]] = []
    reason, eot = "length", None
    while len(ids) < max_tokens:
        if top_logits:
            tops.append(top_k_pairs(logits, top_logits))
        ts = time.perf_counter()
        if constraint is not None and constraint.is_stopped():
            reason = "grammar"  # nothing may follow: stop on a valid prefix, draw nothing
            break
        token = sampler.sample(logits)
        sampler.accept(token)
        timings.sample_s += time.perf_counter() - ts
        if token in vocab.eot_ids:
            reason, eot = "eos", token
            break
        ids.append(token)
        emit, stopped = matcher.push(vocab.token_bytes(token))
        piece = utf8.decode(emit)
        if piece:
            text.append(piece)
            yield Piece(piece, token)
        if stopped:
            reason = "stop"
            break
        if len(ids) >= max_tokens:
            break
        if pos >= engine.n_ctx:
            reason = "context"
            break
        td = time.perf_counter()
        logits = engine.forward([token], pos)[0]
        timings.decode_s += time.perf_counter() - td
        timings.decode_tokens += 1
        pos += 1
    if reason != "stop":
        tail = utf8.decode(matcher.flush(), final=True)
    else:
        tail = utf8.decode(b"", final=True)
    if tail:
        text.append(tail)
        yield Piece(tail, ids[-1] if ids else -1)
    yield Finished(reason, ids, "".join(text), timings, tops, n_past=pos, eot_id=eot)
