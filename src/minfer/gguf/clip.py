"""An mmproj file's vision settings (`clip.*` metadata), read as llama.cpp's clip.cpp reads them.

Only the projector families minfer encodes are accepted; any other `clip.projector_type` is
refused by name. Gemma 3 (`gemma3`): a SigLIP tower (LayerNorm, tanh GELU, learned positions,
no pre-norm), its patches average-pooled by `n_merge` per side (4 unless the file says
`clip.vision.projector.scale_factor`), then RMSNorm (`mm.soft_emb_norm`) and a projection to the
text model's width (`mm.input_projection`); images resized to the fixed `image_size` square.
Idefics3 (`idefics3`, SmolVLM): the same SigLIP tower over tiles of `image_size`, its patches
pixel-shuffled by `n_merge` per side (the scale factor, 2 unless the file says otherwise: each
n_merge x n_merge window's rows joined into one), then `mm.model.fc` to the text model's width;
an image is resized to `longest_edge` (`clip.vision.preproc_image_size`) and cut into tiles
plus an overview (`minfer.engine.vision.image`).
Qwen3-VL (`qwen3vl_merger`): its own ViT (`minfer.models.qwen3vl_vision`) over an image of any
size, resized to a multiple of patch * n_merge (`clip.vision.spatial_merge_size`, 2) with
between `MIN_TOKENS` and `MAX_TOKENS` merged tokens (clip.cpp's limits for the family); the
layers `clip.vision.is_deepstack_layers` flags feed deepstack mergers; `image_size` only sizes
the learned position table (its side: image_size / patch_size).
LFM2-VL (`lfm2`): the SigLIP tower (SigLIP2 NaFlex) over an image of any size, smart-resized
as Qwen3-VL's (align patch * n_merge, n_merge the scale factor, 2) between `LFM2_TOKENS` merged
tokens (clip.cpp's 64 and 256), its learned position table (image_size / patch_size per side)
resized to the patch grid; pixel unshuffle by n_merge, LayerNorm (`mm.input_norm`, optional),
`mm.1`, GELU, `mm.2`. An image past `LFM2_TILE_FACTOR` times the most pixels is cut into
`LFM2_TILE`-pixel tiles (between `LFM2_TILES` of them) plus a smart-resized thumbnail
(`minfer.engine.vision.image`).
"""

from __future__ import annotations

from dataclasses import dataclass

from minfer.errors import ModelError
from minfer.gguf.reader import GGUFFile

QWEN3VL, LFM2 = "qwen3vl_merger", "lfm2"
SUPPORTED = ("gemma3", "idefics3", QWEN3VL, LFM2)
LATER: tuple[str, ...] = ()
DYNAMIC = (QWEN3VL, LFM2)  # the families whose images keep their own (aligned) size
DEFAULT_MERGE = {"gemma3": 4, "idefics3": 2, QWEN3VL: 2, LFM2: 2}
MERGE_KEY = {QWEN3VL: "spatial_merge_size"}  # else projector.scale_factor
MIN_TOKENS, MAX_TOKENS = 8, 4096  # Qwen3-VL's merged tokens per image (clip.cpp's limits)
LFM2_TOKENS = (64, 256)  # LFM2-VL's (clip.cpp's set_limit_image_tokens(64, 256))
LFM2_TILE_FACTOR = 2.0  # llama.cpp tiles an LFM2-VL image past this many times the most pixels
LFM2_TILE = 512  # LFM2-VL's tile side (mtmd_image_preprocessor_lfm2::tile_size)
LFM2_TILES = (2, 10)  # its fewest and most tiles (min_tiles, max_tiles)


@dataclass(frozen=True)
class ClipParams:
    projector: str
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    eps: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    n_merge: int
    n_embd_text: int
    longest_edge: int = 0  # idefics3: the image's longest side before tiling (0: no tiling)
    deepstack: tuple[int, ...] = ()  # qwen3vl: the layers whose outputs feed deepstack mergers

    @property
    def dynamic(self) -> bool:
        """Whether an image keeps its own (aligned) size instead of fixed squares."""
        return self.projector in DYNAMIC

    @property
    def pixel_limits(self) -> tuple[int, int]:
        """A dynamic-size image's (min, max) pixels: MIN_TOKENS / MAX_TOKENS merged tokens
        (LFM2-VL: LFM2_TOKENS)."""
        area = (self.patch_size * self.n_merge) ** 2
        lo, hi = LFM2_TOKENS if self.projector == LFM2 else (MIN_TOKENS, MAX_TOKENS)
        return lo * area, hi * area

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def n_image_tokens(self) -> int:
        """Embeddings one encoder input (an image, a tile) becomes: the merged grid."""
        return (self.patches_per_side // self.n_merge) ** 2

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ClipParams:
        meta = f.metadata
        if not meta.get("clip.has_vision_encoder", False):
            raise ModelError(f"{f.path.name} has no vision encoder (not an mmproj file with "
                             "clip.has_vision_encoder)")
        proj = str(meta.get("clip.vision.projector_type", meta.get("clip.projector_type", "")))
        if proj not in SUPPORTED:
            later = " (planned)" if proj in LATER else ""
            raise ModelError(f"vision projector type {proj!r}{later} is not supported yet; "
                             f"minfer encodes images for: {', '.join(SUPPORTED)}")

        def get(key: str, default: object = None) -> object:
            value = meta.get(f"clip.vision.{key}", default)
            if value is None:
                raise ModelError(f"{f.path.name}: clip.vision.{key} is missing")
            return value

        def triple(key: str) -> tuple[float, float, float]:
            v = [float(x) for x in get(key)]  # type: ignore[attr-defined]
            if len(v) != 3:
                raise ModelError(f"{f.path.name}: clip.vision.{key} needs 3 values")
            return (v[0], v[1], v[2])

        cp = cls(
            projector=proj,
            image_size=int(get("image_size")),  # type: ignore[call-overload]
            patch_size=int(get("patch_size")),  # type: ignore[call-overload]
            n_embd=int(get("embedding_length")),  # type: ignore[call-overload]
            n_ff=int(get("feed_forward_length")),  # type: ignore[call-overload]
            n_layer=int(get("block_count")),  # type: ignore[call-overload]
            n_head=int(get("attention.head_count")),  # type: ignore[call-overload]
            eps=float(get("attention.layer_norm_epsilon", 1e-6)),  # type: ignore[arg-type]
            image_mean=triple("image_mean"),
            image_std=triple("image_std"),
            n_merge=int(get(MERGE_KEY.get(proj, "projector.scale_factor"),  # type: ignore
                            DEFAULT_MERGE[proj])),
            n_embd_text=int(get("projection_dim")),  # type: ignore[call-overload]
            longest_edge=int(get("preproc_image_size", 0))  # type: ignore[call-overload]
            if proj == "idefics3" else 0,
            deepstack=tuple(i for i, d in enumerate(meta.get("clip.vision.is_deepstack_layers",
                                                             ())) if d),
        )
        if proj == "idefics3" and cp.longest_edge <= 0:
            raise ModelError(f"{f.path.name}: an idefics3 mmproj without "
                             "clip.vision.preproc_image_size (an older conversion, which "
                             "llama.cpp slices another way) is not supported: reconvert it")
        side = cp.patches_per_side
        if cp.image_size % cp.patch_size or side % cp.n_merge or cp.n_embd % cp.n_head:
            raise ModelError(f"{f.path.name}: image {cp.image_size} / patch {cp.patch_size} / "
                             f"merge {cp.n_merge} / {cp.n_head} heads do not tile")
        return cp
