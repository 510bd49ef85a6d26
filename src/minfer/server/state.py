"""Server settings and the loaded model, which appears in the background after the socket is up.

`ServerState.start()` spawns a loader thread: assemble the model (`minfer.engine.assembly`: the
GGUF, tokenizer, chat template, draft), then start the engine thread, which creates the Engine
with n_ctx = slots × n_ctx_slot and reports ready.
Until then `/health` answers 503 `loading`; routes that need the model answer 503 with
`Retry-After`. A load failure is kept and reported (`/health` → 503 `error`), and `minfer serve`
exits with it. A draft model (`-md`) is opened and its vocabulary checked against the target's
before the engine thread starts, so a mismatch is such a load failure.

More models (`extra_models`) load on their first request (`acquire`, by the name a request
gives) while the others keep serving, each with its own engine thread; one idle past its
keep_alive, or the least recently used idle one beyond `models_max`, is unloaded (`reap`, on a
background thread). The model the server started with stays loaded.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from minfer.chat.reasoning import ReasoningOptions
from minfer.engine.assembly import Assembly, ModelConfig
from minfer.engine.config import EngineConfig
from minfer.engine.core.scheduler import IDLE_CHUNK
from minfer.engine.speculative import SpecConfig
from minfer.errors import MinferError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.sampling.grammar import GrammarVocab
from minfer.server.embed_worker import EmbedWorker
from minfer.server.errors import APIError, unavailable
from minfer.server.metrics import Metrics
from minfer.server.prepare import ImageReader, Limits, TemplateLike, TokenizerLike
from minfer.server.responses.store import ResponseStore
from minfer.server.worker import EngineFactory, Worker
from minfer.store.models import model_quantization
from minfer.tokenizer.tokenizer import Tokenizer

REAP_INTERVAL_S = 0.5
log = logging.getLogger("minfer.server")


@dataclass
class ServerConfig:
    """The server's settings: the engines' (`engine`, its n_ctx per slot) and speculation's
    (`spec`, per slot; None: off), then the server's own."""

    model_path: Path
    engine: EngineConfig = field(default_factory=EngineConfig.build)
    spec: SpecConfig | None = None
    slots: int = 4
    queue: int = 64
    api_key: str | None = None
    chunk: int = 128  # prompt tokens per step
    idle_chunk: int = IDLE_CHUNK  # ... per step in which nothing decodes
    n_predict: int = -1  # cap on max_tokens; -1 = the context
    max_body_bytes: int = 16 << 20
    # (a draft's k, or a plain step, comes from measured costs unless spec.adaptive is off; the
    # batch's own caps still apply beside other streams: `EngineCore._asks`)
    reasoning: ReasoningOptions = field(default_factory=ReasoningOptions)  # chat requests' default
    # more models, each loaded on its first request (model_path stays loaded)
    extra_models: tuple[Path, ...] = ()
    keep_alive: float = 300.0  # idle seconds before an extra model unloads; < 0: never
    models_max: int = 3  # models loaded at once (the least recently used idle one unloads)
    # a name no served model has is a 404 (False: the first model takes it, as llama-server)
    strict_model_names: bool = False
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (none: no CORS)
    # embeddings from a generative model too (`--embeddings`); an encoder serves them always
    embeddings: bool = False
    pooling: str | None = None  # None: the model file's (a generative model: its last token)
    embd_normalize: int = 2  # pooled vectors' norm when a request names none (llama.cpp's)
    mmproj: Path | None = None  # the first model's vision encoder (None: one found beside it)
    find_mmproj: bool = True  # look for one beside each model (--no-mmproj: off)

    def model(self, *, primary: bool = True) -> ModelConfig:
        """A served model's configuration: batch-invariant engines on the CPU backend (a
        greedy request's ids do not depend on its neighbours or on prompt-cache hits). The
        model the server started with speculates as `spec` says; another model has no draft
        (prompt lookup alone when that is all `spec` asks, else nothing; nor the MTP head)."""
        spec = self.spec
        if not primary and spec is not None and (spec.draft_model is not None or spec.mtp):
            spec = None
        return ModelConfig(replace(self.engine, batch_invariant=True), spec, backend="cpu",
                           batch_size=self.chunk, mmproj=self.mmproj if primary else None,
                           find_mmproj=self.find_mmproj)


