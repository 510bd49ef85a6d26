"""minfer.store: models on disk (the cache under $MINFER_HOME, the catalogue, `pull`)."""

from typing import Any

from minfer.store.catalog import minfer_home
from minfer.store.models import CachedModel, list_models, resolve_model

__all__ = ["CachedModel", "list_models", "minfer_home", "pull", "resolve_model"]


def __getattr__(name: str) -> Any:
    """`pull` on first use: its progress bars (rich) cost a warm start 40 ms otherwise."""
    if name == "pull":
        from minfer.store.download import pull

        return pull
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
