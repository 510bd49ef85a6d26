"""Chat templates for families whose GGUF files may carry none.

Gemma-3-270M's file (the catalogue's `gemma-3-270m`) has no `tokenizer.chat_template`, and
ChatML, the generic fallback, is not what the model was trained on. `builtin_chat_template`
gives the family's own template by `general.architecture`: for Gemma 3 the one its Hugging Face
release ships (turns as `<start_of_turn>user` / `<start_of_turn>model` ... `<end_of_turn>`, a
system message folded into the first user turn), less its leading `{{ bos_token }}`: the text is
what llama.cpp's built-in `gemma` template renders, and BOS comes from the tokenizer as the
vocabulary asks (`tokenizer.ggml.add_bos_token`), once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GEMMA3_TEMPLATE = """{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

_BY_ARCH = {"gemma3": GEMMA3_TEMPLATE}


def builtin_chat_template(metadata: Mapping[str, Any]) -> str | None:
    """The family's own template for a file without one (None: no built-in for it)."""
    arch = metadata.get("general.architecture")
    return _BY_ARCH.get(arch) if isinstance(arch, str) else None
