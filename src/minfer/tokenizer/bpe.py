"""BPE over pre-split words: merges by rank, as llama.cpp's `llm_tokenizer_bpe_session`.

Words come from the pre-tokenizer (`pretok.PreTokenizer.split`); the merging runs in the
`tokenizers` library (a BPE model with merges in file order, lowest rank first, leftmost pair on
ties), fed the words as pre-tokenized input, which keeps encoding well above 1 MB/s.
Building that library model takes a quarter second for a 150,000-merge vocabulary, all of it
holding the GIL, so it is built on first need: a short text of a byte-level vocabulary (a
chat turn, a prompt typed on the command line) merges here in Python by the same rule (the
lowest-ranked adjacent pair, the leftmost of equals, until none is left), word by word with
a cache. The library model is built, and its verdict on the merge list taken, the first time
a text has more than `PY_MAX_WORDS` words or a word longer than `PY_MAX_SYMBOLS` symbols;
`prepare()` builds it at once (a server does at start-up).
Two alphabets:
- byte-level (`byte_encode`, GPT-2 style 'gpt2' vocabularies): each UTF-8 byte of a word is one
  symbol of the GPT-2 byte alphabet;
- raw UTF-8 (Gemma 4): one symbol per character, a character missing from the vocabulary falls
  back to its `<0xNN>` byte tokens, and a word made only of newlines that is itself a token is
  emitted whole (llama.cpp's Gemma 4 rule).
"""

from __future__ import annotations

from itertools import repeat
from operator import contains
from typing import TYPE_CHECKING

from minfer.errors import TokenizerError
from minfer.tokenizer.pretok import PreTokenizer
from minfer.tokenizer.vocab import BYTE_CHARS

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _HFTokenizer

PY_MAX_WORDS = 512  # longer texts build the library model (merging here costs ~5 us a word)
PY_MAX_SYMBOLS = 64  # the Python merge is quadratic in a word's length
_TO_BYTE_CHARS = {b: c for b, c in enumerate(BYTE_CHARS)}  # a word's latin-1 text → alphabet


def split_merges(merges: list[str]) -> list[tuple[str, str]]:
    """'a b' → ('a', 'b'): llama.cpp cuts at the first space after the first character;
    a merge without one is skipped. (`str.split` where the first character is not a space:
    the same cut, at a fraction of the cost for 150,000 merges.)"""
    out: list[tuple[str, str]] = []
    for m in merges:
        if m[:1] != " ":
            parts = m.split(" ", 1)
            if len(parts) == 2:
                out.append((parts[0], parts[1]))
        elif (cut := m.find(" ", 1)) > 0:
            out.append((m[:cut], m[cut + 1:]))
    return out


class BpeModel:
    """Word → ids for one BPE vocabulary and pre-tokenizer."""

    def __init__(self, ids: dict[str, int], merges: list[str], pre: PreTokenizer) -> None:
        self.pre = pre
        self._ids = ids
        self._merges = merges
        self._lib: _HFTokenizer | None = None
        # the Python merge's ranks, keyed by the merge's own text: byte-level vocabularies only
        # (their symbols hold no space, so "a b" names one pair)
        self._ranks = merge_ranks(merges) if pre.byte_encode else None
        self._words: dict[str, list[int]] = {}
        if self._ranks is None:
            self.prepare()

    def prepare(self) -> None:
        """Build the library model now (TokenizerError where it refuses the merge list)."""
        if self._lib is not None:
            return
        # (the library is imported here, where its model is built: a short prompt never is)
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import models as hf_models
        from tokenizers import pre_tokenizers as hf_pre

        try:
            model = hf_models.BPE(self._ids, split_merges(self._merges),
                                  ignore_merges=self.pre.ignore_merges,
                                  byte_fallback=not self.pre.byte_encode)
        except Exception as exc:  # the library reports a merge whose parts are not tokens
            raise TokenizerError(f"bad BPE vocabulary: {exc}") from None
        lib = _HFTokenizer(model)
        if self.pre.byte_encode:
            lib.pre_tokenizer = hf_pre.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                 use_regex=False)
        self._lib = lib
        self._words.clear()

    def words(self, text: str) -> list[str]:
        """The pre-tokenizer's split of `text` (after `▁` escaping where the rule asks for it)."""
        return self.pre.split(text.replace(" ", "▁") if self.pre.escape_whitespace else text)

    def encode(self, text: str) -> list[int]:
        """Ids of raw text (no special tokens in it)."""
        words = self.words(text)
        if not words:
            return []
        if self._lib is None and len(words) <= PY_MAX_WORDS:
            ids = self._encode_here(words)
            if ids is not None:
                return ids
        self.prepare()
        assert self._lib is not None
        if self.pre.byte_encode:
            return self._lib.encode(words, is_pretokenized=True, add_special_tokens=False).ids
        ids = []
        run: list[str] = []
        for word in words:
            whole = self._ids.get(word) if word[0] == "\n" else None
            if whole is None:
                run.append(word)
                continue
            if run:
                ids += self._lib.encode(run, is_pretokenized=True, add_special_tokens=False).ids
                run = []
            ids.append(whole)
        if run:
            ids += self._lib.encode(run, is_pretokenized=True, add_special_tokens=False).ids
        return ids

    def _encode_here(self, words: list[str]) -> list[int] | None:
        """The byte-level merge in Python, or None where the library must decide (a long word,
        a symbol or merge result that is not a token)."""
        cache = self._words
        if len(cache) > 65536:
            cache.clear()
        out: list[int] = []
        for word in words:
            ids = cache.get(word)
            if ids is None:
                ids = self._merge_word(word)
                if ids is None:
                    return None
                cache[word] = ids
            out += ids
        return out

    def _merge_word(self, word: str) -> list[int] | None:
        vocab, ranks = self._ids, self._ranks
        assert ranks is not None
        chars = word.encode("utf-8").decode("latin-1").translate(_TO_BYTE_CHARS)
        if self.pre.ignore_merges and (whole := vocab.get(chars)) is not None:
            return [whole]
        syms = list(chars)
        if len(syms) > PY_MAX_SYMBOLS:
            return None
        while len(syms) > 1:
            best, best_rank = -1, len(ranks)
            for i in range(len(syms) - 1):
                r = ranks.get(f"{syms[i]} {syms[i + 1]}")
                if r is not None and r < best_rank:
                    best, best_rank = i, r
            if best < 0:
                break
            syms[best:best + 2] = [syms[best] + syms[best + 1]]
        ids = [vocab.get(sym) for sym in syms]
        return None if None in ids else ids  # type: ignore[return-value]


def merge_ranks(merges: list[str]) -> dict[str, int]:
    """Each merge's rank by its text, counting the merges `split_merges` keeps, a later
    duplicate replacing an earlier one (as the library's merge map does)."""
    # none starts with a space: no NUL-space in them joined (a NUL inside a merge can only
    # send a vocabulary to the general path, which gives the same ranks)
    if all(map(contains, merges, repeat(" "))) and "\0 " not in "\0" + "\0".join(merges):
        return dict(zip(merges, range(len(merges)), strict=True))
    return {f"{a} {b}": r for r, (a, b) in enumerate(split_merges(merges))}
