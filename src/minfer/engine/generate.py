"""`generate`: one request run alone on an `EngineCore` (minfer.engine.core), stepped in place.

The core is the server's: a one-slot scheduler (chunked prefill in chunks of `batch_size`, then
one token per step), a `SequenceRunner` over the engine (an Engine, or a chat's `KVMirror`), the
request's `TokenStepper` gates (grammar, end-of-generation, stop strings cut on the byte stream,
so a stop that straddles tokens or splits a multi-byte character is still found and never
printed), length and context limits, and with a `Speculator` the proposals verified in the
step's forward (a verify's rows are bitwise one-token decode rows, so greedy output is plain
decoding's). A lone request is a batch of one: its forwards are the ones a plain loop would make.
It yields `Piece`s while it runs and a final `Finished` with the ids, the reason and the timings.
`score` runs a prompt alone on the same core to read each of its tokens' logprobs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from minfer.engine.core.core import EngineCore
from minfer.engine.core.policy import SpecStats
from minfer.engine.core.proposer import Speculator
from minfer.engine.core.request import (
    GenRequest,
    Piece,
    PromptRows,
    Request,
    Timings,
    TokenLogprob,
    held_blocks,
    top_k_pairs,
)
from minfer.engine.core.runner import SequenceRunner
from minfer.engine.speculative import SpeculativeError
from minfer.engine.stepper import Constraint, TokenSampler, TokenText
from minfer.errors import ContextOverflowError

__all__ = ["Constraint", "Finished", "Forward", "Piece", "Timings", "TokenSampler", "TokenText",
           "generate", "prefill", "score", "top_k_pairs"]

SEQ = 0  # the one request's id in its core


class Forward(Protocol):
    """What the loop needs of an engine (an Engine, or a wrapper that records the KV)."""

    @property
    def n_ctx(self) -> int: ...

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1) -> np.ndarray: ...


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


def check_fits(engine: Forward, n_tokens: int, start_pos: int) -> None:
    """Refuse a prompt that is empty or would pass the context."""
    if not n_tokens:
        raise ValueError("nothing to prefill")
    if start_pos + n_tokens > engine.n_ctx:
        raise ContextOverflowError(
            f"prompt of {n_tokens} tokens at position {start_pos} does not fit in the context "
            f"(n_ctx = {engine.n_ctx})"
        )


def prefill(engine: Forward, tokens: Sequence[int], start_pos: int, batch_size: int) -> np.ndarray:
    """Feed tokens at start_pos.. in chunks; return the logits of the last token (a chat's
    restored history, `minfer bench`: the KV without a generation)."""
    check_fits(engine, len(tokens), start_pos)
    logits = np.empty(0, np.float32)
    for i in range(0, len(tokens), batch_size):
        chunk = tokens[i : i + batch_size]
        logits = engine.forward(chunk, start_pos + i, n_out=1)
    return logits[0]


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
    embd: Sequence[PromptRows] = (),
) -> Iterator[Piece | Finished]:
    """Generate after prompt_ids (prefilled at start_pos). `context`: the start_pos tokens
    already in the KV (the proposers of a `speculator` read the whole sequence). `embd`: rows
    given for some prompt tokens (an image's; `at` counted in prompt_ids: one before 0 is one
    the KV holds among `context`, for the M-RoPE positions after it)."""
    check_fits(engine, len(prompt_ids), start_pos)
    if speculator is not None and len(context) != start_pos:
        raise SpeculativeError(f"speculative decoding needs the {start_pos} tokens before the "
                               f"prompt, got {len(context)}")
    attach = getattr(speculator.proposer if speculator else None, "attach", None)
    if callable(attach):  # a proposer that reads the target's rows (the MTP head)
        attach(engine)
    # without a speculator nothing reads the tokens before the prompt: placeholders stand in
    held = list(context) if len(context) == start_pos else [-1] * start_pos
    core = EngineCore(SequenceRunner(engine), vocab, n_slots=1, n_ctx_slot=engine.n_ctx,
                      chunk=batch_size, max_waiting=0,
                      proposer=None if speculator is None else speculator.proposer,
                      speculation=None if speculator is None else speculator.config)
    blocks = tuple(e.shifted(start_pos) for e in embd)
    slot = core.scheduler.slots[0]
    slot.cached = held  # the KV holds them (and the image blocks among them): the prompt cache
    slot.blocks = held_blocks(blocks, start_pos)
    req = GenRequest([*held, *prompt_ids], max_tokens, sampler, list(stops),  # starts after
                     constraint=constraint, top_logits=top_logits, embd=blocks)
    state = core.add(SEQ, req, length=None if speculator is None else speculator.length)
    state.timings.prefill_tokens = len(prompt_ids)
    try:
        while state.finish is None:
            for out in core.step():
                if out.error is not None:
                    raise out.error
                for e in out.emitted:
                    if e.text:
                        yield Piece(e.text, e.token)
    finally:  # rows of proposals never verified, or rejected, are not kept (also on close)
        n_past = _n_computed(core)
        _rewind(engine, n_past)
        detach = getattr(speculator.proposer if speculator else None, "detach", None)
        if callable(detach):  # later forwards without it compute no hidden rows
            detach()
    yield from _finish(state, n_past, speculator)


def score(engine: Forward, vocab: TokenText, sampler: TokenSampler, ids: Sequence[int], *,
          batch_size: int = 512, top: int = 0) -> list[TokenLogprob]:
    """Each token of ids after the first scored given those before it (its logprob, and the
    `top` most likely tokens there): the core's scored prompt (`GenRequest.prompt_logprobs`),
    computed in chunks of batch_size rows from position 0, nothing drawn."""
    check_fits(engine, len(ids), 0)
    core = EngineCore(SequenceRunner(engine), vocab, n_slots=1, n_ctx_slot=engine.n_ctx,
                      chunk=batch_size, max_waiting=0)
    state = core.add(SEQ, GenRequest(list(ids), 0, sampler, prompt_logprobs=top))
    try:
        while state.finish is None:
            for out in core.step():
                if out.error is not None:
                    raise out.error
    finally:
        _rewind(engine, 0)
    return state.prompt_logprobs


def _n_computed(core: EngineCore) -> int:
    """The tokens the one sequence has in the KV (its slot's record once it has finished)."""
    seq = core.scheduler.running.get(SEQ)
    return seq.n_computed if seq is not None else len(core.scheduler.slots[0].cached)


def _finish(state: Request, n_past: int, speculator: Speculator | None
            ) -> Iterator[Piece | Finished]:
    """The text held back until the end, then the Finished record."""
    if state.tail:
        yield Piece(state.tail, state.ids[-1] if state.ids else -1)
    stats = None
    if speculator is not None:
        stats = state.spec
        speculator.add(stats)
    assert state.finish is not None
    text = "".join(state.texts)
    yield Finished(state.finish, state.ids, text, state.timings, state.tops, n_past=n_past,
                   eot_id=state.eot, speculation=stats)


def _rewind(engine: object, cursor: int) -> None:
    """A KVMirror forgets cells from `cursor` on (an Engine has no record to correct)."""
    rewind = getattr(engine, "rewind", None)
    if callable(rewind):
        rewind(cursor)
