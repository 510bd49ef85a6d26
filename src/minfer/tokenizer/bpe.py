"""BPE over pre-split words: merges by rank, as llama.cpp's `llm_tokenizer_bpe_session`.

Words come from the pre-tokenizer (`pretok.PreTokenizer.split`); the merging runs in the
`tokenizers` library (a BPE model with merges in file order, lowest rank first, leftmost pair on
ties), fed the words as pre-tokenized input, which keeps encoding well above 1 MB/s.
Two alphabets:
- byte-level (`byte_encode`, GPT-2 style 'gpt2' vocabularies): each UTF-8 byte of a word is one
  symbol of the GPT-2 byte alphabet;
- raw UTF-8 (Gemma 4): one symbol per character, a character missing from the vocabulary falls
  back to its `<0xNN>` byte tokens, and a word made only of newlines that is itself a token is
  emitted whole (llama.cpp's Gemma 4 rule).
"""

from __future__ import annotations

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as hf_models
from tokenizers import pre_tokenizers as hf_pre

from minfer.errors import TokenizerError
from minfer.tokenizer.pretok import PreTokenizer


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
        try:
            model = hf_models.BPE(ids, split_merges(merges), ignore_merges=pre.ignore_merges,
                                  byte_fallback=not pre.byte_encode)
        except Exception as exc:  # the library reports a merge whose parts are not tokens
            raise TokenizerError(f"bad BPE vocabulary: {exc}") from None
        self._bpe = _HFTokenizer(model)
        if pre.byte_encode:
            self._bpe.pre_tokenizer = hf_pre.ByteLevel(add_prefix_space=False,
                                                       trim_offsets=False, use_regex=False)

    def words(self, text: str) -> list[str]:
        """The pre-tokenizer's split of `text` (after `▁` escaping where the rule asks for it)."""
        return self.pre.split(text.replace(" ", "▁") if self.pre.escape_whitespace else text)

    def encode(self, text: str) -> list[int]:
        """Ids of raw text (no special tokens in it)."""
        words = self.words(text)
        if not words:
            return []
        if self.pre.byte_encode:
            return self._bpe.encode(words, is_pretokenized=True, add_special_tokens=False).ids
        ids: list[int] = []
        run: list[str] = []
        for word in words:
            whole = self._ids.get(word) if word[0] == "\n" else None
            if whole is None:
                run.append(word)
                continue
            if run:
                ids += self._bpe.encode(run, is_pretokenized=True, add_special_tokens=False).ids
                run = []
            ids.append(whole)
        if run:
            ids += self._bpe.encode(run, is_pretokenized=True, add_special_tokens=False).ids
        return ids
