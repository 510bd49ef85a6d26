"""Ollama's API: `GET /`, `GET /api/version`, `GET /api/tags`, `GET /api/ps`, `POST /api/show`,
`POST /api/chat`, `POST /api/generate`, `POST /api/embed` (and the older `/api/embeddings`),
`POST /api/pull` (catalogue and
`hf:` names, progress as NDJSON; the pulled model is served too), `POST /api/copy` (a second
name for a served or cached model, linked into the model cache and served), `DELETE /api/delete`
(a served model other than the first is unloaded; only files in the model cache are deleted).

Chat and generate are translated onto the chat / completion request path (translate.py) and
answered as one object or as NDJSON (`application/x-ndjson`), a line per piece and a final line
with `done: true`, `done_reason` and the counts and durations. A request names its model:
the loaded model's name with or without `:latest`; another name is a 404. Errors are Ollama's
`{"error": "..."}`. An empty prompt (or no messages) only loads the model (`done_reason: load`;
`unload` with `keep_alive: 0`). Generate's `context` (the ids a reply returned) goes before the
templated prompt, and the final object carries the exchange's ids, unless `raw`."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

import minfer
from minfer.convert.convert import convert_checkpoint
from minfer.engine.core.request import TokenLogprob
from minfer.engine.embed import normalize
from minfer.errors import MinferError
from minfer.sampling.tool_calls import tools_for_prompt
from minfer.server.embeddings import encode_inputs, run_embeddings
from minfer.server.errors import APIError
from minfer.server.ollama.schemas import (
    ChatRequest,
    CopyRequest,
    EmbedRequest,
    GenerateRequest,
    LegacyEmbedRequest,
    PullRequest,
    ShowRequest,
)
from minfer.server.ollama.translate import (
    Clock,
    capabilities,
    chat_request,
    check_thinking,
    details,
    generate_request,
    keep_alive_seconds,
    listing,
    message_fields,
    names,
    now,
    tool_calls,
)
from minfer.server.output import OutputPlan, ReplyStream, token_logprobs
from minfer.server.prepare import Prepared, chat_prompt
from minfer.server.relay import NDJSON, Frames, collect, ndjson, prepare_for, stream, submit
from minfer.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from minfer.server.state import LoadedModel, ServerState
from minfer.server.worker import Delta, Done, Failed
from minfer.store import download
from minfer.store.catalog import load_catalog, minfer_home
from minfer.store.hub_select import is_hub_ref, parse_hub_ref
from minfer.store.models import list_models
from minfer.tools.fetch import resolve


def ollama_routes(app: FastAPI, state: ServerState) -> None:
    """Add Ollama's routes to app."""

    @app.get("/", include_in_schema=False)
    async def root() -> PlainTextResponse:
        return PlainTextResponse("minfer is running")

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": minfer.__version__}

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [listing(name, state.facts(name)) for name in state.names()]}

    # HEAD as well as GET, as Ollama answers them (the `ollama` CLI's heartbeat is `HEAD /`);
    # outside the OpenAPI schema, which would list each operation twice
    for path, endpoint in (("/", root), ("/api/version", version), ("/api/tags", tags)):
        app.head(path, include_in_schema=False)(endpoint)

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        out = []
        for lm in state.loaded():
            left = state.expiry(lm.name)
            until = (datetime.now(UTC) + timedelta(seconds=left) if left is not None
                     else datetime(2318, 1, 1, tzinfo=UTC))  # Ollama's "forever"
            out.append({**listing(lm.name, state.facts(lm.name)),
                        "expires_at": until.isoformat().replace("+00:00", "Z"),
                        "size_vram": 0})
        return {"models": out}

    @app.post("/api/show")
    async def show(body: ShowRequest) -> dict[str, Any]:
        lm = await _model(state, body.model, None)
        facts = state.facts(lm.name)
        info = {**facts.metadata, "general.parameter_count": facts.n_params}
        template = lm.template.source
        modelfile = f"FROM {state.path_of(lm.name)}\n" + (
            f'TEMPLATE """{template}"""\n' if template else "")
        return {"modelfile": modelfile, "parameters": "", "template": template,
                "details": details(facts),
                "model_info": info, "capabilities": capabilities(lm),
                "modified_at": listing(lm.name, facts)["modified_at"]}

    @app.post("/api/chat")
    async def chat(body: ChatRequest, request: Request) -> Response:
        lm = await _model(state, body.model, body.keep_alive)
        check_thinking(body, lm)
        if not body.messages:
            return _loaded(lm, {"message": {"role": "assistant", "content": ""}},
                           body.keep_alive)
        req = chat_request(body)
        prepared = await run_in_threadpool(prepare_chat, req, lm)
        return await _run(state, lm, req, prepared, request, body.stream, chat=True)

    @app.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        lm = await _model(state, body.model, body.keep_alive)
        check_thinking(body, lm)
        if body.raw and (body.template or body.system or body.context):
            raise APIError(400, "raw mode does not support template, system, or context")
        if not body.prompt and body.suffix is None:
            return _loaded(lm, {"response": ""}, body.keep_alive)
        req = generate_request(body, lm.limits.n_ctx_slot)
        context = None if body.raw else body.context or []
        prepared = await run_in_threadpool(prepare_for, lm, req, context or ())
        return await _run(state, lm, req, prepared, request, body.stream, chat=False,
                          context=context)

    @app.post("/api/pull")
    async def pull(body: PullRequest) -> Response:
        name = body.model.removesuffix(":latest")
        try:
            entry = load_catalog().entry(name)
        except MinferError:
            if not is_hub_ref(name):
                raise APIError(404, f"pull model manifest: '{body.model}' is neither in the "
                               "model catalogue nor a Hugging Face name (hf:ORG/REPO:FILE)"
                               ) from None
            try:
                parse_hub_ref(name)
            except MinferError as exc:
                raise APIError(400, f"pull model manifest: {exc}") from None
            entry = None
        failures: list[int] = []  # the status of a failed pull (not part of Ollama's events)
        events = _pull_events(state, name, entry, failures)
        if body.stream:
            return StreamingResponse((ndjson(e) async for e in events), media_type=NDJSON)
        last: dict[str, Any] = {}
        async for event in events:
            last = event
        return JSONResponse(last, status_code=failures[0] if failures else 200)

    @app.post("/api/copy")
    async def copy(body: CopyRequest) -> Response:
        """A served or cached model under a second name (Ollama's `copy`): a hard link in the
        model cache (a copy where the file system has none), served from now on. A destination
        already taken is refused; nothing is overwritten."""
        source = body.source.removesuffix(":latest")
        dest = body.destination.removesuffix(":latest")
        if not MODEL_NAME.fullmatch(dest):
            raise APIError(400, f"destination '{body.destination}' is not a model name (letters, "
                           "digits, '.', '_' and '-', an optional ':latest')")
        cached = {m.name: m.path for m in await run_in_threadpool(list_models)}
        if source in state.names():
            path = state.path_of(source)
        elif source in cached:
            path = cached[source]
        else:
            raise APIError(404, f"model '{body.source}' not found")
        target = minfer_home() / f"{dest}.gguf"
        if dest in state.names() or dest in cached or target.exists():
            raise APIError(400, f"destination '{body.destination}' already exists")
        await run_in_threadpool(_link_or_copy, path, target)
        state.add_model(target)
        return Response(status_code=200)

    # Ollama's model building and publishing: minfer serves GGUF files as they are (`pull`,
    # `copy`, `delete` manage the cache); a clear refusal, not a bare 404
    async def not_built_here(request: Request) -> Response:
        raise APIError(501, f"{request.url.path} is not supported by minfer: it serves GGUF "
                       "files as they are (pull one with /api/pull or `minfer pull`; set a "
                       "system prompt or options per request)")

    for path, methods in (("/api/create", ["POST"]), ("/api/push", ["POST"]),
                          ("/api/blobs/{digest}", ["HEAD", "POST"])):
        app.add_api_route(path, not_built_here, methods=methods, include_in_schema=False)

    @app.delete("/api/delete")
    async def delete(body: ShowRequest) -> Response:
        name = body.model.removesuffix(":latest")
        cached = {m.name: m.path for m in await run_in_threadpool(list_models)}
        if name not in state.names() and name not in cached:
            raise APIError(404, f"model '{body.model}' not found")
        if name in state.names():
            state.remove_model(name)
        path = cached.get(name)
        if path is not None and path.parent.resolve() == minfer_home().resolve():
            path.unlink(missing_ok=True)  # only the cache's own files, never a user's file
            path.with_name(path.name + ".sha256").unlink(missing_ok=True)
        return Response(status_code=200)

    @app.post("/api/embed")
    async def embed(body: EmbedRequest) -> dict[str, Any]:
        t0 = time.perf_counter()
        lm = await _model(state, body.model, body.keep_alive)
        t_load = time.perf_counter()
        vectors, inputs = await _embed(lm, body.input, truncate=body.truncate, norm=2)
        if body.dimensions is not None and body.dimensions < len(vectors[0]):
            vectors = [normalize(v[:body.dimensions]) for v in vectors]  # as Ollama: cut, renorm
        t1 = time.perf_counter()
        return {"model": names(lm)[0], "embeddings": [v.tolist() for v in vectors],
                "total_duration": int((t1 - t0) * 1e9), "load_duration": int((t_load - t0) * 1e9),
                "prompt_eval_count": sum(len(e.ids) for e in inputs)}

    @app.post("/api/embeddings")
    async def embeddings(body: LegacyEmbedRequest) -> dict[str, Any]:
        lm = await _model(state, body.model, body.keep_alive)
        if not body.prompt:
            return {"embedding": []}
        vectors, _ = await _embed(lm, body.prompt, truncate=True, norm=-1)
        return {"embedding": vectors[0].tolist()}


