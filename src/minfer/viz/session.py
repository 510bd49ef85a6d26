"""What the viz page looks at: a live model with a traced engine, or a saved trace.

`VizSession` owns the model (None when a trace file was opened), one `StepTracer` attached to
the model's engine, and the graphs and steps of the latest run. It answers the app's questions
(a graph by kind or uid, a step's trace) and runs generations one at a time, turning the
engine's steps into the events the page streams: a `step` event per forward (top-5 candidates,
per-op time), a `token` event per generated piece, then `done`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minfer.engine.generate import Finished, Piece
from minfer.engine.trace import TRACE_VERSION, StepTracer, TracedStep
from minfer.errors import MinferError
from minfer.graph.view import describe
from minfer.sampling.params import SamplerParams

if TYPE_CHECKING:
    from minfer.api import Model
    from minfer.engine.forward import Engine

DEFAULT_PREFILL_TOKENS = 8  # the prefill graph shown before any prompt has run
KINDS = ("prefill", "decode")
STEP_KEYS = frozenset({"step", "kind", "graph", "n_tokens", "pos", "token_text", "top", "time_ms",
                       "nodes"})


class Busy(MinferError):
    """A generation is already running (one engine, one run at a time)."""


class NotFound(MinferError):
    pass


def op_times(times: Sequence[tuple[int, float]], op_of: Sequence[str]) -> dict[str, float]:
    """Milliseconds per op kind in one step, largest first (times: (node id, microseconds);
    op_of: each node's op kind)."""
    ops: dict[str, float] = {}
    for node_id, t_us in times:
        op = op_of[node_id]
        ops[op] = ops.get(op, 0.0) + t_us / 1e3
    return dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def load_trace(path: str | Path) -> dict[str, Any]:
    """A trace file written by MINFER_TRACE or the page, checked enough to be drawn."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise MinferError(f"cannot read trace {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("version") != TRACE_VERSION:
        raise MinferError(f"{path} is not a minfer trace (version {TRACE_VERSION})")
    graphs, steps = data.get("graphs"), data.get("steps")
    if not isinstance(graphs, dict) or not isinstance(steps, list):
        raise MinferError(f"{path}: a trace needs 'graphs' and 'steps'")
    for step in steps:
        if not isinstance(step, dict) or not step.keys() >= STEP_KEYS:
            raise MinferError(f"{path}: a step lacks one of {', '.join(sorted(STEP_KEYS))}")
        if str(step["graph"]) not in graphs:
            raise MinferError(f"{path}: a step refers to a graph the trace does not hold")
    return data


class VizSession:
    def __init__(self, model: Model | None = None, trace: dict[str, Any] | None = None,
                 *, max_steps: int = 1024) -> None:
        if (model is None) == (trace is None):
            raise MinferError("a viz session shows either a model or a trace")
        self.model = model
        self.tracer = StepTracer(token_text=model.token_piece if model else None,
                                 max_steps=max_steps)
        self._trace = trace
        self._lock = threading.Lock()
        self.diffs: dict[str, Any] | None = None

    @property
    def live(self) -> bool:
        return self.model is not None

    def info(self) -> dict[str, Any]:
        name = self.model.name if self.model else self._trace_meta().get("model", "trace")
        return {"model": name, "live": self.live, "steps": len(self.steps())}

    def _trace_meta(self) -> dict[str, Any]:
        meta = self._trace.get("meta", {}) if self._trace else {}
        return meta if isinstance(meta, dict) else {}

    def engine(self, n_prompt: int = 0) -> Engine:
        assert self.model is not None
        engine = self.model.engine(n_prompt)
        engine.tracer = self.tracer
        return engine

    # -- graphs and steps ------------------------------------------------------------------
    def graphs(self) -> dict[str, dict[str, Any]]:
        if self._trace is not None:
            graphs: dict[str, dict[str, Any]] = self._trace["graphs"]
            return graphs
        return self.tracer.graphs_json()

    def _records(self) -> list[TracedStep] | list[dict[str, Any]]:
        if self._trace is not None:
            steps: list[dict[str, Any]] = self._trace["steps"]
            return steps
        return self.tracer.steps

    def steps(self) -> list[dict[str, Any]]:
        """Each step's header (no per-node records)."""
        return [_header(s) for s in self._records()]

    def graph(self, kind: str | None = None, uid: int | None = None) -> dict[str, Any]:
        graphs = self.graphs()
        if uid is not None:
            if str(uid) not in graphs:
                raise NotFound(f"no graph with uid {uid}")
            return graphs[str(uid)]
        if kind not in KINDS:
            raise MinferError(f"kind must be one of {', '.join(KINDS)}")
        for step in reversed(self.steps()):  # the graph the latest run used
            if step["kind"] == kind:
                return graphs[str(step["graph"])]
        if not self.live:
            raise NotFound(f"the trace holds no {kind} step")
        return self._graph_before_any_run(kind)

    def _graph_before_any_run(self, kind: str) -> dict[str, Any]:
        engine = self.engine()
        n_tokens = DEFAULT_PREFILL_TOKENS if kind == "prefill" else 1
        prepared = engine.cache.get(engine.params_for(n_tokens, 1))
        types = {name: t.type_name for name, t in engine.weights.file.tensors.items()}
        return describe(prepared, types)

    def step(self, index: int) -> dict[str, Any]:
        for step in self._records():
            if _header(step)["step"] == index:
                return step.to_json() if isinstance(step, TracedStep) else step
        raise NotFound(f"no step {index} in the current trace")

    def trace_json(self) -> dict[str, Any]:
        if self._trace is not None:
            return self._trace
        meta = {"model": self.model.name if self.model else ""}
        return self.tracer.to_json(meta)

    # -- a live run ------------------------------------------------------------------------
    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        assert self.model is not None
        model = self.model
        text = model.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
        ids = model.tokenizer.encode(text)
        if not ids:
            raise MinferError("the prompt is empty")
        return ids

    def diff(self, prompt: str, *, max_tokens: int, chat: bool = True) -> dict[str, Any]:
        """The prompt on the CPU and torch backends, node by node (`minfer.viz.diff`)."""
        from minfer.viz.diff import diff_backends

        if self.model is None:
            raise MinferError("this page shows a saved trace; start `minfer viz MODEL` to diff")
        if not self._lock.acquire(blocking=False):
            raise Busy("a generation is already running")
        try:
            result = diff_backends(self.model, self.prompt_ids(prompt, chat),
                                   max_tokens=max_tokens)
        finally:
            self._lock.release()
        self.diffs = result
        return result

    def generate(self, prompt: str, *, max_tokens: int, temperature: float = 0.0,
                 chat: bool = True, seed: int | None = 0) -> Iterator[dict[str, Any]]:
        """Events of one traced generation (the run holds the session's lock while it streams)."""
        if self.model is None:
            raise MinferError("this page shows a saved trace; start `minfer viz MODEL` to run")
        if self._lock.locked():
            raise Busy("a generation is already running")
        return self._run(prompt, max_tokens=max_tokens, temperature=temperature, chat=chat,
                         seed=seed)

    def _run(self, prompt: str, *, max_tokens: int, temperature: float, chat: bool,
             seed: int | None) -> Iterator[dict[str, Any]]:
        model = self.model
        assert model is not None
        if not self._lock.acquire(blocking=False):  # taken here: a stream never started
            yield {"event": "error", "message": "a generation is already running"}
            return  # holds nothing
        try:
            ids = self.prompt_ids(prompt, chat)
            self.engine(len(ids))
            self.tracer.clear()
            sent = 0
            params = SamplerParams(temp=temperature)
            for event in model.stream(ids, max_tokens=max_tokens, seed=seed, sampling=params):
                yield from self._new_steps(sent)
                sent = self.tracer.n_steps
                if isinstance(event, Piece):
                    yield {"event": "token", "text": event.text, "id": event.token_id}
                elif isinstance(event, Finished):
                    yield {"event": "done", "reason": event.reason, "n_tokens": len(event.ids),
                           "timings": event.timings.as_dict()}
        except MinferError as exc:
            yield {"event": "error", "message": str(exc)}
        finally:
            self._lock.release()

    def _new_steps(self, sent: int) -> Iterator[dict[str, Any]]:
        for step in self.tracer.steps:
            if step.step >= sent:
                yield {"event": "step", **self.summary(step)}

    def summary(self, step: TracedStep | dict[str, Any]) -> dict[str, Any]:
        """A step without its per-node records: what the step list and the charts show."""
        head = _header(step)
        graph = self.graphs()[str(head["graph"])]
        op_of = [n["op"] for n in graph["nodes"]]
        times = step.node_times() if isinstance(step, TracedStep) else \
            [(r["id"], r["t_us"]) for r in step["nodes"]]
        return {"step": head["step"], "kind": head["kind"], "graph": head["graph"],
                "n_tokens": head["n_tokens"], "pos": head["pos"],
                "token_text": head["token_text"][-8:], "top": head["top"],
                "time_ms": head["time_ms"], "ops": op_times(times, op_of)}

    def summaries(self) -> list[dict[str, Any]]:
        return [self.summary(step) for step in self._records()]


def _header(step: TracedStep | dict[str, Any]) -> dict[str, Any]:
    return step.header if isinstance(step, TracedStep) else step
