"""llama.cpp's native generation routes: `POST /completion` and `POST /infill` (code completion
in the editor, fill-in-the-middle).

`/completion`'s body is llama-server's: `prompt` (a text, token ids, or both mixed), `n_predict`,
the sampling fields, `stop`, `json_schema` / `grammar`, `stream`, `n_probs`
(`completion_probabilities`), `ignore_eos`. `/infill`'s adds
`input_prefix`, `input_suffix`, `input_extra`, `t_max_predict_ms`; its prompt is laid out as
llama-server's `format_prompt_infill` does (minfer.tokenizer.infill), with the extra files
first so that an editor's successive requests share the longest cached prefix. Both answer in
llama-server's shape: `content` plus the counts, `stop_type` (`eos`, `word` with the
`stopping_word`, `limit`) and `timings`, or with `stream` SSE chunks of `{"content", "stop":
false}` ending with one `stop: true` chunk. A model without FIM tokens is a 400 naming
fill-in-the-middle (llama-server answers 501; a 4xx says the request, not the server, is at
fault).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from minfer.engine.core.request import TokenLogprob
from minfer.server.errors import APIError
from minfer.server.output import token_logprobs
from minfer.server.relay import Frames, collect, prepare_for, sse, stream, submit
from minfer.server.schemas import InfillRequest, NativeCompletionRequest
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Failed, Usage

STOP_TYPES = {"stop": "eos", "length": "limit"}


def native_routes(app: FastAPI, state: ServerState) -> None:
    """Add `POST /completion` and `POST /infill` to app."""

    @app.post("/completion")
    async def completion(body: NativeCompletionRequest, request: Request) -> Response:
        return await _generate(state, request, body.output_format())

    @app.post("/infill")
    async def infill(body: InfillRequest, request: Request) -> Response:
        return await _generate(state, request, body)


async def _generate(state: ServerState, request: Request,
                    body: NativeCompletionRequest | InfillRequest) -> Response:
    lm = await state.acquire(body.model)
    prepared = await run_in_threadpool(prepare_for, lm, body)
    n_prompt = len(prepared.gen.prompt)
    if prepared.gen.max_tokens == 0:  # nothing to generate: no slot needed
        return JSONResponse(_final(lm, "", Done("length", Usage(n_prompt, 0, 0))))
    handle = submit(state, lm, prepared.gen)
    if body.stream:
        return stream(lm, [handle], _Chunks(lm, prepared.gen.logprobs is not None))
    [got] = await collect(lm, [handle], request)
    probs = ({"completion_probabilities": probabilities(lm, got.logprobs)}
             if prepared.gen.logprobs is not None else {})
    return JSONResponse({**_final(lm, got.text, got.done), **probs})


def _final(lm: LoadedModel, content: str, done: Done) -> dict[str, Any]:
    usage = done.usage
    word = done.stop_sequence
    return {"index": 0, "content": content, "tokens": [], "model": lm.name, "stop": True,
            "stop_type": "word" if word else STOP_TYPES.get(done.finish_reason, "none"),
            "stopping_word": word or "",
            "tokens_predicted": usage.completion_tokens, "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens, "truncated": False,
            "timings": timings(done)}


def probabilities(lm: LoadedModel, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities` (`n_probs`): each drawn token's id, text,
    bytes and logprob, with its `top_logprobs` alike."""
    return token_logprobs(lps, lm.tokenizer.token_bytes, with_id=True)


def timings(done: Done) -> dict[str, float]:
    """llama-server's `timings`: the prompt (its uncached part) and the decode, in ms."""
    u = done.usage
    n_prompt = u.prompt_tokens - u.cached_tokens
    return {"prompt_n": n_prompt, "prompt_ms": done.prompt_ms,
            "prompt_per_second": n_prompt / done.prompt_ms * 1e3 if done.prompt_ms else 0.0,
            "predicted_n": u.completion_tokens, "predicted_ms": done.predicted_ms,
            "predicted_per_second": (u.completion_tokens / done.predicted_ms * 1e3
                                     if done.predicted_ms else 0.0)}


class _Chunks(Frames):
    """llama-server's stream: a `{"content", "stop": false}` chunk per piece, then the final
    one (`stop: true`, the counts and timings)."""

    def __init__(self, lm: LoadedModel, with_probs: bool) -> None:
        self.lm = lm
        self.with_probs = with_probs

    def delta(self, index: int, event: Delta) -> list[str]:
        chunk = {"index": 0, "content": event.text, "tokens": [], "stop": False}
        if self.with_probs:
            chunk["completion_probabilities"] = probabilities(self.lm, event.logprobs)
        return [sse(chunk)]

    def failed(self, index: int, event: Failed) -> list[str]:
        return [sse(APIError(event.status, event.message).body())]

    def done(self, index: int, event: Done) -> list[str]:
        return [sse(_final(self.lm, "", event))]