@dataclass(frozen=True)
class ModelFacts:
    """What the listing routes say of the loaded model (`/v1/models`, Ollama's tags and show)."""

    architecture: str
    quantization: str
    size: int  # bytes on disk
    n_params: int
    modified: float  # the file's mtime
    metadata: dict[str, Any]  # scalar metadata keys (no token arrays)
    role: str = "generate"  # what it serves without flags: generate, embed (an encoder), rerank

    @classmethod
    def of(cls, f: GGUFFile, path: Path) -> ModelFacts:
        scalars = {k: v for k, v in f.metadata.items() if isinstance(v, str | int | float | bool)}
        n_params = sum(math.prod(t.shape) for t in f.tensors.values())
        return cls(f.architecture or "?", model_quantization(f), f.file_size, n_params,
                   path.stat().st_mtime, scalars, _role(f))


def _role(f: GGUFFile) -> str:
    """What a model file serves by itself: a reranker scores pairs (rank pooling with a
    classifier head, or a cross-encoder), an encoder embeds, a decoder generates; a file whose
    parameters this build cannot read is taken as a decoder (its load then says why)."""
    try:
        hp = HParams.from_gguf(f)
    except MinferError:
        return "generate"
    if hp.reranker or (not hp.causal and hp.pooling == "rank"):
        return "rerank"
    return "generate" if hp.causal else "embed"


@dataclass
class LoadedModel:
    name: str
    tokenizer: TokenizerLike
    template: TemplateLike
    limits: Limits
    worker: Worker | None  # None: an embedding model, which generates nothing
    grammar_vocab: GrammarVocab | None = None  # for structured output; built once at load
    reasoning: ReasoningOptions = field(default_factory=ReasoningOptions)
    facts: ModelFacts | None = None
    embed: EmbedWorker | None = None  # served for embeddings (an encoder, or `--embeddings`)
    vision: ImageReader | None = None  # the image encoder (an mmproj file), None: text only

    @property
    def generator(self) -> Worker:
        """The engine thread that generates; a 400 for an embedding model."""
        if self.worker is None:
            raise APIError(400, f"model '{self.name}' is an embedding model: it does not "
                           "generate text (use /v1/embeddings or /v1/rerank)",
                           code="model_not_generative")
        return self.worker

    def embedder(self, *, rerank: bool = False) -> EmbedWorker:
        """The embedding thread; a 400 naming the flag when the model is not served so (or,
        for `rerank`, does not pool for ranking)."""
        if self.embed is None:
            raise APIError(400, f"model '{self.name}' is not served for embeddings: start the "
                           "server with --embeddings (and --pooling)", code="embeddings_off")
        embedder = self.embed.embedder
        if embedder is not None and rerank and embedder.pooling != "rank":
            raise APIError(400, f"model '{self.name}' is not a reranker (it pools "
                           f"'{embedder.pooling}'; reranking needs rank pooling and a "
                           "classifier head: --pooling rank / --reranking)",
                           code="rerank_unsupported")
        if embedder is not None and not rerank and embedder.pooling == "rank":
            raise APIError(400, f"model '{self.name}' is a reranker: use /v1/rerank",
                           code="embeddings_unsupported")
        return self.embed

    def workers(self) -> list[Worker | EmbedWorker]:
        return [w for w in (self.worker, self.embed) if w is not None]

    def stop(self, timeout: float = 5.0) -> None:
        """Stop its engine threads (generation and embeddings)."""
        for w in self.workers():
            w.stop(timeout)


def model_name(path: Path) -> str:
    """The name /v1/models lists: the cache name (a cached model's file is <name>.gguf)."""
    return path.name.removesuffix(".gguf")


def _grammar_vocab(tokenizer: Tokenizer, n_vocab: int) -> GrammarVocab | None:
    """The vocabulary view every grammar-constrained request shares (≈0.6 s for 150k tokens);
    None (such requests are refused) when the vocabulary has no end-of-generation token."""
    t0 = time.perf_counter()
    try:
        vocab = GrammarVocab.from_tokenizer(tokenizer, n_vocab)
    except MinferError as exc:
        log.warning("structured output is off: %s", exc)
        return None
    log.info("grammar vocabulary ready in %.2f s", time.perf_counter() - t0)
    return vocab


@dataclass
class Entry:
    """A model the server can serve: loaded (`lm`), loading (`ready` not set) or on disk."""

    name: str
    path: Path
    lm: LoadedModel | None = None
    ready: threading.Event | None = None  # set when a load (started at first use) ended
    error: str | None = None
    last_used: float = 0.0  # time.monotonic() of the last request (or busy check)
    keep_alive: float = 0.0  # idle seconds before it unloads (< 0: never)


