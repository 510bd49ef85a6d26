"""Tokenizer built from GGUF metadata, with llama.cpp's special-token rules.

Encoding runs as llama.cpp's `llama_vocab::tokenize` does:
1. special-token partition: the text is cut at every occurrence of a control / user-defined
   token text, longest texts first. Control tokens (type 3) are cut only when `special=True`;
   user-defined tokens (type 4, e.g. `<tool_call>`) always are.
2. each remaining fragment goes to the vocabulary's model (`tokenizer.ggml.model`):
   - 'gpt2' / 'gemma4': BPE (`bpe.BpeModel`) on the words of the pre-tokenizer chosen by
     `tokenizer.ggml.pre` (`pretok`);
   - 'llama': SentencePiece-style merges by score (`spm.SpmModel`) on the fragment with spaces
     turned into `▁`; with `add_space_prefix` a space is put first when the fragment starts
     the text or follows a special token;
   - 'bert': WordPiece (`wpm.WpmModel`); adding special tokens puts [CLS] first and [SEP] last.

Decoding concatenates each token's bytes: a byte-level token's string mapped back to bytes, an
SPM / Gemma 4 token's text with `▁` as a space, a `<0xNN>` byte token as that byte, a control
or user-defined token's text as UTF-8, and nothing for unused tokens. `decode` also removes the
space prefix that encoding put in (SPM with `add_space_prefix`), so it inverts `encode`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from minfer.errors import TokenizerError
from minfer.tokenizer.bpe import BpeModel
from minfer.tokenizer.pretok import PreTokenizer, pre_tokenizer
from minfer.tokenizer.spm import SpmModel
from minfer.tokenizer.vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    SPM_MODEL,
    UNKNOWN,
    USER_DEFINED,
    WPM_MODEL,
    HasMetadata,
    Vocab,
    byte_level_decode,
    read_vocab,
)
from minfer.tokenizer.wpm import WpmModel

_BYTE_TOKEN = re.compile("<0x[0-9A-Fa-f]{2}>")
_C_SPACE = " \t\n\v\f\r"  # what C's isspace strips next to an rstrip token

Fragment = str | int  # raw text still to encode, or an already-resolved special token id


class Tokenizer:
    """Text ↔ token ids for one model. Build with `Tokenizer.from_gguf(f)`."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.n_vocab: int = vocab.n_vocab
        self.bos_id: int | None = vocab.bos_id
        self.eos_id: int | None = vocab.eos_id
        self.pad_id: int | None = vocab.pad_id
        self.unk_id: int | None = vocab.unk_id
        self.eot_ids: frozenset[int] = vocab.eot_ids
        self.add_bos: bool = vocab.add_bos and vocab.bos_id is not None
        self.fim = vocab.fim  # fill-in-the-middle token ids (minfer.tokenizer.infill)
        self._types = vocab.types.tolist()
        self._ids = vocab.ids or dict(zip(vocab.tokens, range(self.n_vocab), strict=True))
        self.pre: PreTokenizer | None = None  # the BPE pre-tokenizer; None for SPM, WordPiece
        self._spm: SpmModel | None = None
        self._bpe: BpeModel | None = None
        self._wpm: WpmModel | None = None
        self.sep_id: int | None = vocab.sep_id
        if vocab.model == SPM_MODEL:
            self._spm = SpmModel(self._ids, vocab.scores, vocab.unk_id)
            self.kind = "spm"
        elif vocab.model == WPM_MODEL:
            self._wpm = WpmModel(self._ids, vocab.unk_id, lowercase=vocab.lowercase,
                                 strip_accents=vocab.strip_accents)
            self.kind = "wpm"
        else:
            self.pre = pre_tokenizer(vocab.pre)
            self._bpe = BpeModel(self._ids, vocab.merges, self.pre)
            self.kind = f"bpe/{self.pre.name}"
        self._byte_level = self.pre is not None and self.pre.byte_encode
        self._bytes: list[bytes | None] = [None] * self.n_vocab  # filled on first use
        # SPM puts a space before each text fragment that starts the text or follows a special
        # token; decode takes it out again.
        self._space_prefix = self._spm is not None and vocab.add_space_prefix
        # (text, id, parsed only with special=True), longest UTF-8 text first, as llama.cpp.
        special_ids = np.flatnonzero(np.isin(vocab.types, (CONTROL, USER_DEFINED, UNKNOWN)))
        specials = [(t, i, self._types[i] != USER_DEFINED) for i in special_ids.tolist()
                    if (t := vocab.tokens[i])]
        self._specials = sorted(specials, key=lambda s: (-len(s[0].encode()), s[1]))
        # which special texts occur in a text: a trie walk from each character a special text
        # can start with (Gemma 3 has 6,400 specials; testing each with `in` took longer than
        # tokenizing a 4,000-token prompt)
        self._special_trie: dict[str, object] = {}  # char -> sub-trie; "" -> index in _specials
        for k, (stext, _, _) in enumerate(self._specials):
            node = self._special_trie
            for ch in stext:
                node = node.setdefault(ch, {})  # type: ignore[assignment]
            node.setdefault("", k)
        firsts = "".join(sorted(self._special_trie))
        self._special_starts = re.compile(f"[{re.escape(firsts)}]") if firsts else None

    @classmethod
    def from_gguf(cls, f: HasMetadata) -> Tokenizer:
        """The tokenizer a GGUF file declares (only `f.metadata` is read)."""
        return cls(read_vocab(f))

    def prepare(self) -> None:
        """Finish what is otherwise built on first need (the BPE library model, see `bpe`):
        for a process that will encode long texts and would rather pay now."""
        if self._bpe is not None:
            self._bpe.prepare()

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. `special`: parse control-token texts such as `<|im_start|>`.

        `add_bos=None` follows `tokenizer.ggml.add_bos_token`; a model without a BOS id adds none.
        A WordPiece vocabulary adds [SEP] at the end whenever it adds [CLS] (its BOS) first.
        """
        ids: list[int] = []
        bos = (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None
        if bos:
            ids.append(self.bos_id)  # type: ignore[arg-type]
        after_special = True
        for frag in self._partition(text, special):
            if isinstance(frag, int):
                ids.append(frag)
                after_special = True
            elif self._wpm is not None:
                ids += self._wpm.encode(frag)
            elif self._spm is not None:
                if self._space_prefix and after_special:
                    frag = " " + frag
                ids += self._spm.encode(frag.replace(" ", "▁"))
                after_special = False
            else:
                assert self._bpe is not None
                ids += self._bpe.encode(frag)
        if bos and self._wpm is not None and self.sep_id is not None:
            ids.append(self.sep_id)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt: special tokens parsed, BOS added per the metadata
        unless the template already wrote it (no double BOS)."""
        starts_with_bos = self.bos_id is not None and text.startswith(
            self.vocab.tokens[self.bos_id])
        return self.encode(text, special=True, add_bos=self.add_bos and not starts_with_bos)

    def words(self, text: str) -> list[str]:
        """The pre-tokenizer's split of `text` (no special-token handling): for inspection.
        An SPM vocabulary has no pre-tokenizer: the whole text is one word."""
        if self._bpe is None:
            return [text] if text else []
        return self._bpe.words(text)

    def _partition(self, text: str, special: bool) -> list[Fragment]:
        """Cut `text` at special-token texts, longest first (llama.cpp's st_partition)."""
        frags: list[Fragment] = [text] if text else []
        rstrip = self.vocab.rstrip_ids
        for stext, tid, control in self._specials_in(text):
            if control and not special:
                continue
            hits = [i for i, f in enumerate(frags) if f.__class__ is str and stext in f]
            if not hits:
                continue
            out: list[Fragment] = []
            done = 0
            for i in hits:
                out += frags[done:i]
                done = i + 1
                frag = frags[i]
                assert isinstance(frag, str)
                for n, part in enumerate(frag.split(stext)):
                    if n:
                        out.append(tid)
                        if tid in rstrip:
                            part = part.lstrip(_C_SPACE)
                    if part:
                        out.append(part)
            out += frags[done:]
            frags = out
        return frags

    def _specials_in(self, text: str) -> list[tuple[str, int, bool]]:
        """The special tokens whose text occurs in `text`, in partition order: a walk down the
        trie of special texts from each character a special text can start with."""
        if self._special_starts is None:
            return []
        trie = self._special_trie
        found: set[int] = set()
        n = len(text)
        for m in self._special_starts.finditer(text):
            node = trie
            p = m.start()
            while p < n:
                node = node.get(text[p])  # type: ignore[assignment]
                if node is None:
                    break
                p += 1
                k = node.get("")
                if k is not None:
                    found.add(k)  # type: ignore[arg-type]
        return [self._specials[k] for k in sorted(found)]

    # -- decoding ---------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a control token's text; b'' when unused)."""
        self._check(token_id)
        return self._piece(token_id)

    def _piece(self, token_id: int) -> bytes:
        piece = self._bytes[token_id]
        if piece is None:
            piece = _piece_bytes(self.vocab.tokens[token_id], self._types[token_id],
                                 self._byte_level)
            self._bytes[token_id] = piece
        return piece

    def decode_bytes(self, ids: Iterable[int], *, special: bool = True) -> bytes:
        """Concatenated token bytes; `special=False` drops control and unknown tokens.
        The space an SPM vocabulary's `add_space_prefix` put before each text fragment (at the
        start and after each special token) is taken out."""
        ids = list(ids)
        for i in ids:
            self._check(i)
        if self._space_prefix:
            return self._decode_space_prefixed(ids, special)
        piece = self._piece
        if special:
            return b"".join([piece(i) for i in ids])
        return b"".join([piece(i) for i in ids if not self.is_control(i)])

    def _decode_space_prefixed(self, ids: list[int], special: bool) -> bytes:
        out: list[bytes] = []
        after_special = True
        for i in ids:
            piece = self._piece(i)
            if self._types[i] in (CONTROL, USER_DEFINED, UNKNOWN):
                after_special = True
                if special or not self.is_control(i):
                    out.append(piece)
                continue
            if after_special and piece.startswith(b" "):
                piece = piece[1:]
            after_special = False
            out.append(piece)
        return b"".join(out)

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
        return f"Tokenizer(kind={self.kind!r}, n_vocab={self.n_vocab})"


def load_tokenizer(f: HasMetadata) -> Tokenizer:
    """Same as `Tokenizer.from_gguf(f)`."""
    return Tokenizer.from_gguf(f)


def _piece_bytes(text: str, token_type: int, byte_level: bool) -> bytes:
    """llama.cpp's token_to_piece(special=True): what a token stands for as bytes."""
    if token_type == BYTE and _BYTE_TOKEN.fullmatch(text):
        return bytes([int(text[3:5], 16)])
    if token_type in (NORMAL, BYTE):
        return byte_level_decode(text) if byte_level else text.replace("▁", " ").encode("utf-8")
    if token_type in (CONTROL, USER_DEFINED, UNKNOWN):
        return text.encode("utf-8")
    return b""
