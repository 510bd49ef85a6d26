"""Turning a model argument into a file, and listing the models in the cache.

Owns `resolve_model` (a path to a .gguf or the first part of a split set, a cached name,
`hf:ORG/REPO[:QUANT|:FILE]` — from the Hub cache, pulled if missing — or None for the default
model, pulled if missing) and `list_models` (what `minfer list` shows). A
`.partial` file is an unfinished pull and is never taken for a model.
"""

from __future__ import annotations

import contextlib
import glob
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from minfer.errors import GGUFError, ModelNotFoundError
from minfer.gguf.reader import GGUFFile
from minfer.store.catalog import default_model_name, minfer_home
from minfer.store.hub import cached_hub_model, list_hub_models, pull_hub
from minfer.store.hub_select import is_hub_ref

_LATER_SPLIT_PART = re.compile(r"-(?!00001)\d{5}-of-\d{5}\.gguf$")
_FIRST_SPLIT_PART = re.compile(r"-00001-of-\d{5}\.gguf$")


@dataclass(frozen=True)
class CachedModel:
    """A model in the cache; architecture/quantization are None when the file cannot be read."""

    name: str
    path: Path
    size: int
    architecture: str | None
    quantization: str | None
    error: str | None = None


def _cached_path(name: str, home: Path) -> Path | None:
    stem = name.removesuffix(".gguf")
    single = home / f"{stem}.gguf"
    if single.is_file():
        return single
    firsts = sorted(home.glob(f"{glob.escape(stem)}-00001-of-[0-9][0-9][0-9][0-9][0-9].gguf"))
    return firsts[0] if firsts else None


def resolve_model(arg: str | None) -> Path:
    """The GGUF file a model argument names; None → the default model (pulled if missing)."""
    home = minfer_home()
    if arg is None:
        name = default_model_name()
        cached_default = _cached_path(name, home)
        if cached_default is not None:
            return cached_default
        from minfer.store.download import pull  # rich's progress bars: imported when pulling

        return pull(name)
    if is_hub_ref(arg):
        return cached_hub_model(arg) or pull_hub(arg)
    if arg.endswith(".partial"):
        raise ModelNotFoundError(f"{arg}: an unfinished download, not a model "
                                 "(run `minfer pull` again)")
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ModelNotFoundError(f"{arg}: is a directory, not a .gguf file")
    looks_like_path = "/" in arg or "\\" in arg
    cached = None if looks_like_path else _cached_path(arg, home)
    if cached is None:
        hint = "no such file" if looks_like_path else (
            f"no such file, and no model {arg!r} in {home} (try `minfer pull {arg}`)")
        raise ModelNotFoundError(f"{arg}: {hint}")
    return cached


def model_quantization(f: GGUFFile) -> str:
    """general.file_type by name (e.g. Q4_K_M), else the most common 2-D tensor type."""
    ftype = f.metadata.get("general.file_type")
    if isinstance(ftype, int):
        import gguf  # (its file-type names; not on a model's load path)

        with contextlib.suppress(ValueError):
            return gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_")
    census = Counter(t.type_name for t in f.tensors.values() if len(t.shape) >= 2)
    return census.most_common(1)[0][0] if census else "?"


def describe_model(path: Path, name: str | None = None) -> CachedModel:
    """A model file's name (the file name without `.gguf` and split suffix), size, architecture
    and quantization; a file that does not parse is described by its error."""
    name = name or _FIRST_SPLIT_PART.sub("", path.name).removesuffix(".gguf")
    try:
        with GGUFFile.open(path) as f:
            return CachedModel(name, path, f.file_size, f.architecture or "?",
                               model_quantization(f))
    except GGUFError as exc:
        return CachedModel(name, path, path.stat().st_size, None, None, exc.problem)


def list_models() -> list[CachedModel]:
    """Every model file in the cache (first parts of split sets only), by name, then the
    Hugging Face Hub models in its cache (named `hf:ORG/REPO:FILE`)."""
    home = minfer_home()
    hub = [describe_model(path, name) for name, path in list_hub_models()]
    if not home.is_dir():
        return hub
    return sorted((describe_model(p) for p in model_files(home)), key=lambda m: m.name) + hub


def model_files(folder: Path) -> list[Path]:
    """The model files in a folder: its .gguf files, of a split set only the first part."""
    return sorted(p for p in folder.glob("*.gguf")
                  if p.is_file() and not _LATER_SPLIT_PART.search(p.name))
