"""Images in a chat's messages: read from their content parts, laid out in the prompt's ids.

As llama.cpp's mtmd: each image part becomes the media marker `<__media__>` in the message's
text before the chat template renders it (so any template places images where their parts
were); the rendered prompt is split at the markers, each text piece tokenized (special tokens
parsed, BOS on the first only), and each marker expands to the image's chunks framed by its
family's markers, one placeholder token per embedding row:

- gemma3: the text `<start_of_image>`, `<image_soft_token>` per row, the text `<end_of_image>`;
  the block reads itself both ways.
- qwen3vl_merger: `<|vision_start|>`, `<|image_pad|>` per row, `<|vision_end|>`; one causal
  block whose rows take M-RoPE positions over the image's merged grid (`PromptRows.grid`).
- lfm2: `<|image_start|>`, `<image>` per row, `<|image_end|>` (one causal block); a tiled image
  (mtmd's `MTMD_SLICE_TMPL_LFM2`): `<|image_start|>`, per tile the text `<|img_row_r_col_c|>`
  and its rows (`<image>` each), no separator between rows; then `<|img_thumbnail|>` (one
  token) and the thumbnail's rows, `<|image_end|>`; causal blocks.
- idefics3: per tile the text `<fake_token_around_image><row_r_col_c>` and its rows
  (`<image>` each), `\n` between tile rows; then `\n\n<fake_token_around_image><global-img>`,
  the overview's rows, `<fake_token_around_image>`; causal blocks (mtmd's
  `MTMD_SLICE_TMPL_IDEFICS3`).

The markers written as text are tokenized as text (special tokens parsed), as mtmd does: a
vocabulary that holds them as special tokens gives one id each. The placeholders count as
prompt tokens (usage); their embedding rows are the encoder's
(`PromptRows`).

An image part is OpenAI's {"type": "image_url", "image_url": {"url": "data:image/...;base64,
..."}} (or "image_url": "data:...", or an http(s) URL: downloaded by `fetch`), the Responses
API's {"type": "input_image", "image_url": ...}, or {"type": "image", "path": FILE} /
{"type": "image", "data": bytes or base64 text}. Text parts ({"type": "text", "text": ...})
are joined with the markers into one string content.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from minfer.engine.core.request import PromptRows
from minfer.engine.vision.image import EncodedImage, ImageError
from minfer.gguf.clip import LFM2, QWEN3VL

MARKER = "<__media__>"
BEGIN, END, PLACEHOLDER = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
FAKE, GLOBAL, IMAGE = "<fake_token_around_image>", "<global-img>", "<image>"
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
LFM2_START, LFM2_END, THUMBNAIL = "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"
IMAGE_TYPES = ("image_url", "image", "input_image")


def image_bytes(part: Mapping[str, Any]) -> bytes:
    """An image content part's file bytes (ImageError: not an image part we read)."""
    # (the HTTP client is imported only where an image is read: a text prompt's
    # `split_images` runs without it)
    from minfer.engine.vision.fetch import base64_bytes, url_bytes

    if part.get("type") == "image":
        if "path" in part:
            try:
                return Path(part["path"]).read_bytes()
            except OSError as exc:
                raise ImageError(f"cannot read the image {part['path']}: {exc}") from None
        data = part.get("data")
        if isinstance(data, bytes | bytearray):
            return bytes(data)
        if isinstance(data, str):
            return base64_bytes(data)
        raise ImageError('an "image" part needs "path" or "data"')
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str):
        raise ImageError(f'an "{part.get("type")}" part needs an image URL ({{"url": '
                         '"data:..."}} or "https://...")')
    return url_bytes(url)


def split_images(messages: Sequence[Mapping[str, Any]]
                 ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages with each image part replaced by MARKER (a content list with images
    joined into one string), and the images' bytes in order."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(
                isinstance(p, Mapping) and p.get("type") in IMAGE_TYPES for p in content):
            out.append(dict(message))
            continue
        text: list[str] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in IMAGE_TYPES:
                images.append(image_bytes(part))
                text.append(MARKER)
            elif kind == "text":
                text.append(str(part.get("text", "")))
            else:
                raise ImageError(f"a content part of type {kind!r} cannot be read "
                                 "(text, image_url, image)")
        out.append({**message, "content": "".join(text)})
    return out, images


