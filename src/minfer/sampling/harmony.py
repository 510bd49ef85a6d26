"""gpt-oss's harmony replies: reasoning, content and a tool call parsed as llama.cpp parses them.

A harmony reply is a run of messages, each `<|start|>assistant` + a header + `<|message|>` + a
body; the rendered prompt ends with `<|start|>assistant` (the generation prompt), so the reply
opens inside the first header:

    <|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>answer
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

(`<|return|>` and `<|call|>` end the generation, so they never reach the text.) The grammar is
llama.cpp's gpt-oss parser (common/parsers/gpt-oss.cpp, a PEG run leniently over the generation
prompt + the reply): messages `analysis` (the reasoning; with the `none` reasoning format the
whole `<|channel|>analysis<|message|>…<|end|>` is content) and `commentary` without a recipient
(a preamble: content), each closed by `<|end|>`, optionally led by a stray
`<|channel|>commentary[ to=assistant]`; then one last message: `final` (content up to `<|end|>`
or the end; nothing after it is read) or, where tools are offered, a call to one of them
(`[ to=functions.NAME]<|channel|>commentary|analysis[ to=functions.NAME][ [<|constrain|>]json]
<|message|>ARGS`, the recipient in the role or the channel header) whose arguments are the JSON
value as written; with no tools, such a call is an unsolicited one and is dropped. Several
analysis or content bodies are joined as they are; whitespace-only reasoning is none.

Where llama.cpp fails the whole reply (a header none of these rules reads, a call to a
function that was not offered, JSON that never closes), minfer does not: from the message that
cannot be read, the rest of the text is content as written (without its `<|start|>assistant`),
and a call whose header was read keeps the arguments text as written. A stream never breaks.

`HarmonyFormat(reasoning, tools, opens_header).parse(text, new_id=...) -> HarmonyReply` parses a
whole reply; `.stream(new_id=...)` gives a `HarmonyStream` whose `push(text)` / `finish()` return
chat.completion.chunk deltas (`reasoning_content`, `content`, `tool_calls` as
minfer.sampling.tool_calls streams them; `new_id` names the calls); every delta is final, so
they concatenate to `parse`'s values for any split of the text. `harmony_history(messages)`
gives an earlier reply's `reasoning_content` to the template as the `thinking` its messages
read, as llama.cpp does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Delta = dict[str, Any]
_JSON = json.JSONDecoder()

START = "<|start|>assistant"  # the generation prompt; every further message's role header
CHANNEL, MESSAGE, END, CONSTRAIN = "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
ANALYSIS = CHANNEL + "analysis" + MESSAGE
PREAMBLE = CHANNEL + "commentary" + MESSAGE
FINAL = CHANNEL + "final" + MESSAGE
STRAY, STRAY_TO = CHANNEL + "commentary", " to=assistant"
RECIPIENT, TO = " to=functions.", " to="
TOOL_CHANNELS = (CHANNEL + "commentary", CHANNEL + "analysis")
_CONSTRAINT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def is_harmony(template_source: str) -> bool:
    """A chat template that writes harmony messages (llama.cpp's test: it writes `<|channel|>`)."""
    return CHANNEL in template_source


def harmony_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each `reasoning_content` also as `thinking` (the template reads it);
    an assistant call's content is dropped beside it (the template refuses both)."""
    out = []
    for message in messages:
        m = dict(message)
        if isinstance(m.get("reasoning_content"), str):
            m["thinking"] = m["reasoning_content"]
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out


# -- matching -------------------------------------------------------------------------------------
# A match at a position is an end index, MORE (the text ends inside what could still match: a
# stream waits) or FAIL.
MORE, FAIL = -1, -2


def _lit(s: str, p: int, literal: str) -> int:
    if s.startswith(literal, p):
        return p + len(literal)
    return MORE if literal.startswith(s[p:]) else FAIL


def _stray(s: str, p: int) -> int:
    """After an optional `<|channel|>commentary[ to=assistant]`."""
    q = _lit(s, p, STRAY) if p < len(s) else FAIL
    if q < 0:
        return MORE if q == MORE else p
    r = _lit(s, q, STRAY_TO) if q < len(s) else FAIL
    return r if r >= 0 else (MORE if r == MORE else q)


def _then(p: int, literal: str, s: str) -> int:
    return p if p < 0 else _lit(s, p, literal)


def _partial_end(s: str, p: int) -> int:
    """Where the body from p stops while `<|end|>` is not written: before a tail that may be
    its start."""
    for n in range(min(len(END) - 1, len(s) - p), 0, -1):
        if s.endswith(END[:n]):
            return len(s) - n
    return len(s)


@dataclass
class _Msg:
    """One message read at a position: `kind` done (more may follow), last (the reply's last
    message: nothing after it is read), open (the text ends inside it) or broken; its values."""
    kind: str
    end: int = 0
    reasoning: str = ""
    content: str = ""
    call: tuple[str, str] | None = None  # (name, arguments as written so far)


def _body(s: str, p: int, *, last: bool) -> tuple[str, int, str]:
    """(kind, end after the closing `<|end|>` or of the text, body) of a body starting at p."""
    e = s.find(END, p)
    if e < 0:
        return "open", len(s), s[p:_partial_end(s, p)]
    return ("last" if last else "done"), e + len(END), s[p:e]


# -- the parser ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HarmonyReply:
    reasoning: str | None  # None: no reasoning (or only whitespace)
    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool calls


@dataclass(frozen=True)
class HarmonyFormat:
    """How one reply is read: `reasoning` False is llama.cpp's `none` reasoning format (the
    analysis stays in content); `tools`: the offered functions' names (None: no tools, or
    tool_choice "none"); `opens_header`: the prompt ended with `<|start|>assistant`."""

    reasoning: bool = True
    tools: tuple[str, ...] | None = None
    opens_header: bool = True

    def parse(self, text: str, *, new_id: Callable[[], str]) -> HarmonyReply:
        """The values of a whole reply; new_id: a tool call's id."""
        stream = self.stream(new_id=new_id)
        deltas = stream.push(text) + stream.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        return HarmonyReply(reasoning or None, content, stream.tool_calls)

    def stream(self, *, new_id: Callable[[], str]) -> HarmonyStream:
        return HarmonyStream(self, new_id=new_id)

    def message(self, s: str, p: int) -> tuple[_Msg, int]:
        """The message at p, and where its body starts past the role header (p when the text
        there is not `<|start|>assistant`)."""
        q = _lit(s, p, START)
        if q == MORE:
            return _Msg("open", len(s)), p
        if q == FAIL:
            return _Msg("broken"), p
        for rule in (self._preamble, self._analysis):
            m = rule(s, q)
            if m.kind != "broken":
                return m, q
        if self.tools is not None:
            m = self._tool_call(s, q)
            return (m if m.kind != "broken" else self._final(s, q)), q
        m = self._final(s, q)
        return (m if m.kind != "broken" else self._unsolicited(s, q)), q

    def _preamble(self, s: str, q: int) -> _Msg:
        r = _lit(s, q, PREAMBLE)
        if r < 0:
            return _Msg("open" if r == MORE else "broken", len(s))
        kind, end, body = _body(s, r, last=False)
        return _Msg(kind, end, content=body)

    def _analysis(self, s: str, q: int) -> _Msg:
        r = _then(_stray(s, q), ANALYSIS, s)
        if r == FAIL:
            return _Msg("broken")
        if r == MORE:
            return _Msg("open", len(s))
        kind, end, body = _body(s, r, last=False)
        if self.reasoning:
            return _Msg(kind, end, reasoning=body)
        return _Msg(kind, end, content=s[q:end] if kind == "done" else s[q:])

    def _final(self, s: str, q: int) -> _Msg:
        r = _then(_stray(s, q), FINAL, s)
        if r < 0:
            return _Msg("open" if r == MORE else "broken", len(s))
        kind, end, body = _body(s, r, last=True)
        return _Msg(kind, end, content=body)

    def _unsolicited(self, s: str, q: int) -> _Msg:
        """A call with no tools offered: read and dropped."""
        r = q
        for channel in TOOL_CHANNELS:
            c = _lit(s, q, channel) if q < len(s) else FAIL
            if c == MORE:
                return _Msg("open", len(s))
            if c >= 0:
                r = c
                break
        r = _lit(s, r, TO)
        if r < 0:
            return _Msg("open" if r == MORE else "broken", len(s))
        kind, end, _ = _body(s, r, last=True)
        return _Msg(kind, end)

    def _tool_call(self, s: str, q: int) -> _Msg:
        """A call to an offered function; open until its header is read, then its arguments as
        they come."""
        assert self.tools is not None
        for name in self.tools:
            for in_role in (True, False):
                h = self._call_header(s, q, name, in_role=in_role)
                if h == MORE:  # llama.cpp's choice takes the first alternative not failed
                    return _Msg("open", len(s))
                if h >= 0:
                    return self._arguments(s, h, name)
        return _Msg("broken")

    def _call_header(self, s: str, q: int, name: str, *, in_role: bool) -> int:
        p = q
        if in_role:
            p = _then(_then(p, RECIPIENT, s), name, s)
        if p >= 0:
            p = _channel(s, p)
        if not in_role:
            p = _then(_then(p, RECIPIENT, s), name, s)
        if p >= 0:
            p = _constraint(s, p)
        return _then(p, MESSAGE, s)

    @staticmethod
    def _arguments(s: str, h: int, name: str) -> _Msg:
        a = h
        while a < len(s) and s[a].isspace():
            a += 1
        end = _json_end(s, a)
        if end is None:
            return _Msg("open", len(s), call=(name, s[a:].rstrip()))
        return _Msg("last", end, call=(name, s[a:end]))


def _json_end(s: str, a: int) -> int | None:
    """The end of the JSON object or array written at a (None: not written whole, or not JSON:
    the arguments then run to the end of the text)."""
    if s[a:a + 1] not in ("{", "["):
        return None
    try:
        return _JSON.raw_decode(s, a)[1]
    except json.JSONDecodeError:
        return None


def _channel(s: str, p: int) -> int:
    """After `<|channel|>commentary` or `<|channel|>analysis`."""
    waiting = False
    for channel in TOOL_CHANNELS:
        r = _lit(s, p, channel)
        if r >= 0:
            return r
        waiting |= r == MORE
    return MORE if waiting else FAIL


def _constraint(s: str, p: int) -> int:
    """After an optional ` [<|constrain|>]json` (any blanks, the tag optional, a type name)."""
    if p == len(s):
        return p
    r = p
    while r < len(s) and s[r].isspace():
        r += 1
    c = _lit(s, r, CONSTRAIN) if r < len(s) else FAIL
    if c == MORE:
        return MORE
    if c >= 0:
        r = c
    n = r
    while n < len(s) and s[n] in _CONSTRAINT_CHARS:
        n += 1
    if n > r:
        return n
    return MORE if r == len(s) else p  # no type name: the constraint is absent


class HarmonyStream:
    """A harmony reply's deltas as its text streams; see the module docstring."""

    def __init__(self, fmt: HarmonyFormat, *, new_id: Callable[[], str]) -> None:
        self.fmt = fmt
        self.tool_calls: list[dict[str, Any]] = []
        self._new_id = new_id
        self._text = START if fmt.opens_header else ""
        self._pos = 0  # where the first message not yet read whole starts
        self._ended = False  # the last message was read: no further text counts
        self._verbatim = -1  # a message could not be read: the content runs as written from here
        self._sent: dict[str, int] = {}  # how much of the open message's values went out
        self._called = False  # the open message's call was announced
        self._reasoned = False  # reasoning other than whitespace went out
        self._held = ""  # reasoning held back while it is only whitespace

    def push(self, text: str) -> list[Delta]:
        self._text += text
        return self._advance()

    def finish(self) -> list[Delta]:
        """The end of the reply: read as it stands (llama.cpp reads the whole reply as leniently
        as a part), so nothing is left to send."""
        return []

    def _advance(self) -> list[Delta]:
        out: list[Delta] = []
        s = self._text
        while self._verbatim < 0 and not self._ended:
            m, body_at = self.fmt.message(s, self._pos)
            if m.kind == "broken":
                self._verbatim = body_at
                break
            self._emit(out, "reasoning_content", m.reasoning)
            self._emit(out, "content", m.content)
            if m.call is not None:
                self._emit_call(out, *m.call)
            if m.kind == "open":
                return out
            self._ended = m.kind == "last"
            self._pos, self._sent, self._called = m.end, {}, False
        if self._verbatim >= 0:
            self._emit(out, "content", s[self._verbatim:])
        return out

    def _emit(self, out: list[Delta], key: str, value: str) -> None:
        """The part of the open message's `value` not sent yet."""
        sent = self._sent.get(key, 0)
        piece = value[sent:]
        if not piece:
            return
        self._sent[key] = len(value)
        if key == "reasoning_content" and not self._reasoned:
            piece, self._held = self._held + piece, ""
            if not piece.strip():  # whitespace-only reasoning is none
                self._held = piece
                return
            self._reasoned = True
        out.append({key: piece})

    def _emit_call(self, out: list[Delta], name: str, arguments: str) -> None:
        if not self._called:
            self._called = True
            call = {"id": self._new_id(), "type": "function",
                    "function": {"name": name, "arguments": ""}}
            self.tool_calls.append(call)
            out.append({"tool_calls": [{"index": len(self.tool_calls) - 1, **call,
                                        "function": {"name": name, "arguments": ""}}]})
        sent = self._sent.get("arguments", 0)
        piece = arguments[sent:]
        if piece:
            self._sent["arguments"] = len(arguments)
            self.tool_calls[-1]["function"]["arguments"] += piece
            out.append({"tool_calls": [{"index": len(self.tool_calls) - 1,
                                        "function": {"arguments": piece}}]})
