"""The viz web app (FastAPI, as `minfer serve`): the page, its assets and the JSON endpoints.

Routes (documented in the README):
- `GET /` the page; `GET /static/...` its script, style and the vendored Cytoscape.js;
- `GET /api/info` model name, live or trace mode, step count;
- `GET /api/graph?kind=prefill|decode` (or `?uid=N`) the graph as
  `minfer.graph.view.describe` gives it;
- `POST /api/generate` `{"prompt", "max_tokens", "temperature", "chat"}`: a traced generation
  as server-sent events (`step`, `token`, `done` or `error`);
- `GET /api/steps` every step of the current trace without its per-node records;
- `GET /api/trace/STEP` one step's trace (per-node time, statistics and heatmap);
  `GET /api/trace` the whole trace (the file `minfer viz --trace` opens);
- `POST /api/diff` `{"prompt", "max_tokens", "chat"}`: CPU vs torch, max |Δ| per node and step.
Bad input gets a 4xx with `{"error": message}`: 400 for a refused value, 404 for an unknown
step or graph, 409 while another run is going, 422 for a malformed body or query.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from minfer.errors import MinferError
from minfer.viz.session import Busy, NotFound, VizSession

MAX_TOKENS = 512


class GenerateBody(BaseModel):
    prompt: str = Field(min_length=1, max_length=20000)
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0)
    chat: bool = True


class DiffBody(BaseModel):
    prompt: str = Field(min_length=1, max_length=20000)
    max_tokens: int = Field(default=4, ge=1, le=64)
    chat: bool = True


def static_dir() -> str:
    return str(resources.files("minfer.viz") / "static")


def _sse(event: dict[str, Any]) -> str:
    name = event.pop("event")
    return f"event: {name}\ndata: {json.dumps(event)}\n\n"


def create_app(session: VizSession) -> FastAPI:
    app = FastAPI(title="minfer viz", docs_url=None, redoc_url=None)
    app.mount("/static", StaticFiles(directory=static_dir()), name="static")

    @app.exception_handler(MinferError)
    async def refused(_: Request, exc: MinferError) -> JSONResponse:
        status = 404 if isinstance(exc, NotFound) else 409 if isinstance(exc, Busy) else 400
        return JSONResponse({"error": str(exc)}, status_code=status)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(f"{static_dir()}/index.html", media_type="text/html")

    @app.get("/api/info")
    async def info() -> dict[str, Any]:
        return session.info()

    @app.get("/api/graph")
    async def graph(kind: str | None = Query(default=None),
                    uid: int | None = Query(default=None)) -> dict[str, Any]:
        return await run_in_threadpool(session.graph, kind, uid)

    @app.post("/api/generate")
    async def generate(body: GenerateBody) -> StreamingResponse:
        events = session.generate(body.prompt, max_tokens=body.max_tokens,
                                  temperature=body.temperature, chat=body.chat)

        def stream() -> Iterator[str]:
            for event in events:
                yield _sse(event)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get("/api/steps")
    async def steps() -> list[dict[str, Any]]:
        return await run_in_threadpool(session.summaries)

    @app.get("/api/trace")
    async def trace() -> dict[str, Any]:
        return await run_in_threadpool(session.trace_json)

    @app.get("/api/trace/{step}")
    async def trace_step(step: int) -> dict[str, Any]:
        return session.step(step)

    @app.post("/api/diff")
    async def diff(body: DiffBody) -> dict[str, Any]:
        return await run_in_threadpool(session.diff, body.prompt, max_tokens=body.max_tokens,
                                       chat=body.chat)

    return app
