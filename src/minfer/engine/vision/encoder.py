"""A vision encoder over an mmproj file: images to the text model's embedding rows.

The tower is a graph in the same IR (`minfer.models.siglip.build_vision`, its projector a branch
on `clip.projector_type`), bound into an op tape on the CPU backend's kernels, its matmuls the
dense-f32 GEMM an encoder uses (batch-invariant: an image's rows do not depend on anything
else). An image is one or more chunks of `image_size` (Idefics3's tiles and overview), each run
through the same tape; Qwen3-VL's and LFM2-VL's chunks have their own sizes (one per image, or
LFM2-VL's 512-pixel tiles and a thumbnail): a tower is bound per patch grid (the graph's params
are the grid: equal grids, e.g. all tiles, reuse it; the last `TOWERS` kept), its inputs the
learned position table resized to the grid (`_positions`, once per tower) and the patch rows
(Qwen3-VL's in merge-window order, with the patches' (y, x) rope positions).
Weights are presented in the form a matmul reads: the patch embedding (a convolution kernel
[n_embd, 3, p, p]; Qwen3-VL's two temporal halves summed, the frame being taken twice) as
[n_embd, 3 p^2], and Gemma 3's projection (stored [n_embd_vision, n_embd_text], applied as
x @ W) transposed. A tower with several outputs (Qwen3-VL's merger and deepstack mergers) gives
them side by side.

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
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minfer import env
from minfer.backends.base import ExecContext
from minfer.backends.cpu.backend import CpuBackend
from minfer.engine.forward import profiler, regions_pay
from minfer.engine.vision.image import EncodedImage, patches, preprocess
from minfer.engine.weights import ModelWeights
from minfer.gguf.clip import LFM2, QWEN3VL, ClipParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import scheduler
from minfer.graph.alloc import Allocator, KVRegions, plan_buffers
from minfer.graph.ir import ComputeGraph, InputKind
from minfer.models.qwen3vl_vision import POS_TABLE
from minfer.models.siglip import INPUT_PROJ, PATCH_EMBD, build_vision

F32, F16, BF16 = 0, 1, 30  # GGML type ids
CACHE_IMAGES = 16  # images whose rows `encode` keeps (Gemma 3 27B: 5.5 MB each)
TOWERS = 2  # patch grids whose bound towers are kept (Qwen3-VL, LFM2-VL: one per image size;
#   LFM2-VL's tiles and its thumbnail: two)


class VisionWeights(ModelWeights):
    """The mmproj's weights, with the patch embedding and the projection reshaped to matrices."""

    def _reshaped(self, name: str) -> np.ndarray | None:
        if name not in self.file.tensors:
            return None
        if name == PATCH_EMBD:
            w = np.asarray(self.file.array(name), np.float32)
            if f"{name}.1" in self.file.tensors:  # Qwen3-VL's Conv3d over a frame taken twice
                w = w + np.asarray(self.file.array(f"{name}.1"), np.float32)
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


def _corners_aligned(n: int, side: int) -> np.ndarray:
    """[n, side] bilinear weights, the corners aligned."""
    src = np.linspace(0.0, side - 1, n) if n > 1 else np.zeros(1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, side - 1)
    w = np.zeros((n, side))
    np.add.at(w, (np.arange(n), lo), 1 - (src - lo))
    np.add.at(w, (np.arange(n), hi), src - lo)
    return w


def _antialiased(n: int, side: int) -> np.ndarray:
    """[n, side] antialiased bilinear weights (align_corners False), as ggml's upscale computes
    them in f32: a triangle filter widened by the scale where it shrinks, each row normalized."""
    f32 = np.float32
    sf = f32(n) / f32(side)
    support = max(f32(1.0), f32(1.0) / sf)
    inv = f32(1.0) / support
    w = np.zeros((n, side))
    for i in range(n):
        center = (f32(i) + f32(0.5)) / sf
        lo = max(int(center - support + f32(0.5)), 0)
        hi = min(int(center + support + f32(0.5)), side)
        for s in range(lo, hi):
            w[i, s] = max(f32(1.0) - abs((f32(s) - center + f32(0.5)) * inv), f32(0.0))
        w[i] /= w[i].sum()
    return w


