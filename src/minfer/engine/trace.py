"""The per-step trace: what every node of every forward produced, how long it took, and the
model's top candidates after it.

An Engine with a `StepTracer` walks each forward's op tape node by node through
`trace_forward` (`Tape.run_observed`; one None check per forward, the untraced path
unchanged). A step record is plain JSON-able data:

    {"step", "kind": "prefill"|"decode", "graph": uid, "n_tokens", "pos", "tokens",
     "token_text", "top": [{"id", "text", "p"}] (softmax of the last row's logits),
     "time_ms", "nodes": [{"id", "t_us", "stats": {min, max, mean, std, absmax, nan, inf},
                           "heat": {"rows", "cols", "scale", "b64"}}]}

The heatmap travels as int8 (value / scale * 127, base64). With `capture`, each step also keeps
a copy of every node's output (`outputs`, not serialized) for the two-backend diff.
`MINFER_TRACE=FILE` gives every Engine of a process a tracer whose trace is written at exit
(`to_json` / `write`: the graphs used, as `minfer.graph.view` describes them, and the steps),
which `minfer viz --trace FILE` opens.
"""

from __future__ import annotations

import atexit
import base64
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minfer import env
from minfer.engine.tensor_stats import STAT_KEYS, stats_dict, summarize_into
from minfer.errors import MinferError
from minfer.graph.cache import PreparedGraph
from minfer.graph.scheduler import Tape
from minfer.graph.view import describe

if TYPE_CHECKING:
    from minfer.engine.forward import Batch

TOP_K = 5
ENV_MAX_STEPS = 512
TRACE_VERSION = 1
TokenText = Callable[[int], str]


def encode_heat(heat: np.ndarray) -> dict[str, Any]:
    scale = float(np.abs(heat).max()) if heat.size else 0.0
    q = np.zeros(heat.shape, np.int8) if scale == 0 else np.rint(heat / scale * 127)
    data = base64.b64encode(q.astype(np.int8).tobytes()).decode()
    return {"rows": int(heat.shape[0]), "cols": int(heat.shape[1]), "scale": scale, "b64": data}


def top_candidates(logits: np.ndarray, k: int, token_text: TokenText | None
                   ) -> list[dict[str, Any]]:
    """The k most likely next tokens of one row of logits, with softmax probabilities."""
    row = logits.astype(np.float64)
    k = min(k, row.shape[0])
    idx = np.argpartition(row, -k)[-k:]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    z = row - row.max()
    probs = np.exp(z[idx]) / np.exp(z).sum()
    return [{"id": int(i), "text": token_text(int(i)) if token_text else "", "p": float(p)}
            for i, p in zip(idx, probs, strict=True)]


@dataclass
class TracedStep:
    """One forward as recorded: the header fields, then per node (in execution order, inputs
    first) its id, seconds, statistics row and heatmap, kept as arrays until asked for JSON."""

    header: dict[str, Any]  # step, kind, graph, n_tokens, pos, tokens, token_text, top, time_ms
    node_ids: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stats: list[np.ndarray | None] = field(default_factory=list)
    heats: list[np.ndarray | None] = field(default_factory=list)
    outputs: dict[int, np.ndarray] = field(default_factory=dict)  # with capture only
    _json: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        return int(self.header["step"])

    def node_times(self) -> list[tuple[int, float]]:
        """(node id, microseconds) per node."""
        return [(i, t * 1e6) for i, t in zip(self.node_ids, self.seconds, strict=True)]

    def to_json(self) -> dict[str, Any]:
        if self._json is None:
            nodes = []
            for node_id, t, stats, heat in sorted(
                    zip(self.node_ids, self.seconds, self.stats, self.heats, strict=True),
                    key=lambda rec: rec[0]):
                rec: dict[str, Any] = {"id": node_id, "t_us": t * 1e6}
                if stats is not None and heat is not None:
                    rec["stats"] = stats_dict(stats)
                    rec["heat"] = encode_heat(heat)
                nodes.append(rec)
            self._json = {**self.header, "nodes": nodes}
        return self._json


