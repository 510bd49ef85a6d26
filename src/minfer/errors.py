"""The typed errors minfer raises.

Every failure a user can cause (a bad file, an unknown architecture, a prompt that does not fit)
is one of these, so the CLI can print one line and exit 2, and the server can map it to a 4xx.
Nothing here falls back silently: raising is the only way out.
"""

from __future__ import annotations


class MinferError(Exception):
    """Base class of every error minfer raises on purpose."""


class GGUFError(MinferError):
    """A GGUF file that cannot be read: names the file and the problem."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ModelError(MinferError):
    """A model that loads as GGUF but that minfer cannot run (unknown architecture, bad shapes)."""


class ModelNotFoundError(MinferError):
    """A model argument that resolves to no file."""


class DownloadError(MinferError):
    """Fetching a catalogue model failed (pip, checksum, disk)."""


class TokenizerError(MinferError):
    """Tokenizer metadata minfer cannot honour (unknown pre-tokenizer, bad vocabulary)."""


class TemplateError(MinferError):
    """A chat template that cannot compile or that raised while rendering."""


class GraphError(MinferError):
    """A malformed compute graph (dangling id, cycle, shape mismatch)."""


class ContextOverflowError(MinferError):
    """A position at or beyond n_ctx: refused before anything is written."""


class SamplingError(MinferError):
    """Invalid sampler settings."""


class GrammarError(MinferError):
    """A grammar or JSON schema the constraint library refuses."""
