"""Image bytes to an encoder's inputs, as llama.cpp's mtmd preprocesses them per projector.

Decoded by Pillow (JPEG, PNG, WebP, GIF's first frame; anything else, or a corrupt file, is an
`ImageError`) and converted to RGB; then, by `clip.projector_type`:

- gemma3 (`mtmd_image_preprocessor_fixed_size`): scaled to fit the `image_size` square keeping
  its aspect (each side ceil(side * scale), at most image_size; the scale in f32 as clip.cpp),
  resized with Pillow's bilinear filter (clip.cpp's `resize_pillow` is Pillow's algorithm) and
  centred on black (llama.cpp's PAD_CEIL letterbox, `letterboxed`; transformers' Gemma3
  processor stretches a non-square image instead: the two agree on square images). One chunk.
- idefics3 (`mtmd_image_preprocessor_idefics3`, Pillow's Lanczos filter throughout): resized so
  its longer side is `longest_edge` (the other int(longest_edge / aspect), rounded up to even),
  then stretched to whole tiles (each side rounded up to a multiple of `image_size`), cut into
  grid_y x grid_x tiles (row-major), and the overview: that refined image resized to one tile.
  The chunks are the tiles, then the overview (the order mtmd places them in the prompt).
  transformers' Idefics3 processor does the same except that it does not split an image that
  fits one tile (llama.cpp: one tile plus the overview).
- qwen3vl_merger (`mtmd_image_preprocessor_dyn_size`, Qwen's smart resize as clip.cpp's
  `calc_size_preserved_ratio`): each side rounded to a multiple of patch * merge (half away
  from zero, at least one), then, past the most pixels, both scaled down by
  sqrt(h w / max) (floored to the multiple), or below the fewest, up by sqrt(min / (h w))
  (ceiled); resized (bicubic, Pillow's as transformers' Qwen2VLImageProcessorPil; clip.cpp's
  own bicubic may differ in the last bits) only where that changes the size. One chunk of its
  own size; its grid the patches (rows, cols).
- lfm2 (`mtmd_image_preprocessor_lfm2`): an image whose aligned size (each side rounded to
  patch * merge, half to even) is at most twice the most pixels (`lfm2_tiles`) is one chunk:
  the same smart size between 64 and 256 merged tokens (`ClipParams.pixel_limits`), resized
  with Pillow's bilinear filter (clip.cpp's `resize_pillow`, PAD_NONE) where that changes the
  size. A bigger one is tiled (`lfm2_grid`): a grid of cols x rows tiles of `LFM2_TILE` (2 to
  10 tiles; the one whose aspect is closest to the image's, in f32, a tie going to the larger
  grid where the image has over half its pixels), the image letterboxed into that grid
  (Pillow's bilinear, centred on black: clip.cpp's PAD_CEIL for the refined image; transformers'
  Lfm2Vl processor stretches it instead) and cut row-major; then the thumbnail: the whole image
  at its smart size as above. The chunks are the tiles, then the thumbnail (mtmd's prompt
  order), `grid` the tiles (rows, cols).

Each chunk then x / 255, (x - mean) / std per channel (f32, as clip.cpp), and is unfolded into
patch rows (channel, y, x), patches in row-major order, by the encoder.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from minfer.errors import MinferError
from minfer.gguf.clip import LFM2, LFM2_TILE, LFM2_TILE_FACTOR, LFM2_TILES, ClipParams

FORMATS = ("JPEG", "PNG", "WEBP", "GIF")


class ImageError(MinferError):
    """An image that cannot be read (corrupt, or in a format minfer does not decode)."""


@dataclass(frozen=True)
class Pixels:
    """An image as the encoder's inputs: `chunks`, each [3, h, w], in their prompt order;
    `grid` (rows, cols): the tiles before the last chunk (the overview / thumbnail, which may
    have its own size), (0, 0): one chunk; a dynamic-size family's one chunk: `grid` its
    patches (rows, cols)."""

    chunks: tuple[np.ndarray, ...]
    grid: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class EncodedImage:
    """An image's embedding rows, `sizes[i]` rows for its chunk i, chunks in prompt order;
    `grid` the tiles (rows, cols) as `Pixels` when it has several chunks (the last the
    overview); one chunk: (0, 0), or a dynamic-size family's merged tokens' grid (rows, cols)
    (Qwen3-VL: its M-RoPE grid; its rows [main | deepstack...] wide); for the projector family
    `projector` (its prompt markers)."""

    rows: np.ndarray  # [sum(sizes), n_embd_text] float32
    sizes: tuple[int, ...]
    grid: tuple[int, int]
    projector: str

    @property
    def per_chunk(self) -> int:
        """The rows of the first chunk (of each tile, where tiled)."""
        return self.sizes[0]

    def chunk(self, i: int) -> np.ndarray:
        at = sum(self.sizes[:i])
        return self.rows[at:at + self.sizes[i]]


def decode(data: bytes) -> object:
    """The image's first frame as an RGB Pillow image."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.format not in FORMATS:
            raise ImageError(f"image format {img.format or 'unknown'} is not supported "
                             f"({', '.join(FORMATS)})")
        img.seek(0)
        return img.convert("RGB")
    except UnidentifiedImageError:
        raise ImageError("the image cannot be decoded (not JPEG, PNG, WebP or GIF, or "
                         "corrupt)") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"the image is corrupt: {exc}") from None


