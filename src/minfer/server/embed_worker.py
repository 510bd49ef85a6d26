"""The embedding thread: the only code that touches an embedding Engine; requests batched.

Requests (`embed`: checked inputs and a norm) queue; the thread takes every request waiting
when it wakes and runs their inputs together, packed into forwards (`engine.embed.Embedder`),
so concurrent clients share forwards as generation requests share decode steps. The engine is
batch-invariant, so an input's vector does not depend on what it was packed with. Pooled
vectors are normalised per request (its `norm`); the result comes back on an asyncio future.

The engine is made on this thread (numba's thread count is per thread), from a factory the
server passes (tests pass fakes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minfer.engine.embed import Embedder, Encoded, normalize
from minfer.engine.warmup import announce_cold_start, engine_marker_or_none, mark_warm

log = logging.getLogger("minfer.server")

EmbedderFactory = Callable[[], Embedder]


@dataclass
class _Job:
    inputs: list[Encoded]
    norm: int
    future: concurrent.futures.Future[list[np.ndarray]] = field(
        default_factory=concurrent.futures.Future)


class EmbedWorker:
    def __init__(self, make: EmbedderFactory, *, max_waiting: int = 64) -> None:
        self._make = make
        self._jobs: list[_Job] = []
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self.max_waiting = max_waiting
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.embedder: Embedder | None = None
        self._cold: Path | None = None  # the kernels' marker, until a first batch compiled them
        self._thread = threading.Thread(target=self._main, name="minfer-embed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            jobs, self._jobs = self._jobs, []
            self._cond.notify_all()
        for job in jobs:
            job.future.set_exception(RuntimeError("the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def busy(self) -> bool:
        with self._cond:
            return self._busy or bool(self._jobs)

    async def embed(self, inputs: list[Encoded], norm: int) -> list[np.ndarray]:
        """The inputs' vectors (pooled ones normalised with `norm`), computed on the thread."""
        job = _Job(inputs, norm)
        with self._cond:
            if self._stop:
                raise RuntimeError("the server is shutting down")
            if len(self._jobs) >= self.max_waiting:
                raise QueueFull(f"{len(self._jobs)} embedding requests are waiting")
            self._jobs.append(job)
            self._cond.notify()
        return await asyncio.wrap_future(job.future)

    def _main(self) -> None:
        try:
            self.embedder = self._make()
        except BaseException as exc:  # reported by the loader
            self.error = exc
            self.ready.set()
            return
        marker = engine_marker_or_none(self.embedder.engine)  # an encoder compiles as it first runs
        self._cold = marker if announce_cold_start(marker, log.info) else None
        self.ready.set()
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                jobs, self._jobs = self._jobs, []
                self._busy = True
            try:
                self._run(jobs)
            finally:
                with self._cond:
                    self._busy = False

    def _run(self, jobs: list[_Job]) -> None:
        embedder = self.embedder
        assert embedder is not None
        t0 = time.perf_counter()
        try:
            vectors = embedder.run([enc for job in jobs for enc in job.inputs], norm=-1)
        except Exception as exc:
            log.exception("embedding failed")
            for job in jobs:
                job.future.set_exception(exc)
            return
        if self._cold is not None:
            mark_warm(self._cold)
            self._cold = None
        pooled = embedder.pooling not in ("none", "rank")
        start = 0
        for job in jobs:
            mine = vectors[start:start + len(job.inputs)]
            start += len(job.inputs)
            job.future.set_result([normalize(v, job.norm) for v in mine] if pooled else mine)
        log.debug("embedded %d inputs in %.1f ms", start, (time.perf_counter() - t0) * 1e3)


class QueueFull(Exception):
    pass