class StepTracer:
    def __init__(self, *, capture: bool = False, token_text: TokenText | None = None,
                 max_steps: int | None = None) -> None:
        self.capture = capture
        self.token_text = token_text
        self.max_steps = max_steps  # older steps are dropped past this many (None: keep all)
        self.steps: list[TracedStep] = []
        self.prepared: dict[int, PreparedGraph] = {}  # graph uid -> the graph a step ran
        self.tensor_types: dict[str, str] = {}
        self.model_name = ""
        self._views: dict[int, dict[str, Any]] = {}  # uid -> described graph (made once)
        self.n_steps = 0  # steps ever recorded (step numbers keep counting after drops)

    def trace_forward(self, prepared: PreparedGraph, tape: Tape,
                      buffers: list[np.ndarray | None], batch: Batch, weights: Any) -> None:
        """Run the tape node by node, recording each node's output statistics and time."""
        graph = prepared.graph
        rec = TracedStep({})
        capture = self.capture

        def observe(node_id: int, seconds: float) -> None:
            out = buffers[node_id]
            rec.node_ids.append(node_id)
            rec.seconds.append(seconds)
            if out is None:
                rec.stats.append(None)
                rec.heats.append(None)
                return
            values = np.empty(len(STAT_KEYS))
            rec.heats.append(summarize_into(out, values))
            rec.stats.append(values)
            if capture:
                rec.outputs[node_id] = out.copy()

        for node_id in graph.inputs.values():  # filled, not executed; their slots are reused
            observe(node_id, 0.0)
        t0 = time.perf_counter()
        tape.run_observed(observe)
        elapsed = time.perf_counter() - t0
        logits = buffers[graph.outputs[0]]
        assert logits is not None
        self._remember(prepared, weights)
        rec.header = {
            "step": self.n_steps, "kind": prepared.params.gtype.value, "graph": graph.uid,
            "n_tokens": batch.n_tokens, "pos": int(batch.positions[0]),
            "tokens": [int(t) for t in batch.tokens],
            "token_text": [self._text(int(t)) for t in batch.tokens],
            "top": top_candidates(logits[-1], TOP_K, self.token_text),
            "time_ms": elapsed * 1e3,
        }
        self._append(rec)

    def _text(self, token_id: int) -> str:
        return self.token_text(token_id) if self.token_text else ""

    def _remember(self, prepared: PreparedGraph, weights: Any) -> None:
        if prepared.graph.uid not in self.prepared:
            self.prepared[prepared.graph.uid] = prepared
            if not self.tensor_types:
                self.model_name = Path(weights.file.path).name.removesuffix(".gguf")
                tensors = weights.file.tensors
                self.tensor_types = {name: t.type_name for name, t in tensors.items()}

    def _append(self, step: TracedStep) -> None:
        self.steps.append(step)
        self.n_steps += 1
        if self.max_steps is not None and len(self.steps) > self.max_steps:
            del self.steps[0]

    def clear(self) -> None:
        """Forget the steps and the graphs they ran (a new run starts at step 0)."""
        self.steps.clear()
        self.prepared.clear()
        self._views.clear()
        self.n_steps = 0

    # -- the trace file --------------------------------------------------------------------
    def graphs_json(self) -> dict[str, Any]:
        for uid, prepared in self.prepared.items():
            if uid not in self._views:
                self._views[uid] = describe(prepared, self.tensor_types)
        return {str(uid): self._views[uid] for uid in self.prepared}

    def to_json(self, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
        steps = [s.to_json() for s in self.steps]
        return {"version": TRACE_VERSION, "meta": {"model": self.model_name, **(meta or {})},
                "graphs": self.graphs_json(), "steps": steps}

    def write(self, path: str | Path, meta: Mapping[str, Any] | None = None) -> None:
        Path(path).write_text(json.dumps(self.to_json(meta)))


_ENV_TRACERS: list[StepTracer] = []


def tracer_from_env() -> StepTracer | None:
    """A tracer for a new Engine when MINFER_TRACE=FILE is set (written at exit), else None.
    Every Engine of the process appends to the one file's trace, which keeps the last
    MINFER_TRACE_STEPS steps (default 512; a 0.5B decode step is ~0.2 MB of JSON)."""
    path = env.get("MINFER_TRACE")
    if not path:
        return None
    if not _ENV_TRACERS:
        keep = env.get("MINFER_TRACE_STEPS", str(ENV_MAX_STEPS))
        if not keep.isdigit() or int(keep) < 1:
            raise MinferError(f"MINFER_TRACE_STEPS={keep!r} is not a positive integer")
        _ENV_TRACERS.append(StepTracer(max_steps=int(keep)))
        atexit.register(_write_env_trace, path)
    return _ENV_TRACERS[0]


def _write_env_trace(path: str) -> None:
    tracer = _ENV_TRACERS[0]
    if tracer.steps:  # a process that ran no forward (a warm-up helper) leaves the file alone
        tracer.write(path, {"source": "MINFER_TRACE"})
