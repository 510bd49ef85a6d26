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
    """Open a model for generation, chat, fill-in-the-middle, embeddings or reranking.

    model: a path to a .gguf file (or the first part of a split set), the name of a model in
        the cache ($MINFER_HOME, default ~/.cache/minfer), a catalogue name (`minfer list
        --catalogue`: "all-minilm-l6-v2", "qwen3:0.6b", ...) or "hf:ORG/REPO[:QUANT|:FILE]";
        a catalogue name or Hub reference not yet downloaded is fetched on first use. None:
        the default model (Qwen2.5-Coder-0.5B-Instruct).

    Options (keywords, as the CLI's flags):
        n_ctx: context size in tokens (default 4096; grown to fit a longer prompt, up to the
            model's training context).
        kv_type: the KV cache format, "f16" (default), "f32", "q8_0" or "q4_0";
            k_type / v_type: the K or V cache alone (each defaults to kv_type).
        threads: CPU threads (default: $MINFER_THREADS, else every usable core).
        batch_size: prefill chunk size in tokens (default 512).
        backend: "auto" (default), "cpu" or "torch".
        fuse: run the fused graph (default True; False runs the unfused twin).

    Returns a `minfer.api.Model`: `.chat(messages or a string)`, `.generate(prompt)`,
    `.infill(prefix, suffix)`, `.embed(texts)`, `.rerank(query, documents)`, and
    `.tokenizer`, `.hparams`, `.metadata`."""
    from minfer.api import load as _load

    return _load(model, **options)  # type: ignore[arg-type]


__all__ = ["__version__", "load"]
