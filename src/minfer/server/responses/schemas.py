"""Request bodies of OpenAI's Responses API (`POST /v1/responses`) as pydantic models.

`input` is a string or a list of items: messages (`role` user / assistant / system / developer,
content a string or `input_text` / `output_text` parts), `function_call`, `function_call_output`
and `reasoning` items. Types are strict and unknown fields ignored, as for the chat bodies; the
llama-server sampling extras clients send through `extra_body` (`top_k`, `min_p`, `seed`,
`repeat_penalty`) are honoured. An `input_image` part (`image_url`: a data: URL or an http(s)
URL) is an image for a model with a vision encoder; file and audio parts are read so that the
answer can name them (this server reads text and images).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from minfer.server.schemas import INT64_MAX, INT64_MIN, _Strict


class TextPart(_Strict):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class ImagePart(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None  # the Files API's: refused (this server stores no files)
    detail: str | None = None


class MediaPart(_Strict):
    type: Literal["input_file", "input_audio"]


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart | ImagePart | MediaPart]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart | ImagePart | MediaPart]


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: str | None = None  # the template's reasoning_effort; "none" turns thinking off
    summary: str | None = None


class ResponsesRequest(_Strict):
    model: str | None = Field(None, max_length=512)
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # llama-server's sampling extras (`extra_body`)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, ge=0.01, le=100.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
