"""Pre-tokenizer table and the Gemma 4 BPE flavour, on synthetic inputs (no download needed).

The real vocabularies are checked case by case in test_tokenizer_vocab_suite.py; these pin the
splitting rules themselves: regexes applied in sequence keeping the unmatched gaps, `\\s+$`
anchored at the end of each piece, and Gemma 4's `▁` escaping, newline runs and byte fallback.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from minfer.errors import TokenizerError
from minfer.tokenizer import Tokenizer
from minfer.tokenizer.pretok import known_pre_tokenizers, pre_tokenizer
from minfer.tokenizer.vocab import BYTE, CONTROL, NORMAL


@pytest.mark.parametrize(("pre", "text", "words"), [
    ("gpt-2", "Hello  world's 42!\n", ["Hello", " ", " world", "'s", " 42", "!", "\n"]),
    ("falcon", "x 1234567", ["x", " ", "123", "456", "7"]),  # gaps kept between the matches
    ("starcoder", "ab 123", ["ab", " ", "1", "2", "3"]),
    ("deepseek-coder", "a1\nb", ["a", "1", "\n", "b"]),
    ("deepseek-llm", "hi  \n  ", ["hi", "  ", "\n", "  "]),
    ("deepseek-llm", "a  b", ["a", " ", " b"]),  # `\s+$` only at the end of a piece
    ("qwen35", "e\u0301x", ["e\u0301x"]),  # combining marks stay in the word
    ("qwen2", "e\u0301x", ["e", "\u0301x"]),
    ("gemma4", "a b\n\nc", ["a▁b", "\n\n", "c"]),
])
def test_split(pre: str, text: str, words: list[str]) -> None:
    rule = pre_tokenizer(pre)
    split = rule.split(text.replace(" ", "▁") if rule.escape_whitespace else text)
    assert split == words
    assert "".join(split) == (text.replace(" ", "▁") if rule.escape_whitespace else text)


def test_every_known_name_compiles() -> None:
    names = known_pre_tokenizers()
    assert {"gpt-2", "deepseek-coder", "deepseek-llm", "starcoder", "falcon", "command-r", "mpt",
            "refact", "qwen2", "qwen35", "llama-bpe", "default"} <= set(names)
    for name in names:
        assert pre_tokenizer(name).split("Hi 123 ✓") != []


def test_unknown_pre_is_refused_by_name() -> None:
    with pytest.raises(TokenizerError, match="'tekken'"):
        pre_tokenizer("tekken")


# -- Gemma 4: BPE over raw UTF-8 with ▁ for spaces and <0xNN> byte fallback -------------------

def gemma4_vocab() -> SimpleNamespace:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    chars = ["▁", "a", "b", "\n", "\n\n"]
    merged = ["▁a", "▁ab", "ab"]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *chars, *merged]
    types = [CONTROL] * 4 + [BYTE] * 256 + [NORMAL] * (len(chars) + len(merged))
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.merges": ["▁ a", "a b", "▁a b"],
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": False,
    }
    return SimpleNamespace(metadata=meta, path=Path("gemma4.gguf"))


def test_gemma4_bpe() -> None:
    tok = Tokenizer.from_gguf(gemma4_vocab())
    assert tok.kind == "bpe/gemma4" and tok.add_bos  # llama.cpp forces BOS for Gemma 4
    ids = tok.encode(" ab\n\nz", add_bos=False)
    # "▁ab" merges by rank; "\n\n" is a token and taken whole; "z" falls back to its byte
    assert [tok.token_text(i) for i in ids] == ["▁ab", "\n\n", "<0x7A>"]
    assert tok.decode(ids) == " ab\n\nz"
    three = tok.encode("\n\n\n", add_bos=False)  # not a token: merged from characters
    assert [tok.token_text(i) for i in three] == ["\n", "\n", "\n"]


# tokenizer.json's expression for GPT-4o (Phi-4-mini), which llama.cpp respells
_GPT4O_JSON = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
               r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("text", [
    "Hello World's HTTPServer isn't 12345 ok!\n\n  x", "camelCaseWord and ALLCAPS'LL do",
    "path/to/file.py\r\n\tdef f(): return 1_000_000", "  leading and trailing  ",
    "café naïve über straße", "I'M YOU'RE we've", "x+=1;y//=2\n/"])
def test_gpt4o_splits_as_its_tokenizer_json(text: str) -> None:
    """`gpt-4o` (Phi-4-mini's pre-tokenizer) in llama.cpp's spelling cuts these texts as the
    `tokenizers` library cuts them with the tokenizer.json expression (they part only on
    upper-case non-ASCII letters inside a word, where minfer follows llama.cpp)."""
    from tokenizers import Regex, pre_tokenizers

    ref = pre_tokenizers.Split(Regex(_GPT4O_JSON), behavior="isolated")
    assert pre_tokenizer("gpt-4o").split(text) == [w for w, _ in ref.pre_tokenize_str(text)]
    assert pre_tokenizer("llama4") is pre_tokenizer("gpt-4o")
