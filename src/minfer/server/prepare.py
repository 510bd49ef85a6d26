"""From a validated request body (schemas.py) to a `GenRequest`: prompt ids, limits and the
sampler; every API's requests go this way (relay.prepare_for runs it against a loaded model).

The checks that need the loaded model live here: the prompt must tokenize to 1..n_ctx_slot
tokens, token ids must be in the vocabulary; a `max_tokens` past the slot's context is capped
to it with a warning (minfer.server.notices).
Unset sampling fields keep llama.cpp's defaults (`SamplerParams()`), as llama-server does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from minfer.chat.reasoning import FORMATS, ReasoningOptions
from minfer.engine.core.request import GenRequest, PromptRows
from minfer.engine.vision.image import EncodedImage, ImageError
from minfer.engine.vision.prompt import image_bytes, layout
from minfer.errors import MinferError
from minfer.sampling.grammar import GrammarVocab
from minfer.sampling.mask import BannedTokens, chain
from minfer.sampling.params import SamplerParams
from minfer.sampling.sampler import Sampler
from minfer.server.errors import APIError, bad_request, from_minfer_error
from minfer.server.notices import capped_max_tokens
from minfer.server.output import OutputPlan, chat_messages, plan_output
from minfer.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    InfillRequest,
    NativeCompletionRequest,
    SamplingFields,
)
from minfer.tokenizer.infill import Budget, ExtraFile, FimUnsupported, Mixed
from minfer.tokenizer.infill import infill_prompt as fim_layout
from minfer.tokenizer.vocab import FimTokens

SEED_MASK = (1 << 64) - 1
INFILL_N_BATCH = 2048  # llama-server's default n_batch, which its infill budget is cut to
MIN_TEMPERATURE = 1e-3
NO_OPTIONS = ReasoningOptions()


class TokenizerLike(Protocol):
    n_vocab: int
    eot_ids: frozenset[int]
    fim: FimTokens
    add_bos: bool
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, *, special: bool = True,
               add_bos: bool | None = None) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def token_id(self, text: str) -> int | None: ...


class ImageReader(Protocol):
    """A model's vision encoder (`minfer.engine.vision.encoder.VisionEncoder`)."""

    def encode(self, data: bytes) -> EncodedImage: ...


class TemplateLike(Protocol):
    source: str

    @property
    def variables(self) -> frozenset[str]: ...

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
               tools: Sequence[Any] | None = None, **extra: Any) -> str: ...


@dataclass(frozen=True)
class Limits:
    n_ctx_slot: int
    n_predict: int = -1  # server-wide cap on max_tokens; -1 = none


@dataclass
class Prepared:
    gen: GenRequest
    output: OutputPlan


def chat_prompt(req: ChatCompletionRequest, tok: TokenizerLike, template: TemplateLike,
                output: OutputPlan, reasoning: ReasoningOptions,
                vision: ImageReader | None = None) -> tuple[list[int], tuple[PromptRows, ...]]:
    """The rendered chat prompt's ids and its images' rows where they go; sets how the reply's
    thinking is split and adds the thinking budget to the request's mask."""
    urls = [url for m in req.messages for url in m.image_urls()]
    images = _read_images(urls, vision) if urls else []
    opts = request_reasoning(req, reasoning)
    try:
        opts.check_model(template.source, template.variables)
    except MinferError as exc:
        param = "reasoning_budget" if req.reasoning_budget else "chat_template_kwargs"
        raise from_minfer_error(exc, param=param) from None
    messages = chat_messages(req.messages, template.source, template.variables, output.tools)
    try:
        text = template.render(messages, add_generation_prompt=True, tools=output.tools,
                               **opts.template_vars())
    except MinferError as exc:
        param = "chat_template_kwargs" if req.chat_template_kwargs else "messages"
        raise from_minfer_error(exc, param=param) from None
    output.reasoning = opts.plan(text, lambda s: tok.encode(s, special=True, add_bos=False),
                                 template_source=template.source)
    output.logit_mask = chain(output.logit_mask, output.reasoning.budget)
    if not images:
        return tok.encode_prompt(text), ()
    try:
        return layout(text, images, tok.token_id, first=tok.encode_prompt,
                      rest=lambda s: tok.encode(s, special=True, add_bos=False))
    except ImageError as exc:
        raise bad_request(str(exc), param="messages", code="invalid_image") from None


