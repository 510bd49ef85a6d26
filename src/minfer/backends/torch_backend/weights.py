"""Weights as torch sees them: bf16 matrices, f32 vectors, on the backend's device.

Two ways to hold the matrices (`MINFER_TORCH_WEIGHTS`, or the backend's `weights=` argument):

- `scratch` (default on the CPU): each matmul dequantizes its weight from the GGUF blocks straight
  into one reused bf16 buffer just before the GEMM, in row tiles of at most `TILE_WEIGHTS`.
  Memory-neutral (~16 MB of buffer), at the price of a dequantization per matrix per forward.
- `bf16`: a bf16 copy of every matrix torch touches, made on first use and kept (2 bytes per
  weight, ~0.7 GB for the 0.5B model's layers). No per-forward dequantization.

Dequantization is the compiled CPU kernel (`minfer.backends.cpu.kernels.dequantize_into`, exact
against gguf's reference), which rounds each value to bf16 (nearest even) as it writes it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

from minfer.backends.cpu.kernels import dequantize_into

MODES = ("scratch", "bf16")
TILE_WEIGHTS = 8 << 20  # weights per scratch tile: 16 MiB of bf16 at most
_F32 = int(gguf.GGMLQuantizationType.F32)


def readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy without the warning for read-only (memory-mapped) arrays; never written."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array)


class TorchWeights:
    """Matrices and vectors of one ModelWeights, converted for torch on `device`."""

    def __init__(self, weights: Any, *, device: torch.device, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"weights mode {mode!r} not in {MODES}")
        self.source = weights  # minfer.engine.weights.ModelWeights
        self.device = device
        self.mode = mode
        self._resident: dict[str, torch.Tensor] = {}
        self._vectors: dict[str, torch.Tensor] = {}
        self._bf16 = torch.empty(0, dtype=torch.bfloat16, device=device)  # scratch mode only
        self.dequantized = 0  # matrices dequantized so far (scratch refills included)

    @property
    def resident_bytes(self) -> int:
        kept = sum(t.numel() * t.element_size() for t in self._resident.values())
        return kept + self._bf16.numel() * 2

    def tiles(self, name: str) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first row, end row, bf16 [rows, n_in]) covering the matrix.

        bf16 mode: one tile, the resident copy. Scratch mode: tiles of at most TILE_WEIGHTS
        weights (a layer's matrices fit in one; the 151,936-row output table takes ~17), each
        valid until the next one is made, so the scratch never outgrows one tile.
        """
        if self.mode == "bf16":
            hit = self._resident.get(name)
            if hit is None:
                n_out = self.source.matrix(name)[0].shape[0]
                hit = self._resident[name] = self._bf16_rows(name, 0, n_out, None)
            yield 0, hit.shape[0], hit
            return
        n_out, n_in = self.source.matrix(name)[0].shape[0], self._n_in(name)
        step = max(1, min(n_out, TILE_WEIGHTS // n_in))
        for r0 in range(0, n_out, step):
            r1 = min(n_out, r0 + step)
            n = (r1 - r0) * n_in
            if self._bf16.numel() < n:
                self._bf16 = torch.empty(n, dtype=torch.bfloat16, device=self.device)
            yield r0, r1, self._bf16_rows(name, r0, r1, self._bf16[:n].view(r1 - r0, n_in))

    def vector(self, name: str) -> torch.Tensor:
        vec = self._vectors.get(name)
        if vec is None:
            vec = self._vectors[name] = readonly_tensor(self.source.vector(name)).to(self.device)
        return vec

    def rows(self, name: str, ids: np.ndarray) -> torch.Tensor:
        """f32 rows `ids` of a (quantized) table, e.g. the token embedding: [len(ids), n_in]."""
        raw, qtype = self.source.matrix(name)
        out = np.empty((len(ids), self._n_in(name)), np.float32)
        dequantize_into(raw, qtype, ids, out)
        return torch.from_numpy(out).to(self.device)

    def _n_in(self, name: str) -> int:
        return int(self.source.file.tensors[name].shape[0])

    def _bf16_rows(self, name: str, r0: int, r1: int, out: torch.Tensor | None) -> torch.Tensor:
        """Rows [r0, r1) as bf16 [r1 - r0, n_in] on the device, written into `out` when given.
        The compiled dequantizer writes bf16 bits straight into the tensor's memory on the CPU
        (no f32 copy of the matrix); for another device it fills a host array first."""
        raw, qtype = self.source.matrix(name)
        shape = (r1 - r0, self._n_in(name))
        on_host = self.device.type == "cpu"
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16, device=self.device if on_host else "cpu")
        host = out if on_host else torch.empty(shape, dtype=torch.bfloat16)
        bits = host.view(torch.int16).numpy().view(np.uint16)
        dequantize_into(raw, qtype, np.arange(r0, r1), bits)
        if qtype != _F32:
            self.dequantized += 1
        if self.source.has_copy(name):  # decode reads the CPU's copy: the file's pages can go
            self.source.file.release(name, (r0, r1))
        if not on_host:
            out.copy_(host)
        return out
