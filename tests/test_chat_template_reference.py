"""The development model's chat template against transformers (tests/fixtures/chat_template.json):
rendered text byte-identical and ids identical for every case, tools included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minfer.gguf.reader import GGUFFile
from minfer.tokenizer import ChatTemplate, Tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "chat_template.json"
CASES: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def model(real_model_path: Path) -> tuple[Tokenizer, ChatTemplate]:
    f = GGUFFile.open(real_model_path)
    tok = Tokenizer.from_gguf(f)
    return tok, ChatTemplate.from_gguf(f, tok)


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_matches_transformers(model: tuple[Tokenizer, ChatTemplate], name: str) -> None:
    tok, template = model
    case = CASES[name]
    inp = case["input"]
    text = template.render(inp["messages"], tools=inp.get("tools"),
                           add_generation_prompt=inp["add_generation_prompt"])
    assert text == case["rendered"]
    assert tok.encode_prompt(text) == case["ids"]


def test_the_template_is_the_models_own(model: tuple[Tokenizer, ChatTemplate]) -> None:
    _, template = model
    assert not template.is_default
    assert "<tool_call>" in template.source
