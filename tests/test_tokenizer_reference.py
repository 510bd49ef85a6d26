"""The development model's tokenizer against llama.cpp's ids (tests/fixtures/tokenizer.json)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from minfer.gguf.reader import GGUFFile
from minfer.tokenizer import IncrementalDecoder, Tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer.json"
LINES = json.loads(FIXTURE.read_text(encoding="utf-8"))["lines"]

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def tok(real_model_path: Path) -> Tokenizer:
    f = GGUFFile.open(real_model_path)
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(f)
    print(f"\ntokenizer load: {(time.perf_counter() - t0) * 1e3:.0f} ms for {tok.n_vocab} tokens")
    return tok


@pytest.mark.parametrize("mode", ["ids_special", "ids_no_special"])
def test_every_reference_line_matches(tok: Tokenizer, mode: str) -> None:
    special = mode == "ids_special"
    wrong = [line["text"] for line in LINES if tok.encode(line["text"], special=special)
             != line[mode]]
    assert not wrong, f"{len(wrong)}/{len(LINES)} lines differ ({mode}): {wrong[:5]}"


def test_reference_ids_decode_to_text(tok: Tokenizer) -> None:
    for line in LINES:
        for mode in ("ids_special", "ids_no_special"):
            assert tok.decode(line[mode]) == line["text"]
            dec = IncrementalDecoder(tok)
            assert "".join(dec.push(i) for i in line[mode]) + dec.flush() == line["text"]


def test_special_tokens_of_the_model(tok: Tokenizer) -> None:
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (151643, 151645, False)
    # eos <|im_end|>, <|endoftext|>, and llama.cpp's FIM pad / repo / file-separator tokens
    # and `</s>` (128247): llama.cpp 0.3.36 promotes it to control / end-of-generation by its
    # text even here (llama_vocab_is_eog gives exactly this set on the development model)
    assert tok.eot_ids == {128247, 151643, 151645, 151662, 151663, 151664}
    assert tok.is_control(128247) and tok.encode("a</s>b") == [64, 128247, 65]
    assert tok.is_control(151644) and not tok.is_control(151657)  # <|im_start|>, <tool_call>
    assert tok.token_bytes(151665) == b""  # unused [PAD] tokens render as nothing


def test_encode_speed_is_reported(tok: Tokenizer) -> None:
    from minfer.tokenizer.bench import english_prose

    text = english_prose(1_000_000)
    t0 = time.perf_counter()
    ids = tok.encode(text)
    seconds = time.perf_counter() - t0
    print(f"\nencode: {len(text.encode()) / seconds / 1e6:.2f} MB/s ({len(ids)} tokens)")
    assert tok.decode(ids) == text
