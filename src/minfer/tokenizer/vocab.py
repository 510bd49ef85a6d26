"""The vocabulary a GGUF file declares under `tokenizer.ggml.*`, read once into plain values.

`read_vocab(f)` is the only place that touches GGUF metadata for the tokenizer; everything else
works on the `Vocab` it returns. Four model kinds (`tokenizer.ggml.model`) are read:
'gpt2' (byte-level BPE), 'llama' (SentencePiece-style: merges by score, `<0xNN>` byte
fallback), 'gemma4' (BPE over raw UTF-8 with `▁` for spaces) and 'bert' (WordPiece in
llama.cpp's phantom-space form, with its normaliser flags; [CLS] 101 / [SEP] 102 / [UNK] 100
unless the file names others, and a vocabulary holding neither is refused). Defaults follow
llama.cpp's `llama_vocab::load`: an SPM vocabulary without the keys has bos 1, eos 2, unk 0,
adds BOS and a space prefix; `tokenizer.ggml.add_bos_token` / `add_space_prefix` override them.
Special-token rules follow llama.cpp too: token types come from `tokenizer.ggml.token_type`,
tokens whose text llama.cpp recognises as end-of-generation (or FIM pad / repo /
file-separator) are promoted to control tokens, and the end-of-generation set is
eos + eot + eom + those tokens.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from minfer.errors import TokenizerError
from minfer.gguf.parse import StringArray

# llama_token_type values stored in tokenizer.ggml.token_type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.model values minfer reads.
BPE_MODEL, SPM_MODEL, GEMMA4_MODEL, WPM_MODEL = "gpt2", "llama", "gemma4", "bert"
MODELS = (BPE_MODEL, SPM_MODEL, GEMMA4_MODEL, WPM_MODEL)

# Token texts llama.cpp treats as end-of-generation whatever the metadata says.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>",
})
# `</s>` stays an ordinary token (not end-of-generation) where one of these is end-of-generation
# (Gemma 4, PLaMo); elsewhere llama.cpp promotes it, even in Qwen2's vocabulary.
_NORMAL_S_MARKERS = frozenset({"<|tool_response>", "<|plamo:eos|>"})
# gpt-oss tokens llama.cpp always renders (user-defined whatever the metadata says).
_ALWAYS_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# Fill-in-the-middle tokens by role: the id key, its deprecated name, then the texts llama.cpp
# recognises when the file names no id (the development model's GGUF has no fim_* keys).
FIM_ROLES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "pre": ("prefix", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>",
                       "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>")),
    "suf": ("suffix", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
                       "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>")),
    "mid": ("middle", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>",
                       "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>")),
    "pad": (None, ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    "rep": (None, ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    "sep": (None, ("<|file_sep|>",)),
}
# FIM pad / repo / file-separator tokens: llama.cpp stops generation on them too.
FIM_EOG_TEXTS = {f"tokenizer.ggml.fim_{role}_token_id": FIM_ROLES[role][1]
                 for role in ("pad", "rep", "sep")}
_EOG_CANDIDATES = EOG_TEXTS.union(*FIM_EOG_TEXTS.values())
_EOG_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id")


class HasMetadata(Protocol):
    """What the tokenizer needs of a `GGUFFile`."""

    @property
    def metadata(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Vocab:
    """Plain-value view of the tokenizer metadata (token types already llama.cpp-adjusted)."""

    model: str  # one of MODELS
    pre: str
    tokens: list[str]
    types: np.ndarray  # int32 [n_vocab]
    merges: list[str]
    scores: np.ndarray  # float32 [n_vocab] (zeros when the file has none)
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    eot_ids: frozenset[int]
    add_bos: bool
    add_space_prefix: bool  # SPM: a space is put before the text (and after each special token)
    rstrip_ids: frozenset[int]  # special tokens that eat the whitespace after them (Phi-3)
    chat_template: str | None
    fim: FimTokens = field(default_factory=lambda: FimTokens())
    sep_id: int | None = None  # WordPiece: [SEP], appended after the text with add_bos's [CLS]
    lowercase: bool = True  # WordPiece normaliser: lowercase the text (llama.cpp: by default)
    strip_accents: bool = False  # WordPiece normaliser: drop accents (defaults to lowercase)
    add_eos: bool = False  # `tokenizer.ggml.add_eos_token` (an embedding model's closing EOS)
    # each text's id, a later duplicate winning as in llama.cpp's map (made when not given)
    ids: dict[str, int] = field(default_factory=dict, repr=False, compare=False)


    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class FimTokens:
    """The fill-in-the-middle tokens of a vocabulary (None where it has none)."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    def missing(self) -> list[str]:
        """The roles an infill prompt needs that this vocabulary lacks (prefix, suffix, middle)."""
        names = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
        return [names[role] for role in ("pre", "suf", "mid") if getattr(self, role) is None]


def _as_list(value: Any, key: str) -> list[str]:
    if isinstance(value, StringArray):  # decoded to str by construction
        return value.tolist()
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise TokenizerError(f"{key} is not a string array")
    return value