def _lookup(token_id: Callable[[str], int | None], *texts: str) -> list[int]:
    """The ids of the family's marker tokens (ImageError naming those the vocabulary lacks)."""
    ids = [token_id(t) for t in texts]
    missing = [t for t, i in zip(texts, ids, strict=True) if i is None]
    if missing:
        raise ImageError(f"the model's vocabulary lacks {', '.join(missing)}: it does not "
                         "take images")
    return [int(i) for i in ids if i is not None]


def _image_ids(image: EncodedImage, ids: list[int], placed: list[PromptRows],
               token_id: Callable[[str], int | None], rest: Callable[[str], list[int]]) -> None:
    """Append one image's markers and placeholders to ids, its blocks to placed."""

    def block(chunk: int, placeholder: int, causal: bool,
              grid: tuple[int, int] = (0, 0)) -> None:
        rows = image.chunk(chunk)
        placed.append(PromptRows(len(ids), rows, causal, grid))
        ids.extend([placeholder] * int(rows.shape[0]))

    if image.projector == QWEN3VL:
        start, end, pad = _lookup(token_id, VISION_START, VISION_END, IMAGE_PAD)
        ids.append(start)
        block(0, pad, True, image.grid)
        ids.append(end)
        return
    def tiles(img: int, marker: str, row_end: str) -> int:
        """Each tile's marker (`marker` formatted with its 1-based row r and col c) and rows,
        row_end between tile rows; the overview's chunk index."""
        n_row, n_col = image.grid
        for r in range(n_row):
            for c in range(n_col):
                ids.extend(rest(marker.format(r=r + 1, c=c + 1)))
                block(r * n_col + c, img, True)
            if row_end and r != n_row - 1:
                ids.extend(rest(row_end))
        return n_row * n_col

    if image.projector == LFM2:
        (img,) = _lookup(token_id, IMAGE)
        ids.extend(rest(LFM2_START))
        if len(image.sizes) > 1:
            (thumb,) = _lookup(token_id, THUMBNAIL)
            overview = tiles(img, "<|img_row_{r}_col_{c}|>", "")
            ids.append(thumb)
            block(overview, img, True)
        else:
            block(0, img, True)
        ids.extend(rest(LFM2_END))
        return
    if image.projector == "idefics3":
        fake, glob, img = _lookup(token_id, FAKE, GLOBAL, IMAGE)
        overview = tiles(img, FAKE + "<row_{r}_col_{c}>", "\n")
        ids.extend([*rest("\n\n"), fake, glob])
        block(overview, img, True)
        ids.append(fake)
        return
    (placeholder,) = _lookup(token_id, PLACEHOLDER)
    ids.extend(rest(BEGIN))
    block(0, placeholder, False)
    ids.extend(rest(END))


def layout(text: str, images: Sequence[EncodedImage], token_id: Callable[[str], int | None], *,
           first: Callable[[str], list[int]], rest: Callable[[str], list[int]]
           ) -> tuple[list[int], tuple[PromptRows, ...]]:
    """The rendered prompt's ids, each MARKER expanded to its image's markers and a
    placeholder per row (see the module docstring), and where each block of rows goes.
    token_id: a vocabulary string's id; first / rest tokenize the first text piece (BOS as
    the model adds it) and the others."""
    pieces = text.split(MARKER)
    if len(pieces) != len(images) + 1:
        raise ImageError(f"the prompt has {len(pieces) - 1} image markers for {len(images)} "
                         "images (a message's text contains the marker itself?)")
    ids = first(pieces[0])
    placed: list[PromptRows] = []
    for image, piece in zip(images, pieces[1:], strict=True):
        _image_ids(image, ids, placed, token_id, rest)
        ids.extend(rest(piece))
    return ids, tuple(placed)
