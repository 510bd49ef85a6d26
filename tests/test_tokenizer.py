"""Tokenizer unit tests on the synthetic byte-level BPE vocabulary (no real model needed).

The fast path (tokenizers library + special-token partition) is checked against a slow,
obviously-correct BPE written here: an ASCII transcription of the qwen2 split regex and
rank-ordered merges, as llama.cpp's `llm_tokenizer_bpe_session` does them.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minfer.errors import TokenizerError
from minfer.gguf.reader import GGUFFile
from minfer.tokenizer import Tokenizer, load_tokenizer
from minfer.tokenizer.vocab import BYTE_CHARS, CONTROL, NORMAL, USER_DEFINED
from minfer.tools.synth import build_tiny_vocab


def fake_gguf(extra_tokens: tuple[str, ...] = (), **meta: Any) -> SimpleNamespace:
    """An object with the GGUFFile attributes the tokenizer reads, around the tiny vocabulary."""
    v = build_tiny_vocab(extra_tokens=extra_tokens, vocab_size=None)
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": list(v.tokens),
        "tokenizer.ggml.token_type": np.array(v.token_types, dtype=np.int32),
        "tokenizer.ggml.merges": list(v.merges),
        "tokenizer.ggml.bos_token_id": v.id("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": v.id("<|im_end|>"),
        "tokenizer.ggml.add_bos_token": False,
    }
    metadata.update(meta)
    return SimpleNamespace(metadata={k: v for k, v in metadata.items() if v is not None},
                           path=Path("fake.gguf"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(fake_gguf())


# -- slow reference ---------------------------------------------------------------------------

_ASCII_QWEN2 = re.compile(r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"
                          r"|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*"
                          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def reference_encode(tok: Tokenizer, text: str) -> list[int]:
    """Byte-level BPE of ASCII `text` without special tokens, merges applied by rank."""
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(tok.vocab.merges)}
    ids: list[int] = []
    for word in _ASCII_QWEN2.findall(text):
        symbols = [BYTE_CHARS[b] for b in word.encode()]
        while len(symbols) > 1:
            pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in
                     enumerate(itertools.pairwise(symbols))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids += [tok.token_id(s) for s in symbols]  # type: ignore[misc]
    return ids


ascii_text = st.lists(st.sampled_from(
    [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t", "\r", "  ", "the ", " in", "'s", "'LL"]),
    max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(ascii_text)
def test_matches_slow_reference_bpe(tok: Tokenizer, text: str) -> None:
    assert tok.encode(text, special=False) == reference_encode(tok, text)


@pytest.fixture(scope="module")
def tok_library() -> Tokenizer:
    t = Tokenizer.from_gguf(fake_gguf())
    t.prepare()  # the `tokenizers` model merges every text
    return t


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_python_merge_equals_library(tok: Tokenizer, tok_library: Tokenizer, text: str) -> None:
    assert tok.encode(text, special=False) == tok_library.encode(text, special=False)


def test_library_model_is_built_for_long_texts_only(tok_library: Tokenizer) -> None:
    fresh = Tokenizer.from_gguf(fake_gguf())
    assert fresh._bpe is not None
    short = "The dog and the fox, twice: the dog and the fox."
    assert fresh.encode(short) == tok_library.encode(short)
    assert fresh._bpe._lib is None
    long = " ".join(["the quick brown fox"] * 200)  # 800 words
    assert fresh.encode(long) == tok_library.encode(long)
    assert fresh._bpe._lib is not None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, special=False)
    assert tok.decode(ids) == text


def test_merges_are_used(tok: Tokenizer) -> None:
    ids = tok.encode("The dog and the fox")
    assert len(ids) < len("The dog and the fox")
    assert tok.token_text(ids[3]) == "Ġthe"


@pytest.mark.parametrize("text", ["", " ", "   leading", "trailing   ", "a\n\nb\r\n", "\t\tx",
                                  "😀 emoji", "中文和English", "café naïve", "x=[1,2,3];"])
def test_round_trip_examples(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


# -- special tokens ---------------------------------------------------------------------------

def test_control_tokens_parsed_only_with_special(tok: Tokenizer) -> None:
    im_start = tok.token_id("<|im_start|>")
    assert tok.encode("<|im_start|>user") == [im_start, *tok.encode("user")]
    plain = tok.encode("<|im_start|>user", special=False)
    assert im_start not in plain
    assert tok.decode(plain) == "<|im_start|>user"


def test_user_defined_tokens_always_parsed(tok: Tokenizer) -> None:
    call = tok.token_id("<tool_call>")
    for special in (True, False):
        ids = tok.encode('a<tool_call>{"x": 1}', special=special)
        assert ids.count(call) == 1
        assert tok.decode(ids) == 'a<tool_call>{"x": 1}'


def test_longest_special_text_wins() -> None:
    # "<tool_call>x" is longer than "<tool_call>", so it is cut first (llama.cpp's order).
    tok = Tokenizer.from_gguf(fake_gguf(extra_tokens=("<tool_call>x",)))
    ids = tok.encode("a<tool_call>xb<tool_call>")
    assert ids == [*tok.encode("a"), tok.token_id("<tool_call>x"), *tok.encode("b"),
                   tok.token_id("<tool_call>")]


def test_adjacent_and_repeated_specials(tok: Tokenizer) -> None:
    s, e = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert tok.encode("<|im_start|><|im_end|><|im_start|>") == [s, e, s]


def test_special_ids_and_eog(tok: Tokenizer) -> None:
    assert tok.bos_id == tok.token_id("<|endoftext|>")
    assert tok.eos_id == tok.token_id("<|im_end|>")
    assert tok.eot_ids == {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")}
    assert tok.is_control(tok.token_id("<|im_start|>"))  # type: ignore[arg-type]
    assert not tok.is_control(tok.token_id("<tool_call>"))  # type: ignore[arg-type]
    assert not tok.is_control(tok.encode("the")[0])


def test_eot_token_id_and_fim_tokens_are_eog() -> None:
    f = fake_gguf(extra_tokens=("<|fim_pad|>", "<|eot_id|>"))
    types = f.metadata["tokenizer.ggml.token_type"]
    tokens = f.metadata["tokenizer.ggml.tokens"]
    eot = tokens.index("<|eot_id|>")
    f.metadata["tokenizer.ggml.eot_token_id"] = eot
    tok = Tokenizer.from_gguf(f)
    assert {eot, tokens.index("<|fim_pad|>")} <= tok.eot_ids
    # end-of-generation texts are promoted to control, as llama.cpp does
    assert types[eot] == USER_DEFINED and tok.is_control(eot)


def test_bos_follows_metadata(tok: Tokenizer) -> None:
    assert tok.encode("hi")[0] != tok.bos_id
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id
    with_bos = Tokenizer.from_gguf(fake_gguf(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("hi") == [with_bos.bos_id, *tok.encode("hi")]
    assert with_bos.encode("hi", add_bos=False) == tok.encode("hi")
    # a rendered prompt that already starts with BOS does not get a second one
    assert with_bos.encode_prompt("<|endoftext|>hi") == [with_bos.bos_id, *tok.encode("hi")]


def test_token_bytes(tok: Tokenizer) -> None:
    space = tok.token_id(BYTE_CHARS[0x20])
    assert space is not None and tok.token_bytes(space) == b" "
    assert tok.token_bytes(tok.token_id(BYTE_CHARS[0xF0])) == b"\xf0"  # type: ignore[arg-type]
    assert tok.token_bytes(tok.token_id("<|im_end|>")) == b"<|im_end|>"  # type: ignore[arg-type]
    assert tok.piece(tok.token_id(BYTE_CHARS[0xF0])) == "\ufffd"  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.token_bytes(tok.n_vocab)


def test_unused_tokens_decode_to_nothing() -> None:
    v = build_tiny_vocab(vocab_size=600)
    f = fake_gguf(**{"tokenizer.ggml.tokens": v.tokens,
                     "tokenizer.ggml.token_type": np.array(v.token_types, dtype=np.int32)})
    tok = Tokenizer.from_gguf(f)
    assert tok.n_vocab == 600
    assert tok.token_bytes(599) == b""


def test_decode_without_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>hi<tool_call><|im_end|>")
    assert tok.decode(ids) == "<|im_start|>hi<tool_call><|im_end|>"
    assert tok.decode(ids, special=False) == "hi<tool_call>"


# -- metadata errors --------------------------------------------------------------------------

@pytest.mark.parametrize(("meta", "message"), [
    ({"tokenizer.ggml.pre": "tekken"}, "'tekken'"),
    ({"tokenizer.ggml.pre": None}, "tokenizer.ggml.pre is missing"),
    ({"tokenizer.ggml.model": "t5"}, "unsupported tokenizer model 't5'"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.scores is missing"),
    ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.merges": []}, "merges is missing"),
    ({"tokenizer.ggml.scores": np.zeros(3, dtype=np.float32)}, "scores has 3 entries"),
    ({"tokenizer.ggml.add_bos_token": 1}, "add_bos_token=1 is not true or false"),
    ({"tokenizer.ggml.model": None}, "no tokenizer"),
    ({"tokenizer.ggml.token_type": np.ones(3, dtype=np.int32)}, "token_type has 3 entries"),
])
def test_refused_metadata(meta: dict[str, Any], message: str) -> None:
    with pytest.raises(TokenizerError, match=re.escape(message)):
        Tokenizer.from_gguf(fake_gguf(**meta))


@pytest.mark.parametrize("pre", ["qwen2", "deepseek-r1-qwen", "llama-bpe"])
def test_known_pre_tokenizers(pre: str) -> None:
    tok = Tokenizer.from_gguf(fake_gguf(**{"tokenizer.ggml.pre": pre}))
    assert tok.decode(tok.encode("In 1492 they sailed")) == "In 1492 they sailed"


def test_llama3_groups_digits_by_three() -> None:
    qwen = Tokenizer.from_gguf(fake_gguf())
    llama = Tokenizer.from_gguf(fake_gguf(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert qwen.words("x 1234567 it's") == ["x", " ", *"1234567", " it", "'s"]
    assert llama.words("x 1234567 it's") == ["x", " ", "123", "456", "7", " it", "'s"]


# -- the GGUF path ----------------------------------------------------------------------------

def test_from_synthetic_gguf(tiny_qwen2: Path) -> None:
    f = GGUFFile.open(tiny_qwen2)
    tok = load_tokenizer(f)
    same = Tokenizer.from_gguf(fake_gguf())
    assert tok.n_vocab == same.n_vocab
    text = "<|im_start|>user\nThe quick brown fox<tool_call>😀<|im_end|>"
    assert tok.encode(text) == same.encode(text)
    assert tok.vocab.types[tok.token_id("<|im_start|>")] == CONTROL  # type: ignore[index]
    assert tok.vocab.types[tok.encode("the")[0]] == NORMAL


def test_llama_cpp_special_token_overrides() -> None:
    # `</s>` is end-of-generation by its text (llama.cpp), unless `<|tool_response>` is (Gemma 4)
    tok = Tokenizer.from_gguf(fake_gguf(extra_tokens=("</s>",)))
    s_id = tok.token_id("</s>")
    assert s_id in tok.eot_ids and tok.is_control(s_id)  # type: ignore[arg-type]
    gemma = Tokenizer.from_gguf(fake_gguf(extra_tokens=("</s>", "<|tool_response>")))
    assert gemma.token_id("</s>") not in gemma.eot_ids
    assert gemma.vocab.types[gemma.token_id("</s>")] == NORMAL  # type: ignore[index]
    # harmony: with <|return|> and <|call|>, <|end|> ends a message, not the generation
    harmony = Tokenizer.from_gguf(fake_gguf(extra_tokens=("<|end|>", "<|return|>", "<|call|>",
                                                          "<|channel|>")))
    end = harmony.token_id("<|end|>")
    assert end not in harmony.eot_ids and harmony.token_id("<|return|>") in harmony.eot_ids
    assert harmony.vocab.types[end] == USER_DEFINED  # type: ignore[index]
    assert harmony.vocab.types[harmony.token_id("<|channel|>")] == USER_DEFINED  # type: ignore[index]
