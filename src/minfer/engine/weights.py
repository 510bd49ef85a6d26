"""Model weights by GGUF tensor name, as the backends read them.

Matrices stay in their file format, zero-copy from the memory map: quantized tensors as
`uint8[n_rows, row_bytes]` block bytes, float tensors as typed views. Small vectors (norm
weights, biases) are converted to float32 once and kept. A backend may keep its own copy of a
matrix in another layout (`derived`: made once, on first use, chunk by chunk); the file's pages
of each chunk are released as it is copied, so the copy replaces them in memory instead of adding
to it. For a model of some size those copies are files, made by the first run and mapped by
every later one and every engine on the machine (shared_weights.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minfer.engine import shared_weights
from minfer.gguf.constants import GGMLQuantizationType
from minfer.gguf.reader import GGUFFile

FLOAT_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
}


# make(rows, qtype, out) writes the rows in the new layout into `out` (same shape and dtype)
# and returns the new layout's type id.
Maker = Callable[[np.ndarray, int, np.ndarray], int]


class ModelWeights:
    def __init__(self, f: GGUFFile, version: int = 0) -> None:
        self.file = f
        self.version = version
        self._vectors: dict[str, np.ndarray] = {}
        self._matrices: dict[str, tuple[np.ndarray, int]] = {}
        self._derived: dict[tuple[str, str], tuple[np.ndarray, int]] = {}
        self.state: dict[object, object] = {}
        """Backends' own per-weight state (e.g. a kernel bound to a weight), kept as long as
        these weights are."""
        self._shared = (shared_weights.SharedStore(f.path)
                        if shared_weights.enabled(f.path.stat().st_size) else None)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.file.tensors.items()}

    def matrix(self, name: str) -> tuple[np.ndarray, int]:
        hit = self._matrices.get(name)
        if hit is None:
            qtype = int(self.file.tensors[name].ggml_type)
            data = self.file.array(name) if qtype in FLOAT_TYPES else self.file.raw(name)
            hit = self._matrices[name] = (data, qtype)
        return hit

    def derived(self, name: str, form: str, make: Maker,
                chunk_rows: int = 4096) -> tuple[np.ndarray, int]:
        """Matrix `name` in a backend's layout `form`, made once: make(rows, qtype, out) -> its
        type id, a row-wise transform written chunk by chunk into one array of the file's shape
        and dtype. Each chunk's file pages are released once copied, so the copy replaces the
        file's pages instead of briefly doubling them (145 MB for an output projection)."""
        key = (name, form)
        hit = self._derived.get(key)
        if hit is not None:
            return hit
        if self._shared is None:
            hit = self._make(name, make, chunk_rows)
        else:
            hit = self._shared.mapped(name, form)
            if hit is None:
                with self._shared.claim(name, form):  # another engine may be making it now
                    hit = self._shared.load(name, form)
                    if hit is None:
                        out, new_type = self._make(name, make, chunk_rows)
                        hit = (self._shared.store(name, form, out, new_type), new_type)
            # a copy mapped from its file leaves the GGUF's pages of the matrix unread; drop
            # any an earlier reader touched (`_make` released its own chunk by chunk)
            self.file.release(name)
        self._derived[key] = hit
        return hit

    def has_copy(self, name: str) -> bool:
        """Whether a backend reads matrix `name` from a copy of its own (`derived`): a reader
        of the file's bytes may then release their pages after use, as `derived` does."""
        return any(key[0] == name for key in self._derived)

    def _make(self, name: str, make: Maker, chunk_rows: int) -> tuple[np.ndarray, int]:
        raw, qtype = self.matrix(name)
        out = np.empty_like(raw)
        new_type = qtype
        for r0 in range(0, raw.shape[0], chunk_rows):
            r1 = min(raw.shape[0], r0 + chunk_rows)
            new_type = make(raw[r0:r1], qtype, out[r0:r1])
            self.file.release(name, (r0, r1))
        return out, new_type

    def read_set(self, gathered: tuple[str, ...] = ()) -> list[np.ndarray]:
        """The matrices a decode step reads whole: each backend copy (`derived`), and the
        file's bytes of every other matrix asked for but those `gathered` row by row (an
        untied model's token embedding). `minfer bench --roofline` reads them as a decode
        step does."""
        copied = {name for name, _ in self._derived}
        return [a for a, _ in self._derived.values()] + [
            a for name, (a, _) in self._matrices.items()
            if name not in copied and name not in gathered]

    def vector(self, name: str) -> np.ndarray:
        vec = self._vectors.get(name)
        if vec is None:
            info = self.file.tensors[name]
            if int(info.ggml_type) == GGMLQuantizationType.BF16:
                raw = self.file.array(name).astype(np.uint32) << 16
                vec = raw.view(np.float32).reshape(-1)
            else:
                vec = np.ascontiguousarray(self.file.array(name), dtype=np.float32).reshape(-1)
            self._vectors[name] = vec
        return vec
