"""A checkpoint's tokenizer as GGUF metadata, written the way llama.cpp's converter writes it.

Three sources: a BERT's WordPiece `tokenizer.json` (`bert` model in llama.cpp's phantom-space
form), a byte-level BPE `tokenizer.json` (`tokenizer.ggml.model = gpt2`, tokens padded to
the config's vocab_size with `[PADi]`, merges, and `tokenizer.ggml.pre` named from the split
regex) or a SentencePiece `tokenizer.model` read with `sentencepiece` (`llama` model, scores
and token types, added tokens from `added_tokens.json` / `tokenizer_config.json`). Special
token ids, add-BOS/EOS flags, merges, the chat template and the normalizer flags come from
`special.SpecialVocab` (llama.cpp's own reader of `tokenizer.json` / `tokenizer_config.json` /
`config.json`).
The pre-tokenizer is recognised by its regex, not guessed: an unknown one is refused unless
`pre` names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from gguf import TokenType

from minfer.convert.checkpoint import CheckpointError
from minfer.convert.special import SpecialVocab
from minfer.tokenizer.pretok import LLAMA3, QWEN2

_SPM_UNUSED_SCORE = -10000.0
_KNOWN_SPLITS = {QWEN2: "qwen2", LLAMA3: "llama-bpe"}


@dataclass(frozen=True)
class Vocab:
    """The tokenizer's KVs are written by `write`; `n_tokens` sizes Gemma's embedding trim."""

    kind: str  # "bpe" | "spm" | "wpm"
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    pre: str
    model_dir: Path

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    n_token_types: int = 0  # WordPiece: BERT's token-type count (written first)

    def write(self, w: gguf.GGUFWriter) -> None:
        if self.kind == "wpm":
            w.add_token_type_count(self.n_token_types)
        w.add_tokenizer_model({"bpe": "gpt2", "spm": "llama", "wpm": "bert"}[self.kind])
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        if self.kind == "bpe":
            special = SpecialVocab(self.model_dir, load_merges=True)
        else:
            special = SpecialVocab(self.model_dir, n_vocab=self.n_tokens)
        special.add_to_gguf(w)


def looks_special(token: str) -> bool:
    """Added tokens some models forget to mark special (llama.cpp's list)."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _split_regex(tok: dict[str, Any]) -> str | None:
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "Split":
            pattern = step.get("pattern", {})
            return str(pattern.get("Regex", pattern.get("String", "")))
    return None


def bpe_pre_name(tok: dict[str, Any], path: Path) -> str:
    regex = _split_regex(tok)
    if regex in _KNOWN_SPLITS:
        return _KNOWN_SPLITS[regex]
    raise CheckpointError(f"{path}: pre-tokenizer split regex {regex!r} is not one minfer "
                          "recognises (qwen2, llama-bpe); pass --tokenizer-pre NAME to say "
                          "which llama.cpp pre-tokenizer it is")


def bpe_vocab(model_dir: Path, vocab_size: int | None, pre: str | None) -> Vocab:
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    model = tok.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "SentencePiece-style BPE" if model.get("byte_fallback") else model.get("type")
        raise CheckpointError(f"{path}: a {kind} tokenizer.json without tokenizer.model is not "
                              "converted (minfer reads byte-level BPE or tokenizer.model)")
    tokens, types = _token_table(tok, path, vocab_size)
    return Vocab("bpe", tokens, types, None, pre or bpe_pre_name(tok, path), model_dir)


def wordpiece_vocab(model_dir: Path, vocab_size: int | None, pre: str | None,
                    n_token_types: int) -> Vocab:
    """BERT's WordPiece in llama.cpp's phantom-space form: a word-initial piece gets `▁`, a
    `##` continuation loses its `##`, control tokens stay. `tokenizer.ggml.pre` does not change
    how llama.cpp (or minfer) runs WordPiece; llama.cpp's converter names it from a hash of the
    tokenizer's output, which is not reproduced here: "default" unless `pre` names it."""
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    if tok.get("model", {}).get("type") != "WordPiece":
        raise CheckpointError(f"{path}: a BERT checkpoint needs a WordPiece tokenizer.json")
    tokens, types = _token_table(tok, path, vocab_size)
    tokens = [t if ty == TokenType.CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
              for t, ty in zip(tokens, types, strict=True)]
    return Vocab("wpm", tokens, types, None, pre or "default", model_dir, n_token_types)


def _token_table(tok: dict[str, Any], path: Path,
                 vocab_size: int | None) -> tuple[list[str], list[int]]:
    """(tokens, types) by id, as llama.cpp's `get_vocab_base`: added tokens special (or
    looking special) are control tokens, other added ones user-defined, gaps `[PADi]`."""
    model = tok.get("model", {})
    by_id = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in tok.get("added_tokens", [])}
    by_id |= {i: a["content"] for i, a in added.items()}
    n = vocab_size or len(by_id)
    if max(by_id) >= n:
        raise CheckpointError(f"{path}: token id {max(by_id)} >= config vocab_size {n}")
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            token = by_id[i]
            if added[i].get("special") or looks_special(token):
                types.append(TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _spm_added(model_dir: Path, tokens: list[str], scores: list[float],
               types: list[int]) -> None:
    """Tokens added on top of the SentencePiece model (added_tokens.json, then the config)."""
    added_file = model_dir / "added_tokens.json"
    if added_file.is_file():
        for token, i in json.loads(added_file.read_text(encoding="utf-8")).items():
            if i < len(tokens):
                tokens[i], scores[i], types[i] = token, -1000.0, TokenType.USER_DEFINED
    config_file = model_dir / "tokenizer_config.json"
    if not config_file.is_file():
        return
    decoder = json.loads(config_file.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
    for key, data in decoder.items():
        i, token = int(key), data["content"]
        if i >= len(tokens):
            continue
        if data.get("special") or looks_special(token):
            types[i] = TokenType.CONTROL
        else:
            token = token.replace("\u2581", " ")
            types[i] = TokenType.USER_DEFINED
        tokens[i], scores[i] = token, -1000.0


def spm_vocab(model_dir: Path, vocab_size: int | None) -> Vocab:
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise CheckpointError(f"{model_dir}/tokenizer.model needs the sentencepiece package "
                              "(pip install 'minfer[convert]')") from None

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(model_dir / "tokenizer.model"))
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [_SPM_UNUSED_SCORE] * n
    types = [int(TokenType.UNUSED)] * n
    for i in range(min(n, sp.vocab_size())):
        kind = TokenType.NORMAL
        if sp.IsUnknown(i):
            kind = TokenType.UNKNOWN
        elif sp.IsControl(i):
            kind = TokenType.CONTROL
        elif sp.IsUnused(i):
            kind = TokenType.UNUSED
        elif sp.IsByte(i):
            kind = TokenType.BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i), sp.GetScore(i), int(kind)
    _spm_added(model_dir, tokens, scores, types)
    return Vocab("spm", tokens, types, scores, "default", model_dir)


def load_vocab(model_dir: Path, vocab_size: int | None, pre: str | None = None, *,
               wordpiece_types: int = 0) -> Vocab:
    """The checkpoint's tokenizer: tokenizer.model first, as llama.cpp does for these families;
    `wordpiece_types` > 0: a BERT's WordPiece with that many token types."""
    if wordpiece_types:
        return wordpiece_vocab(model_dir, vocab_size, pre, wordpiece_types)
    if (model_dir / "tokenizer.model").is_file():
        return spm_vocab(model_dir, vocab_size)
    if (model_dir / "tokenizer.json").is_file():
        return bpe_vocab(model_dir, vocab_size, pre)
    raise CheckpointError(f"{model_dir}: no tokenizer.json or tokenizer.model")
