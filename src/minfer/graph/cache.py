"""Params-only graph reuse: a small most-recently-used cache of prepared graphs.

A lookup compares GraphParams and nothing else: equal params mean the cached graph (with its
backend assignment, buffer plan and splits) is replayed as-is, and only input data changes.
`verify_structural` rebuilds a graph with equal params and compares it node by node; tests use
it as the tripwire for the reuse invariant.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minfer.errors import GraphError
from minfer.graph.alloc import BufferPlan
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams

_uids = itertools.count(1)


@dataclass
class PreparedGraph:
    params: GraphParams
    graph: ComputeGraph
    plan: BufferPlan
    splits: list[tuple[str, list[int]]]
    scratch: dict[str, Any] = field(default_factory=dict)  # executor state (buffer views, tape)


class GraphCache:
    def __init__(self, prepare: Callable[[GraphParams], PreparedGraph], capacity: int = 8) -> None:
        self._prepare = prepare
        self._capacity = capacity
        self._entries: OrderedDict[GraphParams, PreparedGraph] = OrderedDict()
        self.reuses = 0
        self.rebuilds = 0

    def get(self, params: GraphParams) -> PreparedGraph:
        entry = self._entries.get(params)
        if entry is not None:
            self._entries.move_to_end(params)
            self.reuses += 1
            return entry
        entry = self._prepare(params)
        entry.graph.uid = next(_uids)
        self.rebuilds += 1
        self._entries[params] = entry
        if len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def verify_structural(self, params: GraphParams) -> None:
        """Rebuild with equal params and require an identical node sequence."""
        cached = self.get(params).graph
        fresh = self._prepare(params).graph
        if len(cached.nodes) != len(fresh.nodes):
            raise GraphError(f"rebuild has {len(fresh.nodes)} nodes, cache {len(cached.nodes)}")
        for a, b in zip(cached.nodes, fresh.nodes, strict=True):
            if a.structure() != b.structure() or a.backend != b.backend:
                raise GraphError(f"node {a.id} differs after rebuild: {a.name} vs {b.name}")
        if cached.inputs != fresh.inputs or cached.outputs != fresh.outputs:
            raise GraphError("inputs or outputs differ after rebuild")
