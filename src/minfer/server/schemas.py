"""The request bodies every API's request path takes, as pydantic models (also the OpenAPI
schema): OpenAI's chat and completion bodies, which Anthropic's, Ollama's and the Responses API's
bodies are translated into (`translated`), llama.cpp's `/completion` and `/infill` bodies, and
llama-server's `/tokenize`, `/detokenize` and `/apply-template`.

Field names and ranges follow OpenAI's API (`temperature` 0–2, penalties −2–2, `n` 1–128: that
many choices, sampled as separate sequences of the continuous batch; a completion's `prompt` may be
a list of texts or of id lists, each answered with `n` choices),
plus the llama-server extensions clients send (`top_k`, `min_p`, `repeat_penalty`, `grammar`).
Types are strict: a string where a number belongs is a 400, never coerced. Unknown fields are
ignored, as OpenAI-compatible servers do, so newer clients keep working. Values that depend on the
loaded model (context length, vocabulary) are checked later, in `prepare.py`.

`response_format`, `tools`, `tool_choice` and `grammar` are parsed here and handed to
`output.py`, the one place a later change adds constrained decoding.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minfer.engine.vision.prompt import MARKER
from minfer.server.errors import APIError

T = TypeVar("T", bound=BaseModel)
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
MAX_STOPS = 16
MAX_CHOICES = 128  # OpenAI's cap on `n`; also on a completion's prompts x n

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopText = Annotated[str, Field(min_length=1, max_length=1024)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Settings shared by /v1/chat/completions and /v1/completions."""

    model: str | None = Field(None, max_length=512)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repeat_penalty: float | None = Field(None, ge=0.01, le=100.0)
    # llama.cpp server's further sampler fields (checked by SamplerParams: a 400 naming one)
    repeat_last_n: int | None = Field(None, ge=-1, le=INT64_MAX)  # its penalty_last_n
    typical_p: float | None = Field(None, ge=0.0, le=1.0)
    min_keep: int | None = Field(None, ge=0, le=INT64_MAX)
    dry_multiplier: float | None = Field(None, ge=0.0, le=1e6)
    dry_base: float | None = Field(None, ge=0.0, le=1e6)
    dry_allowed_length: int | None = Field(None, ge=0, le=INT64_MAX)
    dry_penalty_last_n: int | None = Field(None, ge=-1, le=INT64_MAX)
    dry_sequence_breakers: list[str] | None = Field(None, max_length=64)
    mirostat: int | None = Field(None, ge=0, le=2)
    mirostat_tau: float | None = Field(None, ge=0.0, le=1e6)
    mirostat_eta: float | None = Field(None, ge=0.0, le=1e6)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # structured output: parsed now, honoured by output.py
    response_format: dict[str, Any] | None = None
    grammar: str | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str
    detail: str | None = None


class ImagePart(_Strict):
    """OpenAI's image part: a base64 data: URL or an http(s) URL (downloaded with limits:
    `minfer.engine.vision.fetch`), read by a model with a vision encoder
    (`minfer.engine.vision.prompt`); it stands in the text as the media marker."""

    type: Literal["image_url"]
    image_url: ImageUrl | str

    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class MediaPart(_Strict):
    """An audio or file part: read so that the answer can say what is wrong (this server reads
    text and images), not refused as a shape pydantic does not know."""

    type: Literal["input_audio", "file", "image", "audio"]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | ImagePart | MediaPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's thinking (the template decides)

    def text(self) -> str | None:
        if isinstance(self.content, list):
            for part in self.content:
                if isinstance(part, MediaPart):
                    raise APIError(400, f"{part.type} content is not supported: this server "
                                   "reads text and images", param="messages",
                                   code="unsupported_content")
            return "".join(p.text if isinstance(p, TextPart) else MARKER for p in self.content)
        return self.content

    def image_urls(self) -> list[str]:
        """The URLs (data: or http(s)) of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.url() for p in self.content if isinstance(p, ImagePart)]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (developer is the newer name of system)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # reasoning models (llama-server's fields): how the thinking is returned, the variables the
    # chat template renders with (Qwen3's enable_thinking), thinking tokens before it is closed
    reasoning_format: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_budget: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    reasoning_effort: str | None = None  # OpenAI's; a template variable ("none": no thinking)


PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: str | PromptIds | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] \
        | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_CHOICES)]
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)  # 0: echo only
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_empty_ids(cls, value: Any) -> Any:
        """`[]` or `[[]]` (an evaluation harness' empty context) named, not a union's errors."""
        if value == [] or (isinstance(value, list) and any(v == [] for v in value)):
            raise ValueError("an empty token list has nothing to complete (give at least one "
                             "token id, or a text)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one, or each of a batch (a list of texts or of id
        lists), in order."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)
        return [p]  # type: ignore[list-item]


Mixed = str | Annotated[list[str | TokenId], Field(max_length=1 << 20)]


class ExtraChunk(_Strict):
    """One file of repo-level context for `/infill`."""

    text: str
    filename: str = "tmp"


class InfillRequest(SamplingFields):
    """llama.cpp's `POST /infill`: the text around the cursor (strings, or token ids mixed with
    strings), other files as context, and the start of the cursor's line (`prompt`)."""

    input_prefix: Mixed
    input_suffix: Mixed
    input_extra: list[ExtraChunk] | None = None
    prompt: str = ""
    n_predict: int | None = Field(None, ge=0, le=INT64_MAX)
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX)  # llama.cpp's alias of n_predict
    t_max_predict_ms: int | None = Field(None, ge=0, le=INT64_MAX)


