"""Diff mode: one prompt on two backends in lockstep, every node's max |Δ| per step.

Two fresh engines over the same file: the CPU backend alone, and torch taking every node it can
(`claim="all"`, from one row) with the CPU backend behind it. Both capture every node's output.
Each step feeds both the same tokens — the prompt, then the CPU engine's greedy token (teacher
forcing, so one backend's different choice cannot derail the comparison) — and compares the
outputs node by node: equal GraphParams build equal topologies, so node ids match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from minfer.backends.base import Backend
from minfer.backends.cpu.backend import CpuBackend
from minfer.engine.forward import Engine
from minfer.engine.trace import StepTracer, TracedStep
from minfer.errors import MinferError

if TYPE_CHECKING:
    from minfer.api import Model


def torch_backends() -> list[Backend]:
    try:
        from minfer.backends.torch_backend.backend import TorchBackend
    except ImportError as exc:
        raise MinferError(f"diff mode needs torch: {exc}") from None
    return [TorchBackend(min_rows=1, claim="all"), CpuBackend()]


def max_abs_delta(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    """max |a - b| over the elements (NaN where either side is not finite); None when a side
    has no output or the shapes differ."""
    if a is None or b is None or a.shape != b.shape:
        return None
    if a.size == 0:
        return 0.0
    delta = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(delta.max()) if np.isfinite(delta).all() else float("nan")


def _engine(model: Model, n_ctx: int, backends: list[Backend]) -> Engine:
    engine = model.parts.engine(n_ctx, backends=backends, adaptive_threads=False)
    engine.tracer = StepTracer(capture=True, token_text=model.token_piece, max_steps=1)
    return engine


def diff_backends(model: Model, prompt_ids: Sequence[int], *, max_tokens: int
                  ) -> dict[str, Any]:
    """{"backends": ["cpu", "torch"], "steps": [{"step", "kind", "n_tokens", "token",
    "text", "max_abs": [per node id: float | None], "worst": {"id", "value"}}]}."""
    if not prompt_ids:
        raise MinferError("the prompt is empty")
    n_ctx = model.session_n_ctx(len(prompt_ids) + max_tokens)
    engines = [_engine(model, n_ctx, [CpuBackend()]), _engine(model, n_ctx, torch_backends())]
    tokens, pos = list(prompt_ids), 0
    steps: list[dict[str, Any]] = []
    for index in range(max_tokens):
        if pos + len(tokens) > n_ctx:
            break
        logits = [e.forward(tokens, pos)[-1] for e in engines]
        traced = []
        for e in engines:
            assert e.tracer is not None
            traced.append(e.tracer.steps[-1])
        ours, theirs = traced[0].outputs, traced[1].outputs
        deltas = [max_abs_delta(ours.get(i), theirs.get(i))
                  for i in range(_n_nodes(engines[0], traced[0]))]
        next_id = int(np.argmax(logits[0]))
        steps.append({
            "step": index, "kind": traced[0].header["kind"], "n_tokens": len(tokens),
            "token": next_id, "text": model.token_piece(next_id), "max_abs": deltas,
            "worst": _worst(deltas),
        })
        pos += len(tokens)
        tokens = [next_id]
    return {"backends": ["cpu", "torch"], "steps": steps}


def _n_nodes(engine: Engine, step: TracedStep) -> int:
    assert engine.tracer is not None
    return len(engine.tracer.prepared[step.header["graph"]].graph.nodes)


def _worst(deltas: list[float | None]) -> dict[str, Any] | None:
    best: tuple[int, float] | None = None
    for i, d in enumerate(deltas):
        if d is not None and (best is None or not d <= best[1]):
            best = (i, d)
    return {"id": best[0], "value": best[1]} if best else None
