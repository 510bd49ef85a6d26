"""Image bytes to an encoder's input, as llama.cpp's mtmd does it for a fixed-size projector.

Decoded by Pillow (JPEG, PNG, WebP, GIF's first frame; anything else, or a corrupt file, is an
`ImageError`), converted to RGB, then `mtmd_image_preprocessor_fixed_size`: scaled to fit the
`image_size` square keeping its aspect (each side ceil(side * scale), at most image_size),
resized with Pillow's bilinear filter (clip.cpp's `resize_pillow` is Pillow's algorithm) and
centred on black (llama.cpp's PAD_CEIL letterbox; transformers' Gemma3 processor stretches a
non-square image instead: the two agree on square images), then x / 255, (x - mean) / std per
channel, and unfolded into patch rows (channel, y, x), patches in row-major order.
"""

from __future__ import annotations

import io
import math

import numpy as np

from minfer.errors import MinferError
from minfer.gguf.clip import ClipParams

FORMATS = ("JPEG", "PNG", "WEBP", "GIF")


class ImageError(MinferError):
    """An image that cannot be read (corrupt, or in a format minfer does not decode)."""


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


def resized(img: object, size: int) -> np.ndarray:
    """The letterboxed [size, size, 3] uint8 square (see the module docstring)."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    w, h = img.size
    if (w, h) != (size, size):
        scale = min(size / w, size / h)
        nw, nh = min(math.ceil(w * scale), size), min(math.ceil(h * scale), size)
        canvas = Image.new("RGB", (size, size), (0, 0, 0))
        canvas.paste(img.resize((nw, nh), Image.Resampling.BILINEAR),
                     ((size - nw) // 2, (size - nh) // 2))
        img = canvas
    return np.asarray(img, np.uint8)


def normalized(rgb: np.ndarray, cp: ClipParams) -> np.ndarray:
    """[3, size, size] float32: x / 255, then (x - mean) / std per channel (f32, as clip.cpp)."""
    x = rgb.astype(np.float32) / np.float32(255.0)
    mean, std = np.array(cp.image_mean, np.float32), np.array(cp.image_std, np.float32)
    return np.ascontiguousarray(((x - mean) / std).transpose(2, 0, 1), dtype=np.float32)


def patches(chw: np.ndarray, patch: int) -> np.ndarray:
    """[n_patches, 3 * patch^2]: each patch's pixels (channel, y, x), patches row-major."""
    c, h, w = chw.shape
    grid = chw.reshape(c, h // patch, patch, w // patch, patch)
    return np.ascontiguousarray(grid.transpose(1, 3, 0, 2, 4).reshape(-1, c * patch * patch))


def preprocess(data: bytes, cp: ClipParams) -> np.ndarray:
    """An image file's bytes as the encoder's [3, size, size] input."""
    return normalized(resized(decode(data), cp.image_size), cp)
