"""Gemma 4's tool-call syntax: its calls parsed into OpenAI calls, its tool history rendered.

Gemma 4 writes a call (several follow each other) as

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

its own object notation, as llama.cpp's gemma4 parser reads it (common/chat-peg-parser.cpp,
`gemma4_to_json`): an object `{key:value,...}` with bare keys (any characters but `:` and `}`),
strings between `<|"|>` marks (anything but that mark inside), arrays `[...]`, JSON numbers,
`true`, `false`, `null`; blanks after `{`, `[`, `,` and `:` and before the closing bracket (a
key is read as written: `{"a":1}` has the key `"a"`, quotes and all).

- `OPEN`, `CLOSE`: the tags around one call; `parse_call(body)`: (name, arguments as compact JSON
  text, as llama.cpp writes them) of the text between them, None when it is not a call in this
  notation. minfer.sampling.tool_calls registers the syntax (`GEMMA4_SYNTAX`) and streams it.
- `is_gemma4_calls(template_source)`: a chat template that writes calls this way (llama.cpp's
  test: its source has `'<|tool_call>call:'`).
- `forcing_rules(names, *, parallel, specials)`: the Lark rules of a reply that is calls only,
  as llama.cpp's gemma4 grammar forces them (tool_choice "required" / a named function): an
  optional thought channel, then one call (or several back to back when `parallel`) of one of
  `names`, whose arguments are an object in the notation above (its keys and values are not
  held to the function's schema, as llama.cpp does not). `specials` maps the vocabulary's
  control tokens' texts to their ids: a mark that is one (`<|tool_call>`, `<|"|>`, ...) is
  matched as that token, any other as text.
- `gemma4_history(messages, template_source)`: for an older Gemma 4 template that reads tool
  results only as an assistant message's `tool_responses` (it lacks the "OpenAI Chat
  Completions" scan of `tool` messages), each assistant call message, the `tool` results after
  it and a plain assistant answer after those become one assistant message with `tool_calls`,
  `tool_responses` (`{"name", "response"}`, a result that is JSON text parsed) and `content`, as
  llama.cpp's `convert_tool_responses_gemma4` does; the messages as they are otherwise.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

OPEN, CLOSE = "<|tool_call>call:", "<tool_call|>"
QUOTE = '<|"|>'
TEMPLATE_MARK = "'<|tool_call>call:'"
SCANS_TOOL_MESSAGES = "{#- OpenAI Chat Completions:"
_NAME = re.compile(r"([^{]+)(?=\{)")
_KEY = re.compile(r"[^:}]+")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = ("true", "false", "null")


def is_gemma4_calls(template_source: str) -> bool:
    return TEMPLATE_MARK in template_source


THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"
_NUMBER_RULE = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"


def forcing_rules(names: Sequence[str], *, parallel: bool,
                  specials: Mapping[str, int]) -> list[str]:
    """Lark rules (`start` first) forcing a reply of Gemma 4 calls (see the docstring)."""

    def mark(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else json.dumps(text)

    def until(name: str, opener: str, close: str) -> list[str]:
        """`name`: opener, then any text up to the first `close` mark, then that mark."""
        if close in specials:  # text cannot hold a control token: take all text
            return [f"{name}: {opener} {name.upper()}_TEXT {mark(close)}",
                    f"{name.upper()}_TEXT: /(?s:.*)/"]
        return [f"{name}[lazy]: {opener} /(?s:.*)/ {mark(close)}"]

    tc_open, colon = OPEN[:-len("call:")], "call:"
    alternatives = " | ".join(json.dumps(n, ensure_ascii=False) for n in names)
    return [
        "start: thought? call" + ("+" if parallel else ""),
        *until("thought", f'{mark(THOUGHT_OPEN)} "thought"', THOUGHT_CLOSE),
        f'call: {mark(tc_open)} "{colon}" ({alternatives}) g4_object {mark(CLOSE)}',
        'g4_object: "{" WS? ("}" | g4_member ("," WS? g4_member)* WS? "}")',
        'g4_member: G4_KEY ":" WS? g4_value',
        r"G4_KEY: /[^:}\s][^:}]*/",
        'g4_value: g4_string | g4_object | g4_array | G4_NUMBER | "true" | "false" | "null"',
        *until("g4_string", mark(QUOTE), QUOTE),
        'g4_array: "[" WS? ("]" | g4_value ("," WS? g4_value)* WS? "]")',
        r"WS: /[ \t\r\n]+/",
        f"G4_NUMBER: {_NUMBER_RULE}",
    ]


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one call's body `NAME{...}`, or None."""
    m = _NAME.match(body)
    if m is None:
        return None
    parsed = _value(body, m.end())
    if parsed is None or not parsed[0].startswith("{") or body[parsed[1]:].strip():
        return None
    return m.group(1).strip(), parsed[0]