def _read_images(urls: Sequence[str], vision: ImageReader | None) -> list[EncodedImage]:
    """Each image's embedding rows; a 400 naming the problem for a model without a vision
    encoder, a URL that is not a base64 data: URL, or an image that cannot be decoded."""
    if vision is None:
        raise APIError(400, "this model takes no images: it has no vision encoder (an mmproj "
                       "file: serve --mmproj FILE, or mmproj*.gguf beside the model)",
                       param="messages", code="unsupported_content")
    try:
        return [vision.encode(image_bytes({"type": "image_url", "image_url": url}))
                for url in urls]
    except ImageError as exc:
        raise bad_request(str(exc), param="messages", code="invalid_image") from None


def request_reasoning(req: ChatCompletionRequest, defaults: ReasoningOptions) -> ReasoningOptions:
    """The server's reasoning options with the request's own fields over them."""
    if req.reasoning_format is not None and req.reasoning_format not in FORMATS:
        raise bad_request(f"unknown reasoning_format {req.reasoning_format!r} (use one of "
                          f"{', '.join(FORMATS)})", param="reasoning_format", code="invalid_value")
    if req.reasoning_budget is not None and req.reasoning_budget < -1:
        raise bad_request(f"reasoning_budget must be -1 (unlimited) or more, got "
                          f"{req.reasoning_budget}", param="reasoning_budget", code="invalid_value")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort == "none":  # llama-server's: no thinking, no effort
        kwargs["enable_thinking"] = False
        kwargs.pop("reasoning_effort", None)
    elif req.reasoning_effort:  # the template reads it (gpt-oss's `Reasoning: high`)
        kwargs["reasoning_effort"] = req.reasoning_effort
    return defaults.override(fmt=req.reasoning_format, budget=req.reasoning_budget,
                             template_kwargs=kwargs)


def completion_prompt(req: CompletionRequest, tok: TokenizerLike, limits: Limits,
                      output: OutputPlan) -> list[int]:
    """The ids of the request's prompt (one prompt: `choices` splits a batch into requests of
    one prompt each); with `echo`, its text becomes the reply's start (`output.echo`)."""
    if req.echo and req.suffix is not None:
        raise bad_request("echo cannot be combined with suffix", param="echo",
                          code="invalid_value")
    prompts = req.prompts()
    if len(prompts) != 1:
        raise bad_request("one prompt per request here (choices splits a batch)", param="prompt")
    prompt: Any = prompts[0]
    if not isinstance(prompt, str):
        check_ids(prompt, tok, "prompt")
    if req.suffix is not None:  # fill-in-the-middle: the prompt is the text before the gap
        return infill_ids(tok, prompt, req.suffix, limits=limits, n_predict=req.max_tokens,
                          param="suffix")
    ids = tok.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if req.echo:
        output.echo = prompt if isinstance(prompt, str) else b"".join(
            tok.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
    return ids


def native_prompt(prompt: Mixed, tok: TokenizerLike) -> list[int]:
    """llama-server's prompt of `/completion`: texts with special tokens parsed, ids as they
    are, a BOS (where the model adds one) only before a leading text."""
    pieces = [prompt] if isinstance(prompt, str) else list(prompt)
    check_ids(pieces, tok, "prompt")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            ids += tok.encode(piece, special=True, add_bos=None if i == 0 else False)
        else:
            ids.append(int(piece))
    return ids


def with_context(context: Sequence[int], prompt: list[int], tok: TokenizerLike) -> list[int]:
    """The prompt continuing an earlier exchange's ids: one BOS, the context's."""
    check_ids(list(context), tok, "context")
    if tok.bos_id is not None and prompt[:1] == [tok.bos_id]:
        prompt = prompt[1:]
    return [int(t) for t in context] + prompt


def check_ids(ids: Sequence[object], tok: TokenizerLike, param: str) -> None:
    bad = [t for t in ids if isinstance(t, int) and not 0 <= t < tok.n_vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{tok.n_vocab - 1})",
                          param=param, code="invalid_token_id")


