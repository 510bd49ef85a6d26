"""Render the reasoning models' published chat templates with transformers, for
tests/test_reasoning_templates.py (tests/fixtures/templates/renders.json).

The templates are the published ones as llama.cpp's repository keeps them
(models/templates/Qwen-Qwen3-0.6B.jinja, deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja, the
latter without llama.cpp's own `enable_thinking` addition). Each conversation is rendered by
transformers' `render_jinja_template` with `enable_thinking` unset, true and false:

    .venv/bin/python scripts/make_template_fixtures.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "templates"
SPECIAL = {"qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
           "r1-distill-qwen": {"bos_token": "<｜begin▁of▁sentence｜>",
                               "eos_token": "<｜end▁of▁sentence｜>"}}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
     {"role": "user", "content": "And now?"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nHello!"},
     {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "reasoning_content": "call the tool",
      "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                       "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny"}],
]


def main() -> None:
    out = []
    for name, special in SPECIAL.items():
        source = (DIR / f"{name}.jinja").read_text()
        for i, conv in enumerate(CONVERSATIONS):
            for thinking in (None, True, False):
                kwargs = {} if thinking is None else {"enable_thinking": thinking}
                text = render_jinja_template([conv], chat_template=source,
                                             add_generation_prompt=True, **special, **kwargs)
                out.append({"template": name, "conversation": i, "kwargs": kwargs,
                            "rendered": text[0][0]})
    (DIR / "renders.json").write_text(json.dumps(
        {"source": "transformers render_jinja_template", "conversations": CONVERSATIONS,
         "special_tokens": SPECIAL, "renders": out}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
