"""Gemma 3's built-in chat template (its GGUF carries none) renders what llama.cpp renders.

The expected strings are llama.cpp's `llama_chat_apply_template` with its built-in "gemma"
template (llama-cpp-python 0.3.36), add_ass=True.
"""

from __future__ import annotations

from minfer.tokenizer.builtin_templates import GEMMA3_TEMPLATE, builtin_chat_template
from minfer.tokenizer.chat import ChatTemplate

LLAMACPP = [
    ([{"role": "user", "content": "Hello!"}],
     "<start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n"),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  Name a color.  "}],
     "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello."
     "<end_of_turn>\n<start_of_turn>user\nName a color.<end_of_turn>\n<start_of_turn>model\n"),
]


def test_gemma3_template_renders_as_llamacpp() -> None:
    template = ChatTemplate(GEMMA3_TEMPLATE, special_tokens={"bos_token": "<bos>"})
    for messages, want in LLAMACPP:
        assert template.render(messages) == want


def test_builtin_template_by_architecture() -> None:
    assert builtin_chat_template({"general.architecture": "gemma3"}) == GEMMA3_TEMPLATE
    assert builtin_chat_template({"general.architecture": "qwen2"}) is None
    assert builtin_chat_template({}) is None
