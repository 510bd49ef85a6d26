"""The one place where values cross between the allocator's numpy buffers and torch tensors.

Every handler of the torch backend reads its sources with `read`, asks `target` where to write
and hands the result to `publish`; nothing else converts between numpy and torch.

- `HostIO` (device `cpu`): a torch tensor *is* the numpy buffer (`torch.from_numpy` shares the
  memory), so a crossing between the CPU backend and torch costs nothing and every result lands
  straight in its planned buffer.
- `DeviceIO` (device `cuda`, or forced on `cpu` by tests to exercise the same path): results stay
  on the device in the per-forward memo, keyed by node id, until their last torch reader has run
  (`DevicePlan.release`); a value produced on the host is copied to the device once per forward,
  however many torch nodes read it; a device value is copied back into its numpy buffer only
  when a node of another backend (or the caller) reads it (`DevicePlan.exports`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from minfer.graph.ir import ComputeGraph, Node

_DEV = "torch.dev"  # memo key prefix: (prefix, node id) -> device tensor
_PLAN = "torch.device_plan"  # memo key: this forward's DevicePlan

_TORCH_DTYPE = {np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}


class TensorIO(Protocol):
    copies: bool  # whether crossings are real copies (and so worth avoiding)

    def read(self, memo: dict[Any, Any], src_id: int, array: np.ndarray | None) -> torch.Tensor:
        ...

    def target(self, node: Node, out: np.ndarray | None) -> torch.Tensor: ...

    def publish(self, memo: dict[Any, Any], node: Node, out: np.ndarray | None,
                result: torch.Tensor) -> None: ...

    def after(self, memo: dict[Any, Any], node: Node) -> None: ...


class HostIO:
    copies = False

    def read(self, memo: dict[Any, Any], src_id: int, array: np.ndarray | None) -> torch.Tensor:
        assert array is not None
        return torch.from_numpy(array)

    def target(self, node: Node, out: np.ndarray | None) -> torch.Tensor:
        assert out is not None
        return torch.from_numpy(out)

    def publish(self, memo: dict[Any, Any], node: Node, out: np.ndarray | None,
                result: torch.Tensor) -> None:
        return None  # `result` is the buffer itself

    def after(self, memo: dict[Any, Any], node: Node) -> None:
        return None


class DeviceIO:
    copies = True

    def __init__(self, device: torch.device,
                 graph_of: Callable[[Node], ComputeGraph | None]) -> None:
        self.device = device
        self._graph_of = graph_of
        self.host_to_device = 0  # copies made (counters for the report and the tests)
        self.device_to_host = 0

    def read(self, memo: dict[Any, Any], src_id: int, array: np.ndarray | None) -> torch.Tensor:
        hit = memo.get((_DEV, src_id))
        if hit is None:
            assert array is not None, f"node {src_id} has neither a device value nor a buffer"
            hit = memo[(_DEV, src_id)] = torch.from_numpy(array).to(self.device)
            self.host_to_device += 1
        return hit

    def target(self, node: Node, out: np.ndarray | None) -> torch.Tensor:
        assert out is not None
        return torch.empty(out.shape, dtype=_TORCH_DTYPE[out.dtype], device=self.device)

    def publish(self, memo: dict[Any, Any], node: Node, out: np.ndarray | None,
                result: torch.Tensor) -> None:
        memo[(_DEV, node.id)] = result
        if out is not None and node.id in self._exports(memo, node):
            torch.from_numpy(out).copy_(result)
            self.device_to_host += 1

    def after(self, memo: dict[Any, Any], node: Node) -> None:
        """Drop the device values whose last torch reader was `node`."""
        for src_id in self._plan(memo, node).release.get(node.id, ()):
            memo.pop((_DEV, src_id), None)

    def _exports(self, memo: dict[Any, Any], node: Node) -> frozenset[int]:
        return self._plan(memo, node).exports

    def _plan(self, memo: dict[Any, Any], node: Node) -> DevicePlan:
        hit = memo.get(_PLAN)
        if hit is None:
            graph = self._graph_of(node)
            hit = memo[_PLAN] = DevicePlan.of(graph, node.backend) if graph else _KEEP_ALL
        return hit


@dataclass(frozen=True)
class DevicePlan:
    """Per graph: which torch values must reach the host, and after which node each device
    value (torch-made or copied in) has no torch reader left."""

    exports: frozenset[int]
    release: dict[int, tuple[int, ...]]

    @classmethod
    def of(cls, graph: ComputeGraph, backend: str | None) -> DevicePlan:
        last: dict[int, int] = {}
        for n in graph.nodes:
            if n.backend == backend:
                for s in n.srcs:
                    last[s] = n.id
        release: dict[int, list[int]] = {}
        for src, reader in last.items():
            if src not in graph.outputs:
                release.setdefault(reader, []).append(src)
        return cls(exports(graph, backend), {k: tuple(v) for k, v in release.items()})


class _Everything(frozenset[int]):
    """Every node id: the safe answer when the graph is unknown (write everything back)."""

    def __contains__(self, item: object) -> bool:
        return True


_EVERYTHING = _Everything()
_KEEP_ALL = DevicePlan(_EVERYTHING, {})  # graph unknown: write everything back, free nothing


def exports(graph: ComputeGraph, backend: str | None) -> frozenset[int]:
    """Nodes of `backend` read by a node of another backend, plus the graph's outputs."""
    found = {out for out in graph.outputs if graph.nodes[out].backend == backend}
    for node in graph.nodes:
        if node.backend != backend:
            found.update(s for s in node.srcs if graph.nodes[s].backend == backend)
    return frozenset(found)

