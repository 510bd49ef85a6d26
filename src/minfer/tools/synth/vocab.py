"""The synthetic models' tokenizers: a byte-level BPE trained on a little English and code.

`build_tiny_vocab` makes the vocabulary (256 byte symbols, merges, ChatML control tokens, padded
to a real model's size if asked); `add_tokenizer` writes it (and a chat template) into a GGUF.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import gguf

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_TOKENS = ("<tool_call>",)

# Enough English (and a little code) that common pairs such as "th", "in", " the" merge.
_TRAIN_TEXT = """
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs
into the forest. In the morning there is nothing better than a cup of tea and a good book.
She said that the weather would be fine, but then it started to rain in the evening.
Hello world! This is a small test of the tokenizer: it should merge the most common pairs
of letters, such as th, in, er, an, on and the whole word the. We are testing, they are
learning, and everything is running. def main(): return print("hello, world") if x else None
for i in range(10): total = total + i  # counting numbers 0123456789
"""
_PRETOKEN_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable symbol map, in GPT-2's order (printable bytes first)."""
    byte_values = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    code_points = list(byte_values)
    unprintable = [b for b in range(256) if b not in byte_values]
    byte_values += unprintable
    code_points += [256 + i for i in range(len(unprintable))]
    return {b: chr(c) for b, c in zip(byte_values, code_points, strict=True)}


def train_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy byte-level BPE on `text` (ties broken by the smaller pair): deterministic."""
    enc = bytes_to_unicode()
    words = Counter(_PRETOKEN_RE.findall(text))
    seqs = {tuple(enc[b] for b in w.encode()): c for w, c in words.items()}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for seq, count in seqs.items():
            for pair in itertools.pairwise(seq):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        seqs = {_apply_merge(seq, best): c for seq, c in seqs.items()}
    return merges


def _apply_merge(seq: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return tuple(out)


@dataclass(frozen=True)
class TinyVocab:
    """tokens / token_type (1 normal, 3 control, 4 user-defined, 5 unused) / merges."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def build_tiny_vocab(*, n_merges: int = 200, extra_tokens: Sequence[str] = (),
                     vocab_size: int | None = None) -> TinyVocab:
    """256 byte symbols + trained merges + control/user tokens, padded with `[PADn]` if asked."""
    tokens = list(bytes_to_unicode().values())
    merges = train_merges(_TRAIN_TEXT, n_merges)
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    types = [1] * len(tokens)
    for tok, ttype in [*((t, 3) for t in CONTROL_TOKENS),
                       *((t, 4) for t in (*USER_TOKENS, *extra_tokens))]:
        tokens.append(tok)
        types.append(ttype)
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size={vocab_size} < the {len(tokens)} tokens needed")
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        types += [5] * (vocab_size - len(types))
    return TinyVocab(tokens, types, [f"{a} {b}" for a, b in merges])


def add_tokenizer(w: gguf.GGUFWriter, vocab: TinyVocab, chat_template: str | None, *,
                  pre: str = "qwen2") -> None:
    """The vocabulary as a GPT-2-style BPE tokenizer (`pre`: llama.cpp's pre-tokenizer name);
    `chat_template` None: the ChatML default, "": none."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_eos_token_id(vocab.id("<|im_end|>"))
    w.add_bos_token_id(vocab.id("<|endoftext|>"))
    w.add_pad_token_id(vocab.id("<|endoftext|>"))
    w.add_add_bos_token(False)
    template = DEFAULT_CHAT_TEMPLATE if chat_template is None else chat_template
    if template:
        w.add_chat_template(template)
