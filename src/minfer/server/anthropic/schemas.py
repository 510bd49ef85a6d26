"""Request bodies of Anthropic's Messages API as pydantic models.

Field names and ranges follow Anthropic's API: `max_tokens` is required, `temperature` is 0–1,
content is a string or a list of typed blocks (`text`, `image`, `document`, `tool_use`,
`tool_result`, `thinking`, `redacted_thinking`), `system` a string or text blocks. Types are
strict (no coercion) and unknown fields are ignored, as for the OpenAI bodies. Current SDKs no
longer offer `temperature` / `top_p` / `top_k` as arguments; clients send them in the body
(`extra_body`) and they are honoured.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from minfer.server.schemas import INT64_MAX, MAX_STOPS, StopText, _Strict


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: dict[str, Any] | None = None


class DocumentBlock(_Strict):
    """A document: its text reaches the model where the source is text (`text`, or `content`
    text blocks); a PDF or URL source is refused by the route."""

    type: Literal["document"]
    source: dict[str, Any] | None = None
    title: str | None = None
    context: str | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock
                  | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom"; Anthropic's server tools are refused by the route


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: str | None = None  # Claude's effort levels: accepted, no meaning here


class CountTokensRequest(_Strict):
    model: str = Field(max_length=512)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None  # structured output: a JSON schema
