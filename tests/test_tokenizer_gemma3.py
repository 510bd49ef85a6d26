"""Gemma 3 270M's vocabulary (SPM 'llama', 262,144 tokens, no space prefix, BOS added) against
ids llama.cpp 0.3.36 gave for the same texts (`Llama(path, vocab_only=True).tokenize`).

The GGUF is the catalogue's `gemma-3-270m` (pulled on first use, as tests/test_gemma3_real.py
pulls it), the file `benchmarks/tokenizer_vs_llamacpp.py` checks on ~2,200 texts; here a few cases
pin it cheaply.
"""

from __future__ import annotations

import pytest

from minfer.gguf.reader import GGUFFile
from minfer.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

# (text, ids with BOS and special tokens parsed, ids without BOS and with special=False)
CASES = [
    ("<start_of_turn>user\nWrite a haiku about 🦙s<end_of_turn>\n<start_of_turn>model\n",
     [2, 105, 2364, 107, 6974, 496, 678, 20517, 1003, 236743, 478, 397, 404, 391, 236751, 106,
      107, 105, 4368, 107],
     [236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 6974, 496, 678, 20517, 1003,
      236743, 478, 397, 404, 391, 236751, 236820, 643, 236779, 1340, 236779, 887, 236813, 107,
      236820, 3041, 236779, 1340, 236779, 887, 236813, 4368, 107]),
    ("def f(x):\n    return x  *  2\t# ok",
     [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 138, 236829, 138, 236778, 255968,
      236865, 7546],
     [2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 138, 236829, 138, 236778, 255968,
      236865, 7546]),
    ("Привет, 世界! naïve café   \n\n\n",
     [2, 116130, 236764, 84679, 236888, 120362, 33443, 139, 109],
     [116130, 236764, 84679, 236888, 120362, 33443, 139, 109]),
    ("<div>  </div> 1234567",
     [2, 224, 138, 235, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832],
     [224, 138, 235, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832]),
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from minfer.store.download import pull

    return Tokenizer.from_gguf(GGUFFile.open(pull("gemma-3-270m", progress=False)))


def test_metadata(tok: Tokenizer) -> None:
    assert tok.kind == "spm" and tok.n_vocab == 262144
    assert tok.add_bos and tok.bos_id == 2 and not tok.vocab.add_space_prefix
    assert tok.token_id("<end_of_turn>") in tok.eot_ids


@pytest.mark.parametrize(("text", "with_special", "plain"), CASES)
def test_matches_llama_cpp(tok: Tokenizer, text: str, with_special: list[int],
                           plain: list[int]) -> None:
    assert tok.encode(text) == with_special
    assert tok.encode(text, special=False, add_bos=False) == plain
    assert tok.decode(plain) == text and tok.decode(with_special) == "<bos>" + text
