"""The host-side mirror of a session's KV cache: which token sits in each written cell.

`KVMirror` wraps an engine and records every forward: the tokens written at `start_pos..` become
the mirror's cells `start_pos..`, and anything the mirror held at or beyond `start_pos` is
forgotten first. So the mirror always describes what the KV really holds, however a generation
ends — a stop gate, the length cap, or a Ctrl-C between two forwards — and the write cursor is
simply `len(tokens)`. Cells past the cursor may still hold stale rows (after a rewind); attention
never reads them, because a token's window ends at its own cell, and the next forward overwrites
them.

A model with recurrent layers (LFM2) holds a state of every token so far, which cannot be cut
back: there a rewind to a cell before the cursor goes back to the furthest state checkpoint at
or before it (`Engine.checkpoint_positions`; 0 where there is none) and the next forward
continues from there; `checkpoint` keeps the state at the cursor; nothing shifts.

The mirror is append-only at the cursor: a forward that would leave a gap is refused. The one
other edit is `shift`: cells [src_start, src_end) move down to dst_start (the engine re-rotates
their keys for the new positions, see minfer.engine.kv_shift), the cells between are forgotten,
and the cursor ends right after the moved block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from minfer.engine.core.scheduler import common_prefix
from minfer.errors import MinferError

__all__ = ["ForwardEngine", "KVMirror", "KVShifter", "common_prefix", "kv_shifter"]

if TYPE_CHECKING:
    from minfer.engine.forward import Engine


class ForwardEngine(Protocol):
    """What a session needs from an engine (minfer.engine.forward.Engine satisfies it)."""

    @property
    def n_ctx(self) -> int: ...

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1) -> np.ndarray: ...


class KVShifter(Protocol):
    """An engine (or wrapper) that can move KV cells to new positions in place."""

    def shift_kv(self, *, src_start: int, src_end: int, dst_start: int) -> None: ...


def kv_shifter(engine: object) -> Callable[[int, int, int], None] | None:
    """How to shift `engine`'s KV: its own `shift_kv`, minfer's for an Engine, else None."""
    own = getattr(engine, "shift_kv", None)
    if callable(own):
        shifter = cast(KVShifter, engine)
        return lambda s, e, d: shifter.shift_kv(src_start=s, src_end=e, dst_start=d)
    if getattr(engine, "recurrent", False):  # a recurrent state cannot be shifted
        return None
    if getattr(getattr(engine, "hparams", None), "rope_sections", ()):  # M-RoPE: not re-rotated
        return None
    if hasattr(engine, "kv") and hasattr(engine, "hparams"):
        from minfer.engine.kv_shift import shift_kv

        real = cast("Engine", engine)
        return lambda s, e, d: shift_kv(real, src_start=s, src_end=e, dst_start=d)
    return None


class KVMirror:
    """An engine wrapper that keeps `tokens`: the id written in every KV cell below the cursor."""

    def __init__(self, engine: ForwardEngine) -> None:
        self.engine = engine
        self._tokens: list[int] = []
        self.n_forwarded = 0
        """Tokens forwarded through this mirror since it was made (prefill and decode)."""
        self.n_shifted = 0
        """KV cells moved by `shift` since the mirror was made."""

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    @property
    def recurrent(self) -> bool:
        """Whether the engine holds a recurrent state (a speculative verify through the mirror
        then keeps the state before it and recomputes the kept tokens: `SequenceRunner`)."""
        return bool(getattr(self.engine, "recurrent", False))

    @property
    def tokens(self) -> list[int]:
        """A copy of the cell contents `[0, cursor)`."""
        return list(self._tokens)

    @property
    def cursor(self) -> int:
        """The next cell to write; also the number of tokens in the KV."""
        return len(self._tokens)

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1, *,
                batch_invariant: bool = False,
                embd: Sequence[tuple[int, np.ndarray]] = (),
                rope_pos: np.ndarray | None = None) -> np.ndarray:
        """Write tokens at start_pos.. (≤ cursor) and return the engine's logits
        (`batch_invariant` as minfer.engine.forward.Engine.forward: a speculative verify;
        `embd`: rows given for some of the tokens, an image's; `rope_pos`: M-RoPE rows')."""
        if start_pos > len(self._tokens):
            raise MinferError(
                f"KV write at {start_pos} would leave a gap (cursor at {len(self._tokens)})")
        # Forget first: if the engine fails half-way, the mirror must not claim rows it lost.
        del self._tokens[start_pos:]
        if embd or rope_pos is not None:
            logits = cast("Engine", self.engine).forward(
                tokens, start_pos, n_out, embd=list(embd), batch_invariant=batch_invariant,
                rope_pos=rope_pos)
        elif batch_invariant:
            logits = cast("Engine", self.engine).forward(tokens, start_pos, n_out,
                                                         batch_invariant=True)
        else:
            logits = self.engine.forward(tokens, start_pos, n_out)
        self._tokens.extend(int(t) for t in tokens)
        self.n_forwarded += len(tokens)
        return logits

    @property
    def can_shift(self) -> bool:
        return kv_shifter(self.engine) is not None

    def shift(self, src_start: int, src_end: int, dst_start: int) -> None:
        """Move cells [src_start, src_end) (≤ cursor) down to dst_start; the cursor follows."""
        shifter = kv_shifter(self.engine)
        if shifter is None:
            raise MinferError("this engine cannot shift its KV cells")
        if not 0 <= dst_start <= src_start <= src_end <= len(self._tokens):
            raise MinferError(f"cannot shift KV cells [{src_start}, {src_end}) to {dst_start} "
                              f"(cursor at {len(self._tokens)})")
        moved = self._tokens[src_start:src_end]
        # Forget first, as forward does: a failed shift leaves the mirror claiming only [0, dst).
        del self._tokens[dst_start:]
        shifter(src_start, src_end, dst_start)
        self._tokens.extend(moved)
        self.n_shifted += len(moved)

    def rewind(self, cursor: int) -> None:
        """Move the cursor back to `cursor` (no-op when it is already there or before); on a
        recurrent model, back to the furthest checkpoint at or before it (read `cursor`)."""
        if cursor < 0:
            raise MinferError(f"cannot rewind the KV to {cursor}")
        if cursor < len(self._tokens) and getattr(self.engine, "recurrent", False):
            cursor = max((p for p in self.checkpoint_positions(0) if p <= cursor), default=0)
        del self._tokens[cursor:]

    def checkpoint_positions(self, seq: int) -> list[int]:
        """Where the engine's recurrent state may restart from (none without one)."""
        positions = getattr(self.engine, "checkpoint_positions", None)
        return positions(seq) if callable(positions) else []

    def save_state(self, seq: int, *, spare: bool = False) -> None:
        """The engine's recurrent state kept where it stands (`Engine.save_state`)."""
        save = getattr(self.engine, "save_state", None)
        if callable(save):
            save(seq, spare=spare)

    def checkpoint(self) -> None:
        """Keep a recurrent state at the cursor, for a later rewind to come back to."""
        if getattr(self.engine, "recurrent", False):
            self.save_state(0)