class NativeCompletionRequest(SamplingFields):
    """llama.cpp's `POST /completion`: one prompt (a text, ids, or ids mixed with texts),
    `n_predict` (-1: until the context ends), the sampling fields, `json_schema` or `grammar`,
    `stream`, `n_probs` (each drawn token's probability and its n most likely alternatives),
    `ignore_eos`. `cache_prompt` and `id_slot` are accepted (the prompt cache is always on, the
    scheduler picks the slot)."""

    prompt: Mixed
    n_predict: int | None = Field(None, ge=-1, le=INT64_MAX)
    t_max_predict_ms: int | None = Field(None, ge=0, le=INT64_MAX)
    json_schema: dict[str, Any] | None = None
    n_probs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool | None = None
    cache_prompt: bool | None = None
    id_slot: int | None = Field(None, ge=-1, le=INT64_MAX)

    def output_format(self) -> NativeCompletionRequest:
        """The request with `json_schema` as the `response_format` it means."""
        if self.json_schema is None:
            return self
        if self.response_format is not None:
            raise APIError(400, "json_schema and response_format cannot both be given",
                           param="json_schema")
        rf = {"type": "json_schema", "json_schema": {"name": "schema", "schema": self.json_schema}}
        return self.model_copy(update={"response_format": rf, "json_schema": None})


class ApplyTemplateRequest(_Strict):
    """llama-server's `/apply-template`: the fields a chat request renders with."""

    model: str | None = Field(None, max_length=512)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_budget: int | None = Field(None, ge=-1, le=INT64_MAX)


GenerationRequest = (ChatCompletionRequest | CompletionRequest | InfillRequest
                     | NativeCompletionRequest)  # what `prepare` makes a GenRequest of


def translated(model: type[T], body: dict[str, Any]) -> T:
    """Another API's request, translated into one of these bodies and validated; a 400 naming
    the field when the translation does not hold (e.g. an out-of-range value it carried)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg', 'invalid value')}",
                       param=where or None) from None


Content = str | list[dict[str, Any]]


def image_part(url: str) -> dict[str, Any]:
    """An OpenAI image part of a URL (data: or http(s)): how every other API's image reaches
    the chat request (Anthropic's image blocks, Ollama's `images`, Responses' input_image)."""
    return {"type": "image_url", "image_url": {"url": url}}


def chat_content(pieces: list[str | dict[str, Any]], sep: str = "") -> Content:
    """A chat message's content from its texts and image parts (`image_part`) in order: the
    texts joined by sep where there is no image, else text and image parts (sep between two
    texts that follow each other)."""
    if all(isinstance(p, str) for p in pieces):
        return sep.join(p for p in pieces if isinstance(p, str))
    out: list[dict[str, Any]] = []
    after_text = False
    for piece in pieces:
        if isinstance(piece, str):
            out.append({"type": "text", "text": (sep if after_text else "") + piece})
        else:
            out.append(piece)
        after_text = isinstance(piece, str)
    return out


class TokenizeRequest(_Strict):
    """llama-server's body (`content`, `add_special`, `with_pieces`) or vLLM's (`prompt`,
    `add_special_tokens`, `return_token_strs`), as evaluation harnesses send it."""

    content: str | None = None
    add_special: bool = False
    with_pieces: bool = False
    prompt: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def text(self) -> str:
        if (self.content is None) == (self.prompt is None):
            raise ValueError("give the text as content (llama-server) or prompt (vLLM)")
        return self.content if self.content is not None else self.prompt  # type: ignore[return-value]


class DetokenizeRequest(_Strict):
    tokens: list[TokenId]
