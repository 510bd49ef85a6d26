"""minfer: a local LLM inference engine for GGUF models.

`minfer.load(model)` opens a model (a path, a cached name, or None for the default model) and
returns a `Model` with its metadata, hyper-parameters, tokenizer and chat template, and
`.generate()` / `.chat()` iterators of text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from minfer.api import Model


def load(model: object = None, **options: Any) -> Model:
    from minfer.api import load as _load

    return _load(model, **options)  # type: ignore[arg-type]


__all__ = ["__version__", "load"]
