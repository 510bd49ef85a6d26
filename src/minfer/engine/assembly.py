"""Model assembly: the one place a loaded model's parts are opened and its engines made.

One `ModelConfig` configures a loaded model: the engines' `EngineConfig`, speculation's
`SpecConfig` (None: off; `draft_model` names a draft file) and the surface's own options
(`backend`, `batch_size`). `Assembly` opens the parts in the order they depend on each other:

    file -> hparams -> tokenizer -> chat template -> engines -> embedders -> draft / proposers

and, beside them, the vision encoder (`vision`: an mmproj file, named or found beside the model).

The file and its hyper-parameters are read at once; the tokenizer and the chat template on first
use (a warm `minfer run` starts readying its engine before it imports the text side, whose
imports then overlap the kernel loads), and the compiled engine is imported only where an engine
is made. `minfer.load` / `api.Model` (and through it `minfer run`, chat, bench, perplexity and
viz) and `minfer serve` (`ServerState._open`) all assemble their models here.

`engine(n_ctx)` is the engine factory: it sets numba's thread count for the calling thread, so
the server calls it on its engine thread (numba's thread count is per thread). The server's
engines are batch-invariant (`ModelConfig.engine.batch_invariant`) on the CPU backend alone
(`backend="cpu"`); embedders always are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minfer.engine.config import EngineConfig
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

if TYPE_CHECKING:  # imported where first used (see the module docstring)
    from minfer.backends.base import Backend
    from minfer.engine.core.mtp import MtpProposer
    from minfer.engine.core.proposer import Proposer, SlotDrafter
    from minfer.engine.embed import Embedder
    from minfer.engine.forward import Engine
    from minfer.engine.speculative import SpecConfig
    from minfer.engine.vision.encoder import VisionEncoder
    from minfer.tokenizer.chat import ChatTemplate
    from minfer.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelConfig:
    """What configures a loaded model: its engines, its speculation, the surface's options."""

    engine: EngineConfig = field(default_factory=EngineConfig.build)
    spec: SpecConfig | None = None  # speculative decoding (None: off)
    backend: str = "auto"  # which backends generating engines run on (`select_backends`)
    batch_size: int = 512  # prompt tokens per forward (and a draft's catch-up)
    # the vision encoder's file (None: an mmproj*.gguf beside the model, if one fits it)
    mmproj: Path | None = None
    find_mmproj: bool = True  # look beside the model when none is named (--no-mmproj: off)

    @classmethod
    def build(cls, *, n_ctx: int = 4096, kv_type: str = "f16", k_type: str | None = None,
              v_type: str | None = None, threads: int | None = None, batch_size: int = 512,
              backend: str = "auto", fuse: bool = True, batch_invariant: bool = False,
              spec: SpecConfig | None = None, state_checkpoints: int = 4,
              mmproj: str | Path | None = None, find_mmproj: bool = True) -> ModelConfig:
        """A config from a surface's flat options (`EngineConfig.build` for the engine's)."""
        return cls(EngineConfig.build(n_ctx=n_ctx, kv_type=kv_type, k_type=k_type,
                                      v_type=v_type, threads=threads, fuse=fuse,
                                      batch_invariant=batch_invariant,
                                      state_checkpoints=state_checkpoints),
                   spec, backend, batch_size, None if mmproj is None else Path(mmproj),
                   find_mmproj)


