"""The torch backend: bf16 prefill GEMMs on CPUs with AMX / AVX512-BF16, and CUDA when present.

`make_torch_backend(required)` is what `--backend auto|torch` calls. Settings (environment):

- `MINFER_TORCH_DEVICE=auto|cpu|cuda`: `auto` takes CUDA when a GPU is visible, else the CPU when
  it has a native bf16 GEMM (flags `amx_bf16`+`amx_tile`, or `avx512_bf16`); `cpu` forces the
  host even without one (slow, for checks). For an explicit `--backend torch`, AVX512-BF16
  counts too: on the dev machine (AMD EPYC, avx512_bf16, no AMX) a 512x896x4864 bf16 GEMM runs
  at ~990 GFLOP/s on 2 threads vs ~220 f32, and pp512 of the 0.5B model is 730-760 tok/s with
  torch vs 490-525 on the CPU kernels' integer path (llama.cpp: ~310); `auto` does not take it
  there (the issue's rule: AMX or CUDA only).
- `MINFER_TORCH_WEIGHTS=scratch|bf16`: per-forward dequantization into one reused buffer
  (memory-neutral, default on the CPU), or a resident bf16 copy (default on CUDA).
- `MINFER_TORCH_CLAIM=matmul|dense|all` and `MINFER_TORCH_MIN_ROWS=N`: which nodes torch takes
  (see backend.py). `dense` is the default: attention stays on the CPU backend, whose blocked
  kernel beat torch's SDPA here (pp512 730-750 tok/s with `dense` vs 690-705 with `all`).

torch is imported only when a backend is made, so `import minfer` never pays for it. Under `auto`
on a CPU with AMX and no GPU, the backend is made even later: `DeferredTorchBackend` declines
every node below `min_rows` rows without torch, and imports it (~1.5 s) when the first graph
that torch would take is prepared, so a short prompt and every decode step never pay for it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from minfer import env
from minfer.backends.torch_backend.device import (
    DEVICES,
    choose_device,
    detect,
    env_choice,
    gpu_present,
    worth_probing,
)
from minfer.backends.torch_backend.rows import node_rows
from minfer.errors import MinferError

if TYPE_CHECKING:
    from minfer.backends.base import ExecContext
    from minfer.backends.torch_backend.backend import TorchBackend
    from minfer.graph.ir import ComputeGraph, Node

CLAIM_CHOICES = ("matmul", "dense", "all")
WEIGHT_CHOICES = ("scratch", "bf16")
# Rows from which a node goes to torch: below it the quantized CPU kernels win. Scratch weights
# pay a whole dequantization per forward (~250 ms for the 0.5B), so they overtake the CPU's
# integer path late: on Intel Xeon (Sapphire Rapids, AMX; the host where `auto` takes torch on
# the CPU), 2 threads, `minfer bench --backend auto|cpu` alternating, the 0.5B (Q5_0 / Q8_0)
# gave pp48 184 vs 486 tok/s, pp128 381 vs 564, pp256 574-594 vs 592-601, pp320 601-661 vs
# 609-616, pp384 653-708 vs 613-621, pp512 711-747 vs 604-612; the 1.5B (Q4_K_M) pp256 200 vs
# 214, pp320 189 vs 210, pp448 224 vs 217. (An earlier sweep on AMD EPYC, avx512_bf16 without
# AMX, put the crossing at 32-48 rows: `--backend torch` there, never `auto`.) Resident bf16
# has no per-forward cost: it overtakes between 8 and 16 rows.
DEFAULT_MIN_ROWS = {"scratch": 384, "bf16": 16}


class DeferredTorchBackend:
    """The torch backend of an AMX host under `auto`, made (and torch imported) only when a
    node with at least `min_rows` rows asks for it; until then it declines every node."""

    name = "torch"
    kv_types = ("f32", "f16")  # TorchBackend's, answered without making it

    def __init__(self, make: Callable[[], TorchBackend], min_rows: int) -> None:
        self._make = make
        self.min_rows = min_rows
        self.made: TorchBackend | None = None

    def supports_op(self, node: Node, graph: ComputeGraph) -> bool:
        if self.made is None:
            if node_rows(node, graph) < self.min_rows:
                return False
            self.made = self._make()
        return self.made.supports_op(node, graph)

    def bind_node(self, node: Node, srcs: list[np.ndarray | None], out: np.ndarray | None,
                  ctx: ExecContext) -> list[Callable[[], None]]:
        if self.made is None:  # only nodes it accepted are assigned to it
            raise MinferError(f"node {node.name} reached the torch backend before it was made")
        return self.made.bind_node(node, srcs, out, ctx)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_") or attr == "made":
            raise AttributeError(attr)
        if self.made is None:
            self.made = self._make()
        return getattr(self.made, attr)


def make_torch_backend(required: bool) -> TorchBackend | DeferredTorchBackend | None:
    """The torch backend configured from the environment, or None where it would not pay.

    With `required` (an explicit `--backend torch`) every reason it cannot run is an error.
    """
    wanted = env_choice("MINFER_TORCH_DEVICE", DEVICES, "auto")
    for name, choices in (("MINFER_TORCH_WEIGHTS", WEIGHT_CHOICES),
                          ("MINFER_TORCH_CLAIM", CLAIM_CHOICES)):
        env_choice(name, choices, choices[0])  # a typo is loud even where torch is not used
    if not required and wanted == "auto":
        if not worth_probing():
            return None  # nothing torch could use: not even imported (~1 s, ~180 MB)
        if not gpu_present():  # an AMX host: torch on the CPU, imported when a prefill needs it
            if importlib.util.find_spec("torch") is None:
                return None
            claim = env_choice("MINFER_TORCH_CLAIM", CLAIM_CHOICES, "dense")
            min_rows = _min_rows("scratch")
            return DeferredTorchBackend(lambda: _made("cpu", claim, "scratch", min_rows),
                                        min_rows)
    caps = detect()
    if not caps.torch_ok:
        if required:
            raise MinferError("the torch backend needs torch: pip install 'minfer[torch]'")
        return None
    device = choose_device(caps, wanted)
    if device is None and required and wanted == "auto" and caps.cpu_bf16:
        device = "cpu"  # asked for by name: a native bf16 dot product is enough
    if device is None:
        if required:
            raise MinferError(
                f"the torch backend has no fast device here ({caps.describe()}); set "
                "MINFER_TORCH_DEVICE=cpu to run it anyway")
        return None
    weights = env_choice("MINFER_TORCH_WEIGHTS", WEIGHT_CHOICES,
                         "scratch" if device == "cpu" else "bf16")
    claim = env_choice("MINFER_TORCH_CLAIM", CLAIM_CHOICES, "dense")
    return _made(device, claim, weights, _min_rows(weights))


def _made(device: str, claim: str, weights: str, min_rows: int) -> TorchBackend:
    try:
        from minfer.backends.torch_backend.backend import TorchBackend
    except ImportError as exc:
        raise MinferError(f"the torch backend could not start: {exc}") from None
    return TorchBackend(device=device, claim=claim, weights=weights, min_rows=min_rows)


def _min_rows(weights: str) -> int:
    text = env.get("MINFER_TORCH_MIN_ROWS")
    if not text:
        return DEFAULT_MIN_ROWS[weights]
    try:
        value = int(text)
    except ValueError:
        raise MinferError(f"MINFER_TORCH_MIN_ROWS={text!r} is not an integer") from None
    if value < 1:
        raise MinferError("MINFER_TORCH_MIN_ROWS must be at least 1")
    return value


__all__ = ["DeferredTorchBackend", "make_torch_backend"]
