"""The core's proposers: guesses at each decoding sequence's next tokens, batched across slots.

A `Proposer` takes the step's `DraftAsk`s (a decoding sequence, its slot, up to k tokens wanted)
and returns each sequence's proposal; the core cuts it to a verify bucket and the target checks
it in the step's forward (`core.py`).

- `LookupProposer` (`--lookup-ngram N`, prompt lookup): continue the latest earlier occurrence of
  the sequence's last n-gram (minfer.engine.speculative.lookup). Free to make.
- `SlotDrafter` (`-md FILE`): a draft model, one draft sequence per slot.

The draft runs its own engine and KV with the target's slot layout (slot s: cells
[s * n_ctx_slot, (s + 1) * n_ctx_slot)), through the same `Runner`. For the decoding sequences of
a step (`DraftAsk`s, each its whole sequence with the pending token last), `propose`

1. catches each slot's draft KV up to the sequence: the tokens past the common prefix of what
   the slot holds and the sequence (the prompt at the first decode, then the tokens accepted since)
   are fed in one multi-sequence forward of at most `chunk` tokens, fewest first. A sequence not
   caught up in it (a long prompt) proposes nothing this step and continues at the next, so
   streams never stall behind a long prompt, as with the target's chunked prefill;
2. drafts greedily, one multi-sequence forward per draft step over every slot still drafting: a
   slot stops at its k tokens, or when the draft's top probability falls under `p_min`
   (llama.cpp's --draft-p-min).

Rejected proposals need no undo: the slot's record (`cached`) keeps every token it forwarded, and
the next catch-up starts at the common prefix, so the write position simply moves back and the
stale cells are overwritten (as `KVMirror` does for `minfer run`). A greedy draft is a point-mass
guess, so the target's verifier stays exact for sampled requests too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from minfer.engine.core.runner import BatchEngine, Runner
from minfer.engine.core.scheduler import Plan, Work, common_prefix
from minfer.engine.speculative import confident_top, lookup


@dataclass(frozen=True)
class DraftAsk:
    """Propose up to k tokens after `tokens` (a sequence from position 0) in `slot`."""

    seq_id: int
    slot: int
    tokens: tuple[int, ...]
    k: int


class Proposer(Protocol):
    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, list[int]]:
        """Up to ask.k tokens that may follow each ask's tokens."""
        ...

    def warm_up(self) -> None:
        """Build what the first proposals need (before the first request)."""
        ...

    def forget(self) -> None:
        """Drop any record of the KV (after a failed forward its state is unknown)."""
        ...


class LookupProposer:
    """Prompt lookup for every ask (no model, nothing to keep)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, list[int]]:
        return {a.seq_id: lookup(np.asarray(a.tokens, dtype=np.int64), self.n, a.k)
                for a in asks}

    def warm_up(self) -> None:
        return None

    def forget(self) -> None:
        return None


class SlotDrafter:
    """A draft engine with one draft sequence per server slot (engine thread only)."""

    def __init__(self, engine: BatchEngine, n_ctx_slot: int, *, p_min: float,
                 chunk: int = 512) -> None:
        self.runner = Runner(engine, n_ctx_slot)
        self.n_ctx_slot = n_ctx_slot
        self.p_min = p_min
        self.chunk = chunk
        self.cached: list[list[int]] = [[] for _ in range(engine.n_ctx // n_ctx_slot)]
        self.n_forwarded = 0  # tokens the draft engine computed (catch-up and drafts)
        self.n_forwards = 0

    def warm_up(self) -> None:
        """Build the draft's first graphs in slot 0 (its record stays empty: never reused)."""
        self.runner.warm_up()

    def forget(self) -> None:
        """Drop every slot's record (after a failed forward the KV state is unknown)."""
        self.cached = [[] for _ in self.cached]

    def propose(self, asks: Sequence[DraftAsk]) -> dict[int, list[int]]:
        """Up to ask.k greedy draft tokens per ask (fewer where the draft is unsure)."""
        asks = [a for a in asks if a.tokens and self._room(a) > 0]
        logits = self._catch_up(asks)
        out: dict[int, list[int]] = {a.seq_id: [] for a in asks}
        live = [a for a in asks if a.seq_id in logits]
        while live:
            works: list[Work] = []
            for a in live:
                token = confident_top(logits[a.seq_id], self.p_min)
                if token is None:
                    continue
                drafted = out[a.seq_id]
                drafted.append(token)
                if len(drafted) < self._room(a):  # its logits give the next draft token
                    works.append(Work(a.seq_id, a.slot, len(a.tokens) + len(drafted) - 1,
                                      (token,), True))
            going = {w.seq_id for w in works}
            live = [a for a in live if a.seq_id in going]
            if works:
                logits = self._forward(works)
        return out

    def _room(self, ask: DraftAsk) -> int:
        """ask.k, capped so that no draft token's cell passes the slot."""
        return min(ask.k, self.n_ctx_slot - len(ask.tokens) + 1)

    def _catch_up(self, asks: Sequence[DraftAsk]) -> dict[int, np.ndarray]:
        """Feed the tokens each ask's slot lacks, fewest first, in one forward of at most
        `chunk` tokens; the logits row after the last token of each ask caught up."""
        lacking = sorted(((min(common_prefix(self.cached[a.slot], a.tokens), len(a.tokens) - 1),
                           a) for a in asks), key=lambda sa: len(sa[1].tokens) - sa[0])
        works: list[Work] = []
        budget = self.chunk
        for start, a in lacking:
            if budget == 0:
                break
            n = min(len(a.tokens) - start, budget)
            works.append(Work(a.seq_id, a.slot, start, a.tokens[start:start + n],
                              start + n == len(a.tokens)))
            budget -= n
        return self._forward(works) if works else {}

    def _forward(self, works: list[Work]) -> dict[int, np.ndarray]:
        """One multi-sequence draft forward; each slot's record follows what it wrote."""
        for w in works:
            held = self.cached[w.slot]
            del held[w.start_pos:]
            held.extend(w.tokens)
        out = self.runner.run(Plan(tuple(works)))
        self.n_forwarded += sum(len(w.tokens) for w in works)
        self.n_forwards += 1
        return out
