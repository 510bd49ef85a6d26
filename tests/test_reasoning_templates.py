"""The published reasoning-model templates (Qwen3, DeepSeek-R1-Distill-Qwen) render in minfer's
sandboxed jinja byte for byte as transformers renders them, `enable_thinking` unset, true and
false (tests/fixtures/templates, made by scripts/make_template_fixtures.py); a prompt that ends
inside a thinking block is recognised as such."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minfer.chat.reasoning import prompt_opens_reasoning
from minfer.tokenizer.chat import ChatTemplate

DIR = Path(__file__).parent / "fixtures" / "templates"
DATA = json.loads((DIR / "renders.json").read_text())


@pytest.mark.parametrize("case", DATA["renders"],
                         ids=[f"{r['template']}-{r['conversation']}-{r['kwargs']}"
                              for r in DATA["renders"]])
def test_render_equals_transformers(case: dict[str, Any]) -> None:
    name = case["template"]
    template = ChatTemplate((DIR / f"{name}.jinja").read_text(),
                            special_tokens=DATA["special_tokens"][name])
    messages = DATA["conversations"][case["conversation"]]
    assert template.render(messages, add_generation_prompt=True, **case["kwargs"]) == \
        case["rendered"]


def test_which_prompts_open_the_thinking() -> None:
    opens = {(r["template"], json.dumps(r["kwargs"])): prompt_opens_reasoning(r["rendered"])
             for r in DATA["renders"] if r["conversation"] == 0}
    assert opens == {("qwen3", "{}"): False, ("qwen3", '{"enable_thinking": true}'): False,
                     ("qwen3", '{"enable_thinking": false}'): False,
                     ("r1-distill-qwen", "{}"): True,
                     ("r1-distill-qwen", '{"enable_thinking": true}'): True,
                     ("r1-distill-qwen", '{"enable_thinking": false}'): True}
