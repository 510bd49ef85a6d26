"""The first run's kernel compilation: made visible, split across two processes, remembered.

numba compiles each CPU kernel the first time it runs and caches the machine code on disk
(`minfer.jit_cache`). On a fresh machine that is ~30 s of work before the first token, which a
person at a terminal must see happening. `warm_up` does that work up front, as a list of items
with a known length: one graph node per distinct kernel (op, weight types, activation form) of
the graphs the session will run first. Each item runs on placeholder inputs (`Engine.
execute_nodes`), which compiles its kernels or loads them from the cache.

Where two or more cores are free, a helper process takes items from the end of the list while
this process takes them from the front; what the helper compiles lands in the shared disk cache
and loads here in milliseconds when the real forward first calls it (compiling holds numba's
global lock, so threads could not share the work). Measured on 2 cores (Intel Xeon SPR, the
development model): a cold `minfer run "Say hi"` took 45 s before this module, 22-28 s with it
(per-type dequantizers and lighter repack compiles included).

A marker file per (kernel sources, CPU target, model tensor types, engine settings) records a
completed warm-up, so later runs skip the planning, print nothing, and start at once.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from minfer import jit_cache
from minfer.graph import ir
from minfer.graph.fusion import live_nodes
from minfer.graph.params import GraphParams

# item states in the array shared with the helper
_FREE, _TAKEN, _DONE = 0, 1, 2


class Progress(Protocol):
    """What `warm_up` tells the person waiting."""

    def start(self, total: int) -> None: ...

    def advance(self, done: int, label: str) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class Item:
    params: GraphParams
    node_id: int
    label: str  # e.g. "matmul q5_0", shown while it compiles


def marker_path(gguf_file: Any, *, kv_type: str, batch_invariant: bool) -> Path:
    """The file whose presence says the kernels for this model's tensor types (and this KV
    type and batch mode) were compiled and cached for this CPU target, by this installed copy
    of the package (`jit_cache.install_stamp`)."""
    import llvmlite.binding as llvm
    from numba.core import config

    from minfer.jit_cache import install_stamp

    types = sorted({int(t.ggml_type) for t in gguf_file.tensors.values()})
    key = repr((llvm.get_host_cpu_name(), getattr(config, "CPU_NAME", None),
                getattr(config, "CPU_FEATURES", None), types, kv_type, batch_invariant,
                install_stamp()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(config.CACHE_DIR) / f"warm-{digest}"  # type: ignore[attr-defined]


def engine_marker(engine: Any) -> Path:
    """`marker_path` for an engine's model, KV type and batch mode."""
    return marker_path(engine.weights.file, kv_type=engine.ctx_params.kv_type,
                       batch_invariant=engine.batch_invariant)


def engine_marker_or_none(engine: Any) -> Path | None:
    """`engine_marker`, or None for an engine that reads no model file (the server's tests
    run stand-ins that compile nothing)."""
    return engine_marker(engine) if hasattr(engine, "weights") else None


COLD_START = ("first run on this machine: compiling the CPU kernels for it (cached for later "
              "runs, usually under 30 s)…")


def announce_cold_start(marker: Path | None, say: Callable[[str], None] | None = None) -> bool:
    """The one first-use notice of every surface (run, chat, embed, bench, perplexity; serve
    says it in its log): when the kernels behind `marker` are not compiled yet, say so
    (default: a `minfer:` line on stderr) and return True. `mark_warm(marker)` once they are,
    where `warm_up` did not compile them (an encoder's, the server's first batches)."""
    if marker is None or marker.exists():
        return False
    (say or (lambda text: print(f"minfer: {text}", file=sys.stderr, flush=True)))(COLD_START)
    return True


def mark_warm(marker: Path) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def plan(engine: Any, shapes: Sequence[tuple[int, int]]) -> list[Item]:
    """One item per distinct CPU kernel the graphs for `shapes` ((n_tokens, n_out) each) run."""
    items: list[Item] = []
    seen: set[tuple[Any, ...]] = set()
    tensors = engine.weights.file.tensors
    for n_tokens, n_out in shapes:
        params = engine.params_for(n_tokens, n_out)
        graph = engine.cache.get(params).graph
        live = live_nodes(graph)
        for node in graph.nodes:
            if not live[node.id] or node.backend != "cpu" or isinstance(
                    node.op, ir.Input | ir.KvcacheLoad | ir.Written):
                continue
            types = tuple(int(tensors[w].ggml_type) for w in node.meta.weights)
            # per shape: a kernel variant may depend on the row count (sgemm, blocked
            # attention); an item a previous shape already compiled costs nothing
            key = (params, node.op.kind, types)
            if key in seen:
                continue
            seen.add(key)
            items.append(Item(params, node.id, _label(node.op.kind, types)))
    return items