def _token_id(meta: Mapping[str, Any], key: str, n_vocab: int,
              default: int | None = None) -> int | None:
    """An id-valued key (or the model kind's default when absent); None when out of range
    (llama.cpp ignores those and keeps the default)."""
    fallback = default if default is not None and 0 <= default < n_vocab else None
    value = meta.get(key)
    if value is None:
        return fallback
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TokenizerError(f"{key}={value!r} is not an integer")
    return int(value) if 0 <= int(value) < n_vocab else fallback


def read_vocab(f: HasMetadata) -> Vocab:
    """Read and check the `tokenizer.*` metadata of an open GGUF file."""
    meta = f.metadata
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("the file has no tokenizer (tokenizer.ggml.model is missing)")
    if model not in MODELS:
        raise TokenizerError(f"unsupported tokenizer model {model!r} (minfer reads "
                             f"{', '.join(repr(m) for m in MODELS)})")
    tokens = _as_list(meta.get("tokenizer.ggml.tokens", []), "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
    merges = _as_list(meta.get("tokenizer.ggml.merges", []), "tokenizer.ggml.merges")
    n_vocab = len(tokens)
    raw_types = meta.get("tokenizer.ggml.token_type")
    if raw_types is None:
        types = np.full(n_vocab, NORMAL, dtype=np.int32)
    else:
        types = np.array(raw_types, dtype=np.int32)
        if types.shape != (n_vocab,):
            raise TokenizerError(f"tokenizer.ggml.token_type has {types.size} entries for "
                                 f"{n_vocab} tokens")
    raw_scores = meta.get("tokenizer.ggml.scores")
    if raw_scores is None:
        if model == SPM_MODEL:
            raise TokenizerError("tokenizer.ggml.scores is missing (an SPM vocabulary merges by "
                                 "score)")
        scores = np.zeros(n_vocab, dtype=np.float32)
    else:
        scores = np.asarray(raw_scores, dtype=np.float32)
        if scores.shape != (n_vocab,):
            raise TokenizerError(f"tokenizer.ggml.scores has {scores.size} entries for "
                                 f"{n_vocab} tokens")
    if model == GEMMA4_MODEL and not merges:
        raise TokenizerError("tokenizer.ggml.merges is missing (a gemma4 vocabulary is BPE)")
    spm, wpm = model == SPM_MODEL, model == WPM_MODEL
    eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", n_vocab, 2 if spm else None)
    # llama.cpp's WordPiece defaults: [CLS] 101 (as BOS), [SEP] 102, [UNK] 100
    bos_default = 1 if spm else 101 if wpm else None
    unk_default = 0 if spm else 100 if wpm else None
    bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", n_vocab, bos_default)
    sep_id = _token_id(meta, "tokenizer.ggml.seperator_token_id", n_vocab, 102 if wpm else None)
    if wpm and (bos_id is None or sep_id is None):
        raise TokenizerError(f"this WordPiece vocabulary of {n_vocab} tokens has no "
                             f"{'[CLS]' if bos_id is None else '[SEP]'} token (neither the "
                             "metadata's id nor llama.cpp's default id is in it)")
    lowercase = _flag(meta, "tokenizer.ggml.normalizer.lowercase", True)
    ids = dict(zip(tokens, range(n_vocab), strict=True))  # a later duplicate wins, as llama.cpp
    eot_ids = _end_of_generation(meta, tokens, ids, types)
    if eos_id is not None:
        eot_ids |= {eos_id}
    return Vocab(
        model=model,
        pre=GEMMA4_MODEL if model == GEMMA4_MODEL else str(meta.get("tokenizer.ggml.pre", "")),
        tokens=tokens,
        types=types,
        merges=merges,
        scores=scores,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=_token_id(meta, "tokenizer.ggml.padding_token_id", n_vocab),
        unk_id=_token_id(meta, "tokenizer.ggml.unknown_token_id", n_vocab, unk_default),
        eot_ids=eot_ids,
        add_bos=_add_bos(meta, model),
        add_space_prefix=_flag(meta, "tokenizer.ggml.add_space_prefix", spm),
        rstrip_ids=_rstrip_ids(meta, tokens, types),
        chat_template=read_chat_template(f),
        fim=_fim_tokens(meta, ids, types),
        sep_id=sep_id,
        lowercase=lowercase,
        strip_accents=_flag(meta, "tokenizer.ggml.normalizer.strip_accents", lowercase),
        add_eos=_flag(meta, "tokenizer.ggml.add_eos_token", False),
        ids=ids,
    )


def _fim_tokens(meta: Mapping[str, Any], index: Mapping[str, int],
                types: np.ndarray) -> FimTokens:
    """Each FIM role's id: `tokenizer.ggml.fim_<role>_token_id` (or its deprecated
    `<prefix|suffix|middle>_token_id`), else the first of llama.cpp's texts the vocabulary has,
    promoted to a control token as llama.cpp does. index: each text's id."""
    n_vocab = len(types)
    found: dict[str, int | None] = {}
    for role, (old_name, texts) in FIM_ROLES.items():
        tid = _token_id(meta, f"tokenizer.ggml.fim_{role}_token_id", n_vocab)
        if tid is None and old_name is not None:
            tid = _token_id(meta, f"tokenizer.ggml.{old_name}_token_id", n_vocab)
        if tid is None:
            tid = next((index[t] for t in texts if t in index), None)
            if tid is not None:
                types[tid] = CONTROL
        found[role] = tid
    return FimTokens(**found)


# `tokenizer.ggml.pre` values for which llama.cpp adds BOS when the file does not say.
_PRE_ADDING_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                             "midm-2.0", "lfm2", "jina-v5-nano", "tekken", "chameleon"})


