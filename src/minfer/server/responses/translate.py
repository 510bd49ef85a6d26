"""OpenAI Responses ⇄ the chat request the core's request path takes.

`chat_request` turns a Responses body into a `ChatCompletionRequest`: `instructions` → a system
message, message items → chat messages, `function_call` items → the assistant's tool calls,
`function_call_output` → tool messages, a `reasoning` item → the next assistant turn's
reasoning_content, `input_image` parts → image parts; function tools, `tool_choice`,
`text.format` and the sampling fields mapped. So both APIs share prepare, sampling, tools and
the reasoning split. `response_body` and `ItemEvents` shape the result as a `response` object or
as the streamed event sequence: a `reasoning` item (its text as `reasoning_text` content), a
`message` item with one `output_text` part, and a `function_call` item per tool call, in that
order.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from minfer.server.errors import bad_request
from minfer.server.output import Reply
from minfer.server.responses.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ImagePart,
    MediaPart,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)
from minfer.server.schemas import (
    ChatCompletionRequest,
    Content,
    chat_content,
    image_part,
    translated,
)
from minfer.server.worker import Usage

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this Responses request's output. `max_output_tokens`
    past the slot's context is capped with a warning (server.notices), as agents ask for large
    ones as a matter of course; unset, the reply may run to the end of the context. (A previous
    response's conversation is already in `input`: routes.with_history.)"""
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses (use "
                          "/v1/chat/completions)", param="top_logprobs",
                          code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += _messages(body.input)
    out: dict[str, Any] = {"messages": messages}
    if body.max_output_tokens is not None:
        out["max_tokens"] = body.max_output_tokens  # capped with a warning (notices)
    for name in SAMPLING:
        if getattr(body, name) is not None:
            out[name] = getattr(body, name)
    if body.tools:
        out["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        out["tool_choice"] = _tool_choice(body.tool_choice)
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_ or {}}}
    if body.reasoning is not None and body.reasoning.effort:  # "none": no thinking
        out["reasoning_effort"] = body.reasoning.effort
    return translated(ChatCompletionRequest, out)


def _messages(items: Sequence[Any]) -> list[dict[str, Any]]:
    """The input items as chat messages, in order; consecutive function calls (and a reasoning
    item before them) join the assistant turn they belong to."""
    out: list[dict[str, Any]] = []
    thought: list[str] = []
    for i, item in enumerate(items):
        at = f"input.{i}"
        if isinstance(item, MessageItem):
            turn: dict[str, Any] = {"role": item.role, "content": _content(item.content, at)}
            if item.role == "assistant" and thought:
                turn["reasoning_content"] = "\n".join(thought)
                thought = []
            out.append(turn)
        elif isinstance(item, ReasoningItem):
            thought += [p.text for p in (item.content or item.summary)]
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not thought:
                last.setdefault("tool_calls", []).append(call)
            else:
                turn = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thought:
                    turn["reasoning_content"] = "\n".join(thought)
                    thought = []
                out.append(turn)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _content(item.output, at)})
    return out


def _content(content: str | list[TextPart | ImagePart | MediaPart], at: str) -> Content:
    if isinstance(content, str):
        return content
    pieces: list[str | dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{at}.content.{j}"
        if isinstance(part, MediaPart):
            raise bad_request(f"{where}: {part.type} parts are not supported (this server "
                              "reads text and images)", param=where, code="unsupported_content")
        if isinstance(part, ImagePart):
            if part.image_url is None:
                raise bad_request(f"{where}: an input_image needs image_url (a data: or "
                                  "http(s) URL; file_id is not supported)",
                                  param=f"{where}.image_url", code="unsupported_content")
            pieces.append(image_part(part.image_url))
        else:
            pieces.append(part.text)
    return chat_content(pieces)


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise bad_request(f"tools.{i}: {kind!r} tools are not supported (function tools only)",
                          param=f"tools.{i}.type", code="unsupported_value")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"tools.{i}: a function tool needs a name", param=f"tools.{i}.name")
    return {"type": "function", "function": {"name": name,
                                             "description": tool.get("description") or "",
                                             "parameters": tool.get("parameters") or {}}}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice: 'auto', 'none', 'required' or {'type': 'function', "
                      "'name': ...}", param="tool_choice", code="invalid_value")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def usage_body(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class Envelope:
    """What the response object and every stream event of one response share."""

    def __init__(self, body: ResponsesRequest, model: str, response_id: str | None = None) -> None:
        self.id = response_id or new_id("resp_")
        self.created = int(time.time())
        self.body = body
        self.model = model

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: Usage | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is True,
            "temperature": b.temperature, "top_p": b.top_p,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [], "metadata": b.metadata or {}, "user": b.user,
            "text": {"format": {"type": "text"}} if b.text is None
            else b.text.model_dump(by_alias=True, exclude_none=True),
            "usage": None if usage is None else usage_body(usage),
        }