def infill_ids(tok: TokenizerLike, prefix: Mixed, suffix: Mixed, *, limits: Limits,
               n_predict: int | None, param: str, extra: Sequence[ExtraFile] = (),
               line: str = "") -> list[int]:
    """The fill-in-the-middle prompt as llama.cpp's server lays it out; a 400 naming
    fill-in-the-middle for a model without FIM tokens."""
    budget = Budget(n_batch=min(INFILL_N_BATCH, limits.n_ctx_slot),
                    n_predict=-1 if n_predict is None else n_predict, n_ctx=limits.n_ctx_slot)
    prompt = tok.encode(line, special=True, add_bos=False) if line else []
    try:
        return fim_layout(tok, prefix, suffix, extra=extra, prompt=prompt, budget=budget)
    except FimUnsupported as exc:
        raise bad_request(str(exc), param=param, code="not_supported") from None


def infill_prompt(req: InfillRequest, tok: TokenizerLike, limits: Limits) -> list[int]:
    for name in ("input_prefix", "input_suffix"):
        value = getattr(req, name)
        if not isinstance(value, str):
            check_ids(value, tok, name)
    extra = [ExtraFile(c.text, c.filename) for c in req.input_extra or ()]
    return infill_ids(tok, req.input_prefix, req.input_suffix, limits=limits,
                      n_predict=req.n_predict if req.n_predict is not None else req.max_tokens,
                      param="input_prefix", extra=extra, line=req.prompt)


# llama.cpp server's sampler fields that are SamplerParams' own, by the same name
EXTRA_SAMPLING = ("typical_p", "min_keep", "dry_multiplier", "dry_base", "dry_allowed_length",
                  "dry_penalty_last_n", "dry_sequence_breakers", "mirostat", "mirostat_tau",
                  "mirostat_eta")


