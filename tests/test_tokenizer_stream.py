"""IncrementalDecoder: complete UTF-8 only, nothing lost, same text as decode()."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minfer.tokenizer import IncrementalDecoder, Tokenizer
from minfer.tokenizer.vocab import BYTE_CHARS

from .test_tokenizer import fake_gguf


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(fake_gguf())


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One byte token per byte (the tiny vocabulary has no merges for non-ASCII)."""
    return [tok.token_id(BYTE_CHARS[b]) for b in data]  # type: ignore[misc]


def stream(tok: Tokenizer, ids: list[int], **kw: bool) -> list[str]:
    dec = IncrementalDecoder(tok, **kw)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("text", ["😀", "中文", "é", "👨\u200d👩\u200d👧", "a😀b中c"])
def test_multibyte_split_over_tokens(tok: Tokenizer, text: str) -> None:
    ids = byte_ids(tok, text.encode())
    parts = stream(tok, ids)
    assert "".join(parts) == text
    assert "\ufffd" not in "".join(parts)
    # a character appears exactly when its last byte arrives
    emitted, seen = "", b""
    for i, part in zip(ids, parts, strict=False):
        seen += tok.token_bytes(i)
        emitted += part
        assert emitted == seen.decode("utf-8", errors="ignore")


def test_emoji_held_until_complete(tok: Tokenizer) -> None:
    dec = IncrementalDecoder(tok)
    ids = byte_ids(tok, "😀".encode())
    assert [dec.push(i) for i in ids[:3]] == ["", "", ""]
    assert dec.pending
    assert dec.push(ids[3]) == "😀"
    assert not dec.pending
    assert dec.flush() == ""


def test_truncated_character_flushes_as_replacement(tok: Tokenizer) -> None:
    dec = IncrementalDecoder(tok)
    for i in byte_ids(tok, "😀".encode()[:2]):
        assert dec.push(i) == ""
    assert dec.flush() == "\ufffd"
    assert dec.push(tok.encode("ok")[0]) == "o"  # usable again after flush


def test_invalid_byte_is_replaced_at_once(tok: Tokenizer) -> None:
    dec = IncrementalDecoder(tok)
    assert dec.push(byte_ids(tok, b"\x80")[0]) == "\ufffd"
    # a lead byte followed by a non-continuation byte: both come out, nothing held
    assert "".join(dec.push(i) for i in byte_ids(tok, b"\xe4A")) == "\ufffdA"


def test_control_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert "".join(stream(tok, ids)) == "<|im_start|>hi<|im_end|>"
    assert "".join(stream(tok, ids, special=False)) == "hi"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=255), max_size=40))
def test_any_byte_sequence_matches_decode(tok: Tokenizer, data: list[int]) -> None:
    ids = byte_ids(tok, bytes(data))
    assert "".join(stream(tok, ids)) == tok.decode(ids)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_any_text_round_trips(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, special=False)
    parts = stream(tok, ids)
    assert "".join(parts) == text
    assert parts[-1] == ""
