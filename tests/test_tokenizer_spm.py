"""SentencePiece-style ('llama') vocabularies on a synthetic vocabulary (no download needed).

The heap-based merging is checked against a slow, obviously-correct transcription of
llama.cpp's rule (repeatedly merge the adjacent pair whose token has the highest score, the
leftmost on ties), plus the surrounding rules: `▁` for spaces, the space prefix at the start and
after special tokens, `<0xNN>` byte fallback and decoding back to the text.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minfer.errors import TokenizerError
from minfer.tokenizer import IncrementalDecoder, Tokenizer
from minfer.tokenizer.spm import SpmModel
from minfer.tokenizer.vocab import BYTE, CONTROL, NORMAL, USER_DEFINED

# (text, score): higher scores merge first. "▁" alone is a token, as in Llama's vocabulary.
PIECES = [("▁", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("é", -3.0), ("ab", -4.0),
          ("bc", -3.5), ("abc", -5.0), ("▁a", -4.5), ("▁ab", -6.0), ("▁▁", -7.0),
          ("ca", -4.0), ("cab", -8.0), ("\n", -9.0), ("▁c", -4.0),
          ("b▁", -6.5), ("b▁c", -1.5)]  # bridging tokens: a merge across a word start
SPECIALS = [("<unk>", 2), ("<s>", CONTROL), ("</s>", CONTROL), ("<tool>", USER_DEFINED)]


def spm_vocab(*, add_space_prefix: bool | None = None, byte_tokens: bool = True,
              **meta: Any) -> SimpleNamespace:
    tokens = [t for t, _ in SPECIALS]
    types = [k for _, k in SPECIALS]
    scores = [0.0] * len(SPECIALS)
    if byte_tokens:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [BYTE] * 256
        scores += [0.0] * 256
    tokens += [t for t, _ in PIECES]
    types += [NORMAL] * len(PIECES)
    scores += [s for _, s in PIECES]
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }
    metadata.update(meta)
    return SimpleNamespace(metadata={k: v for k, v in metadata.items() if v is not None},
                           path=Path("spm.gguf"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(spm_vocab())


def reference_spm(tok: Tokenizer, text: str) -> list[int]:
    """llama.cpp's SPM merge, one best pair at a time (no heap), then byte fallback."""
    scores = dict(zip(tok.vocab.tokens, tok.vocab.scores.tolist(), strict=True))
    symbols = list(text)
    while True:
        pairs = [(-scores[a + b], i) for i, (a, b) in enumerate(itertools.pairwise(symbols))
                 if a + b in scores]
        if not pairs:
            break
        _, i = min(pairs)
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids: list[int] = []
    for s in symbols:
        tid = tok.token_id(s)
        ids += [tid] if tid is not None else [tok.token_id(f"<0x{b:02X}>") for b in s.encode()]
    return ids  # type: ignore[return-value]


spm_text = st.lists(st.sampled_from(["a", "b", "c", " ", "  ", "é", "\n", "z", "😀", "ab", "ca"]),
                    max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(spm_text)
def test_matches_slow_reference(tok: Tokenizer, text: str) -> None:
    expected = reference_spm(tok, (" " + text).replace(" ", "▁")) if text else []
    assert tok.encode(text, special=False, add_bos=False) == expected


@settings(max_examples=200, deadline=None)
@given(spm_text)
def test_decode_inverts_encode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, special=False) == text
    assert tok.decode(ids) == "<s>" + text


def test_scores_order_the_merges(tok: Tokenizer) -> None:
    # "▁abc": ▁a (-4.5) loses to bc (-3.5), then ab cannot form: ▁a + bc
    assert [tok.token_text(i) for i in tok.encode("abc", add_bos=False)] == ["▁a", "bc"]
    # equal scores: the leftmost pair first ("ca" and "ab" are both -4.0 in "cab")
    assert [tok.token_text(i) for i in tok.encode("cab", add_bos=False)] == ["▁c", "ab"]


def test_bos_space_prefix_and_specials(tok: Tokenizer) -> None:
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_id == 2 and tok.unk_id == 0
    assert tok.encode("a") == [1, tok.token_id("▁a")]
    # after a special token the space prefix comes back; a user-defined token is always cut
    ids = tok.encode("a<s>a<tool>a", add_bos=False)
    assert [tok.token_text(i) for i in ids] == ["▁a", "<s>", "▁a", "<tool>", "▁a"]
    assert tok.decode(ids) == "a<s>a<tool>a"
    no_special = tok.encode("a<s>", add_bos=False, special=False)
    assert tok.token_id("<s>") not in no_special


def test_byte_fallback_and_pieces(tok: Tokenizer) -> None:
    ids = tok.encode("z😀", add_bos=False)
    assert [tok.token_text(i) for i in ids] == ["▁", "<0x7A>", "<0xF0>", "<0x9F>", "<0x98>",
                                                "<0x80>"]
    assert tok.token_bytes(ids[1]) == b"z" and tok.piece(ids[0]) == " "
    assert tok.decode(ids) == "z😀"  # the space prefix is taken out again
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == " z😀"  # streamed pieces: raw


def test_no_space_prefix_when_metadata_says_so() -> None:
    tok = Tokenizer.from_gguf(spm_vocab(add_space_prefix=False))
    assert [tok.token_text(i) for i in tok.encode("ab c", add_bos=False)] == ["ab", "▁c"]
    assert tok.decode(tok.encode(" ab")) == "<s> ab"


def test_missing_byte_token_falls_back_to_unk() -> None:
    tok = Tokenizer.from_gguf(spm_vocab(byte_tokens=False))
    assert tok.encode("a\x01", add_bos=False)[-1] == tok.unk_id
    assert tok.encode("az", add_bos=False) == [tok.token_id("▁a"), tok.unk_id]
    # an out-of-range unk id is ignored and the SPM default (0) kept, as llama.cpp does
    bad_unk = Tokenizer.from_gguf(spm_vocab(**{"tokenizer.ggml.unknown_token_id": 999}))
    assert bad_unk.unk_id == 0


def test_missing_byte_and_unk_tokens_is_an_error() -> None:
    model = SpmModel({"a": 0, "▁": 1}, np.zeros(2, dtype=np.float32), unk_id=None)
    assert model.encode("▁a") == [1, 0]
    with pytest.raises(TokenizerError, match="no byte token <0x7A>"):
        model.encode("z")


def test_metadata_overrides_spm_defaults() -> None:
    tok = Tokenizer.from_gguf(spm_vocab(**{"tokenizer.ggml.add_bos_token": False,
                                           "tokenizer.ggml.bos_token_id": 2,
                                           "tokenizer.ggml.eos_token_id": 1}))
    assert not tok.add_bos and tok.bos_id == 2 and tok.eos_id == 1
    assert 1 in tok.eot_ids
    assert tok.kind == "spm" and tok.words("a b") == ["a b"]


def test_bridging_token_merges_across_the_word_start(tok: Tokenizer) -> None:
    # "▁b▁c": ▁c merges first, then b + ▁c = "b▁c", across the start of the word "c"
    ids = tok.encode("b c a", add_bos=False)
    assert [tok.token_text(i) for i in ids] == ["▁", "b▁c", "▁a"]
    assert tok.decode(ids) == "b c a"