def sampler_params(req: SamplingFields) -> SamplerParams:
    changes: dict[str, Any] = {}
    if req.temperature is not None:  # a vanishing temperature is greedy (and cannot overflow)
        changes["temp"] = req.temperature if req.temperature >= MIN_TEMPERATURE else 0.0
    if req.top_p is not None:
        changes["top_p"] = max(req.top_p, 1e-9)  # top_p = 0 keeps only the best token
    if req.top_k is not None:
        changes["top_k"] = max(req.top_k, 0)
    if req.min_p is not None:
        changes["min_p"] = req.min_p
    if req.presence_penalty is not None:
        changes["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty is not None:
        changes["frequency_penalty"] = req.frequency_penalty
    if req.repeat_penalty is not None:
        changes["repeat_penalty"] = req.repeat_penalty
    if req.repeat_last_n is not None:
        changes["penalty_last_n"] = req.repeat_last_n
    for name in EXTRA_SAMPLING:
        value = getattr(req, name)
        if value is not None:
            changes[name] = tuple(value) if name == "dry_sequence_breakers" else value
    try:
        return SamplerParams(**changes)
    except MinferError as exc:
        raise from_minfer_error(exc) from None


def max_tokens(requested: int | None, limits: Limits, param: str) -> int:
    """The reply's limit; past the context it is capped with a warning (server.notices)."""
    n = limits.n_ctx_slot if requested is None else capped_max_tokens(requested,
                                                                       limits.n_ctx_slot, param)
    if limits.n_predict > 0:
        n = min(n, limits.n_predict)
    return max(1, n)


def prepare(req: GenerationRequest, tok: TokenizerLike, template: TemplateLike, limits: Limits, *,
            grammar_vocab: GrammarVocab | None = None,
            reasoning: ReasoningOptions = NO_OPTIONS,
            context: Sequence[int] = (), vision: ImageReader | None = None) -> Prepared:
    """Validate req against the model and build its GenRequest; APIError (4xx) when it cannot.
    grammar_vocab: the model's vocabulary view for structured output (None: refused);
    reasoning: the server's reasoning options (a chat request's fields override them);
    context: ids of an earlier exchange put before the prompt (Ollama's `context`), the
    prompt's own BOS dropped after them; vision: the model's image encoder (None: text only,
    an image part is a 400)."""
    output = plan_output(req, tok.n_vocab, grammar_vocab, template_source=template.source)
    embd: tuple[PromptRows, ...] = ()
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs = true", param="top_logprobs")
        prompt, embd = chat_prompt(req, tok, template, output, reasoning, vision)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    elif isinstance(req, NativeCompletionRequest):
        prompt = native_prompt(req.prompt, tok)
        param = "n_predict"
        requested = None if req.n_predict is None or req.n_predict < 0 else req.n_predict
        logprobs = req.n_probs or None
        if req.ignore_eos:  # llama-server's: the end-of-generation tokens are never drawn
            output.logit_mask = chain(output.logit_mask, BannedTokens(tok.eot_ids))
    elif isinstance(req, InfillRequest):
        prompt = infill_prompt(req, tok, limits)
        param = "n_predict" if req.n_predict is not None else "max_tokens"
        requested, logprobs = _infill_tokens(req, limits, len(prompt)), None
    else:
        prompt = completion_prompt(req, tok, limits, output)
        param, requested, logprobs = "max_tokens", req.max_tokens, req.logprobs
    if context:
        n = len(prompt)
        prompt = with_context(context, prompt, tok)
        embd = tuple(e.shifted(len(prompt) - n) for e in embd)
    check_prompt(prompt, limits, "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    params = sampler_params(req)
    seed = None if req.seed is None or req.seed == -1 else req.seed & SEED_MASK
    try:
        sampler = Sampler(params, tok.n_vocab, seed=seed, token_text=tok.token_text,
                          encode=lambda s: tok.encode(s, special=False),
                          logit_mask=output.logit_mask, n_ctx=limits.n_ctx_slot)
        sampler.reset(prompt)  # each stage keeps the history it needs
    except MinferError as exc:
        raise from_minfer_error(exc) from None
    n_max = 0 if requested == 0 else max_tokens(requested, limits, param)
    t_limit = getattr(req, "t_max_predict_ms", None) or 0
    scored = logprobs if isinstance(req, CompletionRequest) and req.echo else None
    gen = GenRequest(prompt=prompt, max_tokens=n_max, sampler=sampler, stops=req.stops(),
                     logprobs=logprobs, constraint=output.constraint, t_max_predict_ms=t_limit,
                     prompt_logprobs=scored, embd=embd)
    return Prepared(gen, output)


def _infill_tokens(req: InfillRequest, limits: Limits, n_prompt: int) -> int | None:
    """n_predict (or max_tokens); unset: what the slot has left after the prompt."""
    n = req.n_predict if req.n_predict is not None else req.max_tokens
    return n if n is not None else max(1, limits.n_ctx_slot - n_prompt)


def check_prompt(prompt: list[int], limits: Limits, param: str) -> None:
    if not prompt:
        raise bad_request("the prompt is empty (it tokenizes to no tokens)", param=param)
    if len(prompt) > limits.n_ctx_slot:
        raise APIError(400, f"the prompt has {len(prompt)} tokens; this server's context length "
                       f"is {limits.n_ctx_slot} tokens per request", param=param,
                       code="context_length_exceeded")
