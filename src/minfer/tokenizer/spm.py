"""SentencePiece-style tokenization ('llama' vocabularies), as llama.cpp's `llm_tokenizer_spm`.

The text (spaces already turned into `▁` by the caller) starts as one symbol per character.
Every adjacent pair whose concatenation is a token is a candidate; the candidate whose token has
the highest score is merged first (the leftmost on ties), then the new neighbours are offered.
Candidates live in a heap and go stale when one side has grown since they were pushed; those are
skipped, exactly as llama.cpp's work queue does. A final symbol that is not a token (a character
outside the vocabulary) falls back to its UTF-8 bytes as `<0xNN>` tokens.

Speed: a merge never crosses a point that no token can span. Before a `▁` that follows another
character, only a "bridging" token (one holding a non-`▁` character followed by `▁`, e.g. Gemma's
`>▁</`) could; such points are cut unless a bridging token occurs across them, and each piece
is merged on its own, its ids cached (words repeat). The result is the same as merging the
whole text at once.
"""

from __future__ import annotations

import heapq
import re

import numpy as np

from minfer.errors import TokenizerError


class SpmModel:
    """Text → ids by score-ordered bigram merges with byte fallback."""

    def __init__(self, ids: dict[str, int], scores: np.ndarray, unk_id: int | None) -> None:
        self._ids = ids
        self._scores: list[float] = scores.astype(np.float64).tolist()
        self._byte_ids = [_byte_token(ids, b) for b in range(256)]
        self._unk_id = unk_id
        self._bridging = [t for t in ids if "▁" in t[1:] and _BRIDGE.search(t)]
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """Ids of `text` (already `▁`-escaped; no special tokens in it)."""
        cuts = [m.start() for m in _BRIDGE.finditer(text)]
        if self._bridging and cuts:
            covered = {c + 1 for t in self._bridging if t in text
                       for m in re.finditer(re.escape(t), text)
                       for c in range(m.start(), m.end() - 1)}
            cuts = [c for c in cuts if c + 1 not in covered]
        if not cuts:
            return self._encode_piece(text)
        cache = self._cache
        if len(cache) > 100_000:
            cache.clear()
        out: list[int] = []
        start = 0
        for c in [*(c + 1 for c in cuts), len(text)]:
            piece = text[start:c]
            start = c
            ids = cache.get(piece)
            if ids is None:
                ids = cache[piece] = self._encode_piece(piece)
            out += ids
        return out

    def _encode_piece(self, text: str) -> list[int]:
        """llama.cpp's merge loop over one piece."""
        n = len(text)
        if n == 0:
            return []
        get = self._ids.get
        scores = self._scores
        sym = list(text)  # a merged symbol's text sits at its leftmost index; absorbed ones are ""
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = get(text[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            a, b = sym[left], sym[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # stale: one side has been merged since
            merged = a + b
            sym[left] = merged
            sym[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                t = sym[before] + merged
                tid = get(t)
                if tid is not None:
                    push(heap, (-scores[tid], before, left, len(t)))
            if after >= 0:
                t = merged + sym[after]
                tid = get(t)
                if tid is not None:
                    push(heap, (-scores[tid], left, after, len(t)))
        out: list[int] = []
        i = 0
        while i >= 0:
            piece = sym[i]
            tid = get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out += self._fallback(piece)
            i = nxt[i]
        return out

    def _fallback(self, piece: str) -> list[int]:
        ids: list[int] = []
        for byte in piece.encode("utf-8"):
            tid = self._byte_ids[byte]
            if tid is None:
                if self._unk_id is None:
                    raise TokenizerError(f"the vocabulary has no byte token <0x{byte:02X}> "
                                         f"and no unknown token for {piece!r}")
                tid = self._unk_id
            ids.append(tid)
        return ids


# a character other than ▁ followed by ▁: where a merge could cross a word start
_BRIDGE = re.compile("[^▁]▁")


def _byte_token(ids: dict[str, int], byte: int) -> int | None:
    """llama.cpp's byte_to_token for SPM: `<0xNN>`, else the byte itself as a one-char token."""
    tid = ids.get(f"<0x{byte:02X}>")
    if tid is None and byte < 0x80:
        tid = ids.get(chr(byte))
    return tid
