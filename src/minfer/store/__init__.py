"""minfer.store: models on disk (the cache under $MINFER_HOME, the catalogue, `pull`)."""

from minfer.store.catalog import minfer_home
from minfer.store.download import pull
from minfer.store.models import CachedModel, list_models, resolve_model

__all__ = ["CachedModel", "list_models", "minfer_home", "pull", "resolve_model"]
