"""Prompt lookup (`--lookup-ngram N`): guesses copied from earlier in the sequence.

`lookup` finds the latest earlier occurrence of the sequence's last N tokens (then N-1, ..., 1)
and returns what followed it. A point-mass guess: free to make, right whenever the output copies
the prompt (code edits, quotes). `follow` keeps its place in what the output copies
(`CopyCursor`), so an edit that changes a few tokens of each copied line costs a token or two of
proposals, not the rest of the line. `LookupProposer` (minfer.engine.core.proposer) runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


# -- the plain lookup ------------------------------------------------------------------------------
def lookup(seq: np.ndarray, max_n: int, k: int, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of seq's last n tokens, longest n
    first (down to min_n): the latest occurrence with k tokens after it, else the earliest (the
    most after it)."""
    start = _lookup_start(seq, max_n, k, min_n)
    return [] if start is None else [int(t) for t in seq[start:start + k]]


# Where a copy re-synchronises after an edit: n-gram matches ending up to RESYNC_AHEAD tokens
# after the divergence point (or RESYNC_BACK before it), nearest first; a one-token match only
# within RESYNC_NEAR. A rewrite copies its source in order: it resumes within a line or two.
RESYNC_AHEAD = 128
RESYNC_BACK = 4
RESYNC_NEAR = 16
# The most new tokens an edit may put in place of one source token (a renamed identifier: one
# to three) before the copy is given up for the plain lookup.
SUBSTITUTION_MAX = 4
# The situations `follow` proposes in (`CopyCursor.kind`), which are right at very different
# rates, so prompt lookup measures each apart (minfer.engine.core.proposer): "copy" goes on
# with a copy whose last tokens held; "guess" takes the token after an edit's first token for
# a substitution; "resync" resumes a copy after an insertion or deletion; "lookup" is the
# plain n-gram lookup; "repeat" is that lookup made across an edit (below). On a code edit
# that inserts type hints, copies are right at ~0.9 a token and guesses inside the inserted
# text near 0: one rate for both stops proposing through whole copied lines after each
# signature, or verifies rows wasted on each hint.
COPY_KINDS = ("copy", "guess", "resync", "lookup", "repeat")
# Across an edit ("guess", "resync") the output may be writing new text it wrote before (a type
# hint again, the same added argument): prompt lookup then also proposes what followed the
# latest earlier occurrence of the last REPEAT_MIN_N or more tokens ("repeat"), and of the two
# proposals makes the one whose kind is right more often. One-token matches are too loose here.
REPEAT_KINDS = ("guess", "resync")
REPEAT_MIN_N = 2


@dataclass
class CopyCursor:
    """Prompt lookup's memory of one sequence. Its last proposal said that the sequence's
    token `length` onwards copies the source from position `source` (an earlier part of the
    sequence) with `edits` applied; `origin`: when that proposal was a guess across an edit,
    the source position the copy diverged at (the output's tokens from `since` on replaced
    it). `edits`: substitutions seen so far, a source token -> the tokens the output put in
    its place (a rename, a changed quote), applied to every later copy of that token."""

    length: int
    source: int
    origin: int | None = None
    since: int = 0
    edits: dict[int, tuple[int, ...]] = field(default_factory=dict)
    offset: int = 0  # the proposal began at token `offset` of source's edit
    kind: str = "lookup"  # the last proposal's situation: one of COPY_KINDS