def _label(kind: str, types: tuple[int, ...]) -> str:
    from minfer.gguf.constants import GGMLQuantizationType

    names = [GGMLQuantizationType(t).name.lower() for t in types]
    return " ".join([kind, *names])


def default_shapes(n_prompt: int | None, batch_size: int) -> list[tuple[int, int]]:
    """The graphs a session runs first: its first prompt's (or every prefill kernel variant:
    a short and a long batch) and a decode step."""
    if n_prompt is not None:
        first = max(1, min(n_prompt, batch_size))
        return [(first, 1)] + ([(1, 1)] if first != 1 else [])
    return [(2, 1), (min(32, batch_size), 1), (1, 1)]


def warm_up(engine: Any, shapes: Sequence[tuple[int, int]], *, progress: Progress | None = None,
            helper: Callable[[list[Item], Any], Any] | None = None) -> bool:
    """Compile (or load) every kernel the graphs for `shapes` need; False if already warm.

    `helper(items, states)` starts the second process (see `helper_for`) and returns it, or
    None."""
    marker = engine_marker(engine)
    if marker.exists():
        return False
    items = plan(engine, shapes)
    if progress:
        progress.start(len(items))
    states = mp.get_context("spawn").Array("b", len(items))
    proc = helper(items, states) if helper else None
    done = 0
    for i, item in enumerate(items):
        if not _claim(states, i):
            continue
        if progress:
            progress.advance(done, item.label)
        engine.execute_nodes(item.params, [item.node_id])
        states[i] = _DONE
        done = _count_done(states)
    while proc is not None and proc.is_alive():  # the helper's last items
        proc.join(0.1)
        if progress:
            progress.advance(_count_done(states), "(helper process)")
    for i, item in enumerate(items):  # whatever a failed helper left undone
        if states[i] != _DONE:
            engine.execute_nodes(item.params, [item.node_id])
    if progress:
        progress.advance(len(items), "done")
        progress.finish()
    mark_warm(marker)
    jit_cache.prune_other_versions()  # a new version's first run: what older ones left
    return True


def spare_cores(samples: int = 5) -> int:
    """Cores this process may use that no other process is running on right now: the CPU
    affinity minus the fewest other runnable tasks seen in a few samples of /proc/stat
    (the load average lags by minutes)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    others = n
    for i in range(samples):
        try:
            with open("/proc/stat", encoding="ascii") as f:
                running = next(int(ln.split()[1]) for ln in f if ln.startswith("procs_running"))
        except (OSError, StopIteration, ValueError):
            return n
        others = min(others, running - 1)  # minus this process
        if i + 1 < samples:
            time.sleep(0.01)
    return max(0, n - others)


def helper_for(engine: Any, min_spare: int = 2) -> Callable[[list[Item], Any], Any]:
    """A `helper` for `warm_up` that reopens the engine's model in a spawned process (when
    `min_spare` cores are free), with the same context but CPU kernels only, and works through
    the items from the end."""
    options = {"config": replace(engine.config, n_threads=None, adaptive_threads=False)}
    path = str(engine.weights.file.path)

    def start(items: list[Item], states: Any) -> Any:
        if spare_cores() < min_spare:
            return None
        proc = mp.get_context("spawn").Process(
            target=_helper_main, args=(path, options, items, states), daemon=True)
        proc.start()
        return proc

    return start


def _helper_main(path: str, engine_options: dict[str, Any], items: list[Item],
                 states: Any) -> None:
    import numba

    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile

    numba.set_num_threads(1)
    f = GGUFFile.open(path)
    engine = Engine(f, HParams.from_gguf(f), **engine_options)
    for i in reversed(range(len(items))):
        if not _claim(states, i):
            continue
        engine.execute_nodes(items[i].params, [items[i].node_id])
        states[i] = _DONE


class TerminalProgress:
    """A progress bar on stderr (rich) when it is a terminal; otherwise one line, no bar."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Any = None
        self._task: Any = None
        self._t0 = time.perf_counter()

    def announce(self) -> None:
        """The first words, as soon as a cold start is known (before the model loads)."""
        print(f"minfer: {COLD_START}", file=self.stream, flush=True)

    def start(self, total: int) -> None:
        if not self.tty:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(TextColumn("compiling kernels"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TextColumn("{task.description}"),
                             console=Console(file=self.stream), transient=True)
        self._bar.start()
        self._task = self._bar.add_task("", total=total)

    def advance(self, done: int, label: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=label)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            print(f"minfer: kernels compiled in {time.perf_counter() - self._t0:.0f} s",
                  file=self.stream, flush=True)


def _claim(states: Any, i: int) -> bool:
    """Take item i for this process, unless the other one has."""
    with states.get_lock():
        if states[i] != _FREE:
            return False
        states[i] = _TAKEN
        return True


def _count_done(states: Any) -> int:
    return sum(states[i] == _DONE for i in range(len(states)))