class ServerState:
    def __init__(self, config: ServerConfig, *, engine_factory: EngineFactory | None = None,
                 draft_engine_factory: EngineFactory | None = None,
                 metrics: Metrics | None = None) -> None:
        """engine_factory / draft_engine_factory: engines for the model and the draft model
        (tests pass fakes); by default, Engines over their files (`Assembly.engine`)."""
        self.config = config
        self.metrics = metrics or Metrics()
        self.responses = ResponseStore()  # the Responses API's stored responses
        self._engine_factory = engine_factory
        self._draft_engine_factory = draft_engine_factory
        self._model: LoadedModel | None = None
        self._started = False
        self._lock = threading.Lock()
        self.error: str | None = None
        self.draining = False
        primary = model_name(config.model_path)
        self.extra: dict[str, Entry] = {}  # the other models, by name
        for path in config.extra_models:
            name = model_name(path)
            if name != primary and name not in self.extra:
                self.extra[name] = Entry(name, path, keep_alive=config.keep_alive)
        self._facts: dict[str, ModelFacts] = {}
        self._stopped = threading.Event()
        self._register_gauges()

    @property
    def status(self) -> str:
        if self.error is not None:
            return "error"
        if self._model is None:
            return "loading"
        if any(w.error is not None for w in self._model.workers()):  # an engine thread died
            return "error"
        return "draining" if self.draining else "ok"

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._load, name="minfer-loader", daemon=True).start()
        if self.extra:
            threading.Thread(target=self._reaper, name="minfer-reaper", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.status == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.status == "ok"

    def model(self) -> LoadedModel:
        """The loaded model, or a 503 while it loads (or after it failed)."""
        if self._model is None:
            what = "failed to load" if self.error else "is loading"
            raise unavailable(f"the model {what}", retry_after=2, code="model_not_ready")
        if self.draining:
            raise unavailable("the server is shutting down", code="shutting_down")
        return self._model

    # -- several models ------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every model this server serves, the one it started with first."""
        return [model_name(self.config.model_path), *self.extra]

    def resolve(self, name: str | None, purpose: str = "generate") -> str:
        """The served model a request's name means (with or without `:latest`).

        A served name means that model. No name, or a name no served model has (OpenAI's and
        Anthropic's clients send their own, llama-server ignores it), means the first model for
        generation, and for `purpose` "embed" / "rerank" the first served model that does that
        by itself when the first one does not (an encoder served beside a coder takes unnamed
        /v1/embeddings). With `strict_model_names`, an unknown name is a 404 listing the models."""
        names = self.names()
        bare = (name or "").removesuffix(":latest")
        if bare in names:
            return bare
        if name and self.config.strict_model_names and len(names) > 1:
            raise APIError(404, f"model '{name}' is not served here (models: "
                           f"{', '.join(names)})", code="model_not_found")
        if not self._serves(names[0], purpose):
            for other in names[1:]:
                if self._serves(other, purpose):
                    return other
        return names[0]

    def _serves(self, name: str, purpose: str) -> bool:
        """Whether a served model answers `purpose` (generate, embed, rerank) as configured."""
        try:
            role = self.facts(name).role
        except (OSError, MinferError):
            return purpose == "generate"  # its load will say what is wrong with it
        if purpose == "generate":
            return role == "generate"
        if purpose == "rerank":
            return role == "rerank" or (self.config.pooling == "rank" and role == "generate")
        return role == "embed" or (self.config.embeddings and role == "generate"
                                   and self.config.pooling != "rank")

    def default_name(self, purpose: str) -> str | None:
        """The model unnamed requests of `purpose` (generate, embed, rerank) go to; None when
        no served model does that."""
        name = self.resolve(None, purpose)
        return name if self._serves(name, purpose) else None

    async def acquire(self, name: str | None, *, keep_alive: float | None = None,
                      purpose: str = "generate") -> LoadedModel:
        """The model a request names (`resolve`: purpose generate, embed or rerank), loading
        it first when it is not (other models keep serving meanwhile); keep_alive: this
        request's idle time before it unloads."""
        key = self.resolve(name, purpose)
        entry = self.extra.get(key)
        if entry is None:
            return self.model()
        if self.draining:
            raise unavailable("the server is shutting down", code="shutting_down")
        with self._lock:
            entry.last_used = time.monotonic()
            if keep_alive is not None:
                entry.keep_alive = keep_alive
            if entry.lm is None and (entry.ready is None or entry.ready.is_set()):
                entry.ready, entry.error = threading.Event(), None
                threading.Thread(target=self._load_extra, args=(entry,), daemon=True,
                                 name=f"minfer-loader-{key}").start()
            ready = entry.ready
        if entry.lm is None and ready is not None:
            await run_in_threadpool(ready.wait)
        if entry.lm is None:
            raise unavailable(f"the model {key} failed to load: {entry.error}", retry_after=5,
                              code="model_not_ready")
        entry.last_used = time.monotonic()
        return entry.lm

    def add_model(self, path: Path) -> str:
        """Serve one more model (e.g. just pulled); its name."""
        name = model_name(path)
        with self._lock:
            if name != self.names()[0] and name not in self.extra:
                self.extra[name] = Entry(name, path, keep_alive=self.config.keep_alive)
                if self._started and len(self.extra) == 1:
                    threading.Thread(target=self._reaper, name="minfer-reaper",
                                     daemon=True).start()
        return name

    def remove_model(self, name: str) -> Path:
        """Stop serving a model other than the first (unloading it); its file."""
        if name == self.names()[0]:
            raise APIError(400, f"{name} is the model this server started with; it cannot be "
                           "removed while serving", param="model")
        with self._lock:
            entry = self.extra.pop(name, None)
        if entry is None:
            raise APIError(404, f"model '{name}' not found", code="model_not_found")
        if entry.lm is not None:
            entry.lm.stop()
            entry.lm = None
            gc.collect()  # its engine's arrays, held in reference cycles
        self._facts.pop(name, None)
        return entry.path

    def loaded(self) -> list[LoadedModel]:
        """The models in memory now, the one the server started with first."""
        extra = [e.lm for e in self.extra.values() if e.lm is not None]
        return ([self._model] if self._model is not None else []) + extra

    def path_of(self, name: str) -> Path:
        """The file of a served model (by its listed name)."""
        return self.extra[name].path if name in self.extra else self.config.model_path

    def facts(self, name: str) -> ModelFacts:
        """A served model's facts, loaded or not (read from its file once)."""
        for lm in self.loaded():
            if lm.name == name and lm.facts is not None:
                return lm.facts
        if name not in self._facts:
            path = self.path_of(name)
            with GGUFFile.open(path) as f:
                self._facts[name] = ModelFacts.of(f, path)
        return self._facts[name]

    def expiry(self, name: str) -> float | None:
        """Seconds until a loaded extra model unloads when idle (None: it stays)."""
        entry = self.extra.get(name)
        if entry is None or entry.keep_alive < 0:
            return None
        return max(0.0, entry.last_used + entry.keep_alive - time.monotonic())

    def reap(self) -> list[str]:
        """Unload the extra models idle past their keep_alive, and the least recently used idle
        ones beyond models_max; the names unloaded."""
        now = time.monotonic()
        out = []
        with self._lock:
            live = [e for e in self.extra.values() if e.lm is not None]
            for e in live:
                if e.lm is not None and any(w.busy() for w in e.lm.workers()):
                    e.last_used = now
            idle = sorted((e for e in live if now - e.last_used >= 1.0), key=lambda e: e.last_used)
            over = len(self.loaded()) - max(1, self.config.models_max)
            for e in idle:
                if over > 0 or (e.keep_alive >= 0 and now - e.last_used >= e.keep_alive):
                    over -= 1
                    out.append(e)
            for e in out:
                lm, e.lm, e.ready = e.lm, None, None
                assert lm is not None
                lm.stop()
                log.info("unloaded %s (idle)", e.name)
        if out:  # an engine's arrays sit in reference cycles: give them back now, not whenever
            del lm  # the collector next runs in an idle server (nothing here holds the last one)
            gc.collect()
        return [e.name for e in out]

    def _load_extra(self, entry: Entry) -> None:
        try:
            entry.lm = self._open(entry.path, primary=False)
            entry.last_used = time.monotonic()  # its idle time starts now, not at the request
        except Exception as exc:
            log.exception("loading %s failed", entry.name)
            entry.error = f"{type(exc).__name__}: {exc}"
        finally:
            assert entry.ready is not None
            entry.ready.set()
        self.reap()  # over models_max now: the least recently used idle model goes

    def _reaper(self) -> None:
        while not self._stopped.wait(REAP_INTERVAL_S):
            try:
                self.reap()
            except Exception:  # never let the reaper die: the next tick tries again
                log.exception("unloading idle models failed")

    def abort_all(self) -> None:
        """Cut whatever is still in flight (end of the drain period)."""
        for lm in self.loaded():
            if lm.worker is not None:
                lm.worker.abort_all("the server is shutting down")

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        for lm in self.loaded():
            lm.stop(timeout)

    def _load(self) -> None:
        try:
            self._model = self._open()
        except MinferError as exc:  # what the user can act on: the message alone
            log.error("loading the model failed: %s", exc)
            self.error = str(exc)
        except Exception as exc:  # reported by /health and by `minfer serve`
            log.exception("loading the model failed")
            self.error = f"{type(exc).__name__}: {exc}"

    def _open(self, path: Path | None = None, *, primary: bool = True) -> LoadedModel:
        """Load a model: the one the server started with (its draft model too), or another
        one (same settings, no draft). An encoder or a reranker (Qwen3-Reranker: a decoder
        with rank pooling) is served for embeddings / reranking only; a generative model also
        for embeddings with `embeddings` on. The engines are made on their own threads."""
        cfg = self.config
        path = path or cfg.model_path
        parts = Assembly(path, cfg.model(primary=primary))
        hparams = parts.hparams
        tokenizer = parts.tokenizer
        tokenizer.prepare()  # long prompts come: the BPE library model is built before serving
        template = parts.chat_template
        if primary:  # serve --reasoning on a model that cannot think: refused at start
            cfg.reasoning.check_model(template.source, template.variables)
        n_ctx_slot = hparams.fit_n_ctx(cfg.engine.n_ctx, "--n-ctx")
        embed = None
        generative = hparams.causal and not hparams.reranker  # a reranker only scores pairs
        if not generative or cfg.embeddings:
            embed = EmbedWorker(lambda: parts.embedder(cfg.pooling), max_waiting=cfg.queue)
            embed.start()
        worker = None
        grammar_vocab = None
        if generative:
            draft = parts.draft()
            worker = Worker(self._engine_factory or parts.engine, tokenizer, n_slots=cfg.slots,
                            n_ctx_slot=n_ctx_slot, chunk=cfg.chunk, idle_chunk=cfg.idle_chunk,
                            max_waiting=cfg.queue, metrics=self.metrics,
                            speculation=parts.config.spec, make_draft=None if draft is None
                            else self._draft_engine_factory or draft.engine,
                            mtp=parts.mtp_proposer())
            worker.start()
            grammar_vocab = _grammar_vocab(tokenizer, hparams.n_vocab)  # while the engine warms
            worker.ready.wait()
            if worker.error is not None:
                raise worker.error
        if embed is not None:
            embed.ready.wait()
            if embed.error is not None:
                if worker is not None:
                    worker.stop()
                raise embed.error
        return LoadedModel(model_name(path), tokenizer, template,
                           Limits(n_ctx_slot, cfg.n_predict), worker, grammar_vocab,
                           cfg.reasoning, ModelFacts.of(parts.file, path), embed,
                           parts.vision if generative else None)

    def _register_gauges(self) -> None:
        """Gauges summed over the loaded models."""
        m = self.metrics

        def total(of: Callable[[Any], int]) -> Callable[[], int]:
            return lambda: sum(of(lm.worker.scheduler) for lm in self.loaded()
                               if lm.worker is not None)

        m.gauge("minfer_queue_depth", "Requests waiting for a slot", total(lambda s: s.n_waiting))
        m.gauge("minfer_slots_busy", "Slots running a request", total(lambda s: s.n_busy))
        m.gauge("minfer_slots_total", "Slots", total(lambda s: len(s.slots)))
        m.gauge("minfer_kv_cells_used", "KV cells holding tokens (running and cached)",
                total(lambda s: s.kv_cells_used))
        m.gauge("minfer_kv_cells_total", "KV cells",
                total(lambda s: len(s.slots) * s.n_ctx_slot))
        m.gauge("minfer_models_loaded", "Models in memory", lambda: len(self.loaded()))
        m.gauge("minfer_graph_builds_total", "Forward graphs built (a batch shape not in the "
                "graph cache): each costs a build and a tape binding",
                lambda: sum(_graph_builds(lm) for lm in self.loaded()))
        m.gauge("minfer_image_chunks_encoded_total", "Vision tower runs: one per image chunk "
                "(a tile, an overview); an image the encoder's cache holds runs none",
                lambda: sum(int(getattr(lm.vision, "n_encoded", 0)) for lm in self.loaded()))


def _graph_builds(lm: LoadedModel) -> int:
    """The graphs a loaded model's engine has built (0 before its engine exists, or for an
    engine without a graph cache: a test's fake)."""
    engine = getattr(lm.worker.core.runner, "engine", None) if lm.worker is not None else None
    return int(getattr(getattr(engine, "cache", None), "rebuilds", 0))