class Assembly:
    """One model's parts: its file and hyper-parameters (read at once), its tokenizer and chat
    template (on first use), and the engines, embedders and draft made from them."""

    def __init__(self, path: Path, config: ModelConfig | None = None, *,
                 gguf_file: GGUFFile | None = None) -> None:
        self.path = path
        self.config = config or ModelConfig()
        self.file = gguf_file or GGUFFile.open(path)  # an already opened `path` is reused
        self.hparams = HParams.from_gguf(self.file)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Read on first use: what takes token ids (the engine, `minfer bench`) runs on a file
        whose vocabulary this build cannot tokenize, and a refusal comes when text is asked."""
        from minfer.tokenizer.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.file)

    @cached_property
    def chat_template(self) -> ChatTemplate:
        from minfer.tokenizer.chat import ChatTemplate

        return ChatTemplate.from_gguf(self.file, self.tokenizer)

    @cached_property
    def vision(self) -> VisionEncoder | None:
        """The image encoder (`ModelConfig.mmproj`, else, unless `find_mmproj` is off, the
        first mmproj*.gguf beside the model whose projection fits this model's width, in
        llama.cpp's order: `rank_mmproj`, the quantization closest to the model's), opened on
        first use; None: text only. A named file of another width is refused, naming both."""
        from minfer.engine.vision.encoder import VisionEncoder
        from minfer.errors import MinferError, ModelError
        from minfer.store.hub_select import rank_mmproj

        path = self.config.mmproj
        if path is not None:
            enc = VisionEncoder(path)
            if enc.params.n_embd_text != self.hparams.n_embd:
                raise ModelError(f"{path.name} does not match {self.path.name}: it projects "
                                 f"images to width {enc.params.n_embd_text}, the model's "
                                 f"width (n_embd) is {self.hparams.n_embd}")
            return enc
        if not self.config.find_mmproj:
            return None
        beside = sorted(p.name for p in self.path.parent.glob("mmproj*.gguf"))
        for name in rank_mmproj(beside, self.path.name):
            try:
                enc = VisionEncoder(self.path.parent / name)
            except MinferError:  # not a vision encoder minfer reads
                continue
            if enc.params.n_embd_text == self.hparams.n_embd:
                return enc
        return None

    # -- engines --------------------------------------------------------------------------------
    def engine(self, n_ctx: int | None = None, *, backends: list[Backend] | None = None,
               **fields: Any) -> Engine:
        """An Engine over the file: the config's settings with n_ctx (None: the config's) and
        `fields` replaced, on the config's backends unless `backends` are given. numba's thread
        count is set for the calling thread: call it on the thread that runs the engine."""
        from minfer.backends.select import select_backends
        from minfer.engine.forward import Engine, set_threads

        if n_ctx is not None:
            fields["n_ctx"] = n_ctx
        config = replace(self.config.engine, **fields)
        set_threads(config.n_threads or 1)
        return Engine(self.file, self.hparams, config,
                      backends=backends or select_backends(self.config.backend))

    def embedder(self, pooling: str | None = None) -> Embedder:
        """An Embedder pooling so (None: the file's; a decoder without one pools its last
        token): batch-invariant, on the CPU backend, its context the engine's n_ctx capped at
        the training context (an encoder's: its learned positions)."""
        from minfer.backends.select import select_backends
        from minfer.engine.embed import Embedder, embedding_config, rerank_template

        config = embedding_config(self.hparams, self.config.engine, pooling)
        return Embedder(self.engine(backends=select_backends("cpu"), **asdict(config)),
                        self.tokenizer, rerank_template=rerank_template(self.file))

    # -- speculation ----------------------------------------------------------------------------
    def mtp_head(self, n_ctx: int) -> Engine:
        """An Engine over the file's MTP (NextN) head (`HParams.mtp_head`; ModelError without
        one): this model's engine settings, n_ctx cells of the head's one layer."""
        from minfer.backends.select import select_backends
        from minfer.engine.forward import Engine

        config = replace(self.config.engine, n_ctx=n_ctx)
        return Engine(self.file, self.hparams.mtp_head(), config,
                      backends=select_backends(self.config.backend))

    def mtp_proposer(self, spec: SpecConfig | None = None) -> MtpProposer | None:
        """The MTP head's proposer when `spec` (None: the config's) asks for it (`spec.mtp`),
        its head made for the target it is attached to; else None."""
        from minfer.engine.core.mtp import MtpProposer

        spec = spec or self.config.spec
        if spec is None or not spec.mtp:
            return None
        self.hparams.mtp_head()  # refused now, not at the first proposal, without MTP layers
        return MtpProposer(self.mtp_head, p_min=spec.p_min, chunk=self.config.batch_size)

    def draft(self, spec: SpecConfig | None = None) -> Assembly | None:
        """The draft model `spec` (None: the config's) names, or None: its file narrowed as
        `draft_quant` says (`draft_file`), refused unless its vocabulary is this model's; its
        engines are this model's settings scoring the first `draft_vocab` ids."""
        from minfer.engine.speculative import check_same_vocab, draft_file

        spec = spec or self.config.spec
        if spec is None or spec.draft_model is None:
            return None
        path = draft_file(spec.draft_model, spec.draft_quant)
        draft = Assembly(path, replace(self.config, spec=None, engine=replace(
            self.config.engine, vocab_limit=spec.draft_vocab)))
        check_same_vocab(self.tokenizer.vocab.tokens,
                         list(draft.file.metadata.get("tokenizer.ggml.tokens") or ()),
                         target_n_vocab=self.hparams.n_vocab, draft_n_vocab=draft.hparams.n_vocab)
        return draft


def proposer(spec: SpecConfig, drafter: SlotDrafter | None,
             mtp: MtpProposer | None = None) -> Proposer:
    """The proposer the speculation settings ask for: the model's MTP head (`mtp`, alone),
    prompt lookup (`lookup_ngram`), the draft model (`drafter`), or both (`HybridProposer`:
    lookup where it is sure, the draft elsewhere)."""
    from minfer.engine.core.proposer import HybridProposer, LookupProposer
    from minfer.engine.speculative import SpeculativeError

    if mtp is not None:
        return mtp
    if drafter is None:
        if not spec.lookup_ngram:
            raise SpeculativeError("speculative decoding needs a proposer: a draft model "
                                   "and / or --lookup-ngram N, or --spec mtp")
        return LookupProposer(spec.lookup_ngram)
    if spec.lookup_ngram:
        return HybridProposer(LookupProposer(spec.lookup_ngram), drafter, spec.draft_max)
    return drafter

