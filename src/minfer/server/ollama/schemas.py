"""Request bodies of Ollama's API as pydantic models.

`options` carries the sampling and context settings (`num_predict`, `temperature`, `top_k`,
`top_p`, `min_p`, `typical_p`, `repeat_penalty`, `repeat_last_n`, `presence_penalty`,
`frequency_penalty`, `mirostat`, `mirostat_tau`, `mirostat_eta`, `seed`, `stop`, `num_ctx`,
`num_thread`; others are
accepted and ignored, as Ollama ignores what a runner does not use). `format` is `"json"` or a
JSON schema; `think` switches a reasoning model's thinking; `keep_alive` is accepted (one
model stays loaded). Types are strict, unknown fields ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from minfer.server.schemas import INT64_MAX, INT64_MIN, _Strict


class Options(_Strict):
    num_predict: int | None = Field(None, ge=-2, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, ge=0.01, le=100.0)
    repeat_last_n: int | None = Field(None, ge=-1, le=INT64_MAX)
    typical_p: float | None = Field(None, ge=0.0, le=1.0)
    mirostat: int | None = Field(None, ge=0, le=2)
    mirostat_tau: float | None = Field(None, ge=0.0, le=1e6)
    mirostat_eta: float | None = Field(None, ge=0.0, le=1e6)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] | None = Field(None, max_length=16)
    num_ctx: int | None = Field(None, ge=1, le=INT64_MAX)
    num_thread: int | None = Field(None, ge=0, le=INT64_MAX)


class ToolFunction(_Strict):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Strict):
    function: ToolFunction


class Message(_Strict):
    role: str = Field(pattern="^(system|user|assistant|tool)$")
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class _Request(_Strict):
    model: str = Field(min_length=1, max_length=512)
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    logprobs: bool | None = None  # each generated token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many alternatives


class ChatRequest(_Request):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Request):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = Field(None, max_length=1 << 20)  # an earlier reply's `context`
    template: str | None = None  # a Go template in place of the model's (gotemplate.py)


class ShowRequest(_Strict):
    model: str = Field(min_length=1, max_length=512)
    verbose: bool | None = None


class CopyRequest(_Strict):
    source: str = Field(min_length=1, max_length=512)
    destination: str = Field(min_length=1, max_length=512)


class PullRequest(_Strict):
    model: str = Field(min_length=1, max_length=512)
    stream: bool = True
    insecure: bool | None = None


class EmbedRequest(_Strict):
    model: str
    input: str | list[str]
    truncate: bool = True  # Ollama cuts long inputs unless told not to
    options: Options | None = None
    keep_alive: str | float | None = None
    dimensions: int | None = Field(None, ge=1)


class LegacyEmbedRequest(_Strict):
    model: str
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | float | None = None