def _blank(s: str, p: int) -> int:
    while p < len(s) and s[p].isspace():
        p += 1
    return p


def _value(s: str, p: int) -> tuple[str, int] | None:
    """(the value at p as JSON text, its end), or None where none is written."""
    if s.startswith(QUOTE, p):
        e = s.find(QUOTE, p + len(QUOTE))
        if e < 0:
            return None
        return json.dumps(s[p + len(QUOTE):e], ensure_ascii=False), e + len(QUOTE)
    if s.startswith("{", p):
        return _items(s, p + 1, "}", key=True)
    if s.startswith("[", p):
        return _items(s, p + 1, "]", key=False)
    for word in _WORDS:
        if s.startswith(word, p):
            return word, p + len(word)
    m = _NUMBER.match(s, p)
    return (m.group(0), m.end()) if m else None


def _items(s: str, p: int, close: str, *, key: bool) -> tuple[str, int] | None:
    """The members of an object (key) or the elements of an array, up to `close`."""
    out: list[str] = []
    p = _blank(s, p)
    if s.startswith(close, p):
        return ("{}" if key else "[]"), p + 1
    while True:
        name = ""
        if key:
            m = _KEY.match(s, p)
            if m is None or not s.startswith(":", m.end()):
                return None
            name, p = json.dumps(m.group(0), ensure_ascii=False) + ":", _blank(s, m.end() + 1)
        got = _value(s, p)
        if got is None:
            return None
        out.append(name + got[0])
        end = _blank(s, got[1])
        if s.startswith(close, end):
            text = ",".join(out)
            return ("{" + text + "}" if key else "[" + text + "]"), end + 1
        if not s.startswith(",", got[1]):  # a comma right after the value, as llama.cpp
            return None
        p = _blank(s, got[1] + 1)


# -- the tool history ------------------------------------------------------------------------------

def gemma4_history(messages: Sequence[Mapping[str, Any]],
                   template_source: str) -> list[dict[str, Any]]:
    """The messages as an older Gemma 4 template reads a tool history (see the docstring)."""
    if not is_gemma4_calls(template_source) or SCANS_TOOL_MESSAGES in template_source:
        return [dict(m) for m in messages]
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(dict(m))
            continue
        calls = list(m["tool_calls"])
        turn: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        responses: list[dict[str, Any]] = []
        while i < len(messages) and messages[i].get("role") == "tool":
            responses.append(_response(messages[i], calls, len(responses)))
            i += 1
        if responses:
            turn["tool_responses"] = responses
        if i < len(messages) and messages[i].get("role") == "assistant" and \
                not messages[i].get("tool_calls") and messages[i].get("content"):
            turn["content"] = messages[i]["content"]
            i += 1
        out.append(turn)
    return out


def _response(message: Mapping[str, Any], calls: Sequence[Any], index: int) -> dict[str, Any]:
    """A tool result as `{"name", "response"}`: the name of the call it answers (by position,
    else its `tool_call_id`), the content parsed where it is JSON text."""
    content = message.get("content")
    response: Any = content
    if isinstance(content, str):
        with contextlib.suppress(json.JSONDecodeError):
            response = json.loads(content)
    name = ""
    if index < len(calls) and isinstance(calls[index], Mapping):
        fn = calls[index].get("function")
        name = fn.get("name", "") if isinstance(fn, Mapping) else ""
    return {"name": name or message.get("tool_call_id", ""), "response": response}
