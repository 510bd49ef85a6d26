"""BPE pre-tokenizer rules, chosen by `tokenizer.ggml.pre` as llama.cpp's `llm_tokenizer_bpe` does.

A rule is a sequence of split regexes (llama.cpp's `regex_exprs` for that pre type). Each regex
cuts every piece left by the previous one into its matches *and* the unmatched gaps between them
(llama.cpp's `unicode_regex_split`, the `tokenizers` library's "isolated" Split), so nothing of
the text is dropped. The expressions are the ones in the models' `tokenizer.json` (llama.cpp runs
some of them through hand-written equivalents, e.g. the GPT-2 and Llama 3 splitters, and spells
`(?i:…)` out by hand); they run here in the `regex` package, which knows `\\p{L}`, `\\p{N}`, ….

llama.cpp runs an expression without Unicode classes (`\\p{…}`) through `std::wregex` on a copy of
the text where every non-ASCII whitespace character is a vertical tab (its `\\s` is ASCII-only):
such a character then matches `\\s` and nothing else, even where the expression names it in a
character range (DeepSeek LLM's `　-。`). `split` does the same for those expressions.

Besides the regexes a rule carries llama.cpp's per-type flags: `ignore_merges` (a word already in
the vocabulary is emitted whole) and `byte_encode` (GPT-2 byte-level alphabet; false for Gemma 4,
whose BPE runs on raw UTF-8 with `▁` for spaces and `<0xNN>` byte fallback).
A name not listed here is refused: a wrong pre-tokenizer silently degrades every prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import regex

from minfer.errors import TokenizerError


@dataclass(frozen=True)
class PreTokenizer:
    """How text is cut into words before BPE runs on each word."""

    name: str
    patterns: tuple[str, ...]
    ignore_merges: bool = False
    byte_encode: bool = True
    escape_whitespace: bool = False  # spaces become '▁' before splitting (Gemma 4)
    _compiled: tuple[tuple[regex.Pattern[str], bool], ...] | None = field(
        default=None, init=False, repr=False, compare=False)

    def compiled(self) -> tuple[tuple[regex.Pattern[str], bool], ...]:
        """The patterns compiled, each with whether its whitespace is folded first; compiled on
        first use (all the rules' patterns at import took ~40 ms, on a warm start's path)."""
        if self._compiled is None:
            compiled = tuple((regex.compile(p), "\\p{" not in p and p not in _HAND_WRITTEN)
                             for p in self.patterns)
            object.__setattr__(self, "_compiled", compiled)
        assert self._compiled is not None
        return self._compiled

    @property
    def pattern(self) -> str:
        """The patterns joined for display."""
        return " ⟶ ".join(self.patterns)

    def split(self, text: str) -> list[str]:
        """`text` cut into words: every regex in turn splits each piece into matches and gaps."""
        words = [text] if text else []
        for rx, fold in self.compiled():
            out: list[str] = []
            for word in words:
                if not fold and not rx.groups:
                    found = rx.findall(word)
                    if sum(map(len, found)) == len(word) and "" not in found:  # no gaps: done
                        out += found
                        continue
                pos = 0
                for m in rx.finditer(word.translate(_FOLD_WHITESPACE) if fold else word):
                    start, end = m.span()
                    if start > pos:
                        out.append(word[pos:start])
                    if end > start:
                        out.append(word[start:end])
                    pos = end
                if pos < len(word):
                    out.append(word[pos:])
            words = out
        return words


# llama.cpp's non-ASCII whitespace (its unicode_set_whitespace; the same set as regex's `\s`).
_FOLD_WHITESPACE = dict.fromkeys([0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                                  0x202F, 0x205F, 0x3000], 0x0B)

_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# Qwen2: single digits, letters with at most one leading non-letter, punctuation runs.
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 3.5: as Qwen2 with combining marks kept inside words.
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3: as Qwen2 but digits in groups of up to three.
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o (Phi-4-mini, Llama 4): cased words (upper-case run, then lower case) with their
# contraction, digits in threes. llama.cpp's spelling of tokenizer.json's `[\p{Lu}\p{Lt}...]`
# classes ("a letter but not a-z", "a letter but not A-Z"), which it runs instead of the
# original; kept so that non-ASCII letters split as llama.cpp splits them.
_GPT4O_CONTRACTION = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _GPT4O_CONTRACTION
         + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
         + _GPT4O_CONTRACTION
         + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-2 (llama.cpp's hand-written splitter also takes a lone trailing space run: the `|\s+`).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# DeepSeek LLM / Coder: llama.cpp's expressions (their letter and CJK ranges as code points).
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a"
    "\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
DEEPSEEK_LLM = ("[\r\n]", "\\s?[" + _DEEPSEEK_LETTERS + "]+",
                "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                r"\s+\Z", _CJK, r"\p{N}+")  # llama.cpp's `\s+$`: the end of the piece
DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")
STARCODER = (r"\p{N}", GPT2)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
# Gemma 4: no word split, only newline runs apart (BPE merges run over whole lines).
NEWLINES = (r"[^\n]+|[\n]+",)
# expressions llama.cpp runs by hand-written code on the original text (no whitespace folding)
_HAND_WRITTEN = frozenset(NEWLINES)


def _rules() -> dict[str, PreTokenizer]:
    qwen2 = PreTokenizer("qwen2", (QWEN2,))
    llama3 = PreTokenizer("llama-bpe", (LLAMA3,), ignore_merges=True)
    gpt2 = PreTokenizer("gpt-2", (GPT2,))
    starcoder = PreTokenizer("starcoder", STARCODER)
    table: dict[str, PreTokenizer] = {
        "default": PreTokenizer("default", DEFAULT),
        "qwen35": PreTokenizer("qwen35", (QWEN35,)),
        "deepseek-llm": PreTokenizer("deepseek-llm", DEEPSEEK_LLM),
        "deepseek-coder": PreTokenizer("deepseek-coder", DEEPSEEK_CODER),
        "falcon": PreTokenizer("falcon", FALCON),
        "gemma4": PreTokenizer("gemma4", NEWLINES, byte_encode=False, escape_whitespace=True),
    }
    # names llama.cpp maps onto the same pre type (same regexes, same merge rule)
    for names, rule in [
        (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "solar-open"), qwen2),
        (("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral"), llama3),
        (("dbrx", "smaug-bpe"), PreTokenizer("dbrx", (LLAMA3,))),
        (("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling",
          "mellum", "gigachat", "a.x-4.0"), gpt2),
        (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
          "mellum2"), starcoder),
        (("gpt-4o", "llama4", "kanana2", "talkie"), PreTokenizer("gpt-4o", (GPT4O,))),
    ]:
        for name in names:
            table[name] = rule
    return table


_RULES = _rules()


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