def letterboxed(img: object, width: int, height: int) -> np.ndarray:
    """The [height, width, 3] uint8 image: scaled to fit keeping its aspect (each side
    ceil(side * scale) in f32, at most the target's), Pillow's bilinear, centred on black
    (clip.cpp's `img_tool::resize` with PAD_CEIL); unchanged at the target size."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    w, h = img.size
    if (w, h) != (width, height):
        f32 = np.float32
        scale = min(f32(width) / f32(w), f32(height) / f32(h))
        nw = min(math.ceil(f32(w) * scale), width)
        nh = min(math.ceil(f32(h) * scale), height)
        canvas = Image.new("RGB", (width, height), (0, 0, 0))
        canvas.paste(img.resize((nw, nh), Image.Resampling.BILINEAR),
                     ((width - nw) // 2, (height - nh) // 2))
        img = canvas
    return np.asarray(img, np.uint8)


def normalized(rgb: np.ndarray, cp: ClipParams) -> np.ndarray:
    """[3, size, size] float32: x / 255, then (x - mean) / std per channel (f32, as clip.cpp)."""
    x = rgb.astype(np.float32) / np.float32(255.0)
    mean, std = np.array(cp.image_mean, np.float32), np.array(cp.image_std, np.float32)
    return np.ascontiguousarray(((x - mean) / std).transpose(2, 0, 1), dtype=np.float32)


def resized(img: object, size: int) -> np.ndarray:
    """The letterboxed [size, size, 3] uint8 square (Gemma 3's)."""
    return letterboxed(img, size, size)


def patches(chw: np.ndarray, patch: int) -> np.ndarray:
    """[n_patches, 3 * patch^2]: each patch's pixels (channel, y, x), patches row-major."""
    c, h, w = chw.shape
    grid = chw.reshape(c, h // patch, patch, w // patch, patch)
    return np.ascontiguousarray(grid.transpose(1, 3, 0, 2, 4).reshape(-1, c * patch * patch))


def tiles(img: object, tile: int, longest_edge: int) -> tuple[list[np.ndarray], tuple[int, int]]:
    """Idefics3's [tile, tile, 3] uint8 chunks (tiles row-major, then the overview) and the
    tile grid (rows, cols); see the module docstring."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    lanczos = Image.Resampling.LANCZOS
    w, h = img.size
    aspect = w / h
    if w >= h:
        rw, rh = longest_edge, int(longest_edge / aspect)
        rh += rh % 2
    else:
        rw, rh = int(longest_edge * aspect), longest_edge
        rw += rw % 2
    cols, rows = -(-rw // tile), -(-rh // tile)
    refined = img.resize((rw, rh), lanczos).resize((cols * tile, rows * tile), lanczos)
    overview = refined.resize((tile, tile), lanczos)
    return [*cut(np.asarray(refined, np.uint8), tile), np.asarray(overview, np.uint8)], \
        (rows, cols)


def cut(refined: np.ndarray, tile: int) -> list[np.ndarray]:
    """An [rows * tile, cols * tile, 3] image's tiles, row-major."""
    rows, cols = refined.shape[0] // tile, refined.shape[1] // tile
    return [refined[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
            for r in range(rows) for c in range(cols)]


def smart_size(w: int, h: int, align: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) of Qwen's smart resize as clip.cpp computes it (module docstring)."""

    def rounded(x: float) -> int:
        return math.floor(x / align + 0.5) * align

    wb, hb = max(align, rounded(w)), max(align, rounded(h))
    if wb * hb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(align, math.floor(h / beta / align) * align)
        wb = max(align, math.floor(w / beta / align) * align)
    elif wb * hb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / align) * align, math.ceil(w * beta / align) * align
    return wb, hb


def lfm2_tiles(w: int, h: int, cp: ClipParams) -> bool:
    """Whether llama.cpp tiles an LFM2-VL image of w x h (`should_tile`: each side rounded to
    the alignment, at least a patch, past LFM2_TILE_FACTOR times the most pixels)."""
    align = cp.patch_size * cp.n_merge

    def rounded(x: int) -> int:
        return max(cp.patch_size, round(x / align) * align)  # nearbyint: half to even

    return rounded(h) * rounded(w) > cp.pixel_limits[1] * LFM2_TILE_FACTOR


def lfm2_grid(w: int, h: int) -> tuple[int, int]:
    """LFM2-VL's tile grid (cols, rows) for a w x h image, as clip.cpp's `get_grid_layout`:
    the grids of LFM2_TILES tiles by area, the first whose aspect is closest to the image's
    (f32), a later equally close one where the image has over half its pixels."""
    f32 = np.float32
    lo, hi = LFM2_TILES
    grids: list[tuple[int, int]] = []
    for n in range(lo, hi + 1):
        grids += [(gw, gh) for gw in range(1, n + 1) for gh in range(1, n + 1)
                  if lo <= gw * gh <= hi and (gw, gh) not in grids]
    grids.sort(key=lambda g: g[0] * g[1])
    aspect, area = f32(w) / f32(h), f32(w * h)
    best, best_diff = (1, 1), f32(np.inf)
    for gw, gh in grids:
        diff = abs(aspect - f32(gw) / f32(gh))
        if diff < best_diff:
            best, best_diff = (gw, gh), diff
        elif diff == best_diff and area > f32(0.5) * f32(LFM2_TILE * LFM2_TILE * gw * gh):
            best = (gw, gh)
    return best


def lfm2_chunks(img: object, cp: ClipParams) -> tuple[list[np.ndarray], tuple[int, int]]:
    """LFM2-VL's tiled [h, w, 3] uint8 chunks (tiles row-major, then the thumbnail) and the
    grid (rows, cols); see the module docstring."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    cols, rows = lfm2_grid(*img.size)
    refined = letterboxed(img, cols * LFM2_TILE, rows * LFM2_TILE)
    return [*cut(refined, LFM2_TILE), dynamic(img, cp)], (rows, cols)


def dynamic(img: object, cp: ClipParams) -> np.ndarray:
    """The [h, w, 3] uint8 image at its smart-resized size."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    size = smart_size(*img.size, cp.patch_size * cp.n_merge, *cp.pixel_limits)
    if size != img.size:
        bilinear = cp.projector == LFM2
        img = img.resize(size, Image.Resampling.BILINEAR if bilinear
                         else Image.Resampling.BICUBIC)
    return np.asarray(img, np.uint8)


def preprocess(data: bytes, cp: ClipParams) -> Pixels:
    """An image file's bytes as the encoder's chunks."""
    from PIL import Image

    img = decode(data)
    assert isinstance(img, Image.Image)
    if cp.projector == LFM2 and lfm2_tiles(*img.size, cp):
        chunks, grid = lfm2_chunks(img, cp)
    elif cp.dynamic:
        chw = normalized(dynamic(img, cp), cp)
        return Pixels((chw,), (chw.shape[1] // cp.patch_size, chw.shape[2] // cp.patch_size))
    elif cp.projector == "idefics3":
        chunks, grid = tiles(img, cp.image_size, cp.longest_edge)
    else:
        chunks, grid = [letterboxed(img, cp.image_size, cp.image_size)], (0, 0)
    return Pixels(tuple(normalized(c, cp) for c in chunks), grid)
