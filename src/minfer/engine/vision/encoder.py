"""A vision encoder over an mmproj file: images to the text model's embedding rows.

The tower is a graph in the same IR (`minfer.models.siglip.build_vision`, its projector a branch
on `clip.projector_type`), bound into an op tape on the CPU backend's kernels, its matmuls the
dense-f32 GEMM an encoder uses (batch-invariant: an image's rows do not depend on anything
else). An image is one or more chunks of `image_size` (Idefics3's tiles and overview), each run
through the same tape. Two weights are presented in the form a matmul reads:
the patch embedding (a convolution kernel [n_embd, 3, p, p]) as [n_embd, 3 p^2], and Gemma 3's
projection (stored [n_embd_vision, n_embd_text], applied as x @ W) transposed.

The numbers are clip.cpp's on ggml's CPU backend (llama.cpp's mtmd): a matmul over an
f16-stored weight reads its input rounded to f16 (`F16_TYPES`; `RoundF16` nodes), and the patch
embedding, ggml_conv_2d over an f16 im2col, reads the pixels and its kernel rounded to f16
(unless the kernel is bf16: an f32 im2col). Without them an f32 file's rows drift ~3e-4
(relative) from mtmd's; with them they agree to ~1e-6 (5e-5 with mtmd's default flash
attention, its K and V in f16).

`encode` keeps the rows of the last `CACHE_IMAGES` images by the sha256 of their file bytes (an
LRU): a follow-up question about the same image, a retried or trimmed request, or each of `n`
choices reads the rows again instead of running the tower again (`n_encoded` counts the runs).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from minfer.backends.base import ExecContext
from minfer.backends.cpu.backend import CpuBackend
from minfer.engine.vision.image import EncodedImage, patches, preprocess
from minfer.engine.weights import ModelWeights
from minfer.gguf.clip import ClipParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import scheduler
from minfer.graph.alloc import Allocator, KVRegions, plan_buffers
from minfer.graph.ir import InputKind
from minfer.models.siglip import INPUT_PROJ, PATCH_EMBD, build_vision

F32, F16, BF16 = 0, 1, 30  # GGML type ids
CACHE_IMAGES = 16  # images whose rows `encode` keeps (Gemma 3 27B: 5.5 MB each)


class VisionWeights(ModelWeights):
    """The mmproj's weights, with the patch embedding and the projection reshaped to matrices."""

    def _reshaped(self, name: str) -> np.ndarray | None:
        if name not in self.file.tensors:
            return None
        if name == PATCH_EMBD:
            w = np.asarray(self.file.array(name), np.float32)
            if name in self.f16_inputs():  # ggml_conv_2d's f16 im2col: the kernel in f16
                w = w.astype(np.float16).astype(np.float32)
            return np.ascontiguousarray(w.reshape(w.shape[0], -1))
        if name == INPUT_PROJ:
            return np.ascontiguousarray(np.asarray(self.file.array(name), np.float32).T)
        return None

    def f16_inputs(self) -> frozenset[str]:
        """The weights whose matmuls ggml runs on f16-rounded inputs: f16-stored ones, and
        the patch embedding unless bf16."""
        types = {name: int(t.ggml_type) for name, t in self.file.tensors.items()}
        names = {name for name, t in types.items() if t == F16}
        if types.get(PATCH_EMBD) not in (None, BF16):
            names.add(PATCH_EMBD)
        return frozenset(names)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().shapes()
        for name in (PATCH_EMBD, INPUT_PROJ):
            w = self._reshaped(name)
            if w is not None and name in shapes:
                shapes[name] = (w.shape[1], w.shape[0])
        return shapes

    def matrix(self, name: str) -> tuple[np.ndarray, int]:
        if name in (PATCH_EMBD, INPUT_PROJ) and name not in self._matrices:
            w = self._reshaped(name)
            assert w is not None
            self._matrices[name] = (w, F32)
        return super().matrix(name)


