"""Ollama requests ⇄ the OpenAI requests the core's request path takes, and Ollama's bodies.

`/api/chat` becomes a chat completion, `/api/generate` a chat completion of one user turn (its
`system` first), a raw completion with `raw`, a fill-in-the-middle completion with `suffix`, or
a completion of the request's own `template` (gotemplate.py's subset of Go's templates).
A message's `images` (base64 files, as the generate body's `images` with the prompt) become
image parts before its text, as Ollama puts them; read by a model with a vision encoder,
refused with a 400 by a text-only one (minfer.server.prepare).
`options` map onto the sampling fields, `format` onto `response_format`, `think` onto the chat
template's `enable_thinking` (a level onto `reasoning_effort` too). `capabilities` says what a
model does as Ollama infers it (its kind, and the template's `tools`, suffix and thinking); a
`think` request to a model without "thinking" is refused as Ollama refuses it. Replies carry
`message` (chat) or `response` (generate), the thinking as `thinking`, tool calls with their
arguments as objects, and the final object's `done_reason` and durations in nanoseconds.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from minfer.chat.reasoning import template_thinks
from minfer.server.errors import bad_request
from minfer.server.ollama import gotemplate
from minfer.server.ollama.schemas import ChatRequest, GenerateRequest, Message
from minfer.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Content,
    chat_content,
    image_part,
    translated,
)
from minfer.server.state import LoadedModel, ModelFacts
from minfer.server.worker import Done

SAMPLING = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
            "repeat_last_n", "presence_penalty", "frequency_penalty", "mirostat", "mirostat_tau",
            "mirostat_eta", "seed", "stop")
IMAGE_TYPE = "application/octet-stream"  # Ollama's images carry no type: the bytes decide


def names(lm: LoadedModel) -> tuple[str, str]:
    """The loaded model's Ollama name (with its tag) and its bare name (`/v1/models`'s id)."""
    return f"{lm.name}:latest", lm.name


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _common(body: ChatRequest | GenerateRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    opts = body.options
    if opts is not None:
        for name in SAMPLING:
            value = getattr(opts, name)
            if value is not None:
                out[name] = value
        if opts.num_predict is not None and opts.num_predict >= 0:
            out["max_tokens"] = max(opts.num_predict, 1)  # capped with a warning (notices)
    fmt = body.format
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request(f"format must be \"json\" or a JSON schema, got {fmt!r}",
                          param="format")
    return out


def capabilities(lm: LoadedModel) -> list[str]:
    """Ollama's capabilities of a served model, in its order: "completion" (it generates),
    "embedding" (it is served for embeddings), then what its chat template handles: "tools"
    (it writes the `tools` into the prompt), "insert" (fill-in-the-middle tokens), "vision"
    (a vision encoder, an mmproj, is loaded), "thinking" (`<think>`, or a thinking switch)."""
    caps = (["completion"] if lm.worker is not None else []) + (
        ["embedding"] if lm.embed is not None else [])
    if lm.worker is None:
        return caps
    variables = lm.template.variables
    if "tools" in variables:
        caps.append("tools")
    if not lm.tokenizer.fim.missing():
        caps.append("insert")
    if lm.vision is not None:
        caps.append("vision")
    if template_thinks(lm.template.source, variables):
        caps.append("thinking")
    return caps


def thinking_on(body: ChatRequest | GenerateRequest) -> bool | None:
    """The request's `think` (true, false, or a level: "high", "medium", "low"); None: unset."""
    if body.think is None:
        return None
    return body.think is not False and body.think != "false"


def check_thinking(body: ChatRequest | GenerateRequest, lm: LoadedModel) -> None:
    """Ollama's 400 for thinking asked of a model that cannot think (clients match its text
    and ask again without `think`)."""
    if thinking_on(body) and "thinking" not in capabilities(lm):
        raise bad_request(f"{body.model} does not support thinking")


def _thinking(body: ChatRequest | GenerateRequest) -> dict[str, Any]:
    """`enable_thinking`; a level ("high", "medium", "low") is the reasoning effort too (the
    gpt-oss template's `Reasoning: high`), as Ollama gives it to gpt-oss."""
    on = thinking_on(body)
    if on is None:
        return {}
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": on}}
    if isinstance(body.think, str) and body.think in ("high", "medium", "low"):
        out["reasoning_effort"] = body.think
    return out


def chat_request(body: ChatRequest) -> ChatCompletionRequest:
    messages = [_message(m) for m in body.messages]
    out = {"messages": messages, **_common(body), **_thinking(body),
           **_logprobs(body, chat=True)}
    if body.tools:
        out["tools"] = body.tools
    return translated(ChatCompletionRequest, out)


def _with_images(text: str, images: list[str] | None) -> Content:
    """A message's content with its images (base64 files) before its text, as Ollama."""
    if not images:
        return text
    return chat_content([*(image_part(f"data:{IMAGE_TYPE};base64,{b}") for b in images), text])


