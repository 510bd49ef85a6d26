"""`minfer serve --ray`: the OpenAI app as Ray Serve deployments, one engine per replica.

Two deployments form the application:

- `engine` (N replicas, or autoscaled): each replica runs the same FastAPI app as
  `minfer serve` over its own engine (ServerState + create_app, unchanged), reserving
  `threads` CPUs from Ray so that replicas on one node never oversubscribe its cores. The
  front hands it a request as plain data (method, path, headers, body); the replica drives the
  app through ASGI and yields the app's ASGI messages back, so streaming passes through as the
  app produces it. A replica takes at most `slots` requests; more wait at the front for a free
  slot (on the session's replica first). The replicas of one machine map one copy of the
  repacked weights (engine/shared_weights.py) besides sharing the model file's page cache.
- `front` (one replica, no CPU reserved): receives every HTTP request from Ray's proxy, reads
  the body, derives the session key (affinity.py) and calls the engine deployment with it; the
  router (ray/router.py) sends the conversation to the replica holding its prompt cache. The
  front answers `/metrics` (every live replica's metrics, summed), `/replicas` (one line per
  replica: node, pid, threads, status) and `/health` itself.

A replica that dies mid-request ends that request with a retryable 503 (`Retry-After`), or,
once a stream has started, with an error event in the stream; Ray starts a replacement. This
module imports ray only inside functions, and only `minfer serve --ray` imports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import Message

from minfer.errors import MinferError
from minfer.server.errors import APIError, unavailable
from minfer.server.metrics import merge_expositions
from minfer.server.ray.affinity import RESPONSES_PATHS, session_key
from minfer.server.response_ids import CHAIN_HEADER, new_chain
from minfer.server.state import ServerConfig

log = logging.getLogger("minfer.server")

FRONT_PATHS = frozenset({"/metrics", "/replicas", "/health"})
PER_REPLICA_TIMEOUT_S = 5.0
HOP_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection"})


@dataclass(frozen=True)
class RayOptions:
    replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) replicas
    threads: int = 1  # per replica; also the CPUs each replica reserves
    app_name: str = "minfer"
    share_weights: bool = True  # one copy of the repacked weights per machine (shared_weights)

    @property
    def max_replicas(self) -> int:
        return self.autoscale[1] if self.autoscale else self.replicas


def parse_autoscale(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
        raise MinferError(f"--autoscale wants MIN:MAX with 1 <= MIN <= MAX, not {text!r}")
    return int(lo), int(hi)


def replica_threads(node_cpus: list[int], replicas: int) -> int:
    """Threads per replica when the user gave none: replicas spread evenly over the nodes,
    each node's cores split among the replicas it gets (the smallest node decides)."""
    cpus = [c for c in node_cpus if c > 0]
    if not cpus:
        return 1
    per_node = math.ceil(replicas / len(cpus))
    return max(1, min(cpus) // per_node)


# -- the engine replica ------------------------------------------------------------------------


class EngineReplica:
    """One engine behind the unchanged OpenAI app; Ray calls `http` with the front's request."""

    def __init__(self, config: ServerConfig, share_weights: bool = True) -> None:
        from minfer.engine import shared_weights
        from minfer.server.app import create_app
        from minfer.server.state import ServerState

        if share_weights:  # the machine's replicas map one copy of the repacked weights
            os.environ.setdefault(shared_weights.ENV, "1")
        else:
            os.environ[shared_weights.ENV] = "0"
        self.config = config
        self.state = ServerState(config)
        self.app = create_app(self.state, own_state=False)
        self._tasks: set[asyncio.Task[None]] = set()
        self._id = _replica_id().encode()
        self.state.start()
        self.state.wait_ready(timeout=3600)  # Ray routes nothing here before __init__ returns
        if self.state.status != "ok":
            raise MinferError(f"the engine replica failed to start: {self.state.error}")

    async def http(self, key: str | None, req: dict[str, Any]) -> AsyncIterator[Message]:
        """Run req through the app; yield its `http.response.*` ASGI messages."""
        del key  # the router's
        out: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        body: list[bytes] = [req["body"]]

        async def receive() -> Message:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            await out.put(message)

        async def run() -> None:
            try:
                await self.app(_scope(req), receive, send)
            finally:
                await out.put(None)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            while (message := await out.get()) is not None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-minfer-replica", self._id)]}
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    break
        finally:
            gone.set()  # the caller left or we are done: the app frees the slot

    def metrics(self, key: str | None) -> str:
        del key
        return self.state.metrics.render()

    def info(self, key: str | None) -> dict[str, Any]:
        del key
        import ray

        return {"replica": self._id.decode(), "node": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "threads": self.config.engine.n_threads,
                "status": self.state.status}

    def check_health(self) -> None:
        if self.state.status == "error":
            raise RuntimeError(f"the engine failed: {self.state.error}")

    def __del__(self) -> None:
        """Ray Serve's shutdown hook (after its graceful period): stop the engine thread."""
        state = getattr(self, "state", None)  # None when __init__ failed early
        if state is not None:
            state.draining = True
            state.stop()


def _replica_id() -> str:
    from ray import serve

    return str(serve.get_replica_context().replica_id.unique_id)


def _scope(req: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": req["method"], "scheme": "http",
        "path": req["path"], "raw_path": req["path"].encode(), "query_string": req["query"],
        "root_path": "", "headers": req["headers"], "client": ("front", 0),
        "server": ("replica", 0),
    }


# -- the front ---------------------------------------------------------------------------------


class Front:
    """Every HTTP request first: session key, then the engine replica the router picks."""

    def __init__(self, engine: Any, config: ServerConfig) -> None:
        import ray.exceptions
        from ray.serve.exceptions import BackPressureError

        self.engine = engine
        self.config = config
        self._gone_errors = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                             ray.exceptions.ObjectLostError)
        self._backpressure = BackPressureError
        self._failures: dict[str, int] = {}
        key = config.api_key
        self._expected = f"Bearer {key}" if key else None

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, PlainTextResponse

        path = request.url.path
        try:
            if path in FRONT_PATHS:
                if path != "/health":
                    self._check_key(request.headers.get("authorization", ""))
                if path == "/metrics":
                    return PlainTextResponse(await self._metrics(),
                                             media_type="text/plain; version=0.0.4; charset=utf-8")
                infos = await self._infos()
                if path == "/replicas":
                    return JSONResponse({"replicas": infos})
                n_ok = sum(1 for i in infos if i.get("status") == "ok")
                return JSONResponse({"status": "ok" if n_ok else "unavailable",
                                     "replicas": len(infos), "replicas_ok": n_ok},
                                    status_code=200 if n_ok else 503)
            return await self._forward(request, path)
        except APIError as exc:
            return exc.response()
        except Exception:
            log.exception("the front failed on %s", path)
            return APIError(500, "internal server error", type_="server_error").response()

    def _check_key(self, given: str) -> None:
        if self._expected is not None and not secrets.compare_digest(given.encode(),
                                                                     self._expected.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    def _fail(self, code: str, message: str) -> APIError:
        self._failures[code] = self._failures.get(code, 0) + 1
        return unavailable(message, retry_after=1, code=code)

    async def _forward(self, request: Any, path: str) -> Any:
        from starlette.responses import Response, StreamingResponse

        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            raise APIError(413, f"request body larger than {self.config.max_body_bytes} bytes",
                           code="request_too_large")
        body = await request.body()
        sent = [(k, v) for k, v in request.headers.raw  # the chain is the front's to name
                if k.lower() != CHAIN_HEADER.encode()]
        req = {"method": request.method, "path": path, "query": request.url.query.encode(),
               "headers": sent, "body": body}
        key = session_key(path, body)
        if key is None and path in RESPONSES_PATHS:  # a new chain: routed by a name it keeps
            chain = new_chain()
            key = "chain:" + chain
            req["headers"].append((CHAIN_HEADER.encode(), chain.encode()))
        stream = self.engine.options(stream=True).http.remote(key, req)
        try:
            start = await stream.__anext__()
        except BaseException as exc:
            stream.cancel()
            raise self._ray_error(exc) from None
        status, headers = int(start["status"]), _headers(start.get("headers", []))
        if "text/event-stream" in headers.get("content-type", ""):
            return StreamingResponse(self._relay(stream), status_code=status, headers=headers)
        chunks: list[bytes] = []
        try:
            async for message in stream:
                chunks.append(message.get("body", b""))
        except BaseException as exc:
            stream.cancel()
            raise self._ray_error(exc) from None
        return Response(b"".join(chunks), status_code=status, headers=headers)

    def _ray_error(self, exc: BaseException) -> BaseException:
        """An exception from the engine call as the client should see it (or re-raised)."""
        if isinstance(exc, self._backpressure):
            return self._fail("queue_full", "every replica's queue is full")
        if isinstance(exc, self._gone_errors):
            return self._fail("replica_unavailable", "the replica serving this request went "
                              "away; retry")
        if isinstance(exc, StopAsyncIteration):
            return self._fail("replica_unavailable", "the replica returned no response")
        return exc

    async def _relay(self, stream: Any) -> AsyncIterator[bytes]:
        try:
            async for message in stream:
                yield message.get("body", b"")
        except self._gone_errors:
            err = self._fail("replica_unavailable", "the replica serving this stream went away")
            yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
        finally:
            stream.cancel()  # a no-op once done; else the client left: stop the replica's work

    async def _per_replica(self, method: str) -> list[Any]:
        """method's answer from every live replica (those that fail or time out left out)."""
        call = self.engine.broadcast(method, None)
        try:
            results = await call.results_async(timeout_s=PER_REPLICA_TIMEOUT_S,
                                               return_exceptions=True)
        except TimeoutError:
            log.warning("a replica did not answer %s within %.0f s", method,
                        PER_REPLICA_TIMEOUT_S)
            return []
        except Exception as exc:  # e.g. no replica is running
            log.warning("asking the replicas for %s failed: %s", method, exc)
            return []
        return [r for r in results if not isinstance(r, BaseException)]

    async def _infos(self) -> list[dict[str, Any]]:
        return sorted(await self._per_replica("info"), key=lambda i: str(i["replica"]))

    async def _metrics(self) -> str:
        texts = await self._per_replica("metrics")
        lines = ["# HELP minfer_replicas Engine replicas that answered this scrape",
                 "# TYPE minfer_replicas gauge", f"minfer_replicas {len(texts)}",
                 "# HELP minfer_front_failures_total Requests the front answered 503 by cause",
                 "# TYPE minfer_front_failures_total counter"]
        lines += [f'minfer_front_failures_total{{code="{c}"}} {n}'
                  for c, n in sorted(self._failures.items())]
        return merge_expositions(texts) + "\n".join(lines) + "\n"


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw
            if k.lower() not in HOP_HEADERS}


