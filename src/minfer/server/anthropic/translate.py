"""Anthropic Messages ⇄ the OpenAI chat request the core's request path takes.

`chat_request` turns a Messages body into a `ChatCompletionRequest` (consecutive messages of one
role combined into one turn, as Anthropic's API does; system → a system message, `tool_result`
blocks → tool messages, `tool_use` → assistant tool calls, `thinking` → the assistant's
reasoning_content, `image` blocks (a base64 or url source) → image parts, tools / tool_choice /
stop_sequences / thinking mapped), so both APIs share prepare, sampling, stops, tools and the
reasoning split. `message_body` and `BlockEvents` shape the result as a `message` object or as
the streamed event sequence.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

from minfer.server.anthropic.schemas import (
    Block,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from minfer.server.errors import bad_request
from minfer.server.output import Reply
from minfer.server.schemas import (
    ChatCompletionRequest,
    Content,
    chat_content,
    image_part,
    translated,
)
from minfer.server.worker import Usage

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI chat request that generates this Messages request's reply. Anthropic's
    clients ask for large `max_tokens` as a matter of course: past the slot's context it is
    capped with a warning (server.notices), as on every API, instead of refused."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else \
            "\n".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for role, blocks in _turns(body.messages):
        messages.extend(_messages(role, blocks))
    out: dict[str, Any] = {"messages": messages}
    if body.tools:
        for i, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"tools.{i}: server tools ({tool.type}) are not supported",
                                  param=f"tools.{i}.type")
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise bad_request("tool_choice: type tool needs a name", param="tool_choice.name")
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    thinking = body.thinking
    if thinking is not None and thinking.type != "adaptive":  # adaptive: the template decides
        on = thinking.type != "disabled"
        out["chat_template_kwargs"] = {"enable_thinking": on}
        if on and thinking.budget_tokens is not None:
            out["reasoning_budget"] = thinking.budget_tokens
    if isinstance(body, MessagesRequest):
        out["max_tokens"] = body.max_tokens  # capped with a warning (server.notices)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                out[name] = getattr(body, name)
        if body.stop_sequences:
            out["stop"] = body.stop_sequences
        fmt = body.output_config.format if body.output_config else None
        if fmt is not None:
            out["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}}
    return translated(ChatCompletionRequest, out)


def _turns(messages: Sequence[Message]) -> list[tuple[str, list[tuple[str, Block]]]]:
    """The conversation's turns: consecutive messages of one role combined into one, as
    Anthropic's API combines them; each block with its path in the request (for errors)."""
    turns: list[tuple[str, list[tuple[str, Block]]]] = []
    for i, message in enumerate(messages):
        blocks: list[tuple[str, Block]] = (
            [(f"messages.{i}.content", TextBlock(type="text", text=message.content))]
            if isinstance(message.content, str) else
            [(f"messages.{i}.content.{j}", b) for j, b in enumerate(message.content)])
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks))
    return turns


def _messages(role: str, blocks: Sequence[tuple[str, Block]]) -> list[dict[str, Any]]:
    """One Anthropic turn as OpenAI chat messages (a user turn's tool results become tool
    messages, in order around its text and images; its texts are joined by newlines)."""
    out: list[dict[str, Any]] = []
    text: list[str | dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for at, block in blocks:
        if isinstance(block, ImageBlock):
            if role != "user":
                raise bad_request(f"{at}: image blocks belong to user turns", param=at)
            text.append(_image(block, at))
        elif isinstance(block, DocumentBlock):
            text.append(_document_text(block, at))
        elif isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if role != "assistant":
                raise bad_request(f"{at}: tool_use blocks belong to assistant turns", param=at)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            if role != "user":
                raise bad_request(f"{at}: tool_result blocks belong to user turns", param=at)
            if text:
                out.append({"role": "user", "content": chat_content(text, "\n")})
                text = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_content(block, at)})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": chat_content(text, "\n")}
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning_content"] = "\n".join(thinking)
        return [turn]
    if text or not out:
        out.append({"role": "user", "content": chat_content(text, "\n")})
    return out


def _result_content(block: ToolResultBlock, at: str) -> Content:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    parts: list[str | dict[str, Any]] = []
    for k, part in enumerate(block.content):
        where = f"{at}.content.{k}"
        if isinstance(part, ImageBlock):
            parts.append(_image(part, where))
        else:
            parts.append(_document_text(part, where) if isinstance(part, DocumentBlock)
                         else part.text)
    return chat_content(parts, "\n")