def follow(seq: np.ndarray, cursor: CopyCursor | None, max_n: int,
           k: int) -> tuple[list[int], CopyCursor | None]:
    """Prompt lookup that follows a copy through edits: up to k tokens after seq, and the
    cursor to pass with the next call (the same sequence, grown by the tokens accepted and
    the target's own next token).

    A rewrite of the prompt (rename a variable, change the quotes, add an argument, drop a
    line) copies its source in order, and the plain n-gram lookup loses its place at each
    change: the changed tokens' n-grams are nowhere in the source, and a short n-gram matches
    all over it. So the cursor remembers where in the source the copy stands. While the new
    tokens equal the source from there on (with the edits learnt so far), the copy goes on.
    At a difference, the copy resumes at the nearest match of the last tokens after that point
    (`_resync`: after an insertion or a deletion), or, at the edit's first token, at the
    latest match of the last N tokens anywhere (the copy was placed wrong); failing those, the
    difference is taken for a substitution of that one source token and the source after it
    is proposed; once the copy goes on after it, the substitution is learnt as an edit. A
    learnt edit the output does not make again is forgotten. Without a cursor, or when the
    copy is lost, the plain `lookup` (latest occurrence of the longest n-gram)."""
    size = seq.shape[0]
    edits = cursor.edits if cursor is not None else {}
    if cursor is not None and cursor.source < cursor.length < size:
        p, j, i = cursor.source, cursor.offset, cursor.length
        while i < size:
            expected = _expected(seq, p, edits)
            if seq[i] == expected[j]:
                i, j = i + 1, j + 1
                if j == len(expected):
                    p, j = p + 1, 0
            elif j == 0 and seq[i] == seq[p]:  # a learnt edit (expected) not made here
                del edits[int(seq[p])]
                i, p = i + 1, p + 1
            else:
                break
        guessing = cursor.origin is not None
        if guessing and i > cursor.length:  # the guess held: learn the substitution
            assert cursor.origin is not None
            made = tuple(int(t) for t in seq[cursor.since:cursor.length])
            if 0 < len(made) <= SUBSTITUTION_MAX:
                edits[int(seq[cursor.origin])] = made
        if i == size:  # every new token copied the source: go on copying
            if p < size - 1:
                return _copy(seq, p, j, k, edits, kind="copy")
        else:
            again = guessing and i == cursor.length
            origin = cursor.origin if again and cursor.origin is not None else p
            since = cursor.since if again else i
            found = _resync(seq, origin, max_n, strong=True)
            if found is None and not again:  # the copy's place was wrong: a whole n-gram's
                found = _lookup_start(seq, max_n, k, min_n=max_n)  # match elsewhere
            if found is None and origin + 1 < size - 1 and size - since <= SUBSTITUTION_MAX:
                return _copy(seq, origin + 1, 0, k, edits, origin, since, kind="guess")
            if found is None:
                found = _resync(seq, origin, max_n, strong=False)
            if found is not None:
                return _copy(seq, found, 0, k, edits, kind="resync")
    start = _lookup_start(seq, max_n, k)
    if start is None:
        return [], CopyCursor(size, size, edits=edits) if edits else None
    return _copy(seq, start, 0, k, edits)


def _expected(seq: np.ndarray, p: int, edits: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    """The tokens a copy of source position p puts out: the learnt edit of its token, or it."""
    t = int(seq[p])
    return edits.get(t, (t,))


def _copy(seq: np.ndarray, p: int, j: int, k: int, edits: dict[int, tuple[int, ...]],
          origin: int | None = None, since: int = 0, *,
          kind: str = "lookup") -> tuple[list[int], CopyCursor]:
    """Up to k tokens of the source from position p (token j of its edit), edits applied."""
    size, out = seq.shape[0], list[int]()
    q, skip = p, j
    while len(out) < k and q < size:
        out.extend(_expected(seq, q, edits)[skip:skip + k - len(out)])
        q, skip = q + 1, 0
    return out, CopyCursor(size, p, origin, since, edits, offset=j, kind=kind)


def _resync(seq: np.ndarray, origin: int, max_n: int, *, strong: bool) -> int | None:
    """Where the copy resumes after an edit at source position `origin`: the end e of an
    earlier match of seq's last tokens, e from origin - RESYNC_BACK to origin + RESYNC_AHEAD.
    strong: a match of the last two tokens or more (of max_n), the nearest after origin, else
    the nearest before it; otherwise a one-token match within RESYNC_NEAR after origin (a
    common token matches all over). None: no such match."""
    size = seq.shape[0]
    lo = max(1, origin - RESYNC_BACK)
    hi = min(size - 1, origin + (RESYNC_AHEAD if strong else RESYNC_NEAR))
    if lo >= hi:  # an end e < size - 1: seq[e] is proposed
        return None
    ends = np.arange(lo, hi)
    matched = np.zeros(ends.size, dtype=np.int64)  # trailing tokens equal, up to max_n
    live = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, size - 1) + 1):
        live &= (ends >= j) & (seq[np.maximum(ends - j, 0)] == seq[size - j])
        matched[live] = j
    hits = ends[matched >= min(2, max_n)] if strong else ends[(matched >= 1) & (ends >= origin)]
    if not hits.size:
        return None
    after = hits[hits >= origin]
    return int(after[0] if after.size else hits[-1])


def _lookup_start(seq: np.ndarray, max_n: int, k: int, min_n: int = 1) -> int | None:
    """Where `lookup`'s proposal starts in seq (None: no n-gram of min_n tokens or more
    matched)."""
    size = seq.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [size - n, n]
        hits = np.flatnonzero((windows == seq[size - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= size]
            return int(full[-1] if full.size else hits[0]) + n
    return None

