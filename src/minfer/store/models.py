"""Turning a model argument into a file, and listing the models in the cache.

Owns `resolve_model` (a path to a .gguf or the first part of a split set, a cached name, a
catalogue name or `hf:ORG/REPO[:QUANT|:FILE]` — from the cache, pulled on first use, saying so
on stderr — or None for the default model) and `list_models` (what `minfer list` shows). A
`.partial` file is an unfinished pull and is never taken for a model.
"""

from __future__ import annotations

import contextlib
import glob
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from minfer.errors import GGUFError, ModelNotFoundError
from minfer.gguf.reader import GGUFFile
from minfer.store.catalog import default_model_name, load_catalog, minfer_home
from minfer.store.hub import cached_hub_model, list_hub_models, pull_hub
from minfer.store.hub_select import is_hub_ref

if TYPE_CHECKING:
    from minfer.store.download import Converter

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


def resolve_model(arg: str | None, *, converter: Converter | None = None) -> Path:
    """The GGUF file a model argument names: a path, a cached name, a catalogue name or
    `hf:ORG/REPO[:QUANT|:FILE]` (fetched on first use, as `ollama run` does, saying so on
    stderr), or None for the default model. `converter` turns a catalogue entry shipped as a
    checkpoint into its GGUF (the surfaces pass `minfer.tools.fetch`'s; the store sits below
    the converter)."""
    home = minfer_home()
    if arg is None:
        arg = default_model_name()
    elif is_hub_ref(arg):
        if (cached_hub := cached_hub_model(arg)) is not None:
            return cached_hub
        _say_first_use(arg, arg)
        return pull_hub(arg)
    if arg.endswith(".partial"):
        raise ModelNotFoundError(f"{arg}: an unfinished download, not a model "
                                 "(run `minfer pull` again)")
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ModelNotFoundError(f"{arg}: is a directory, not a .gguf file")
    if "/" in arg or "\\" in arg:
        raise ModelNotFoundError(f"{arg}: no such file")
    cached = _cached_path(arg, home)
    if cached is not None:
        return cached
    entry = load_catalog().find(arg.removesuffix(".gguf"))
    if entry is None:
        raise ModelNotFoundError(f"{arg}: no such file, and no model {arg!r} in {home} or in "
                                 "the catalogue (`minfer list --catalogue`)")
    if entry.hub is not None and (cached_hub := cached_hub_model(entry.hub)) is not None:
        return cached_hub
    if entry.hub is None and entry.name != arg and (
            cached := _cached_path(entry.name, home)) is not None:
        return cached  # an alias of a pulled entry
    size = f"{entry.size / 2**20:,.0f} MiB" if entry.size >= 2**20 else f"{entry.size:,} bytes"
    _say_first_use(arg, entry.hub or size)
    from minfer.store.download import pull  # rich's progress bars: imported when pulling

    return pull(entry.name, converter=converter)


def _say_first_use(name: str, what: str) -> None:
    """The one line a first use prints before it downloads (the progress bar follows)."""
    where = "the Hugging Face cache" if what.startswith("hf:") else str(minfer_home())
    source = f" ({what})" if what != name else ""
    print(f"minfer: {name} is not downloaded yet: pulling it{source} into {where}",
          file=sys.stderr, flush=True)


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
