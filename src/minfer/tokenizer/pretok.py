"""Pre-tokenizer rules, chosen by `tokenizer.ggml.pre` as llama.cpp does.

Each rule is the split regex of the model's original `tokenizer.json` (the form the `tokenizers`
library runs; llama.cpp carries the same expressions with `(?i:…)` spelled out by hand) plus
llama.cpp's `ignore_merges` flag (a word already in the vocabulary is emitted whole).
A name not listed here is refused: a wrong pre-tokenizer silently degrades every prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from minfer.errors import TokenizerError


@dataclass(frozen=True)
class PreTokenizer:
    """How text is cut into words before BPE runs on each word."""

    name: str
    pattern: str
    ignore_merges: bool = False


# Qwen2: single digits, letters with at most one leading non-letter, punctuation runs.
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3: as Qwen2 but digits in groups of up to three.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_RULES: dict[str, PreTokenizer] = {
    "qwen2": PreTokenizer("qwen2", QWEN2),
    "deepseek-r1-qwen": PreTokenizer("qwen2", QWEN2),
    "llama-bpe": PreTokenizer("llama-bpe", LLAMA3, ignore_merges=True),
    "llama3": PreTokenizer("llama-bpe", LLAMA3, ignore_merges=True),
    "llama-v3": PreTokenizer("llama-bpe", LLAMA3, ignore_merges=True),
}


def known_pre_tokenizers() -> list[str]:
    """The `tokenizer.ggml.pre` values minfer understands."""
    return sorted(_RULES)


def pre_tokenizer(name: str) -> PreTokenizer:
    """The rule for a `tokenizer.ggml.pre` value; TokenizerError naming it when unknown."""
    if not name:
        raise TokenizerError("tokenizer.ggml.pre is missing; minfer needs the pre-tokenizer "
                             f"named (one of {', '.join(known_pre_tokenizers())})")
    try:
        return _RULES[name]
    except KeyError:
        raise TokenizerError(f"unknown pre-tokenizer tokenizer.ggml.pre={name!r} "
                             f"(minfer knows {', '.join(known_pre_tokenizers())})") from None
