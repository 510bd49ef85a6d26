"""`minfer serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

The socket comes up first and the model loads behind it (`/health` is 503 until it is ready).
`--n-ctx` is the context of each slot (capped at the model's training context); the engine holds
slots × n-ctx KV cells. SIGINT / SIGTERM stop accepting connections, let in-flight requests finish
for up to `--drain-timeout` seconds, cut what is left, and exit 0 (a second SIGINT forces it).
`--lookup-ngram N` or `-md DRAFT` add speculative decoding per slot (output unchanged).
`--ray` serves replicas of the same app as a Ray Serve deployment (server/ray/deploy.py); only
then is Ray imported. Several models (`-m A -m B`, `--models-dir DIR`, or with no model every
model in the cache): the first loads at start and stays; the others load on their first request
and unload after `--keep-alive` idle seconds or beyond `--models-max`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from minfer import env
from minfer.cli.common import (
    add_kv_args,
    add_reasoning_args,
    add_speculative_args,
    file_has_mtp,
    kv_types,
    reasoning_from_args,
    spec_from_args,
)
from minfer.engine.core.scheduler import IDLE_CHUNK
from minfer.errors import MinferError
from minfer.gguf.hparams import POOLING_TYPES

if TYPE_CHECKING:
    from minfer.server.state import ServerConfig

log = logging.getLogger("minfer.server")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", help="model path or cached name (default model if omitted)")
    p.add_argument("-m", "--model", dest="model_opt", action="append", default=[],
                   help="model path or cached name; repeat it to serve several models (the "
                        "first stays loaded, the others load on their first request)")
    p.add_argument("-mm", "--mmproj", metavar="FILE",
                   help="the first model's vision encoder, for image parts (default: an "
                        "mmproj*.gguf beside the model)")
    p.add_argument("--no-mmproj", action="store_true",
                   help="no vision encoder: neither an mmproj beside the model nor one pulled "
                        "with an hf: model")
    p.add_argument("--models-dir", metavar="DIR", default=None,
                   help="also serve every .gguf in DIR (each loads on its first request)")
    p.add_argument("--strict-model-names", action="store_true",
                   help="answer 404 to a request naming a model not served (default: the "
                        "default model takes it, as llama-server ignores the name)")
    p.add_argument("--keep-alive", type=float, default=300.0, metavar="SECONDS",
                   help="idle seconds before a model other than the first unloads (default "
                        "300; -1: never)")
    p.add_argument("--models-max", type=int, default=3, metavar="N",
                   help="models in memory at once; the least recently used idle one unloads "
                        "(default 3)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-c", "--n-ctx", type=int, default=4096,
                   help="context per slot in tokens (default 4096, capped at the model's)")
    p.add_argument("--slots", "-np", "--parallel", dest="slots", type=int, default=4,
                   help="requests decoded together (default 4)")
    p.add_argument("--queue", type=int, default=64,
                   help="requests that may wait for a slot; more get 503 (default 64)")
    p.add_argument("--api-key", default=env.get("MINFER_API_KEY") or None,
                   help="require Authorization: Bearer KEY (default: $MINFER_API_KEY)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("-b", "--chunk", "--batch-size", dest="chunk", type=int, default=None,
                   help="prompt tokens prefilled per step (default 128 beside decodes, "
                        f"{IDLE_CHUNK} when nothing decodes; a value given applies to both)")
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="cap on tokens generated per request (default -1: the context)")
    add_kv_args(p)
    p.add_argument("--no-fuse", action="store_true", help="run the unfused graph")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown (default 30)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.add_argument("--embeddings", action="store_true",
                   help="serve /v1/embeddings from a generative model too (an embedding "
                        "model serves them without it)")
    p.add_argument("--pooling", choices=POOLING_TYPES, default=None,
                   help="embeddings' pooling (default: the model file's; a generative "
                        "model's last token)")
    p.add_argument("--embd-normalize", type=int, default=2, metavar="N",
                   help="pooled embeddings' norm when a request names none: -1 none, 0 max-abs "
                        "(int16), 1 taxicab, 2 euclidean (default), p > 2 p-norm")
    p.add_argument("--reranking", "--rerank", action="store_true",
                   help="serve /v1/rerank (rank pooling: a cross-encoder's classifier head)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let a browser page from ORIGIN call the API (repeatable; * for any; "
                        "default: none)")
    ray = p.add_argument_group("replicas on Ray Serve (needs minfer[ray])")
    ray.add_argument("--ray", action="store_true",
                     help="serve replicas of the engine as a Ray Serve deployment")
    ray.add_argument("--replicas", type=int, default=None, help="engine replicas (default 1)")
    ray.add_argument("--autoscale", metavar="MIN:MAX", default=None,
                     help="autoscale between MIN and MAX replicas instead of --replicas")
    ray.add_argument("--address", default=None,
                     help="Ray cluster to join (ray://HOST:PORT or auto; default: start a "
                          "local one)")
    add_speculative_args(p)  # per slot here
    add_reasoning_args(p, show=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from minfer.engine.config import EngineConfig
    from minfer.server.state import ServerConfig

    if args.embd_normalize < -1:
        raise MinferError("--embd-normalize must be -1 or more")
    if args.reranking and args.pooling not in (None, "rank"):
        raise MinferError("--reranking is rank pooling; it cannot take --pooling "
                          f"{args.pooling}")
    primary, extra = served_models(args)
    for name in ("n_ctx", "slots", "chunk"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise MinferError(f"--{name.replace('_', '-')} must be positive")
    if args.queue < 0 or not 0 < args.port < 65536:
        raise MinferError("--queue must be >= 0 and --port in 1..65535")
    if not args.ray and (args.replicas is not None or args.autoscale or args.address):
        raise MinferError("--replicas, --autoscale and --address need --ray")
    engine = EngineConfig.build(n_ctx=args.n_ctx, k_type=kv_types(args)[0],
                                v_type=kv_types(args)[1], threads=args.threads,
                                fuse=not args.no_fuse,
                                state_checkpoints=max(0, args.state_checkpoints))
    config = ServerConfig(
        model_path=primary, engine=engine,  # bad values refused; auto: MTP where the file has it
        spec=spec_from_args(args, has_mtp=file_has_mtp(primary)),
        extra_models=tuple(extra), keep_alive=args.keep_alive, models_max=args.models_max,
        strict_model_names=args.strict_model_names,
        slots=args.slots, queue=args.queue, api_key=args.api_key or None,
        **({} if args.chunk is None else {"chunk": args.chunk, "idle_chunk": args.chunk}),
        n_predict=args.n_predict,
        reasoning=reasoning_from_args(args), cors_origins=tuple(args.cors_origin),
        embeddings=args.embeddings or args.reranking or args.pooling is not None,
        pooling="rank" if args.reranking else args.pooling,
        embd_normalize=args.embd_normalize,
        mmproj=None if args.mmproj is None else Path(args.mmproj),
        find_mmproj=not args.no_mmproj,
    )
    if not _is_loopback(args.host) and not config.api_key:
        print(f"minfer: warning: serving on {args.host} without --api-key", file=sys.stderr)
    if args.ray:
        return _serve_on_ray(args, config)
    return serve(config, host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                 verbose=args.verbose)


def served_models(args: argparse.Namespace) -> tuple[Path, list[Path]]:
    """The first model and the others: those named (positional, then each -m) and those in
    --models-dir; with none named, the default model and every other model in the cache."""
    from minfer.store.models import list_models, model_files
    from minfer.tools.fetch import resolve

    names = ([args.model] if args.model else []) + list(args.model_opt)
    paths = [resolve(n) for n in names]
    if args.models_dir:
        folder = Path(args.models_dir).expanduser()
        if not folder.is_dir():
            raise MinferError(f"--models-dir {folder} is not a folder")
        paths += model_files(folder)
    if not paths:
        paths = [resolve(None)] + [m.path for m in list_models() if m.error is None]
    if args.models_max < 1:
        raise MinferError("--models-max must be at least 1")
    unique = list(dict.fromkeys(p.resolve() for p in paths))
    return unique[0], unique[1:]


def _serve_on_ray(args: argparse.Namespace, config: ServerConfig) -> int:
    """The Ray path; ray is imported only here (an optional extra)."""
    from minfer.server.ray.deploy import RayOptions, parse_autoscale, serve_on_ray

    if args.replicas is not None and args.autoscale:
        raise MinferError("give --replicas or --autoscale, not both")
    if args.replicas is not None and args.replicas < 1:
        raise MinferError("--replicas must be positive")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise MinferError("--ray needs Ray Serve: pip install 'minfer[ray]'") from None
    autoscale = parse_autoscale(args.autoscale) if args.autoscale else None
    opts = RayOptions(replicas=args.replicas or 1, autoscale=autoscale)
    return serve_on_ray(config, opts, host=args.host, port=args.port, address=args.address)


def serve(config: ServerConfig, *, host: str, port: int, drain_timeout: float = 30.0,
          verbose: bool = False) -> int:
    import uvicorn

    from minfer.server.app import create_app
    from minfer.server.state import ServerState

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    state = ServerState(config)
    app = create_app(state)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="info" if verbose
                               else "warning", access_log=verbose, lifespan="on",
                               timeout_graceful_shutdown=round(drain_timeout) + 5)
    server = _make_server(uv_config, state, drain_timeout)
    sock = _listen(host, port)
    threading.Thread(target=_exit_on_load_error, args=(state, server), daemon=True).start()
    print(f"minfer: serving on http://{host}:{port} ({_capacity(config)}); loading "
          f"{config.model_path.name}...", file=sys.stderr, flush=True)
    for line in served_lines(state):
        print(f"minfer:   {line}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if state.error:
        print(f"minfer: error: {state.error}", file=sys.stderr)
        return 1
    return 0


def served_lines(state: Any) -> list[str]:
    """One line per served model: its name, what it serves, and which requests it takes by
    default (unnamed ones, and on the generative routes unknown names unless strict)."""
    names = state.names()
    if len(names) == 1:
        return []
    defaults: dict[str, list[str]] = {}
    for purpose, what in (("generate", "chat / completions"), ("embed", "embeddings"),
                          ("rerank", "rerank")):
        name = state.default_name(purpose)
        if name is not None:
            defaults.setdefault(name, []).append(what)
    lines = []
    for name in names:
        role = state.facts(name).role
        what = {"generate": "generates", "embed": "embeds", "rerank": "reranks"}[role]
        tail = f"; default for {', '.join(defaults[name])}" if name in defaults else ""
        loaded = "" if name == names[0] else ", loaded on first use"
        lines.append(f"{name} ({what}{loaded}{tail})")
    return lines


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything says "serving": a port in use is one line
    and a non-zero exit, not a traceback after the banner."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = " (another server there? pick another --port)" if \
            exc.errno == errno.EADDRINUSE else ""
        raise MinferError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    return sock


def _capacity(config: ServerConfig) -> str:
    """What the first model holds, as its load will size it: an encoder reads at most its
    trained context per input (all-MiniLM: 512), a generator has slots x n_ctx (capped)."""
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile

    try:
        with GGUFFile.open(config.model_path) as f:
            hp = HParams.from_gguf(f)
    except MinferError:  # the load says what is wrong with it
        return f"{config.slots} slots x {config.engine.n_ctx} tokens"
    if not hp.causal:
        return f"an encoder: up to {min(config.engine.n_ctx, hp.n_ctx_train)} tokens per input"
    return f"{config.slots} slots x {min(config.engine.n_ctx, hp.n_ctx_max)} tokens"


def _make_server(uv_config: Any, state: Any, drain_timeout: float) -> Any:
    """uvicorn's server, with signals that drain and then exit 0 (not re-raised afterwards).

    The first signal stops new work (uvicorn closes the socket, the state answers 503) and
    starts the drain clock; when it runs out, requests still in flight end with an error event
    (streams) or a 503, so their connections close cleanly. uvicorn's own graceful-shutdown
    timeout, a few seconds longer, is only the backstop."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not state.draining:
                state.draining = True
                timer = threading.Timer(max(0.0, drain_timeout), state.abort_all)
                timer.daemon = True
                timer.start()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    return DrainingServer(uv_config)


def _exit_on_load_error(state: Any, server: Any) -> None:
    state.start()
    while state.status == "loading":
        threading.Event().wait(0.1)
    if state.error:
        server.should_exit = True
    else:
        lm = state.loaded()[0] if state.loaded() else None
        what = ""
        if lm is not None and lm.embed is not None and lm.embed.embedder is not None:
            route = "/v1/rerank" if lm.embed.embedder.pooling == "rank" else "/v1/embeddings"
            what = f" (an embedding model: {route})" if lm.worker is None \
                else f" (generation, and embeddings on {route})"
        print(f"minfer: model loaded, ready{what}", file=sys.stderr, flush=True)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False