# -- the application ---------------------------------------------------------------------------


def engine_options(config: ServerConfig, opts: RayOptions) -> dict[str, Any]:
    """The engine deployment's Ray Serve options."""
    scaling: dict[str, Any] = {"num_replicas": opts.replicas}
    if opts.autoscale:
        lo, hi = opts.autoscale
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi,
                                          "target_ongoing_requests": config.slots}}
    return {
        "name": "engine", "max_ongoing_requests": config.slots,
        "max_queued_requests": config.queue, "health_check_period_s": 2.0,
        "ray_actor_options": {"num_cpus": opts.threads},
        "request_router_config": {
            "request_router_class": "minfer.server.ray.router.AffinityRouter"},
        **scaling,
    }


def build_app(config: ServerConfig, opts: RayOptions) -> Any:
    """The Ray Serve application: the front bound to the engine deployment."""
    from ray import serve

    replica_config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, n_threads=opts.threads, adaptive_threads=False))
    engine = serve.deployment(**engine_options(config, opts))(EngineReplica).bind(
        replica_config, opts.share_weights)
    front = serve.deployment(name="front", num_replicas=1, max_ongoing_requests=10_000,
                             ray_actor_options={"num_cpus": 0})(Front)
    return front.bind(engine, config)


def serve_on_ray(config: ServerConfig, opts: RayOptions, *, host: str, port: int,
                 address: str | None) -> int:
    """Deploy on the cluster at address (None: a local single-node Ray, on loopback, usage
    statistics off), print the URL, and serve until SIGINT / SIGTERM."""
    if address is None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if address is None:
        ray.init(include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        if config.engine.adaptive_threads:  # no thread count given: share the nodes' cores
            nodes = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]]
            opts = dataclasses.replace(opts, threads=replica_threads(nodes, opts.max_replicas))
        else:
            opts = dataclasses.replace(opts, threads=config.engine.n_threads or 1)
        serve.start(http_options={"host": host, "port": port})
        print(f"minfer: deploying {config.model_path.name} on Ray: {opts.max_replicas} "
              f"replica(s) x {opts.threads} thread(s); loading...", file=sys.stderr, flush=True)
        serve.run(build_app(config, opts), name=opts.app_name, route_prefix="/")
        print(f"minfer: serving on http://{host}:{port}", file=sys.stderr, flush=True)
        _wait_for_signal()
        serve.delete(opts.app_name)
        if address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
    return 0


def _wait_for_signal() -> None:
    sigs = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        signal.sigwait(sigs)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