class VisionEncoder:
    def __init__(self, path: str | Path) -> None:
        self.file = GGUFFile.open(Path(path))
        self.params = cp = ClipParams.from_gguf(self.file)
        self.weights = VisionWeights(self.file)
        graph = build_vision(cp, self.weights.shapes(), self.weights.f16_inputs())
        backend = CpuBackend()
        scheduler.assign_backends(graph, [backend])
        graph.topo_order()
        plan = plan_buffers(graph)
        kv = KVRegions(n_layer=0, n_ctx=1, n_kv_embd=1, new_cache=None)  # type: ignore[arg-type]
        self._buffers = Allocator(kv).buffers(graph, plan)
        self._graph = graph
        self._lock = threading.Lock()  # one image at a time through the shared buffers
        self._cache: OrderedDict[bytes, EncodedImage] = OrderedDict()  # sha256 -> rows, LRU
        self._cache_lock = threading.Lock()
        self.n_encoded = 0  # images run through the tower
        ctx = ExecContext(weights=self.weights, kv=kv, batch_invariant=True, dense_f32=True)
        self._tape = scheduler.build_tape(graph, scheduler.make_splits(graph, plan.live),
                                          self._buffers, {backend.name: backend}, ctx)

    @property
    def n_image_tokens(self) -> int:
        """Embedding rows per chunk (a whole image for Gemma 3, a tile for Idefics3)."""
        return self.params.n_image_tokens

    def _input(self, kind: InputKind) -> np.ndarray:
        buf = self._buffers[self._graph.inputs[kind]]
        assert buf is not None
        return buf

    def _fill(self, cp: ClipParams, rows: np.ndarray) -> None:
        """Every input, before every run (their buffers are reused once read)."""
        self._input(InputKind.PIXELS)[:] = rows
        n, side, m = cp.n_patches, cp.patches_per_side, cp.n_merge
        self._input(InputKind.POSITIONS)[:] = np.arange(n)
        self._input(InputKind.SEQ_START)[:] = 0
        self._input(InputKind.SEQ_END)[:] = n
        # each m x m window's patches together (row-major within it), windows row-major:
        # ggml_pool_2d's output order, and Idefics3's pixel shuffle once joined
        grid = np.arange(n).reshape(side // m, m, side // m, m).transpose(0, 2, 1, 3)
        self._input(InputKind.POOL_ROWS)[:] = grid.reshape(-1)
        if InputKind.OUT_START not in self._graph.inputs:
            return
        n_out = cp.n_image_tokens
        self._input(InputKind.OUT_START)[:] = np.arange(n_out) * m * m
        self._input(InputKind.OUT_END)[:] = (np.arange(n_out) + 1) * m * m

    def encode_pixels(self, chw: np.ndarray) -> np.ndarray:
        """A preprocessed [3, size, size] chunk's [n_image_tokens, n_embd_text] rows."""
        cp = self.params
        if chw.shape != (3, cp.image_size, cp.image_size):
            raise ValueError(f"pixels {chw.shape}, expected (3, {cp.image_size}, "
                             f"{cp.image_size})")
        with self._lock:
            self._fill(cp, patches(np.asarray(chw, np.float32), cp.patch_size))
            self._tape.run()
            self.n_encoded += 1
            out = self._buffers[self._graph.outputs[0]]
            assert out is not None
            return out.copy()

    def encode(self, data: bytes) -> EncodedImage:
        """An image file's bytes to its embedding rows, its chunks' in prompt order (the rows
        read-only: shared with the cache, keyed by the bytes' sha256)."""
        key = hashlib.sha256(data).digest()
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        px = preprocess(data, self.params)
        rows = np.concatenate([self.encode_pixels(c) for c in px.chunks])
        rows.setflags(write=False)
        image = EncodedImage(rows, self.n_image_tokens, px.grid, self.params.projector)
        with self._cache_lock:
            self._cache[key] = image
            while len(self._cache) > CACHE_IMAGES:
                self._cache.popitem(last=False)
        return image
