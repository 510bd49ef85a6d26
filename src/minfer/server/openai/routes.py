"""The OpenAI-compatible routes: `POST /v1/chat/completions` and `POST /v1/completions` (stream
or not; each also answers without the `/v1` prefix). The model list (`/v1/models`) is app.py's.

A request is validated (minfer.server.schemas), turned into a GenRequest (minfer.server.prepare,
on a worker thread since tokenizing can take a while), queued on the engine thread and its
events relayed (minfer.server.relay) as one JSON body or as SSE chunks (responses.py); `n`
choices (and a completion's prompt list) are that many requests (`choices`), answered in one
body or one stream. A chat reply's text goes through the reasoning split and, when tools were
offered, the tool-call parser (minfer.server.output). A client that goes away cancels its
requests, which frees their slots at the engine's next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from minfer.engine.core.request import TokenLogprob
from minfer.server.errors import APIError, bad_request
from minfer.server.openai.responses import (
    Envelope,
    chat_logprobs,
    completion_logprobs,
    total_usage,
)
from minfer.server.output import ReplyStream
from minfer.server.prepare import SEED_MASK, Prepared
from minfer.server.relay import Frames, collect, prepare_for, sse, stream, submit_all
from minfer.server.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Failed, Usage


def openai_routes(app: FastAPI, state: ServerState) -> None:
    """Add the OpenAI routes to app."""

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _complete(state, request, body, "chat")

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(state, request, body, "completion")


def choices(req: ChatCompletionRequest | CompletionRequest
            ) -> list[ChatCompletionRequest | CompletionRequest]:
    """The request as one request per choice, in choice order: OpenAI's `index` = prompt number
    x n + draw (a completion's prompt list; `n` draws of each). Each asks for one draw of one
    prompt, so each gets its own sampler and output parsers from `prepare`. A seeded request's
    draw i samples with seed + i: its choices differ, and each is reproducible."""
    n = req.n or 1
    prompts = req.prompts() if isinstance(req, CompletionRequest) else [None]
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n = {n} asks for {len(prompts) * n} "
                          f"choices; at most {MAX_CHOICES}", param="n", code="invalid_value")
    if len(prompts) == 1 and n == 1:
        return [req]
    out: list[ChatCompletionRequest | CompletionRequest] = []
    for prompt in prompts:
        for i in range(n):
            update: dict[str, Any] = {"n": 1}
            if prompt is not None:
                update["prompt"] = prompt
            if req.seed is not None and req.seed != -1:
                update["seed"] = ((req.seed + i) & SEED_MASK) if i else req.seed
            out.append(req.model_copy(update=update))
    return out


async def _complete(state: ServerState, request: Request,
                    body: ChatCompletionRequest | CompletionRequest, kind: str) -> Response:
    lm = await state.acquire(body.model)
    asks = choices(body)
    room = lm.generator.n_slots + lm.generator.max_waiting
    if len(asks) > room:
        raise bad_request(f"{len(asks)} choices asked; this server runs or queues at most {room} "
                          "at once (its slots and queue)", param="n", code="invalid_value")
    prepared = [await run_in_threadpool(prepare_for, lm, ask) for ask in asks]
    handles = submit_all(state, lm, [p.gen for p in prepared])
    env = Envelope(kind, lm.name)
    n = body.n or 1
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return stream(lm, handles, _Chunks(lm, env, prepared, include_usage, n))
    got = await collect(lm, handles, request)
    to_logprobs = _logprobs_fn(lm, env.kind)
    bodies = []
    for index, (p, c) in enumerate(zip(prepared, got, strict=True)):
        logprobs: dict[str, Any] | None
        if p.gen.prompt_logprobs is not None:  # echo: the prompt's tokens first
            logprobs = completion_logprobs(c.prompt_logprobs + c.logprobs,
                                           lm.tokenizer.token_bytes, first=p.gen.prompt[0])
        else:
            logprobs = to_logprobs(c.logprobs, 0) if p.gen.logprobs is not None else None
        fields, finish = p.output.finalize(c.text, c.done.finish_reason)
        bodies.append(env.choice(index, fields, finish, logprobs))
    return JSONResponse(env.full(bodies, total_usage([c.done.usage for c in got], n)))


def _logprobs_fn(lm: LoadedModel, kind: str) -> Callable[[list[TokenLogprob], int],
                                                            dict[str, Any]]:
    tb = lm.tokenizer.token_bytes
    if kind == "chat":
        return lambda lps, _offset: chat_logprobs(lps, tb)
    return lambda lps, offset: completion_logprobs(lps, tb, offset)


class _Chunks(Frames):
    """SSE chunks of every choice as their events come (each chunk names its choice), then
    the usage and [DONE] once all have finished; a failed choice ends the stream with its
    error (and [DONE])."""

    def __init__(self, lm: LoadedModel, env: Envelope, prepared: list[Prepared],
                 include_usage: bool, n: int) -> None:
        self.lm, self.env, self.prepared = lm, env, prepared
        self.include_usage, self.n = include_usage, n
        self.to_logprobs = _logprobs_fn(lm, env.kind)
        self.replies: list[ReplyStream | None] = [
            p.output.reply_stream() if env.kind == "chat" else None for p in prepared]
        self.offsets = [0] * len(prepared)
        self.usages: list[Usage | None] = [None] * len(prepared)  # in choice order

    def _chunk(self, index: int, **fields: Any) -> str:
        return sse(self.env.chunk(with_usage=self.include_usage, index=index, **fields))

    def start(self) -> list[str]:
        out = []
        for i, reply in enumerate(self.replies):
            echo = self.prepared[i].output.echo
            if reply is not None:
                out.append(self._chunk(i, role=True, fields={"content": None}
                                       if reply.tools is not None else None))
            elif echo and self.prepared[i].gen.prompt_logprobs is None:
                self.offsets[i] = len(echo)  # echo: the prompt's text first
                out.append(self._chunk(i, text=echo))
        return out

    def delta(self, index: int, event: Delta) -> list[str]:
        p, reply = self.prepared[index], self.replies[index]
        if event.prompt_logprobs is not None:  # a scored prompt: echoed with its logprobs
            self.offsets[index] = len(p.output.echo)
            scored = completion_logprobs(event.prompt_logprobs, self.lm.tokenizer.token_bytes,
                                         first=p.gen.prompt[0])
            return [self._chunk(index, text=p.output.echo, logprobs=scored)]
        lp = (self.to_logprobs(event.logprobs, self.offsets[index])
              if p.gen.logprobs is not None else None)
        self.offsets[index] += len(event.text)
        if reply is None:
            return [self._chunk(index, text=event.text, logprobs=lp)]
        return self._deltas(index, reply.push(event.text), lp)

    def failed(self, index: int, event: Failed) -> list[str]:
        return [sse(APIError(event.status, event.message).body()), sse("[DONE]")]

    def done(self, index: int, event: Done) -> list[str]:
        reply = self.replies[index]
        out = [] if reply is None else self._deltas(index, reply.finish(), None)
        finish = event.finish_reason if reply is None else reply.finish_reason(event.finish_reason)
        self.usages[index] = event.usage
        return [*out, self._chunk(index, finish=finish)]

    def end(self) -> list[str]:
        usage = [sse(self.env.usage_chunk(total_usage([u for u in self.usages if u], self.n)))]
        return [*(usage if self.include_usage else []), sse("[DONE]")]

    def _deltas(self, index: int, deltas: list[dict[str, Any]],
                logprobs: dict[str, Any] | None) -> list[str]:
        """Chunks for ReplyStream deltas; a step's logprobs ride on its first chunk (on an
        empty delta when the parsers held all of its text back)."""
        if not deltas and logprobs is not None:
            deltas = [{}]
        return [self._chunk(index, fields=delta, logprobs=logprobs if i == 0 else None)
                for i, delta in enumerate(deltas)]
