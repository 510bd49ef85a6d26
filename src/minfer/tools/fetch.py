"""The model resolver the surfaces call (CLI, Python API, server): the store's `resolve_model`
with the converter a catalogue entry shipped as a checkpoint needs (`all-minilm-l6-v2`), so a
catalogue name, a Hub reference or the default model is fetched on first use everywhere alike.
The converter (gguf's writer, ~0.3 s to import) is imported only when a checkpoint is pulled."""

from __future__ import annotations

from pathlib import Path

from minfer.store.models import resolve_model


def convert_pulled_checkpoint(folder: Path, out: Path, outtype: str,
                              tokenizer_pre: str | None) -> Path:
    """`minfer convert` on a pulled checkpoint (`minfer.store.download.Converter`)."""
    from minfer.convert.convert import convert_checkpoint

    return convert_checkpoint(folder, out, outtype, tokenizer_pre)


def resolve(model: str | Path | None) -> Path:
    """The GGUF file a model argument names, fetched (and converted) on first use."""
    return resolve_model(None if model is None else str(model),
                         converter=convert_pulled_checkpoint)
