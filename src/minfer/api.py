"""The public Python API: `minfer.load(model)` → a `Model` that can generate and chat, or embed
and rerank (`embed`, `rerank`: an encoder as its file says, a decoder's pooled hidden states).

A Model bundles what one GGUF file gives (metadata, hyper-parameters, tokenizer, chat template)
with an Engine created on first use. The session's n_ctx is max(requested n_ctx, prompt length),
capped at the model's training context; it is fixed for the Engine's lifetime, and a later prompt
that needs more makes a new Engine (a new session), never a silent truncation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minfer import env
from minfer.engine.assembly import Assembly, ModelConfig
from minfer.engine.config import usable_cores
from minfer.engine.embed import Embedder
from minfer.engine.forward import Engine
from minfer.errors import ContextOverflowError, MinferError, ModelError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.sampling.params import SamplerParams
from minfer.tools.fetch import resolve

# The text side (tokenizer, chat template, generation, sampling) is imported where it is first
# used: a warm `minfer run` starts readying the engine before these imports (~0.1 s), which
# then overlap the engine's kernel loads (`Engine.warm_in_background`).
if TYPE_CHECKING:
    from minfer.chat.reasoning import ReasoningOptions, ReplyPlan
    from minfer.engine.core.proposer import Speculator
    from minfer.engine.core.request import PromptRows, TokenLogprob
    from minfer.engine.generate import Constraint, Finished, Piece
    from minfer.engine.speculative import SpecConfig
    from minfer.engine.vision.encoder import VisionEncoder
    from minfer.engine.warmup import Progress
    from minfer.sampling.grammar import GrammarMask, GrammarVocab
    from minfer.sampling.mask import LogitMask
    from minfer.sampling.sampler import Sampler
    from minfer.tokenizer.chat import ChatTemplate
    from minfer.tokenizer.tokenizer import Tokenizer


class Model:
    def __init__(self, path: Path, config: ModelConfig | None = None, *,
                 gguf_file: GGUFFile | None = None, **options: Any) -> None:
        """config: the engines', speculation's and this surface's settings (`ModelConfig`); or,
        as before, their flat options (`n_ctx`, `kv_type` / `k_type` / `v_type`, `threads`,
        `batch_size`, `backend`, `fuse`: `ModelConfig.build`), not both. gguf_file: `path`
        already opened (reused)."""
        if config is not None and options:
            raise MinferError("give a ModelConfig or its options, not both")
        # the model's parts, opened where every surface opens them (minfer.engine.assembly)
        self.parts = Assembly(path, config or ModelConfig.build(**options), gguf_file=gguf_file)
        n_ctx = self.hparams.fit_n_ctx(self.n_ctx)  # past the model's: capped, with a warning
        if n_ctx != self.n_ctx:
            self.parts.config = replace(self.config, engine=replace(self.config.engine,
                                                                    n_ctx=n_ctx))
        self._engine: Engine | None = None
        self._embedders: dict[str | None, Embedder] = {}
        self._grammar_vocab: GrammarVocab | None = None

    @property
    def path(self) -> Path:
        return self.parts.path

    @property
    def file(self) -> GGUFFile:
        return self.parts.file

    @property
    def hparams(self) -> HParams:
        return self.parts.hparams

    @property
    def config(self) -> ModelConfig:
        return self.parts.config

    @property
    def n_ctx(self) -> int:
        """The context a session asks for (it grows to a longer prompt: `session_n_ctx`)."""
        return self.config.engine.n_ctx

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def threads(self) -> int:
        """Threads the engine runs prefill on (and the most a decode step takes)."""
        return self.config.engine.n_threads or 1

    @property
    def adaptive_threads(self) -> bool:
        """Whether decode steps pick their thread count by measurement."""
        return self.config.engine.adaptive_threads

    def set_threads(self, n_threads: int, *, adaptive: bool = False) -> None:
        """Run on n_threads from the next engine on (adaptive: decode steps may take fewer,
        as measured); the engines made for the old count are dropped."""
        if n_threads < 1:
            raise MinferError(f"threads must be at least 1, got {n_threads}")
        engine = replace(self.config.engine, n_threads=n_threads, adaptive_threads=adaptive)
        self.parts.config = replace(self.config, engine=engine)
        self._engine = None
        self._embedders.clear()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.parts.tokenizer

    @property
    def chat_template(self) -> ChatTemplate:
        return self.parts.chat_template

    @chat_template.setter
    def chat_template(self, template: ChatTemplate) -> None:
        """Use another template than the file's (as llama-server's `--chat-template-file`)."""
        self.parts.chat_template = template

    @property
    def kv_type(self) -> str:
        """Both cache formats in one name ("q8_0", or "q8_0/f16" when K and V differ)."""
        k, v = self.config.engine.k_type, self.config.engine.v_type
        return k if k == v else f"{k}/{v}"

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.file.metadata

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(".gguf")

    # -- sessions -----------------------------------------------------------------------------
    def session_n_ctx(self, n_prompt: int) -> int:
        n_ctx = min(max(self.n_ctx, n_prompt), self.hparams.n_ctx_max)
        if n_prompt > n_ctx:
            raise ContextOverflowError(
                f"prompt of {n_prompt} tokens exceeds the model's context length "
                f"({self.hparams.n_ctx_max})"
            )
        return n_ctx

    def engine(self, n_prompt: int = 0) -> Engine:
        """The current Engine, or a new one when it cannot hold n_prompt tokens."""
        if not self.hparams.causal:
            raise ModelError(f"{self.name} is an embedding model ({self.hparams.arch} encoder): "
                             "it does not generate text (use `minfer embed`, model.embed, or "
                             "/v1/embeddings)")
        n_ctx = self.session_n_ctx(n_prompt)
        if self._engine is None or self._engine.n_ctx < n_ctx:
            if self._engine is not None:
                self._engine.wait_ready()  # not two engines readying weights at once
            self._engine = self.parts.engine(n_ctx)
            tracer = self._engine.tracer  # MINFER_TRACE: name the traced tokens
            if tracer is not None and tracer.token_text is None:
                tracer.token_text = self.token_piece
        return self._engine

    # -- embeddings -------------------------------------------------------------------------
    def embedder(self, pooling: str | None = None) -> Embedder:
        """The Embedder for this pooling (None: the file's; a decoder without one pools its
        last token), made once. Batch-invariant: a text's vector does not depend on the
        texts it is packed with."""
        embedder = self._embedders.get(pooling)
        if embedder is None:
            embedder = self._embedders[pooling] = self.parts.embedder(pooling)
        return embedder

    def embed(self, texts: str | Sequence[str], *, normalize: int = 2, pooling: str | None = None,
              truncate: bool = False) -> np.ndarray:
        """Each text's embedding, `[len(texts), n_embd]` (one text: `[n_embd]`); normalised as
        llama.cpp's `--embd-normalize` (2: unit length; -1: as pooled)."""
        batch = [texts] if isinstance(texts, str) else list(texts)
        vecs = self.embedder(pooling).embed(batch, norm=normalize, truncate=truncate)
        return vecs[0] if isinstance(texts, str) else np.stack(vecs)

    def rerank(self, query: str, documents: Sequence[str], *,
               truncate: bool = False) -> list[float]:
        """Each document's relevance score for the query (a cross-encoder with rank pooling)."""
        return self.embedder("rank" if self.hparams.n_cls_out else None).rerank(
            query, documents, truncate=truncate)

    def token_piece(self, token_id: int) -> str:
        """One token's text as it would print; a token that is part of a UTF-8 character
        shows its bytes (`<e4 bd>`)."""
        raw = self.tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "<" + raw.hex(" ") + ">"

    def warm_up(self, n_prompt: int | None = None, progress: Progress | None = None) -> bool:
        """Compile (or load from the disk cache) every CPU kernel the first forwards need,
        sharing the work with a helper process where a core is free (`minfer.engine.warmup`).
        n_prompt: the first prompt's length (None: every prefill variant). False if warm."""
        from minfer.engine import warmup

        engine = self.engine(n_prompt or 0)
        return warmup.warm_up(engine, warmup.default_shapes(n_prompt, self.batch_size),
                              progress=progress, helper=warmup.helper_for(engine))

    def sampler(self, params: SamplerParams, seed: int | None, n_ctx: int,
                logit_mask: LogitMask | None = None) -> Sampler:
        from minfer.sampling.sampler import Sampler

        return Sampler(params, self.hparams.n_vocab, seed=seed,
                       token_text=self.tokenizer.token_text,
                       encode=lambda s: self.tokenizer.encode(s, special=False), n_ctx=n_ctx,
                       logit_mask=logit_mask)

    def grammar_mask(self, grammar: str) -> GrammarMask:
        """A fresh mask for a grammar from minfer.sampling.grammar / tool_calls (one per
        generation); the vocabulary view behind it is built on first use and kept."""
        from minfer.sampling.grammar import GrammarMask, GrammarVocab

        if self._grammar_vocab is None:
            self._grammar_vocab = GrammarVocab.from_tokenizer(self.tokenizer, self.hparams.n_vocab)
        return GrammarMask(self._grammar_vocab, grammar)

    # -- generation ---------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_vars: Any) -> str:
        """The prompt text; template_vars reach the jinja template (Qwen3's enable_thinking).
        A template that cannot write a tool history gets it as text, one that never reads
        `tools` their description in the system message (`history_for`)."""
        from minfer.sampling.tool_calls import history_for

        template = self.chat_template
        return template.render(history_for(messages, template.source, template.variables, tools),
                               tools=tools, add_generation_prompt=add_generation_prompt,
                               **template_vars)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    reasoning: ReasoningOptions | None = None) -> tuple[list[int], ReplyPlan]:
        """The rendered conversation's ids and the reply's plan: where its thinking starts,
        how it is split off, the mask that holds it to the budget."""
        from minfer.chat.reasoning import ReasoningOptions

        opts = reasoning or ReasoningOptions()
        opts.check_model(self.chat_template.source, self.chat_template.variables)
        text = self.render_chat(messages, tools=tools, **opts.template_vars())
        plan = opts.plan(text, lambda s: self.tokenizer.encode(s, special=True, add_bos=False),
                         template_source=self.chat_template.source)
        return self.tokenizer.encode_prompt(text), plan

    @property
    def vision(self) -> VisionEncoder | None:
        """The image encoder (an mmproj file named or found beside the model), None: text."""
        return self.parts.vision

    def image_prompt(self, text: str, images: Sequence[bytes]
                     ) -> tuple[list[int], tuple[PromptRows, ...]]:
        """A rendered prompt's ids with each image marker expanded (`vision.prompt.layout`),
        and the images' embedding rows where they go. ImageError: a text-only model, or an
        image that cannot be read."""
        from minfer.engine.vision.image import ImageError
        from minfer.engine.vision.prompt import layout

        encoder = self.vision
        if encoder is None:
            raise ImageError(f"{self.name} takes no images: it has no vision encoder (an "
                             "mmproj file: --mmproj FILE, or mmproj*.gguf beside the model)")
        rows = [encoder.encode(data) for data in images]
        return layout(text, rows, self.tokenizer.token_id, first=self.tokenizer.encode_prompt,
                      rest=lambda s: self.tokenizer.encode(s, special=True, add_bos=False))

    def chat_images(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    reasoning: ReasoningOptions | None = None
                    ) -> tuple[list[int], ReplyPlan, tuple[PromptRows, ...]]:
        """`chat_prompt` for messages that may hold image parts (`vision.prompt`): the ids,
        the reply's plan, and the images' rows where they go."""
        from minfer.engine.vision.prompt import split_images

        messages, images = split_images(messages)
        ids, plan = self.chat_prompt(messages, tools=tools, reasoning=reasoning)
        if not images:
            return ids, plan, ()
        text = self.render_chat(messages, tools=tools,
                                **(reasoning.template_vars() if reasoning else {}))
        ids, embd = self.image_prompt(text, images)
        return ids, plan, embd

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = 512,
        stop: Sequence[str] = (),
        seed: int | None = None,
        top_logits: int = 0,
        sampling: SamplerParams | None = None,
        logit_mask: LogitMask | None = None,
        speculator: Speculator | None = None,
        constraint: Constraint | None = None,
        embd: Sequence[PromptRows] = (),
    ) -> Iterator[Piece | Finished]:
        """Events of one generation from a fresh context: Pieces, then one Finished.

        logit_mask: a constraint run first in the sampler chain, e.g. `self.grammar_mask(g)`;
        a mask with `is_stopped()` ends the generation (reason "grammar") when nothing may follow
        (constraint: that grammar, when logit_mask chains it with others).
        speculator: verify proposals in batches (`self.speculator(...)`); Finished.speculation
        then counts drafted and accepted tokens.
        embd: rows given for some prompt tokens (images: `chat_images`).
        """
        from minfer.engine.generate import Constraint, generate

        if not prompt_ids:
            raise MinferError("the prompt is empty")
        if max_tokens < 0:
            raise MinferError("max_tokens must be >= 0")
        engine = self.engine(len(prompt_ids))
        params = sampling or SamplerParams()
        sampler = self.sampler(params, seed, engine.n_ctx, logit_mask)
        sampler.reset(prompt_ids)  # each stage keeps the history it needs
        yield from generate(engine, self.tokenizer, sampler, prompt_ids, max_tokens=max_tokens,
                            stops=stop, batch_size=self.batch_size, top_logits=top_logits,
                            constraint=constraint or (logit_mask if isinstance(
                                logit_mask, Constraint) else None),
                            speculator=speculator, embd=embd)

    def speculator(self, config: SpecConfig | None = None, *, draft: str | Path | None = None,
                   temp: float = 0.0, seed: int | None = None) -> Speculator:
        """Speculative decoding for this model (config: None for the model's own, else
        defaults): prompt lookup (`config.lookup_ngram`), a draft model (`draft`: path or cached
        name, else `config.draft_model`; same vocabulary, its own engine and KV), or both
        (`HybridProposer`: lookup where it is sure, the draft elsewhere), or the model's own
        MTP head (`config.mtp`, a file with MTP layers: `MtpProposer`).
        temp: the draft's sampling temperature when the target samples."""
        from minfer.engine.assembly import proposer
        from minfer.engine.core.proposer import SlotDrafter, Speculator
        from minfer.engine.speculative import SpecConfig

        spec = config or self.config.spec or SpecConfig()
        if draft is not None:
            spec = replace(spec, draft_model=resolve(draft))
        drafter = None
        parts = self.parts.draft(spec)
        if parts is not None:
            engine = parts.engine(self.engine().n_ctx)
            drafter = SlotDrafter(engine, engine.n_ctx, p_min=spec.p_min, chunk=self.batch_size,
                                  temp=temp or 1.0, seed=0 if seed is None else seed,
                                  n_vocab=parts.hparams.n_vocab)
        return Speculator(proposer(spec, drafter, self.parts.mtp_proposer(spec)), spec)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 512,
                 stop: Sequence[str] = (), seed: int | None = None,
                 **sampling: Any) -> Iterator[str]:
        """Continue a raw prompt (no chat template); yields text pieces as they are produced."""
        from minfer.engine.generate import Piece

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = SamplerParams(**sampling)
        for event in self.stream(ids, max_tokens=max_tokens, stop=stop, seed=seed,
                                 sampling=params):
            if isinstance(event, Piece):
                yield event.text

    def score(self, prompt: str | Sequence[int], *, top: int = 0) -> list[TokenLogprob]:
        """Each token of the prompt after the first, scored given those before it: its
        logprob and the `top` most likely tokens there (a text's log-likelihood, perplexity)."""
        from minfer.engine.generate import score

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise MinferError("the prompt is empty")
        engine = self.engine(len(ids))
        sampler = self.sampler(SamplerParams(), None, engine.n_ctx)
        return score(engine, self.tokenizer, sampler, ids, batch_size=self.batch_size, top=top)

    def infill_ids(self, prefix: str, suffix: str, *,
                   extra: Sequence[tuple[str, str]] = ()) -> list[int]:
        """The fill-in-the-middle prompt for the gap between prefix and suffix, laid out as
        llama.cpp's server lays out `/infill` (extra: (filename, text) of other files)."""
        from minfer.tokenizer.infill import Budget, ExtraFile, infill_prompt

        files = [ExtraFile(text, name) for name, text in extra]
        n_ctx = self.n_ctx or 4096
        return infill_prompt(self.tokenizer, prefix, suffix, extra=files,
                             budget=Budget(n_batch=min(2048, n_ctx), n_ctx=n_ctx))

    def infill(self, prefix: str, suffix: str, *, extra: Sequence[tuple[str, str]] = (),
               max_tokens: int = 128, stop: Sequence[str] = (), seed: int | None = None,
               **sampling: Any) -> Iterator[str]:
        """Fill the middle between prefix and suffix with the model's FIM tokens (a coder
        model's code completion); yields text pieces. FimUnsupported for a model without them."""
        yield from self.generate(self.infill_ids(prefix, suffix, extra=extra),
                                 max_tokens=max_tokens, stop=stop, seed=seed, **sampling)

    def respond(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 512,
                stop: Sequence[str] = (), seed: int | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None,
                reasoning: ReasoningOptions | None = None, **sampling: Any) -> ChatReply:
        """The whole reply to a conversation, its thinking split from its content as the
        server splits it (reasoning: format, budget, template variables; default auto)."""
        from minfer.engine.generate import Finished

        ids, plan, embd = self.chat_images(messages, tools=tools, reasoning=reasoning)
        finished: Finished | None = None
        for event in self.stream(ids, max_tokens=max_tokens, stop=stop, seed=seed,
                                 sampling=SamplerParams(**sampling), logit_mask=plan.budget,
                                 embd=embd):
            if isinstance(event, Finished):
                finished = event
        assert finished is not None
        split = plan.split(finished.text)
        return ChatReply(split.content, split.reasoning, finished.reason, finished.text)

    def chat(self, messages: str | Sequence[Mapping[str, Any]], *, max_tokens: int = 512,
             stop: Sequence[str] = (), seed: int | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, **sampling: Any) -> Iterator[str]:
        """Reply to a conversation (a string: one user message) rendered with the model's
        chat template; a message's content may hold image parts (`minfer.engine.vision.prompt`:
        {"type": "image_url", "image_url": {"url": "data:..."}}, {"type": "image", "path": ...})
        where the model has a vision encoder."""
        from minfer.engine.generate import Piece
        from minfer.engine.vision.prompt import split_images

        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages, images = split_images(messages)
        prompt = self.render_chat(messages, tools=tools)
        if not images:
            yield from self.generate(self.tokenizer.encode(prompt), max_tokens=max_tokens,
                                     stop=stop, seed=seed, **sampling)
            return
        ids, embd = self.image_prompt(prompt, images)
        for event in self.stream(ids, max_tokens=max_tokens, stop=stop, seed=seed,
                                 sampling=SamplerParams(**sampling), embd=embd):
            if isinstance(event, Piece):
                yield event.text


@dataclass(frozen=True)
class ChatReply:
    content: str
    reasoning_content: str | None  # the thinking, when the reply had any
    finish_reason: str
    text: str  # the reply as generated


def default_threads() -> int:
    """MINFER_THREADS, else every usable core."""
    return env.threads() or usable_cores()


def load(model: str | Path | None = None, **options: Any) -> Model:
    """Open a model by path, cache or catalogue name, or Hub reference (None → the default
    model; fetched on first use); its options and what it returns: `minfer.load`."""
    return Model(resolve(model), **options)
