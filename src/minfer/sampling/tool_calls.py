"""OpenAI tool calls: the grammar that forces them, and the parsers, per model family.

Qwen2.5 / Qwen3 (and Hermes-style models) write a call as (several are separated by a newline)

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each family's syntax is a `ToolSyntax` (its tags, its block parser, whether its arguments stream
as they come, whether an untagged JSON call counts); `tool_syntax(template_source)` picks it:
`HERMES` (the above) or `GEMMA4` (minfer.sampling.gemma4_calls). The parsers and the stream
below take it as `syntax=` (default `HERMES`). A harmony template's (gpt-oss) calls are messages,
parsed by minfer.sampling.harmony; `tool_choice_grammar` forces them with `template_source`.

API for the HTTP server (all errors are GrammarError, a MinferError → HTTP 400):

- `tools_for_prompt(tools, tool_choice) -> list | None`: the tools to render into the chat
  template (None when there are none or `tool_choice` is "none").
- `tool_choice_grammar(tools, tool_choice, *, parallel=True) -> str | None`: None for "auto" /
  "none" / no tools (free text); for "required" or `{"type": "function", "function": {"name": N}}`
  an llguidance grammar (see minfer.sampling.grammar) that forces one or more (`parallel`)
  `<tool_call>` blocks whose arguments match the function's `parameters` schema, then end of
  generation. Pass it to `Model.grammar_mask(...)` like a `response_format` grammar.
- `history_as_text(messages)`: a conversation's tool calls and results as `<tool_call>` /
  `<tool_response>` text, for a chat template that cannot write them; `tools_as_text(tools)`: the
  tools' signatures and the `<tool_call>` form as a system-message text, for a template that never
  reads `tools`; `history_for(messages, template_source, template_variables, tools)` applies
  both where the template needs them, after `template_calls`: every assistant call's
  `arguments` parsed into an object when they are JSON text (llama-server's form, which
  Qwen-style templates write with `tojson`), so every surface (the server, `Model.render_chat`,
  `minfer tokenize --chat`) renders one conversation to the same bytes.
- `parse_tool_calls(text) -> (content, tool_calls)`: the finished text split into the content
  (text outside the parsed blocks, stripped; "" when nothing is left, which the server sends as
  null) and OpenAI `tool_calls` (`{"id", "type": "function", "function": {"name", "arguments"}}`,
  `arguments` being the JSON text the model wrote). A block that is not valid JSON with a string
  `name`, or that is never closed, stays in the content. When the list is not empty the
  `finish_reason` is "tool_calls". Small models often drop the tags: a reply that is nothing but
  one `{"name": ..., "arguments": ...}` object (optionally in a ```json fence) is a call too, as
  llama.cpp's parser accepts it.
- `ToolCallStream()`: `.push(text) -> list[delta]` for each generated piece, `.finish() ->
  list[delta]` at the end; each delta is a chat.completion.chunk `delta` object: `{"content":
  s}` or `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}` (a
  call's first delta) then `{"tool_calls": [{"index", "function": {"arguments": piece}}]}` as
  the arguments arrive. A reply that opens with `{` or a fence is held back until the end, where
  it is either a bare call (one call delta) or content. `.tool_calls` holds the calls so far.
  For well-formed output (always, under a tool_choice grammar) the joined deltas equal
  `parse_tool_calls` of the whole text. A call is announced as soon as its `{"name": ...,
  "arguments": ` header is read, so a block that turns out malformed or unclosed after that is
  still reported as a call (the one-shot parser would leave it as content).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from minfer.errors import GrammarError
from minfer.sampling import gemma4_calls
from minfer.sampling.harmony import (
    ANALYSIS,
    CONSTRAIN,
    END,
    MESSAGE,
    PREAMBLE,
    RECIPIENT,
    START,
    TOOL_CHANNELS,
    harmony_history,
    is_harmony,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NL, NAME_KEY = "\n", '"name": '
_JSON_FENCE = "```json"
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')

Delta = dict[str, Any]


@dataclass(frozen=True)
class ToolSyntax:
    """How one family writes its calls: the tags around a call, the parser of what lies
    between them ((name, arguments JSON text) or None), the regex of a call's head after which
    its arguments stream as they come (None: a call goes out whole once closed), and whether a
    reply that is one untagged JSON call object counts as a call."""

    name: str
    open: str
    close: str
    parse_block: Callable[[str], tuple[str, str] | None]
    header: re.Pattern[str] | None
    bare: bool

    @property
    def block(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.open) + r"(.*?)" + re.escape(self.close), re.S)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# -- offering and forcing -------------------------------------------------------------------------

def _functions(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    out = []
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or \
                not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or \
                not fn["name"]:
            raise GrammarError(f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}}"
                               f", got {str(tool)[:80]}")
        out.append(fn)
    return out


def _choice(tool_choice: str | Mapping[str, Any] | None) -> str:
    """'none' | 'auto' | 'required' | 'fn:<name>'."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice in ("none", "auto", "required"):
            return tool_choice
    elif isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return "fn:" + name
    raise GrammarError(f"tool_choice must be 'none', 'auto', 'required' or "
                       f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


def tools_for_prompt(tools: Sequence[Mapping[str, Any]] | None,
                     tool_choice: str | Mapping[str, Any] | None = None) -> list[Any] | None:
    """The tools the chat template should list (None: render no tool section)."""
    if not tools or _choice(tool_choice) == "none":
        return None
    _functions(tools)
    return list(tools)


def tool_choice_grammar(tools: Sequence[Mapping[str, Any]] | None,
                        tool_choice: str | Mapping[str, Any] | None = None,
                        *, parallel: bool = True, template_source: str = "",
                        specials: Mapping[str, int] | None = None) -> str | None:
    """A grammar forcing tool calls for 'required' / a named function; None otherwise.
    template_source: the chat template's (a harmony template's calls are messages, see
    `_harmony_call_rules`; Gemma 4's notation is `gemma4_calls.forcing_rules`'); specials: the
    vocabulary's control tokens, text → id (`GrammarVocab.specials`), for marks that are
    tokens rather than text."""
    # (llguidance is imported only where a grammar is made: a chat prompt's rendering, which
    # reads `history_for`, runs without it)
    from minfer.sampling.grammar import JSON_DEFAULTS, lark_grammar

    choice = _choice(tool_choice)
    functions = _functions(tools)
    if choice in ("none", "auto"):
        return None
    if not functions:
        raise GrammarError(f"tool_choice {choice!r} needs at least one tool")
    if choice.startswith("fn:"):
        functions = [fn for fn in functions if fn["name"] == choice[3:]]
        if not functions:
            raise GrammarError(f"tool_choice names an unknown function {choice[3:]!r}")
    if gemma4_calls.is_gemma4_calls(template_source):
        return lark_grammar("\n".join(gemma4_calls.forcing_rules(
            [fn["name"] for fn in functions], parallel=parallel, specials=specials or {})) + "\n")
    alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
    if is_harmony(template_source):
        rules = _harmony_call_rules(alternatives)
        heads = [_lit(f"{fn['name']} {CONSTRAIN}json{MESSAGE}") for fn in functions]
    else:
        rules = ["start: call" + (' ("\\n" call)*' if parallel else ""),
                 f"call: {_lit(OPEN + NL + '{' + NAME_KEY)} ({alternatives}) "
                 f"{_lit('}' + NL + CLOSE)}"]
        heads = [_lit(json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ')
                 for fn in functions]
    for i, (fn, head) in enumerate(zip(functions, heads, strict=True)):
        schema = fn.get("parameters") or {"type": "object"}
        if not isinstance(schema, Mapping):
            raise GrammarError(f"parameters of {fn['name']!r} must be a JSON schema object")
        schema = {**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {})}}
        rules.append(f"fn{i}: {head} args{i}")
        rules.append(f"args{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return lark_grammar("\n".join(rules) + "\n")


def _harmony_call_rules(alternatives: str) -> list[str]:
    """A harmony reply that ends in a call, as llama.cpp's gpt-oss grammar forces one: any
    analysis or preamble messages (each closed by `<|end|>`, the next opened by
    `<|start|>assistant`: the prompt wrote the first), then
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS` (the
    generation ends there, or with `<|call|>`). The marks are text to the grammar: minfer's
    vocabularies (as llama.cpp's) make them user-defined tokens, never control ones."""
    return ["start: (message start_next)* call",
            f"start_next: {_lit(START)}",
            f"message: ({_lit(ANALYSIS)} | {_lit(PREAMBLE)}) body",
            f"body[lazy]: BODY {_lit(END)}",
            "BODY: /(?s:.*)/",
            f"call: {_lit(TOOL_CHANNELS[0] + RECIPIENT)} ({alternatives})"]


def _lit(text: str) -> str:
    """A Lark string literal for `text`."""
    return json.dumps(text, ensure_ascii=False)


# -- a tool history for templates that cannot write one --------------------------------------------

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def history_as_text(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a chat template that cannot write a tool history (Gemma's, a plain
    ChatML one): each assistant message's `tool_calls` (arguments as objects) become
    `<tool_call>` blocks after its content, the form its replies are parsed from, and each run
    of `tool` results one user message of `<tool_response>` blocks, with a user message right
    after them (Anthropic's text beside its `tool_result` blocks) joined to it: roles keep
    alternating.
    Without this such templates fail on the null content of a call-only message, or the model
    never sees its calls and their results."""
    out: list[dict[str, Any]] = []
    results_at = -1  # index in out of the user message the current run of results went to
    for message in messages:
        m = dict(message)
        calls = m.pop("tool_calls", None)
        if m.get("role") == "tool":
            block = f"{RESPONSE_OPEN}\n{m.get('content') or ''}\n{RESPONSE_CLOSE}"
            if results_at == len(out) - 1 >= 0:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
                results_at = len(out) - 1
            continue
        if m.get("role") == "user" and results_at == len(out) - 1 >= 0 and \
                isinstance(m.get("content"), str):  # text sent with the results: one turn
            out[-1]["content"] += "\n" + m["content"]
            continue
        if calls:
            blocks = "\n".join(
                f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                          "arguments": _arguments(c["function"])},
                                         ensure_ascii=False) + f"\n{CLOSE}" for c in calls)
            m["content"] = f"{m['content']}\n{blocks}" if m.get("content") else blocks
        out.append(m)
    return out


TOOLS_INTRO = ("You can call the functions below to help with the request. Their signatures "
               "are inside <tools></tools>, one JSON object per line:")
TOOLS_HOWTO = ("To call a function, write a JSON object with its name and arguments inside "
               f"{OPEN}{CLOSE} tags:\n{OPEN}\n"
               '{"name": <function-name>, "arguments": <args-json-object>}'
               f"\n{CLOSE}")


def tools_as_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools' description for a chat template that never reads `tools`: their signatures and
    the `<tool_call>` form the replies are parsed from (the Hermes / Qwen convention)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"# Tools\n\n{TOOLS_INTRO}\n<tools>\n{lines}\n</tools>\n\n{TOOLS_HOWTO}"


def with_tools_text(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]],
                    template_source: str) -> list[dict[str, Any]]:
    """messages with `tools_as_text` at the end of the system message (one is added first
    when there is none), or at the start of the first user message where the template refuses
    roles (it can raise) and never names a system role."""
    text = tools_as_text(tools)
    has_system = bool(messages) and messages[0].get("role") == "system"
    if has_system and isinstance(messages[0].get("content"), str):
        first = messages[0]["content"]
        return [{**messages[0], "content": f"{first}\n\n{text}" if first else text},
                *messages[1:]]
    refuses_system = "raise_exception" in template_source and "system" not in template_source
    if has_system or not refuses_system:
        return [{"role": "system", "content": text}, *messages]
    for i, m in enumerate(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return [*messages[:i], {**m, "content": f"{text}\n\n{m['content']}"},
                    *messages[i + 1:]]
    return [{"role": "system", "content": text}, *messages]


def history_for(messages: Sequence[Mapping[str, Any]], template_source: str,
                template_variables: Collection[str],
                tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages as a chat template (its source and the variables it reads) can take them:
    the tool calls and results as they are where it writes them itself (it reads `tool_calls`),
    else `history_as_text`; a harmony template's `thinking` (minfer.sampling.harmony); an
    older Gemma 4 template's `tool_responses` (minfer.sampling.gemma4_calls); and the tools
    described in the system message (`with_tools_text`) where the template never reads
    `tools`."""
    messages = template_calls(messages)
    if is_harmony(template_source):
        messages = harmony_history(messages)
    messages = gemma4_calls.gemma4_history(messages, template_source)
    out = messages if "tool_calls" in template_source else history_as_text(messages)
    if tools and "tools" not in template_variables:
        out = with_tools_text(out, tools, template_source)
    return out


def template_calls(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each assistant tool call as chat templates read it: `type`
    "function", `arguments` an object where they are JSON text (text that is not JSON stays
    as it is, as llama-server keeps it), and a call-only message's null content "" (templates
    test text, not null; Qwen3's looks for `</think>` in it)."""
    out = []
    for message in messages:
        m = dict(message)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [
                {**c, "type": c.get("type") or "function",
                 "function": {**c["function"], "arguments": _arguments(c["function"])}}
                if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) else c
                for c in calls]
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


def call_arguments(fn: Mapping[str, Any]) -> Any:
    """A call's `function.arguments` as an object: the API's JSON text parsed ("" is {}), an
    object as it is. Text that is not JSON raises json.JSONDecodeError."""
    args = fn.get("arguments", {})
    if isinstance(args, str):
        return json.loads(args) if args.strip() else {}
    return args


def _arguments(fn: Mapping[str, Any]) -> Any:
    """`call_arguments`, text that is not JSON kept as it is (the Python API's messages)."""
    try:
        return call_arguments(fn)
    except json.JSONDecodeError:
        return fn["arguments"]


# -- parsing a finished text ----------------------------------------------------------------------

def parse_tool_calls(text: str, *, new_id: Callable[[], str] = new_call_id,
                     syntax: ToolSyntax | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished generation; see the module docstring."""
    parts = tool_segments(text, new_id=new_id, syntax=syntax)
    return ("".join(p for p in parts if isinstance(p, str)).strip(),
            [p for p in parts if not isinstance(p, str)])


def tool_segments(text: str, *, new_id: Callable[[], str] = new_call_id,
                  syntax: ToolSyntax | None = None) -> list[str | dict[str, Any]]:
    """A finished generation in its order: the texts around the parsed blocks (as they are,
    possibly empty) and the OpenAI calls between them; `parse_tool_calls` joins the texts.
    syntax: the family's (`tool_syntax`; None: Qwen's `<tool_call>` blocks)."""
    syntax = syntax or HERMES
    parts: list[str | dict[str, Any]] = []
    last = 0
    for m in syntax.block.finditer(text):
        call = syntax.parse_block(m.group(1))
        if call is None:
            continue
        parts.append(text[last:m.start()])
        last = m.end()
        name, arguments = call
        parts.append(_call(new_id(), name, arguments))
    parts.append(text[last:])
    if len(parts) == 1 and syntax.bare:
        bare = parse_bare_call(text)
        if bare is not None:
            return [_call(new_id(), *bare)]
    return parts


def parse_bare_call(text: str) -> tuple[str, str] | None:
    """(name, arguments) when the whole reply is one untagged call object, else None."""
    body = _FENCE.sub("", text.strip()).strip()
    if not body.startswith("{"):
        return None
    call = parse_block(body)
    if call is None or '"arguments"' not in body:
        return None
    return call


def parse_block(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one block's body, or None when it is malformed."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        return obj["name"], args
    m = _HEADER.match(body)
    if m is not None and list(obj) == ["name", "arguments"]:
        end = scan_value(body, m.end())
        if end is not None and body[end:].strip() == "}":
            return obj["name"], body[m.end():end]  # as written, so streaming gives the same
    return obj["name"], json.dumps(args, ensure_ascii=False)


def scan_value(text: str, start: int) -> int | None:
    """End index of the JSON value at text[start] (a bracket/quote scan, no validation), or None
    when text ends before it does."""
    first = text[start] if start < len(text) else ""
    if first in "{[":
        depth, in_str, esc = 0, False, False
        for i in range(start, len(text)):
            c = text[i]
            if in_str:
                esc, in_str = (False, True) if esc else (c == "\\", c != '"')
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        return None
    if first == '"':
        esc = False
        for i in range(start + 1, len(text)):
            if esc:
                esc = False
            elif text[i] == "\\":
                esc = True
            elif text[i] == '"':
                return i + 1
        return None
    m = re.compile(r"[^\s,}\]]*").match(text, start)
    assert m is not None
    return m.end() if m.end() < len(text) else None


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- the families' syntaxes ----------------------------------------------------------------------

HERMES = ToolSyntax("hermes", OPEN, CLOSE, parse_block, _HEADER, bare=True)
GEMMA4 = ToolSyntax("gemma4", gemma4_calls.OPEN, gemma4_calls.CLOSE, gemma4_calls.parse_call,
                    None, bare=False)


def tool_syntax(template_source: str) -> ToolSyntax:
    """The syntax a chat template's model writes its calls in: Gemma 4's own, else the
    `<tool_call>` JSON blocks (Qwen, Hermes, and what `tools_as_text` teaches). A harmony
    template's calls are messages, read by minfer.sampling.harmony instead."""
    return GEMMA4 if gemma4_calls.is_gemma4_calls(template_source) else HERMES


# -- parsing a stream -----------------------------------------------------------------------------

class ToolCallStream:
    """Turns generated text pieces into chat.completion.chunk deltas (content and tool calls).

    States: text (content, holding back what may start `<tool_call>`); head (inside a block,
    waiting for the `{"name": ..., "arguments": ` header or the closing tag); args (streaming the
    arguments value); tail (after the value, waiting for the closing tag); bare (a reply that
    opens like an untagged call object, held whole until `finish`).
    """

    def __init__(self, *, new_id: Callable[[], str] = new_call_id,
                 syntax: ToolSyntax = HERMES) -> None:
        self.syntax = syntax
        self.tool_calls: list[dict[str, Any]] = []
        self._new_id = new_id
        self._state = "text"
        self._buf = ""  # unconsumed text of the current state
        self._sent = 0  # args: how much of _buf was sent as arguments
        self._started = False  # content: anything but whitespace sent yet?
        self._held_ws = ""  # content: trailing whitespace not sent yet

    def push(self, text: str) -> list[Delta]:
        """Deltas made ready by one more piece of generated text."""
        self._buf += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        """Deltas for what is left at the end of generation (an unclosed block stays text,
        unless its header was already sent)."""
        out: list[Delta] = []
        if self._state == "bare":
            call = parse_bare_call(self._buf)
            if call is None:
                self._content(self._buf, out)
            else:
                self._begin_call(call[0], out)
                self._args_delta(call[1], out)
        elif self._state == "text":
            self._content(self._buf, out)
        elif self._state == "head":
            self._content(self.syntax.open + self._buf, out)
        elif self._state == "args":
            self._send_args(len(self._buf), out)
        self._buf, self._state = "", "text"
        return out

    # -- states -------------------------------------------------------------------------------
    def _step(self, out: list[Delta]) -> bool:
        """Advance one state transition if the buffer allows; False when it needs more text."""
        if self._state == "text":
            return self._step_text(out)
        if self._state == "head":
            return self._step_head(out)
        if self._state == "args":
            return self._step_args(out)
        if self._state == "bare":
            return False  # held whole until finish()
        return self._step_tail()

    def _step_text(self, out: list[Delta]) -> bool:
        if not self._started and not self.tool_calls and self.syntax.bare:
            head = self._buf.lstrip()
            opens_call = head.startswith(("{", _JSON_FENCE))
            if opens_call:  # may be a call without tags: decide at the end
                self._state = "bare"
            if opens_call or _JSON_FENCE.startswith(head):  # or too short to tell yet
                return False
            if not head:
                return False
        tag = self.syntax.open
        at = self._buf.find(tag)
        if at >= 0:
            self._content(self._buf[:at], out)
            self._buf, self._state = self._buf[at + len(tag):], "head"
            return True
        keep = _partial_suffix(self._buf, tag)
        self._content(self._buf[:len(self._buf) - keep], out)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _step_head(self, out: list[Delta]) -> bool:
        syntax = self.syntax
        m = syntax.header.match(self._buf) if syntax.header is not None else None
        close = self._buf.find(syntax.close)
        name = _json_string(m.group(1)) if m is not None else None
        if m is not None and name is not None and (close < 0 or m.end() < close):
            self._begin_call(name, out)
            self._buf, self._sent, self._state = self._buf[m.end():], 0, "args"
            return True
        if close < 0:
            return False
        body, self._buf = self._buf[:close], self._buf[close + len(syntax.close):]
        call = syntax.parse_block(body)  # another shape: all at once, or left as text
        if call is None:
            self._content(syntax.open + body + syntax.close, out)
        else:
            self._begin_call(call[0], out)
            self._args_delta(call[1], out)
        self._state = "text"
        return True

    def _step_args(self, out: list[Delta]) -> bool:
        end = scan_value(self._buf, 0)
        close = self._buf.find(self.syntax.close)
        if end is not None and (close < 0 or end <= close):
            value = self._buf[:end]
            if value.startswith('"'):  # arguments given as a JSON string: send its text
                try:
                    self._args_delta(json.loads(value), out)
                except json.JSONDecodeError:
                    self._args_delta(value, out)
            else:
                self._send_args(end, out)
            self._buf, self._state = self._buf[end:], "tail"
            return True
        if close >= 0:  # closed inside the value: malformed, but already announced
            self._send_args(close, out)
            self._buf, self._state = self._buf[close + len(self.syntax.close):], "text"
            return True
        if self._buf[:1] in ("{", "["):  # send what cannot be the closing tag's start
            self._send_args(len(self._buf) - _partial_suffix(self._buf, self.syntax.close), out)
        return False

    def _step_tail(self) -> bool:
        close = self._buf.find(self.syntax.close)
        if close < 0:
            return False
        self._buf, self._state = self._buf[close + len(self.syntax.close):], "text"
        return True

    # -- emitting -----------------------------------------------------------------------------
    def _content(self, text: str, out: list[Delta]) -> None:
        """Content with leading and trailing whitespace of the whole reply removed."""
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            out.append({"content": self._held_ws + body})
            self._started, self._held_ws = True, text[len(body):]
        else:
            self._held_ws += text

    def _begin_call(self, name: str, out: list[Delta]) -> None:
        call = _call(self._new_id(), name, "")
        self.tool_calls.append(call)
        out.append({"tool_calls": [{"index": len(self.tool_calls) - 1, **call,
                                    "function": {"name": name, "arguments": ""}}]})

    def _send_args(self, upto: int, out: list[Delta]) -> None:
        if upto > self._sent:
            self._args_delta(self._buf[self._sent:upto], out)
            self._sent = upto

    def _args_delta(self, piece: str, out: list[Delta]) -> None:
        if not piece:
            return
        self.tool_calls[-1]["function"]["arguments"] += piece
        out.append({"tool_calls": [{"index": len(self.tool_calls) - 1,
                                    "function": {"arguments": piece}}]})


def _json_string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