def _rstrip_ids(meta: Mapping[str, Any], tokens: Sequence[str],
                types: np.ndarray) -> frozenset[int]:
    """llama.cpp's per-model token attributes: for a model named Phi-3 every special token but
    `<unk>`, `<s>`, `<|endoftext|>` (and `</s>` in any case) strips the whitespace after it."""
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    special = np.flatnonzero(np.isin(types, (CONTROL, USER_DEFINED, UNKNOWN))).tolist()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    ids = {i for i in special if tokens[i] not in keep}
    ids.update(i for i, t in enumerate(tokens) if t == "</s>")
    return frozenset(ids)


def _flag(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool | np.bool_):
        raise TokenizerError(f"{key}={value!r} is not true or false")
    return bool(value)


def _add_bos(meta: Mapping[str, Any], model: str) -> bool:
    """llama.cpp's add_bos: SPM, WordPiece ([CLS]) and Llama-3-style BPE default to true,
    gemma4 always adds it."""
    pre = str(meta.get("tokenizer.ggml.pre", ""))
    default = model in (SPM_MODEL, WPM_MODEL) or (model == BPE_MODEL and pre in _PRE_ADDING_BOS)
    return _flag(meta, "tokenizer.ggml.add_bos_token", default) or model == GEMMA4_MODEL


def read_chat_template(f: HasMetadata) -> str | None:
    """The file's `tokenizer.chat_template`, None when it has none."""
    template = f.metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template.strip() else None


def _end_of_generation(meta: Mapping[str, Any], tokens: Sequence[str], ids: Mapping[str, int],
                       types: np.ndarray) -> frozenset[int]:
    """Every end-of-generation id; promotes the ones found by text to CONTROL in `types`.
    ids: each text's id (llama.cpp's token_to_id, which these rules read)."""
    n_vocab = len(tokens)
    index = {t: ids[t] for t in _EOG_CANDIDATES if t in ids}
    eog: set[int] = set()
    for key, texts in FIM_EOG_TEXTS.items():
        tid = _token_id(meta, key, n_vocab)
        if tid is None:
            tid = next((index[t] for t in texts if t in index), None)
        if tid is not None:
            eog.add(tid)
            types[tid] = CONTROL
    for text, tid in index.items():
        if text in EOG_TEXTS:
            eog.add(tid)
            types[tid] = CONTROL
    for text in _ALWAYS_USER_DEFINED & ids.keys():
        types[ids[text]] = USER_DEFINED
    for key in _EOG_ID_KEYS:
        tid = _token_id(meta, key, n_vocab)
        if tid is not None:
            eog.add(tid)
    eog_ids = {tokens[i]: i for i in eog}
    # o200k_harmony / solar-open: `<|end|>` ends a message, not the generation
    has_call = "<|call|>" in eog_ids or "<|calls|>" in eog_ids
    if "<|end|>" in eog_ids and has_call and ("<|return|>" in eog_ids or "<|flush|>" in eog_ids):
        eog.discard(eog_ids["<|end|>"])
        types[eog_ids["<|end|>"]] = USER_DEFINED
    if "</s>" in eog_ids and _NORMAL_S_MARKERS & eog_ids.keys():
        eog.discard(eog_ids["</s>"])
        types[eog_ids["</s>"]] = NORMAL
    return frozenset(eog)


# GPT-2 byte-level alphabet: byte b is stored as the character BYTE_CHARS[b].
def _byte_chars() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = [""] * 256
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


BYTE_CHARS = _byte_chars()
_CHAR_TO_BYTE = {ord(c): b for b, c in enumerate(BYTE_CHARS)}
_OUTSIDE_ALPHABET = re.compile("[^" + re.escape("".join(BYTE_CHARS)) + "]")


def byte_level_decode(text: str) -> bytes:
    """The bytes a byte-level token string stands for (chars outside the alphabet as UTF-8)."""
    if not _OUTSIDE_ALPHABET.search(text):
        return text.translate(_CHAR_TO_BYTE).encode("latin-1")
    out = bytearray()
    for ch in text:
        b = _CHAR_TO_BYTE.get(ord(ch))
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)
