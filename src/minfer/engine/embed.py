"""Embeddings and reranking scores: inputs packed into forwards, pooled, normalised.

An `Embedder` runs an Engine whose context pools (`EngineConfig.pooling`: an encoder's file
says how, a decoder's is asked for). Whole inputs are packed into forwards of at most
`max_batch_tokens` rows (`Batch.sequences`: each reads only itself), in order; on a
batch-invariant engine an input's vector is bitwise the same whatever it was packed with. Each
pooled vector is then normalised as llama.cpp's `common_embd_normalize` does (`normalize`: -1
none, 0 max-abs to the int16 range, 1 taxicab, 2 euclidean (the default), p > 2 the p-norm);
unpooled ("none") rows and rank scores are returned as they are.

Rerank inputs are the query and one document as one input: the file's `rerank` prompt
template (`tokenizer.chat_template.rerank`, Qwen3-Reranker's: `{query}` and `{document}`
replaced, special-token texts parsed, nothing added), as llama.cpp's server formats it; else
BERT's pair layout `[CLS] query [SEP] document [SEP]` with token types 0 then 1 (all 0 for a
model with one token type); a vocabulary without [SEP] puts its end-of-sequence token between
and after them. A decoder's rank head reads each input's last row (an encoder's its first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from minfer.errors import MinferError

if TYPE_CHECKING:  # the server imports this module before any engine is made
    from minfer.engine.config import EngineConfig
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile
    from minfer.tokenizer.tokenizer import Tokenizer

DEFAULT_BATCH_TOKENS = 2048


class InputError(MinferError):
    """One input cannot be embedded; `index` says which (in the caller's list)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class Encoded:
    """One input as the model reads it."""

    ids: list[int]
    types: list[int] | None = None  # token types (BERT's sentence A / B); None: all 0
    truncated: bool = False


def embedding_config(hp: HParams, config: EngineConfig, pooling: str | None) -> EngineConfig:
    """An embedding engine's config from a surface's: batch-invariant; pooling as asked, else
    the file's (a generative model without one: its last token); the context an encoder's
    learned positions, a decoder's n_ctx capped at its training context."""
    from dataclasses import replace

    pool = pooling or hp.pooling
    if hp.causal and pool == "none" and pooling is None:
        pool = "last"
    n_ctx = min(config.n_ctx, hp.n_ctx_train) if hp.causal else hp.n_ctx_train
    return replace(config, n_ctx=n_ctx, batch_invariant=True, pooling=pool)


def normalize(v: np.ndarray, norm: int = 2) -> np.ndarray:
    """llama.cpp's `common_embd_normalize` of one vector (sums in f64, result f32)."""
    x = np.asarray(v, np.float64)
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif norm == 2:
        total = float(np.sqrt(np.sum(x * x)))
    else:
        total = float(np.sum(np.abs(x) ** norm) ** (1.0 / norm))
    scale = 1.0 / total if total > 0.0 else 0.0
    return (np.asarray(v, np.float32) * np.float32(scale)).astype(np.float32)


def rerank_template(f: GGUFFile) -> str | None:
    """A file's rerank prompt template (`tokenizer.chat_template.rerank`), None without one."""
    text = f.metadata.get("tokenizer.chat_template.rerank")
    return text if isinstance(text, str) else None


class Embedder:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, *,
                 max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 rerank_template: str | None = None) -> None:
        if not engine.pooling:
            raise MinferError("this engine returns logits; embeddings need one made with a "
                              "pooling (EngineConfig.pooling)")
        self.engine = engine
        self.tokenizer = tokenizer
        self.rerank_template = rerank_template
        hp = engine.hparams
        # the longest input: the learned positions of an encoder, the KV cells of a decoder
        self.max_tokens = min(engine.n_ctx, hp.n_ctx_train) if engine.encoder else engine.n_ctx
        # a decoder's packed inputs each take KV cells; an encoder's rows are not bounded
        limit = engine.n_ctx if not engine.encoder else max_batch_tokens
        self.max_batch_tokens = max(self.max_tokens, min(max_batch_tokens, limit))

    @property
    def pooling(self) -> str:
        return self.engine.pooling

    @property
    def n_embd(self) -> int:
        hp = self.engine.hparams
        return hp.n_cls_out if self.pooling == "rank" else hp.n_embd

    # -- inputs --------------------------------------------------------------------------------
    def encode_text(self, text: str) -> Encoded:
        """A text as the model embeds it: the vocabulary's special tokens added ([CLS] ... [SEP]
        for WordPiece; BOS, and EOS where the file's `add_eos_token` asks, as an embedding
        decoder such as Qwen3-Embedding pools its closing EOS), special-token texts parsed."""
        tok = self.tokenizer
        ids = tok.encode(text, special=True)
        if tok.vocab.add_eos and tok.eos_id is not None and tok.sep_id is None:
            ids.append(tok.eos_id)
        return Encoded(ids)

    def encode_pair(self, query: str, document: str) -> Encoded:
        """A rerank input: query and document as one sequence (see the module docstring)."""
        tok = self.tokenizer
        if self.rerank_template is not None:
            text = self.rerank_template.replace("{query}", query).replace("{document}", document)
            return Encoded(tok.encode(text, special=True, add_bos=False))
        q = tok.encode(query, special=True, add_bos=False)
        d = tok.encode(document, special=True, add_bos=False)
        sep = tok.sep_id if tok.sep_id is not None else tok.eos_id
        head = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
        mid = [sep] if sep is not None else []
        first = head + q + mid
        second = d + mid
        # the document is BERT's sentence B where the model has a second token type
        second_type = 1 if self.engine.hparams.n_token_types > 1 else 0
        return Encoded(first + second, [0] * len(first) + [second_type] * len(second))

    def rerank_inputs(self, query: str, documents: Sequence[str], *,
                      truncate: bool = False) -> list[Encoded]:
        """Each document paired with the query, checked (InputError names the document)."""
        if self.pooling != "rank":
            raise MinferError("reranking needs rank pooling and a classifier head "
                              f"(this model pools {self.pooling!r})")
        return self.check([self.encode_pair(query, d) for d in documents], truncate=truncate)

    def check(self, inputs: Sequence[Encoded], *, truncate: bool = False) -> list[Encoded]:
        """Each input checked (InputError naming the first bad one): not empty, ids inside the
        vocabulary, no longer than the model reads (cut to fit when `truncate`: the tail is
        dropped and a closing [SEP] kept)."""
        n_vocab = self.engine.hparams.n_vocab
        out = []
        for i, enc in enumerate(inputs):
            if not enc.ids:
                raise InputError(i, f"input {i} is empty (no tokens to embed)")
            bad = next((t for t in enc.ids if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise InputError(i, f"input {i} has token id {bad}, outside the vocabulary "
                                    f"(0..{n_vocab - 1})")
            if len(enc.ids) > self.max_tokens:
                if not truncate:
                    raise InputError(i, f"input {i} has {len(enc.ids)} tokens, more than this "
                                        f"model reads ({self.max_tokens})")
                enc = self._truncate(enc)
            out.append(enc)
        return out

    def _truncate(self, enc: Encoded) -> Encoded:
        n = self.max_tokens
        sep = self.tokenizer.sep_id
        ids = enc.ids[:n]
        types = enc.types[:n] if enc.types is not None else None
        if sep is not None and enc.ids[-1] == sep and ids[-1] != sep:
            ids[-1] = sep
        return Encoded(ids, types, truncated=True)

    # -- running -------------------------------------------------------------------------------
    def run(self, inputs: Sequence[Encoded], *, norm: int = 2) -> list[np.ndarray]:
        """Each (checked) input's vector (`[n_embd]` pooled, `[n_tokens, n_embd]` unpooled,
        `[n_cls_out]` rank scores), in order."""
        from minfer.engine.forward import Batch

        out: list[np.ndarray] = []
        for group in self._groups(inputs):
            seqs = [e.ids for e in group]
            types = [e.types if e.types is not None else [0] * len(e.ids) for e in group]
            # a decoder's rank head reads each input's last row, as its last-token pooling
            rows_of = ("last" if self.pooling == "rank" and self.engine.hparams.causal
                       else self.pooling)
            batch = Batch.sequences(seqs, pooling=rows_of, types=types)
            rows = self.engine.forward_batch(batch)
            if self.pooling == "none":
                for start, end in zip(batch.out_start, batch.out_end, strict=True):  # type: ignore[arg-type]
                    out.append(rows[start:end].copy())
            elif self.pooling == "rank":
                out.extend(rows[i].copy() for i in range(len(group)))
            else:
                out.extend(normalize(rows[i], norm) for i in range(len(group)))
        return out

    def _groups(self, inputs: Sequence[Encoded]) -> list[list[Encoded]]:
        """Consecutive inputs packed into forwards of at most max_batch_tokens rows."""
        groups: list[list[Encoded]] = []
        size = 0
        for enc in inputs:
            if not groups or size + len(enc.ids) > self.max_batch_tokens:
                groups.append([])
                size = 0
            groups[-1].append(enc)
            size += len(enc.ids)
        return groups

    def embed(self, texts: Sequence[str], *, norm: int = 2,
              truncate: bool = False) -> list[np.ndarray]:
        """Each text's vector (see `run`)."""
        return self.run(self.check([self.encode_text(t) for t in texts], truncate=truncate),
                        norm=norm)

    def rerank(self, query: str, documents: Sequence[str], *,
               truncate: bool = False) -> list[float]:
        """Each document's relevance score for the query (the classifier's first output)."""
        return [float(v[0])
                for v in self.run(self.rerank_inputs(query, documents, truncate=truncate))]
