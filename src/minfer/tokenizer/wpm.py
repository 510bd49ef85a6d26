"""WordPiece (`tokenizer.ggml.model = bert`) as llama.cpp's `llm_tokenizer_wpm_session` runs it.

The vocabulary is stored in llama.cpp's phantom-space form: a word-initial piece is `▁piece`, a
continuation (`##piece` in BERT's vocab.txt) is the bare `piece`, control tokens stay as written.
Encoding a text fragment:
1. normalise and split: per code point, llama.cpp's "NFD" (the first code point of the canonical
   decomposition, so `Ä` → `A`) and accent-mark removal when the vocabulary strips accents,
   lowercasing (the simple Unicode mapping) when it lowercases; whitespace ends a word; NUL,
   U+FFFD and control characters are dropped; punctuation, ASCII symbols and CJK ideographs are
   words of their own.
2. each word, prefixed with `▁`, is cut greedily into the longest vocabulary pieces from the
   left, over its UTF-8 bytes with at most the longest token's length per try; a word with a
   position no piece matches becomes `[UNK]` whole.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Mapping

_PHANTOM = "\u2581"
_WHITESPACE = frozenset([*range(0x09, 0x0E), *range(0x2000, 0x200B), 0x20, 0x85, 0xA0, 0x1680,
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
# what a code point does in the split: kept in the word, ends it, stands alone, or is dropped
_KEEP, _SPACE, _ALONE, _DROP = 0, 1, 2, 3


@functools.lru_cache(maxsize=65536)
def _char_class(cp: int, strip_accents: bool) -> int:
    if cp in _WHITESPACE:
        return _SPACE
    cat = unicodedata.category(chr(cp))
    if cp == 0 or cp == 0xFFFD or (cat[0] == "C" and cat != "Cn"):
        return _DROP
    if strip_accents and cat[0] == "M":
        return _DROP
    if cat[0] == "P" or (cp < 0x7F and cat[0] == "S") or any(a <= cp <= b for a, b in _CJK):
        return _ALONE
    return _KEEP


@functools.lru_cache(maxsize=65536)
def _nfd_first(ch: str) -> str:
    return unicodedata.normalize("NFD", ch)[0]


@functools.lru_cache(maxsize=65536)
def _lower(ch: str) -> str:
    low = ch.lower()
    return low[0] if low else ch  # the simple mapping: U+0130 lowers to 'i' alone


def split_words(text: str, *, lowercase: bool, strip_accents: bool) -> list[str]:
    """Step 1: the normalised words of a text fragment."""
    words: list[str] = []
    word: list[str] = []
    for ch in text:
        if strip_accents:
            ch = _nfd_first(ch)
        kind = _char_class(ord(ch), strip_accents)
        if kind == _KEEP:
            word.append(_lower(ch) if lowercase else ch)
            continue
        if kind == _DROP:
            continue
        if word:
            words.append("".join(word))
            word = []
        if kind == _ALONE:
            words.append(_lower(ch) if lowercase else ch)
    if word:
        words.append("".join(word))
    return words


class WpmModel:
    """Greedy longest-match WordPiece over a phantom-space vocabulary."""

    def __init__(self, ids: Mapping[str, int], unk_id: int | None, *, lowercase: bool,
                 strip_accents: bool) -> None:
        self._ids = {text.encode("utf-8"): i for text, i in ids.items()}
        self._max_len = max((len(t) for t in self._ids), default=0)
        self._unk = unk_id
        self.lowercase = lowercase
        self.strip_accents = strip_accents

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for word in split_words(text, lowercase=self.lowercase, strip_accents=self.strip_accents):
            out += self._word(word)
        return out

    @functools.lru_cache(maxsize=16384)  # noqa: B019 (one model per tokenizer, kept for its life)
    def _word(self, word: str) -> tuple[int, ...]:
        data = (_PHANTOM + word).encode("utf-8")
        n, ids, max_len = len(data), self._ids, self._max_len
        pieces: list[int] = []
        i = 0
        while i < n:
            for j in range(min(n, i + max_len + 1), i, -1):
                tid = ids.get(data[i:j])
                if tid is not None:
                    pieces.append(tid)
                    i = j
                    break
            else:  # a position no piece starts: the whole word is unknown
                pieces = []
                break
        if not pieces and self._unk is not None:
            return (self._unk,)
        return tuple(pieces)
