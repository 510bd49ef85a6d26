"""Chat templates: the model's `tokenizer.chat_template` rendered as transformers renders it.

The environment copies transformers' `_compile_jinja_template`: jinja2's
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the loop-controls
extension (`{% break %}`, `{% continue %}`), a `{% generation %}` block that renders its body,
`raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` filter that is `json.dumps` with
`ensure_ascii=False` (jinja's own escapes HTML characters). Render variables follow HF:
`messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token` (plus
`pad_token` / `unk_token` where the vocabulary has them) and any extra keyword.

A file without a template gets ChatML. A template that does not compile refuses the load with
a TemplateError naming the line; an error while rendering is a TemplateError too.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn, Protocol

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minfer.errors import TemplateError
from minfer.tokenizer.builtin_templates import builtin_chat_template
from minfer.tokenizer.vocab import HasMetadata, read_chat_template

# transformers' default template, used when the file carries none.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TEMPLATE_FILENAME = "<chat_template>"


class _SpecialTokens(Protocol):
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None

    def token_text(self, token_id: int) -> str: ...


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask marker): the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's extension API is a class attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. Build with `ChatTemplate.from_gguf(f, tokenizer)`."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None,
                 is_default: bool = False) -> None:
        self.source = source
        self.is_default = is_default
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not compile: line {exc.lineno}: "
                                f"{exc.message}") from None

    @classmethod
    def from_gguf(cls, f: HasMetadata, tokenizer: _SpecialTokens) -> ChatTemplate:
        """The file's `tokenizer.chat_template`, else its family's built-in one
        (`minfer.tokenizer.builtin_templates`), else ChatML."""
        source = read_chat_template(f) or builtin_chat_template(f.metadata)
        return cls(source or CHATML, special_tokens=special_token_texts(tokenizer),
                   is_default=source is None)

    @functools.cached_property
    def variables(self) -> frozenset[str]:
        """The variables the template reads from its render context (`tools` where it writes
        the tools into the prompt, Qwen3's `enable_thinking`, ...)."""
        ast = self._template.environment.parse(self.source)
        return frozenset(jinja2.meta.find_undeclared_variables(ast))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for `messages` (special tokens appear as text, e.g. `<|im_start|>`)."""
        context: dict[str, Any] = {**self.special_tokens, **extra}
        context.update(messages=list(messages), tools=list(tools) if tools is not None else None,
                       add_generation_prompt=add_generation_prompt)
        context.setdefault("documents", None)
        try:
            return self._template.render(context)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template{_line_hint()}: {exc}") from None
        except Exception as exc:  # a template bug (bad index, wrong type) is the user's input
            raise TemplateError(f"chat template{_line_hint()}: "
                                f"{type(exc).__name__}: {exc}") from None


def special_token_texts(tokenizer: _SpecialTokens) -> dict[str, str]:
    """`bos_token`, `eos_token`, `pad_token`, `unk_token` as HF passes them (those that exist)."""
    ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id,
           "pad_token": tokenizer.pad_id, "unk_token": tokenizer.unk_id}
    return {name: tokenizer.token_text(tid) for name, tid in ids.items() if tid is not None}


def _line_hint() -> str:
    """' line N' for the template line being rendered when the current exception was raised."""
    tb = sys.exc_info()[2]
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" line {line}" if line is not None else ""
