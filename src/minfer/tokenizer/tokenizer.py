"""Byte-level BPE tokenizer built from GGUF metadata, with llama.cpp's special-token rules.

Encoding runs in three steps, as llama.cpp's `llama_vocab::tokenize` does:
1. special-token partition: the text is cut at every occurrence of a control / user-defined
   token text, longest texts first. Control tokens (type 3) are cut only when `special=True`;
   user-defined tokens (type 4, e.g. `<tool_call>`) always are.
2. each remaining fragment is split by the pre-tokenizer regex chosen by `tokenizer.ggml.pre`;
3. each word is byte-level encoded and merged by BPE rank.
Steps 2–3 run in the `tokenizers` library (a ByteLevel BPE with a Split pre-tokenizer, the same
object transformers builds from this metadata), which keeps encoding well above 1 MB/s.

Decoding concatenates each token's bytes: a normal token's byte-level string mapped back to
bytes, a control or user-defined token's text as UTF-8, and nothing for unused tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as hf_models
from tokenizers import pre_tokenizers as hf_pre

from minfer.errors import TokenizerError
from minfer.tokenizer.pretok import PreTokenizer, pre_tokenizer
from minfer.tokenizer.vocab import (
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    HasMetadata,
    Vocab,
    byte_level_decode,
    read_vocab,
)

Fragment = str | int  # raw text still to encode, or an already-resolved special token id


class Tokenizer:
    """Text ↔ token ids for one model. Build with `Tokenizer.from_gguf(f)`."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.pre: PreTokenizer = pre_tokenizer(vocab.pre)
        self.n_vocab: int = vocab.n_vocab
        self.bos_id: int | None = vocab.bos_id
        self.eos_id: int | None = vocab.eos_id
        self.pad_id: int | None = vocab.pad_id
        self.unk_id: int | None = vocab.unk_id
        self.eot_ids: frozenset[int] = vocab.eot_ids
        self.add_bos: bool = vocab.add_bos and vocab.bos_id is not None
        self._types = vocab.types.tolist()
        self._bytes = [_piece_bytes(t, k) for t, k in zip(vocab.tokens, self._types, strict=True)]
        self._ids = {t: i for i, t in enumerate(vocab.tokens)}
        self._bpe = _build_bpe(vocab, self._ids, self.pre)
        # (text, id, parsed only with special=True), longest UTF-8 text first, as llama.cpp.
        specials = [(t, i, k != USER_DEFINED) for i, (t, k) in enumerate(zip(vocab.tokens,
                    self._types, strict=True)) if k in (CONTROL, USER_DEFINED, UNKNOWN) and t]
        self._specials = sorted(specials, key=lambda s: (-len(s[0].encode()), s[1]))

    @classmethod
    def from_gguf(cls, f: HasMetadata) -> Tokenizer:
        """The tokenizer a GGUF file declares (only `f.metadata` is read)."""
        return cls(read_vocab(f))

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. `special`: parse control-token texts such as `<|im_start|>`.

        `add_bos=None` follows `tokenizer.ggml.add_bos_token`; a model without a BOS id adds none.
        """
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(self.bos_id)
        for frag in self._partition(text, special):
            if isinstance(frag, int):
                ids.append(frag)
            else:
                ids.extend(self._bpe.encode(frag, add_special_tokens=False).ids)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt: special tokens parsed, BOS added per the metadata
        unless the template already wrote it (no double BOS)."""
        starts_with_bos = self.bos_id is not None and text.startswith(
            self.vocab.tokens[self.bos_id])
        return self.encode(text, special=True, add_bos=self.add_bos and not starts_with_bos)

    def words(self, text: str) -> list[str]:
        """The pre-tokenizer's split of `text` (no special-token handling): for inspection."""
        pieces = self._bpe.pre_tokenizer.pre_tokenize_str(text)
        return [byte_level_decode(p).decode("utf-8", errors="replace") for p, _ in pieces]

    def _partition(self, text: str, special: bool) -> list[Fragment]:
        """Cut `text` at special-token texts, longest first (llama.cpp's st_partition)."""
        frags: list[Fragment] = [text] if text else []
        for stext, tid, control in self._specials:
            if (control and not special) or stext not in text:
                continue
            out: list[Fragment] = []
            for frag in frags:
                if isinstance(frag, int) or stext not in frag:
                    out.append(frag)
                    continue
                for n, part in enumerate(frag.split(stext)):
                    if n:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    # -- decoding ---------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a control token's text; b'' when unused)."""
        self._check(token_id)
        return self._bytes[token_id]

    def decode_bytes(self, ids: Iterable[int], *, special: bool = True) -> bytes:
        """Concatenated token bytes; `special=False` drops control and unknown tokens."""
        ids = list(ids)
        for i in ids:
            self._check(i)
        if special:
            return b"".join([self._bytes[i] for i in ids])
        return b"".join([self._bytes[i] for i in ids if not self.is_control(i)])

    def decode(self, ids: Iterable[int], *, special: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 replaced by U+FFFD). No space clean-up is applied."""
        return self.decode_bytes(ids, special=special).decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        """A token's bytes as text, broken UTF-8 replaced (what `minfer tokenize` shows)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # -- vocabulary queries -----------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """The token's string as stored in the vocabulary (byte-level form for normal tokens)."""
        self._check(token_id)
        return self.vocab.tokens[token_id]

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary string is exactly `text`, or None."""
        return self._ids.get(text)

    def is_control(self, token_id: int) -> bool:
        """Control (or unknown) token: rendered only when special tokens are shown."""
        return self._types[token_id] in (CONTROL, UNKNOWN)

    def is_eog(self, token_id: int) -> bool:
        """True for every end-of-generation id."""
        return token_id in self.eot_ids

    def _check(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary "
                                 f"(0..{self.n_vocab - 1})")

    def __repr__(self) -> str:
        return f"Tokenizer(pre={self.pre.name!r}, n_vocab={self.n_vocab})"


def load_tokenizer(f: HasMetadata) -> Tokenizer:
    """Same as `Tokenizer.from_gguf(f)`."""
    return Tokenizer.from_gguf(f)


def _piece_bytes(text: str, token_type: int) -> bytes:
    """llama.cpp's token_to_piece(special=True) for a BPE vocabulary."""
    if token_type == NORMAL:
        return byte_level_decode(text)
    if token_type in (CONTROL, USER_DEFINED, UNKNOWN):
        return text.encode("utf-8")
    return b""


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    """'a b' → ('a', 'b'): llama.cpp cuts at the first space after the first character;
    a merge without one is skipped."""
    return [(m[:cut], m[cut + 1:]) for m in merges if (cut := m.find(" ", 1)) > 0]


def _build_bpe(vocab: Vocab, ids: dict[str, int], pre: PreTokenizer) -> _HFTokenizer:
    merges = _split_merges(vocab.merges)
    try:
        model = hf_models.BPE(ids, merges, ignore_merges=pre.ignore_merges)
    except Exception as exc:  # the library reports a merge whose parts are not tokens
        raise TokenizerError(f"bad BPE vocabulary: {exc}") from None
    bpe = _HFTokenizer(model)
    bpe.pre_tokenizer = hf_pre.Sequence([
        hf_pre.Split(Regex(pre.pattern), behavior="isolated", invert=False),
        hf_pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    return bpe
