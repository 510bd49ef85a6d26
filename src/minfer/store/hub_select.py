"""Which files of a Hugging Face repo a `hf:ORG/REPO[:FILE_OR_QUANT]` argument means.

Pure functions over file listings, following llama.cpp's `-hf` rule (common/download.cpp): a
quant tag picks the first model file (in listing order) whose path contains `<TAG>.` or
`<TAG>-` (case-insensitive), skipping parts after the first of a split set and sidecars
(mmproj, imatrix, mtp-, eagle3-, …); no tag tries Q4_K_M, then Q8_0, then the first model
file. A selector ending in `.gguf` names a file exactly. A split set comes whole.

`rank_mmproj` orders a model's mmproj candidates as llama.cpp's `find_best_sibling` picks the
one `llama-server -hf` pulls with it: GGUF files with "mmproj" in their path, in the model's
folder or one above it (deeper first), then the quantization bits closest to the model's
(`Q4_K_M` 4, `F16` 16: the digits of the tag after the last `-` or `.`), then listing order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from minfer.errors import ModelNotFoundError

HF_PREFIX = "hf:"
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
_SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class HubRef:
    """`hf:ORG/REPO[:SELECTOR]`: selector is a file path (ends .gguf), a quant tag, or ""."""

    repo: str
    selector: str = ""

    @property
    def is_file(self) -> bool:
        return self.selector.lower().endswith(".gguf")

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.repo}" + (f":{self.selector}" if self.selector else "")


@dataclass(frozen=True)
class HubFile:
    """One file of a repo listing; sha256 is the LFS oid when the Hub gives one."""

    path: str
    size: int | None = None
    sha256: str | None = None


def is_hub_ref(arg: str) -> bool:
    return arg.startswith(HF_PREFIX)


def parse_hub_ref(arg: str) -> HubRef:
    body = arg.removeprefix(HF_PREFIX)
    repo, _, selector = body.partition(":")
    if not _REPO.match(repo) or ":" in selector:
        raise ModelNotFoundError(f"{arg!r}: expected hf:ORG/REPO[:QUANT or :FILE.gguf]")
    return HubRef(repo, selector)


def split_info(path: str) -> tuple[str, int, int]:
    """(prefix without the split suffix, part index from 1, part count) of a .gguf path."""
    stem = path.removesuffix(".gguf")
    m = _SPLIT.match(stem)
    return (m[1], int(m[2]), int(m[3])) if m else (stem, 1, 1)


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(s in name for s in _SIDECARS)


def _first_tagged(files: list[HubFile], tag: str) -> HubFile | None:
    pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
    for f in files:
        if is_model_file(f.path) and pattern.search(f.path) and split_info(f.path)[1] == 1:
            return f
    return None


def _primary(files: list[HubFile], ref: HubRef) -> HubFile | None:
    if ref.is_file:
        return next((f for f in files if f.path == ref.selector), None)
    for tag in (ref.selector,) if ref.selector else DEFAULT_TAGS:
        if found := _first_tagged(files, tag):
            return found
    if ref.selector:
        return None
    return next((f for f in files if is_model_file(f.path) and split_info(f.path)[1] == 1), None)


def select_files(files: list[HubFile], ref: HubRef) -> list[HubFile]:
    """The model files ref names (all parts of a split set, first part first)."""
    primary = _primary(files, ref)
    if primary is None:
        ggufs = [f.path for f in files if f.path.endswith(".gguf")]
        listing = ", ".join(ggufs[:20]) or "none"
        raise ModelNotFoundError(f"{ref}: no matching GGUF file in the repository "
                                 f"(GGUF files: {listing})")
    prefix, _, count = split_info(primary.path)
    if count == 1:
        return [primary]
    parts = sorted((f for f in files if split_info(f.path)[0] == prefix
                    and split_info(f.path)[2] == count), key=lambda f: split_info(f.path)[1])
    if [split_info(f.path)[1] for f in parts] != list(range(1, count + 1)):
        raise ModelNotFoundError(f"{ref}: split set {primary.path} is incomplete in the "
                                 f"repository ({len(parts)} of {count} parts)")
    return parts


def quant_bits(path: str) -> int:
    """llama.cpp's `extract_quant_bits`: Q4_0 -> 4, F16 -> 16, no digits -> 0."""
    m = _TAG.search(split_info(path)[0])
    digits = re.search(r"[0-9]+", m[1]) if m else None
    return int(digits[0]) if digits else 0


def rank_mmproj(paths: list[str], model: str) -> list[str]:
    """The mmproj candidates among paths for the model file, best first (see the module
    docstring); paths in folders that are not the model's or above it are left out."""
    model_dir = model.split("/")[:-1]
    bits = quant_bits(model)
    ranked = []
    for i, path in enumerate(paths):
        parts = path.split("/")
        if not path.endswith(".gguf") or "mmproj" not in path or path == model:
            continue
        folder = parts[:-1]
        if model_dir[:len(folder)] != folder:
            continue
        ranked.append((-len(folder), abs(quant_bits(path) - bits), i, path))
    return [path for *_, path in sorted(ranked)]