def status_of(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


def output_items(reply: Reply) -> list[dict[str, Any]]:
    """The output items of a whole reply: its reasoning, then its messages and function calls
    in the order written (beside calls, texts stripped and empty ones dropped; a reply without
    calls is one message, even empty)."""
    items: list[dict[str, Any]] = []
    if reply.reasoning:
        items.append(_reasoning(new_id("rs_"), reply.reasoning, "completed"))
    for part in reply.parts:
        if isinstance(part, str):
            text = part.strip() if reply.calls else part
            if text or not reply.calls:
                items.append(_message(new_id("msg_"), text, "completed"))
        else:
            fn = part["function"]
            items.append(_call(new_id("fc_"), part["id"], fn["name"], fn["arguments"],
                               "completed"))
    return items


def _reasoning(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call(item_id: str, call_id: str, name: str, arguments: str,
          status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


Event = dict[str, Any]


class ItemEvents:
    """The reply's output items as stream events, from the chat deltas of a `ReplyStream`:
    `response.output_item.added`, the item's deltas (`response.reasoning_text.delta`,
    `response.content_part.added` then `response.output_text.delta`,
    `response.function_call_arguments.delta`), their `.done` events and
    `response.output_item.done`, one item at a time; `items` collects the finished ones."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open item's text (or arguments) so far

    def push(self, deltas: Sequence[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        for d in deltas:
            if d.get("reasoning_content"):
                events += self._ensure("reasoning")
                events.append(self._delta("response.reasoning_text.delta",
                                          d["reasoning_content"], content_index=0))
            if d.get("content"):
                events += self._ensure("message")
                events.append(self._delta("response.output_text.delta", d["content"],
                                          content_index=0, logprobs=[]))
            for call in d.get("tool_calls") or ():
                fn = call.get("function", {})
                if "id" in call:  # a new call opens a new item
                    events += self._close()
                    events += self._open(_call(new_id("fc_"), call["id"], fn.get("name", ""),
                                               "", "in_progress"))
                if fn.get("arguments") and self.open is not None:
                    events.append(self._delta("response.function_call_arguments.delta",
                                              fn["arguments"]))
        return events

    def finish(self) -> list[Event]:
        events = self._close()
        if not self.items:  # an empty reply is still a message
            events += self._ensure("message") + self._close()
        return events

    def _ensure(self, kind: str) -> list[Event]:
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            return events + self._open(_reasoning(new_id("rs_"), None, "in_progress"))
        events += self._open(_message(new_id("msg_"), None, "in_progress"))
        assert self.open is not None
        events.append({"type": "response.content_part.added", "item_id": self.open["id"],
                       "output_index": len(self.items), "content_index": 0,
                       "part": _part("")})
        return events

    def _open(self, item: dict[str, Any]) -> list[Event]:
        self.open, self.text = item, ""
        return [{"type": "response.output_item.added", "output_index": len(self.items),
                 "item": dict(item)}]

    def _delta(self, kind: str, delta: str, **extra: Any) -> Event:
        assert self.open is not None
        self.text += delta
        return {"type": kind, "item_id": self.open["id"], "output_index": len(self.items),
                "delta": delta, **extra}

    def _close(self) -> list[Event]:
        item = self.open
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": len(self.items)}
        events: list[Event] = []
        if item["type"] == "reasoning":
            done = _reasoning(item["id"], self.text, "completed")
            events.append({"type": "response.reasoning_text.done", **at, "content_index": 0,
                           "text": self.text})
        elif item["type"] == "message":
            done = _message(item["id"], self.text, "completed")
            events.append({"type": "response.output_text.done", **at, "content_index": 0,
                           "text": self.text, "logprobs": []})
            events.append({"type": "response.content_part.done", **at, "content_index": 0,
                           "part": _part(self.text)})
        else:
            done = _call(item["id"], item["call_id"], item["name"], self.text, "completed")
            events.append({"type": "response.function_call_arguments.done", **at,
                           "name": item["name"], "arguments": self.text})
        events.append({"type": "response.output_item.done", "output_index": len(self.items),
                       "item": done})
        self.items.append(done)
        self.open, self.text = None, ""
        return events