@dataclass
class _Tower:
    """The tower bound for one patch grid: its graph, buffers and op tape."""

    grid: tuple[int, int]  # patches (rows, cols)
    graph: ComputeGraph
    buffers: list[np.ndarray | None]
    tape: scheduler.Tape
    positions: np.ndarray | None = None  # the position table resized to the grid, once made

    def input(self, kind: InputKind) -> np.ndarray:
        buf = self.buffers[self.graph.inputs[kind]]
        assert buf is not None
        return buf


class VisionEncoder:
    def __init__(self, path: str | Path) -> None:
        self.file = GGUFFile.open(Path(path))
        self.params = cp = ClipParams.from_gguf(self.file)
        self.weights = VisionWeights(self.file)
        self._backend = CpuBackend()
        self._kv = KVRegions(n_layer=0, n_ctx=1, n_kv_embd=1, new_cache=None)  # type: ignore
        self._towers: OrderedDict[tuple[int, int], _Tower] = OrderedDict()  # by grid, LRU
        self._pos_table: np.ndarray | None = None
        self._lock = threading.Lock()  # one image at a time through the shared buffers
        self._cache: OrderedDict[bytes, EncodedImage] = OrderedDict()  # sha256 -> rows, LRU
        self._cache_lock = threading.Lock()
        self.n_encoded = 0  # images run through the tower
        # seconds per `op:role` of every tower run when profiling (MINFER_PROFILE)
        self.profile: dict[str, float] | None = {} if env.flag("MINFER_PROFILE") else None
        if not cp.dynamic:
            side = cp.patches_per_side
            self._tower((side, side))

    @property
    def _graph(self) -> ComputeGraph:
        """The most recently used tower's graph (the fixed-size families' only one)."""
        return next(reversed(self._towers.values())).graph

    def _tower(self, grid: tuple[int, int]) -> _Tower:
        """The tower for a grid of patches, bound on first use (the last TOWERS kept)."""
        tower = self._towers.get(grid)
        if tower is not None:
            self._towers.move_to_end(grid)
            return tower
        graph = build_vision(self.params, self.weights.shapes(), self.weights.f16_inputs(),
                             n_patches=grid[0] * grid[1])
        scheduler.assign_backends(graph, [self._backend])
        graph.topo_order()
        plan = plan_buffers(graph)
        buffers = Allocator(self._kv).buffers(graph, plan)
        ctx = ExecContext(weights=self.weights, kv=self._kv, batch_invariant=True,
                          dense_f32=True, composed=regions_pay(grid[0] * grid[1]))
        tape = scheduler.build_tape(graph, scheduler.make_splits(graph, plan.live), buffers,
                                    {self._backend.name: self._backend}, ctx)
        self._towers[grid] = tower = _Tower(grid, graph, buffers, tape)
        while len(self._towers) > TOWERS:
            self._towers.popitem(last=False)
        return tower

    @property
    def n_image_tokens(self) -> int:
        """Embedding rows per chunk (a whole image for Gemma 3, a tile for Idefics3; Qwen3-VL:
        as many as the image's merged grid has)."""
        return self.params.n_image_tokens

    def _fill(self, tower: _Tower, rows: np.ndarray) -> None:
        """Every input, before every run (their buffers are reused once read)."""
        cp, (gh, gw), m = self.params, tower.grid, self.params.n_merge
        n = gh * gw
        # each m x m window's patches together (row-major within it), windows row-major:
        # ggml_pool_2d's output order, Idefics3's pixel shuffle once joined, Qwen3-VL's merge
        order = np.arange(n).reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)
        tower.input(InputKind.SEQ_START)[:] = 0
        tower.input(InputKind.SEQ_END)[:] = n
        if cp.projector == QWEN3VL:  # the rows themselves in window order
            tower.input(InputKind.PIXELS)[:] = rows[order]
            tower.input(InputKind.POS_EMBD)[:] = self._grid_positions(tower)[order]
            y, x = order // gw, order % gw
            tower.input(InputKind.ROPE_POS)[:] = np.concatenate([y, x, y, x])
            return
        tower.input(InputKind.PIXELS)[:] = rows
        if cp.dynamic:  # LFM2-VL: the table resized to the grid
            tower.input(InputKind.POS_EMBD)[:] = self._grid_positions(tower)
        else:
            tower.input(InputKind.POSITIONS)[:] = np.arange(n)
        tower.input(InputKind.POOL_ROWS)[:] = order
        if InputKind.OUT_START not in tower.graph.inputs:
            return
        n_out = cp.n_image_tokens
        tower.input(InputKind.OUT_START)[:] = np.arange(n_out) * m * m
        tower.input(InputKind.OUT_END)[:] = (np.arange(n_out) + 1) * m * m

    def _grid_positions(self, tower: _Tower) -> np.ndarray:
        """`_positions` for the tower's grid, made on its first image (LFM2-VL's tiles)."""
        if tower.positions is None:
            tower.positions = self._positions(*tower.grid)
        return tower.positions

    def _positions(self, gh: int, gw: int) -> np.ndarray:
        """The learned position table (a square of side^2 rows) resized to gh x gw patches,
        row-major, in f64 then f32: Qwen3-VL's bilinear with the corners aligned
        (transformers' and clip.cpp's), LFM2-VL's antialiased bilinear (align_corners False:
        F.interpolate(antialias=True), ggml_interpolate's GGML_SCALE_FLAG_ANTIALIAS)."""
        if self._pos_table is None:
            self._pos_table = np.asarray(self.file.array(POS_TABLE), np.float64)
        side = math.isqrt(self._pos_table.shape[0])
        table = self._pos_table.reshape(side, side, -1)
        axis = _antialiased if self.params.projector == LFM2 else _corners_aligned
        wy, wx = axis(gh, side), axis(gw, side)
        out = np.einsum("ys,stc,xt->yxc", wy, table, wx)
        return out.reshape(gh * gw, -1).astype(np.float32)

    def encode_pixels(self, chw: np.ndarray) -> np.ndarray:
        """A preprocessed [3, size, size] chunk's [n_image_tokens, n_embd_text] rows (Qwen3-VL:
        any [3, h, w] aligned to patch * merge; its merged rows [main | deepstack...])."""
        cp = self.params
        p, m = cp.patch_size, cp.n_merge
        if cp.dynamic:
            if chw.ndim != 3 or chw.shape[0] != 3 or chw.shape[1] % (p * m) \
                    or chw.shape[2] % (p * m):
                raise ValueError(f"pixels {chw.shape}, expected (3, h, w) in multiples of "
                                 f"{p * m}")
        elif chw.shape != (3, cp.image_size, cp.image_size):
            raise ValueError(f"pixels {chw.shape}, expected (3, {cp.image_size}, "
                             f"{cp.image_size})")
        with self._lock:
            tower = self._tower((chw.shape[1] // p, chw.shape[2] // p))
            self._fill(tower, patches(np.asarray(chw, np.float32), p))
            if self.profile is None:
                tower.tape.run()
            else:
                tower.tape.run_observed(profiler(tower.graph, self.profile))
            self.n_encoded += 1
            outs = [tower.buffers[o] for o in tower.graph.outputs]
            return np.concatenate([o for o in outs if o is not None], axis=1)

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
        chunks = [self.encode_pixels(c) for c in px.chunks]
        rows = np.concatenate(chunks)
        rows.setflags(write=False)
        grid = px.grid
        if self.params.dynamic and len(chunks) == 1:  # its grid: the merged tokens'
            grid = (grid[0] // self.params.n_merge, grid[1] // self.params.n_merge)
        image = EncodedImage(rows, tuple(int(c.shape[0]) for c in chunks), grid,
                             self.params.projector)
        with self._cache_lock:
            self._cache[key] = image
            while len(self._cache) > CACHE_IMAGES:
                self._cache.popitem(last=False)
        return image
