"""The part of Go's text/template that a `/api/generate` `template` override is written in.

Ollama's older prompt templates read `.System`, `.Prompt`, `.Response` and `.Suffix` (also as
`$.Name`) and branch with `{{ if }}` / `{{ else if }}` / `{{ else }}` / `{{ end }}`; `{{-` and
`-}}` trim the white space beside an action, `{{/* */}}` is a comment. That is what is rendered
here. Anything else (`range`, `with`, functions, pipelines, `.Messages`, `.Tools`) is a
`TemplateUnsupported` naming the action, never a silently different prompt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_FIELD = re.compile(r"\$?\.([A-Za-z_][A-Za-z0-9_]*)")
FIELDS = ("System", "Prompt", "Response", "Suffix")


class TemplateUnsupported(ValueError):
    """A template this subset cannot render (its message names the action)."""


@dataclass
class _If:
    branches: list[tuple[str | None, list[_Node]]] = field(default_factory=list)


_Node = str | tuple[str] | _If  # literal text, ("Field",), a conditional


def render(source: str, values: Mapping[str, str]) -> str:
    """source rendered with values (missing fields are empty)."""
    nodes, rest = _parse(_tokens(source), 0, top=True)
    assert rest is None
    return _emit(nodes, values)


def _tokens(source: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", body) in order, with the trim markers applied."""
    out: list[tuple[str, str]] = []
    pos = 0
    for m in _ACTION.finditer(source):
        text = source[pos:m.start()]
        if m.group(1):
            text = text.rstrip()
        if out and out[-1][0] == "trim":
            out.pop()
            text = text.lstrip()
        out.append(("text", text))
        out.append(("action", m.group(2).strip()))
        if m.group(3):
            out.append(("trim", ""))
        pos = m.end()
    text = source[pos:]
    if out and out[-1][0] == "trim":
        out.pop()
        text = text.lstrip()
    out.append(("text", text))
    if "{{" in text:
        raise TemplateUnsupported("template: an unclosed {{ action")
    return out


def _parse(tokens: list[tuple[str, str]], i: int, *, top: bool = False
           ) -> tuple[list[_Node], tuple[int, str] | None]:
    """Nodes from tokens[i:] up to an `else...` / `end` (its index and body), or the end."""
    nodes: list[_Node] = []
    while i < len(tokens):
        kind, body = tokens[i]
        i += 1
        if kind == "text":
            if body:
                nodes.append(body)
            continue
        if body.startswith("/*") and body.endswith("*/"):
            continue
        word = body.split(None, 1)[0] if body else ""
        if word in ("else", "end"):
            if top:
                raise TemplateUnsupported(f"template: unexpected {{{{{word}}}}}")
            return nodes, (i, body)
        if word == "if":
            cond: str | None = _field(body[2:].strip(), body)
            node = _If()
            while True:
                branch, stop = _parse(tokens, i)
                node.branches.append((cond, branch))
                if stop is None:
                    raise TemplateUnsupported("template: an {{if}} without {{end}}")
                i, closing = stop
                if closing == "end":
                    break
                rest = closing[4:].strip()
                if rest.startswith("if "):
                    cond = _field(rest[3:].strip(), closing)
                elif not rest:
                    cond = None
                else:
                    raise TemplateUnsupported(f"template: unsupported action {{{{{closing}}}}}")
            nodes.append(node)
            continue
        nodes.append((_field(body, body),))
    if not top:
        raise TemplateUnsupported("template: an {{if}} without {{end}}")
    return nodes, None


def _field(expr: str, action: str) -> str:
    m = _FIELD.fullmatch(expr)
    if m is None or m.group(1) not in FIELDS:
        raise TemplateUnsupported(
            f"template: unsupported action {{{{{action}}}}} (a template override may use "
            f"{', '.join('.' + f for f in FIELDS)}, if / else if / else / end and comments)")
    return m.group(1)


def _emit(nodes: list[_Node], values: Mapping[str, str]) -> str:
    out: list[str] = []
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, tuple):
            out.append(values.get(node[0], ""))
        else:
            for cond, branch in node.branches:
                if cond is None or values.get(cond):
                    out.append(_emit(branch, values))
                    break
    return "".join(out)