def _image(block: ImageBlock, at: str) -> dict[str, Any]:
    """An image block as an image part: a base64 source as a data: URL, a url source as it
    is (downloaded when the prompt is read: `minfer.engine.vision.fetch`)."""
    source = block.source or {}
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad_request(f"{at}: a base64 image source needs media_type and data",
                              param=f"{at}.source")
        return image_part(f"data:{media};base64,{data}")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise bad_request(f"{at}: a url image source needs url", param=f"{at}.source.url")
        return image_part(url)
    raise bad_request(f"{at}: image blocks are supported with a base64 or url source (got "
                      f"{kind!r})", param=f"{at}.source")


def _document_text(block: DocumentBlock, at: str) -> str:
    """A document as the model reads it: its title, its context and its text, a blank line
    apart. A text source (`data`) or a content source (a string or text blocks) has text; a
    base64 (PDF) or URL source is refused: this server reads no files."""
    source = block.source or {}
    kind = source.get("type")
    body: Any = source.get("data") if kind == "text" else source.get("content")
    if kind == "content" and isinstance(body, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in body):
            raise bad_request(f"{at}: a content document holds text blocks only here",
                              param=f"{at}.source.content")
        body = "\n".join(p["text"] for p in body)
    if kind not in ("text", "content") or not isinstance(body, str):
        raise bad_request(f"{at}: document blocks are supported with a text or content source "
                          f"(got {kind!r}: this server runs text-only models and reads no "
                          "files)", param=f"{at}.source")
    return "\n\n".join(t for t in (block.title, block.context, body) if t)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def stop_reason(finish: str, stop_sequence: str | None) -> str:
    if finish == "stop" and stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish, "end_turn")


def usage_body(usage: Usage, output_tokens: int | None = None) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens if output_tokens is None else output_tokens}


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    """The reply's blocks: thinking, then its texts and tool uses in the order written (texts
    stripped, empty ones dropped)."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    for part in reply.parts:
        if isinstance(part, str):
            if text := (part.strip() if reply.calls else part):
                blocks.append({"type": "text", "text": text})
        else:
            fn = part["function"]
            blocks.append({"type": "tool_use", "id": part["id"], "name": fn["name"],
                           "input": _input(fn["arguments"])})
    return blocks


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"_raw": arguments}


def message_body(msg_id: str, model: str, reply: Reply, stop_sequence: str | None,
                 usage: Usage) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(reply),
            "stop_reason": stop_reason(reply.finish, stop_sequence),
            "stop_sequence": stop_sequence, "usage": usage_body(usage)}


Event = tuple[str, dict[str, Any]]


class BlockEvents:
    """The reply's content blocks as stream events, from the chat deltas of a `ReplyStream`:
    `content_block_start`, `content_block_delta` (thinking_delta / text_delta /
    input_json_delta) and `content_block_stop`, one block at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"

    def push(self, deltas: Sequence[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        for d in deltas:
            if d.get("reasoning_content"):
                events += self._ensure("thinking", {"type": "thinking", "thinking": "",
                                                    "signature": ""})
                events.append(self._delta({"type": "thinking_delta",
                                           "thinking": d["reasoning_content"]}))
            if d.get("content"):
                events += self._ensure("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for call in d.get("tool_calls") or ():
                fn = call.get("function", {})
                if "id" in call:  # a new call opens a new block
                    events += self._close()
                    events += self._ensure("tool_use", {"type": "tool_use", "id": call["id"],
                                                        "name": fn.get("name", ""), "input": {}})
                if fn.get("arguments"):
                    events.append(self._delta({"type": "input_json_delta",
                                               "partial_json": fn["arguments"]}))
        return events

    def finish(self) -> list[Event]:
        return self._close()

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[Event]:
        if self.open == kind:
            return []
        events = self._close()
        self.index += 1
        self.open = kind
        events.append(("content_block_start", {"type": "content_block_start",
                                               "index": self.index, "content_block": block}))
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                        "delta": delta})

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        events: list[Event] = []
        if self.open == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        events.append(("content_block_stop", {"type": "content_block_stop",
                                              "index": self.index}))
        return events