async def _embed(lm: LoadedModel, raw: str | list[str], *, truncate: bool,
                 norm: int) -> tuple[list[Any], list[Any]]:
    worker = lm.embedder()
    embedder = worker.embedder
    if embedder is None or embedder.pooling == "none":
        raise APIError(400, f"model '{lm.name}' does not pool its embeddings (start the "
                       "server with --pooling mean, cls or last)")
    inputs = await run_in_threadpool(encode_inputs, embedder, raw, truncate=truncate)
    return await run_embeddings(worker, inputs, norm), inputs


async def _model(state: ServerState, name: str, keep_alive: str | float | None) -> LoadedModel:
    """The model a request names, as `/api/tags` lists it (with or without `:latest`);
    another name is a 404, as Ollama answers it."""
    served = state.names()
    bare = name.removesuffix(":latest")
    if bare not in served:
        raise APIError(404, f"model '{name}' not found (models: "
                       f"{', '.join(n + ':latest' for n in served)})")
    return await state.acquire(bare, keep_alive=keep_alive_seconds(keep_alive))


def reply_room(req: ChatCompletionRequest, n_ctx: int) -> int:
    """The tokens a chat's prompt leaves its reply at least: a quarter of the slot's context,
    or its max_tokens if smaller (Ollama's runner shifts its context while it generates;
    minfer's server does not)."""
    return min(req.max_tokens or n_ctx, n_ctx // 4)


def prepare_chat(req: ChatCompletionRequest, lm: LoadedModel) -> Prepared:
    """A chat request prepared as it came, or, when its prompt is past the context or leaves
    the reply less than its room, with its history trimmed as Ollama trims it (`fit_history`)
    and prepared again: a conversation that fits is rendered once."""
    n_ctx = lm.limits.n_ctx_slot
    try:
        prepared = prepare_for(lm, req)
        if len(prepared.gen.prompt) + reply_room(req, n_ctx) <= n_ctx:
            return prepared
    except APIError as exc:
        if exc.code != "context_length_exceeded":
            raise
    return prepare_for(lm, fit_history(req, lm))


def fit_history(req: ChatCompletionRequest, lm: LoadedModel) -> ChatCompletionRequest:
    """A conversation that does not fit as Ollama trims it: the latest messages that fit (with
    `reply_room` left), with the system messages before them, the last message always kept
    (alone too long, it stays a 400)."""
    n_ctx = lm.limits.n_ctx_slot
    room = reply_room(req, n_ctx)
    tools = tools_for_prompt(req.tools, req.tool_choice)

    def fits(messages: list[ChatMessage]) -> bool:
        trial = req.model_copy(update={"messages": messages})
        plan = OutputPlan(tools=None if tools is None else [dict(t) for t in tools])
        ids, _ = chat_prompt(trial, lm.tokenizer, lm.template, plan, lm.reasoning, lm.vision)
        return len(ids) + room <= n_ctx

    msgs = req.messages
    keep = len(msgs) - 1
    for start in range(len(msgs) - 2, 0, -1):  # the longest tail that fits, systems kept
        trial = [m for m in msgs[:start] if m.role == "system"] + msgs[start:]
        try:
            ok = fits(trial)
        except APIError:  # a cut the template refuses (roles must alternate): one earlier
            continue
        if not ok:
            break
        keep = start
    kept = [m for m in msgs[:keep] if m.role == "system"] + msgs[keep:]
    return req.model_copy(update={"messages": kept})


def _loaded(lm: LoadedModel, text: dict[str, Any],
            keep_alive: str | float | None) -> JSONResponse:
    """The answer to a request that only loads the model, or (keep_alive 0) unloads it."""
    unload = keep_alive is not None and keep_alive_seconds(keep_alive) == 0
    return JSONResponse({"model": names(lm)[0], "created_at": now(), **text, "done": True,
                         "done_reason": "unload" if unload else "load"})


async def _run(state: ServerState, lm: LoadedModel,
               req: ChatCompletionRequest | CompletionRequest, prepared: Prepared,
               request: Request, streamed: bool, *, chat: bool,
               context: list[int] | None = None) -> Response:
    """Run a prepared chat or generate request. context (generate without `raw`): the ids of
    an earlier exchange it continues, [] for none; the final object then carries this
    exchange's ids as its `context`, as Ollama's does."""
    clock = Clock()
    handle = submit(state, lm, prepared.gen)
    name = names(lm)[0]

    def exchange(text: str) -> dict[str, Any]:
        if context is None:
            return {}
        return {"context": prepared.gen.prompt + lm.tokenizer.encode(text, special=False,
                                                                     add_bos=False)}

    if streamed:
        return stream(lm, [handle], _Lines(lm, prepared, clock, name, chat=chat,
                                           exchange=exchange), media_type=NDJSON)
    [got] = await collect(lm, [handle], request)
    if isinstance(req, ChatCompletionRequest):
        fields, _ = prepared.output.finalize(got.text, got.done.finish_reason)
    else:
        fields = {"content": got.text}
    lps = ({"logprobs": token_logprobs(got.logprobs, lm.tokenizer.token_bytes)}
           if prepared.gen.logprobs is not None else {})
    return JSONResponse({**_text(fields, chat), **clock.final(name, got.done),
                         **exchange(got.text), **lps})


def _text(fields: dict[str, Any], chat: bool) -> dict[str, Any]:
    if chat:
        return {"message": message_fields(fields)}
    out: dict[str, Any] = {"response": fields.get("content") or ""}
    if fields.get("reasoning_content"):
        out["thinking"] = fields["reasoning_content"]
    return out


class _Lines(Frames):
    """Ollama's stream: a line per piece of the reply (`message` or `response`, `thinking`
    apart; the logprobs of the tokens it shows), the tool calls in a line of their own, then
    the final line (`done: true`, the counts and durations, generate's `context`)."""

    def __init__(self, lm: LoadedModel, prepared: Prepared, clock: Clock, name: str, *,
                 chat: bool, exchange: Callable[[str], dict[str, Any]]) -> None:
        self.lm, self.clock, self.name, self.chat, self.exchange = lm, clock, name, chat, exchange
        self.reply: ReplyStream | None = (prepared.output.reply_stream()
                                          if prepared.output.reasoning is not None else None)
        self.want_lps = prepared.gen.logprobs is not None
        self.pending: list[TokenLogprob] = []  # logprobs of tokens whose text no line carried yet
        self.text: list[str] = []

    def _lines(self, deltas: list[dict[str, Any]]) -> list[str]:
        out = []
        for d in deltas:
            fields = {k: d[k] for k in ("content", "reasoning_content") if d.get(k)}
            if fields:
                line = {"model": self.name, "created_at": now(), **_text(fields, self.chat),
                        "done": False}
                if self.pending:
                    line["logprobs"] = token_logprobs(self.pending, self.lm.tokenizer.token_bytes)
                    self.pending.clear()
                out.append(ndjson(line))
        return out

    def delta(self, index: int, event: Delta) -> list[str]:
        self.text.append(event.text)
        if self.want_lps:
            self.pending.extend(event.logprobs)
        return self._lines(self.reply.push(event.text) if self.reply else
                           [{"content": event.text}])

    def failed(self, index: int, event: Failed) -> list[str]:
        return [ndjson({"error": event.message})]

    def done(self, index: int, event: Done) -> list[str]:
        out = []
        if self.reply is not None:
            out += self._lines(self.reply.finish())
            if self.reply.tools is not None and self.reply.tools.tool_calls:
                msg = {"role": "assistant", "content": "",
                       "tool_calls": tool_calls(self.reply.tools.tool_calls)}
                out.append(ndjson({"model": self.name, "created_at": now(), "message": msg,
                                   "done": False}))
        final = self.clock.final(self.name, event)
        if self.pending:  # (an end-of-generation token's, which shows no text)
            final["logprobs"] = token_logprobs(self.pending, self.lm.tokenizer.token_bytes)
        out.append(ndjson({**_text({}, self.chat), **final, **self.exchange("".join(self.text))}))
        return out


async def _pull_events(state: ServerState, name: str, entry: Any,
                       failures: list[int]) -> AsyncIterator[dict[str, Any]]:
    """Ollama's pull progress for a catalogue (or Hub) model: the download runs on a thread;
    when it is in place the server serves it too. A failure appends its HTTP status to
    `failures`: 404 when the model cannot be had from here (not on the Hub, unreachable,
    offline, not a model minfer runs), 500 for anything else."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    digest = f"sha256:{entry.sha256}" if entry is not None else ""

    def report(status: str, done: int, total: int) -> None:
        event: dict[str, Any] = {"status": {"downloading": f"pulling {name}",
                                            "verifying": "verifying sha256 digest"}.get(
                                                status, status)}
        if status == "downloading":
            event.update(digest=digest, total=total, completed=done)
        if status != "success":
            loop.call_soon_threadsafe(queue.put_nowait, event)

    def work() -> None:
        try:
            path = (download.pull(name, progress=False, report=report,
                                  converter=convert_checkpoint) if entry is not None
                    else resolve(name))
            state.add_model(path)
            loop.call_soon_threadsafe(queue.put_nowait, {"status": "success"})
        except Exception as exc:  # reported in the stream, as Ollama does
            failures.append(404 if isinstance(exc, MinferError) else 500)
            loop.call_soon_threadsafe(queue.put_nowait, {"error": str(exc)})

    yield {"status": "pulling manifest"}
    threading.Thread(target=work, name=f"minfer-pull-{name}", daemon=True).start()
    while True:
        event = await queue.get()
        yield event
        if "error" in event or event.get("status") == "success":
            return


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _link_or_copy(source: Path, target: Path) -> None:
    """target as a second name of source's bytes: a hard link, else a copy written under a
    private name and renamed (never a half file under the model's name)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        tmp = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise APIError(500, f"cannot copy the model: {exc.strerror}") from None