def _message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": _with_images(m.content, m.images)}
    if m.thinking:
        out["reasoning_content"] = m.thinking
    if m.tool_calls:
        out["tool_calls"] = [{"id": f"call_{j}", "type": "function", "function": {
            "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
            for j, c in enumerate(m.tool_calls)]
    if m.tool_name:
        out["name"] = m.tool_name
    return out


def generate_request(body: GenerateRequest,
                     n_ctx: int) -> ChatCompletionRequest | CompletionRequest:
    if body.images and (body.template or body.suffix is not None or body.raw):
        raise bad_request("images go with the model's chat template: not with raw, suffix or "
                          "template", param="images")
    common = _common(body)
    common.setdefault("max_tokens", n_ctx)
    if body.template:  # the request's own (Go) template in place of the model's
        values = {"System": body.system or "", "Prompt": body.prompt,
                  "Suffix": body.suffix or ""}
        try:
            prompt = gotemplate.render(body.template, values)
        except gotemplate.TemplateUnsupported as exc:
            raise bad_request(str(exc), param="template") from None
        return translated(CompletionRequest, {"prompt": prompt, **common})
    if body.suffix is not None:  # fill in the middle: the prompt is the text before the gap
        return translated(CompletionRequest, {"prompt": body.prompt, "suffix": body.suffix,
                                             **common, **_logprobs(body, chat=False)})
    if body.raw:
        return translated(CompletionRequest, {"prompt": body.prompt, **common,
                                             **_logprobs(body, chat=False)})
    messages: list[dict[str, Any]] = ([{"role": "system", "content": body.system}]
                                     if body.system else [])
    messages.append({"role": "user", "content": _with_images(body.prompt, body.images)})
    return translated(ChatCompletionRequest, {"messages": messages, **common, **_thinking(body),
                                              **_logprobs(body, chat=True)})


def _logprobs(body: ChatRequest | GenerateRequest, *, chat: bool) -> dict[str, Any]:
    """Ollama's `logprobs` / `top_logprobs` as the chat or completion request's fields."""
    if not body.logprobs:
        return {}
    top = body.top_logprobs or 0
    return {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top}


def message_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """An assistant message in Ollama's shape from the chat fields."""
    msg: dict[str, Any] = {"role": "assistant", "content": fields.get("content") or ""}
    if fields.get("reasoning_content"):
        msg["thinking"] = fields["reasoning_content"]
    if fields.get("tool_calls"):
        msg["tool_calls"] = tool_calls(fields["tool_calls"])
    return msg


def tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        args = call["function"].get("arguments") or "{}"
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            value = {"_raw": args}
        out.append({"function": {"name": call["function"]["name"], "arguments": value}})
    return out


class Clock:
    """A request's durations as Ollama reports them (nanoseconds): the whole request by the
    wall clock, the prompt and the generation by the engine's own timings of the request
    (`Done.prompt_ms`, `Done.predicted_ms`), whether or not it streamed."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter_ns()

    def final(self, model: str, done: Done) -> dict[str, Any]:
        usage = done.usage
        return {"model": model, "created_at": now(), "done": True,
                "done_reason": "length" if done.finish_reason == "length" else "stop",
                "total_duration": time.perf_counter_ns() - self.t0, "load_duration": 0,
                "prompt_eval_count": usage.prompt_tokens,
                "prompt_eval_duration": int(done.prompt_ms * 1e6),
                "eval_count": usage.completion_tokens,
                "eval_duration": int(done.predicted_ms * 1e6)}


def details(facts: ModelFacts | None) -> dict[str, Any]:
    arch = facts.architecture if facts else "?"
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": _size(facts.n_params) if facts else "",
            "quantization_level": facts.quantization if facts else ""}


def _size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def listing(name: str, facts: ModelFacts) -> dict[str, Any]:
    """One entry of `/api/tags` and `/api/ps` (name: as `/v1/models` lists it)."""
    modified = datetime.fromtimestamp(facts.modified, UTC)
    return {"name": f"{name}:latest", "model": f"{name}:latest",
            "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "size": facts.size, "digest": "", "details": details(facts)}


def keep_alive_seconds(value: str | float | None) -> float | None:
    """Ollama's keep_alive ("5m", "30s", "1h", seconds as a number; negative: forever) in
    seconds; None when not given."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return float(value)
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in ("ms", "s", "m", "h"):
        if value.endswith(unit):
            number = value[:-len(unit)]
            break
    else:
        number, unit = value, "s"
    try:
        return float(number) * units[unit]
    except ValueError:
        raise bad_request(f"keep_alive: cannot read {value!r} as a duration (e.g. \"5m\")",
                          param="keep_alive") from None
