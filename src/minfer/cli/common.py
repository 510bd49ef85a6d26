"""Flags shared by the generating commands (run, chat, serve, bench) and their translation.

Names and defaults follow llama.cpp's CLI so its users find what they expect.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from minfer.chat.reasoning import FORMATS, SWITCHES, ReasoningOptions
from minfer.engine.speculative import DRAFT_QUANTS, DRAFT_VOCAB
from minfer.errors import MinferError
from minfer.sampling.params import SamplerParams


def add_model_args(p: argparse.ArgumentParser, *, n_ctx_help: str = "context size") -> None:
    p.add_argument("-m", "--model", dest="model_opt", help="model path or cached name")
    p.add_argument("-c", "--n-ctx", type=int, default=4096, help=f"{n_ctx_help} (default 4096)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("-b", "--batch-size", type=int, default=512,
                   help="prefill chunk size in tokens (default 512)")
    add_kv_args(p)
    p.add_argument("--backend", choices=("auto", "cpu", "torch"), default=None,
                   help="compute backend (default: auto, or $MINFER_BACKEND)")
    p.add_argument("--no-fuse", action="store_true", help="run the unfused graph")


KV_CHOICES = ("f32", "f16", "q8_0", "q4_0")


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's cache-type flags; --kv-type sets both."""
    p.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", choices=KV_CHOICES,
                   default=None, help="K cache type (default f16, as llama.cpp)")
    p.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", choices=KV_CHOICES,
                   default=None, help="V cache type (default f16, as llama.cpp)")
    p.add_argument("--kv-type", choices=KV_CHOICES, default=None,
                   help="K and V cache type at once (the two flags above take precedence)")
    p.add_argument("--state-checkpoints", type=int, default=4, metavar="N",
                   help="recurrent models (LFM2): copies of each slot's state kept at prompt "
                        "chunk and turn ends, to reuse a prefix of its cache (default 4)")


def kv_types(args: argparse.Namespace) -> tuple[str, str]:
    """(K type, V type) from the cache-type flags."""
    both = args.kv_type or "f16"
    return args.cache_type_k or both, args.cache_type_v or both


def kv_label(k_type: str, v_type: str) -> str:
    """One name for both (as ContextParams.kv_type): "q8_0", or "q8_0/f16" when they differ."""
    return k_type if k_type == v_type else f"{k_type}/{v_type}"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama.cpp defaults)")
    d = SamplerParams()
    g.add_argument("-n", "--n-predict", "--max-tokens", dest="n_predict", type=int, default=512,
                   help="maximum tokens to generate (default 512)")
    g.add_argument("--temp", type=float, default=d.temp, help="temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=d.top_k)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--min-p", type=float, default=d.min_p)
    g.add_argument("--typical-p", "--typical", dest="typical_p", type=float, default=d.typical_p)
    g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty)
    g.add_argument("--repeat-last-n", type=int, default=d.penalty_last_n)
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    g.add_argument("--dry-multiplier", type=float, default=d.dry_multiplier)
    g.add_argument("--dry-base", type=float, default=d.dry_base)
    g.add_argument("--dry-allowed-length", type=int, default=d.dry_allowed_length)
    g.add_argument("--mirostat", type=int, choices=(0, 1, 2), default=d.mirostat)
    g.add_argument("--mirostat-lr", type=float, default=d.mirostat_eta)
    g.add_argument("--mirostat-ent", type=float, default=d.mirostat_tau)
    g.add_argument("-s", "--seed", type=int, default=None, help="RNG seed (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplerParams:
    return SamplerParams(
        temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        typical_p=args.typical_p, repeat_penalty=args.repeat_penalty,
        penalty_last_n=args.repeat_last_n, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, dry_multiplier=args.dry_multiplier,
        dry_base=args.dry_base, dry_allowed_length=args.dry_allowed_length,
        mirostat=args.mirostat, mirostat_eta=args.mirostat_lr, mirostat_tau=args.mirostat_ent,
    )


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.n_ctx < 1 or args.batch_size < 1:
        raise MinferError("--n-ctx and --batch-size must be positive")
    if args.state_checkpoints < 0:
        raise MinferError("--state-checkpoints must be >= 0")
    return {
        "n_ctx": args.n_ctx, "k_type": kv_types(args)[0], "v_type": kv_types(args)[1],
        "threads": args.threads,
        "batch_size": args.batch_size, "backend": args.backend, "fuse": not args.no_fuse,
        "state_checkpoints": args.state_checkpoints,
        "mmproj": getattr(args, "mmproj", None),
        "find_mmproj": not getattr(args, "no_mmproj", False),
    }


def looks_like_model(arg: str) -> bool:
    """A positional that names a model: an existing .gguf path, a cached model name, a
    catalogue name (fetched on first use) or a Hub reference."""
    path = Path(arg).expanduser()
    if path.suffix == ".gguf" and path.exists():
        return True
    if "\n" in arg or " " in arg or len(arg) > 200:
        return False
    from minfer.store.catalog import load_catalog, minfer_home
    from minfer.store.hub_select import is_hub_ref

    return (minfer_home() / f"{arg}.gguf").exists() or is_hub_ref(arg) or \
        load_catalog().find(arg) is not None


def split_positionals(args: argparse.Namespace) -> tuple[str | None, str | None]:
    model, prompt = args.model_opt, args.prompt
    pos = list(args.positionals)
    if len(pos) > 2:
        raise MinferError("expected at most two positionals: [MODEL] [PROMPT]")
    if len(pos) == 2:
        if model is not None or prompt is not None:
            raise MinferError("model or prompt given twice")
        return pos[0], pos[1]
    if len(pos) == 1:
        if model is None and prompt is None and looks_like_model(pos[0]):
            return pos[0], None
        if prompt is None:
            return model, pos[0]
        if model is None:
            return pos[0], prompt
        raise MinferError("model or prompt given twice")
    return model, prompt


def read_stdin_prompt() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise MinferError("no prompt given (pass it as an argument or on stdin)")
    return sys.stdin.read()


def load_announcing_cold_start(model_arg: str | None, args: argparse.Namespace, *,
                               wait: bool = True) -> tuple[Any, Any]:
    """(the Model, a progress reporter for the first run's kernel compilation or None when
    this model's kernels are cached). A cold start is announced at once, before the model
    (its tokenizer, its template) loads. wait=False: a warm start returns while the engine's
    warm-up thread still binds its decode tape (the caller renders and tokenizes its prompt
    meanwhile), and the caller ends the start-up with `ready`."""
    from minfer.api import Model
    from minfer.engine.warmup import TerminalProgress, announce_cold_start, marker_path
    from minfer.gguf.reader import GGUFFile
    from minfer.tools.fetch import resolve

    f = GGUFFile.open(resolve(model_arg))
    progress = None
    if announce_cold_start(marker_path(f, kv_type=kv_label(*kv_types(args)),
                                       batch_invariant=False)):
        progress = TerminalProgress()
    model = Model(f.path, gguf_file=f, **model_options(args))
    if progress is None:  # warm: the engine readies its weights while the tokenizer loads
        model.engine().warm_in_background()
    model.chat_template  # noqa: B018  (text commands: an unreadable vocabulary fails now)
    if wait:
        ready(model, progress)
    return model, progress


def ready(model: Any, progress: Any) -> None:
    """The end of a start-up `load_announcing_cold_start(wait=False)` began: a warm start
    waits for the engine's warm-up thread (raising what it met), then `started`."""
    if progress is None:
        model.engine().wait_ready()
    started()


def warm_up_announced(model: Any, n_prompt: int | None) -> None:
    """bench, perplexity: a model whose kernels are not compiled yet says so and compiles
    them up front, with the progress `run` shows (nothing when they are cached)."""
    from minfer.engine.warmup import TerminalProgress, announce_cold_start, engine_marker

    if announce_cold_start(engine_marker(model.engine(n_prompt or 0))):
        model.warm_up(n_prompt, TerminalProgress())


def started() -> None:
    """The end of a command's start-up: what it allocated so far stays for the process's life,
    so the garbage collector leaves it out of its walks from now on (`gc.freeze`) and runs
    again where the console script had turned it off (`main.DEFERRED_GC`). The few unreachable
    cycles start-up left (~900 objects for the development model) stay with it, for less than
    one collection of everything would cost. A cold start calls this before compiling, which
    makes cyclic garbage."""
    gc.freeze()
    gc.enable()


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's speculative-decoding flags, and prompt lookup."""
    g = p.add_argument_group("speculative decoding (output unchanged; faster when guesses pass)")
    g.add_argument("--spec", choices=("auto", "mtp", "none"), default="auto",
                   help="mtp: the model's own MTP (NextN) head proposes (a Qwen3.5 file "
                        "converted with its MTP layers); auto (default): mtp where the file has "
                        "them and no other proposer is asked for; none: only the flags below")
    g.add_argument("-md", "--model-draft", metavar="FILE",
                   help="draft model (path or cached name) with the same vocabulary; with "
                        "--lookup-ngram too, lookup's sure guesses (a copy going on) and the "
                        "draft's elsewhere")
    g.add_argument("--lookup-ngram", type=int, default=0, metavar="N",
                   help="prompt lookup: propose what followed the last N-gram earlier (0: off)")
    g.add_argument("--draft-max", "--draft", type=int, default=16, metavar="N",
                   help="most tokens proposed per step (default 16)")
    g.add_argument("--draft-min", type=int, default=0, metavar="N",
                   help="shorter proposals are not verified (default 0)")
    g.add_argument("--draft-p-min", type=float, default=0.3, metavar="P",
                   help="the draft stops when its top probability is below P (default 0.3)")
    g.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB, metavar="N",
                   help="the draft model scores only the first N token ids (rounded up to a "
                        f"multiple of 16), a cheaper draft step (default {DRAFT_VOCAB}; 0: all)")
    g.add_argument("--draft-quant", choices=DRAFT_QUANTS, default="q4_0",
                   help="the draft's weights narrowed to Q4_0 when its file's are wider (made "
                        "once into the cache; faster draft steps, the same output); keep: the "
                        "file as it is (default q4_0)")
    g.add_argument("--draft-fixed", action="store_true",
                   help="always propose as many tokens as --draft-max allows, as llama.cpp "
                        "does (default: the length, or a plain step, chosen per step from "
                        "measured step costs and acceptance); serve still proposes less beside "
                        "other streams where a row costs the batch more than it yields")


def spec_from_args(args: argparse.Namespace, *, has_mtp: bool = False) -> Any:
    """The SpecConfig the flags ask for (refused when a value is bad), None without
    --model-draft / --lookup-ngram / --spec mtp. has_mtp: the model's file has MTP layers,
    which `--spec auto` then proposes with when no other proposer is asked for."""
    spec = getattr(args, "spec", "none")
    other = bool(args.model_draft or args.lookup_ngram)
    mtp = spec == "mtp" or (spec == "auto" and has_mtp and not other)
    if not other and not mtp:
        return None
    from minfer.engine.speculative import SpecConfig
    from minfer.tools.fetch import resolve

    return SpecConfig(draft_max=args.draft_max, draft_min=args.draft_min,
                      p_min=args.draft_p_min, lookup_ngram=args.lookup_ngram,
                      draft_vocab=args.draft_vocab, draft_quant=args.draft_quant,
                      adaptive=not args.draft_fixed,
                      draft_model=resolve(args.model_draft) if args.model_draft else None,
                      mtp=mtp)


def file_has_mtp(path: Path) -> bool:
    """Whether a model file carries MTP (NextN) layers (`--spec auto` drafts with them); False
    for a file that cannot be read (its loader says why later)."""
    from minfer.gguf.reader import GGUFFile

    try:
        with GGUFFile.open(path) as f:
            arch = f.metadata.get("general.architecture")
            return bool(f.metadata.get(f"{arch}.nextn_predict_layers"))
    except Exception:
        return False


def speculator_from_args(model: Any, args: argparse.Namespace) -> Any:
    """The Speculator the flags ask for (None without --model-draft / --lookup-ngram and
    without an MTP head to use: `spec_from_args`)."""
    hparams = getattr(model, "hparams", None)
    spec = spec_from_args(args, has_mtp=bool(getattr(hparams, "n_layer_nextn", 0)))
    return None if spec is None else model.speculator(spec, temp=args.temp, seed=args.seed)


def add_reasoning_args(p: argparse.ArgumentParser, *, split: bool = True,
                       show: bool = True) -> None:
    """llama.cpp's reasoning flags (thinking models: Qwen3, DeepSeek-R1 distills); split: also
    how the reply is split and its budget (the REPL shows the thinking as it comes); show: the
    flag that hides the thinking on a terminal."""
    g = p.add_argument_group("reasoning models")
    if split:
        g.add_argument("--reasoning-format", choices=FORMATS, default="auto",
                       help="none: thinking left in the text; deepseek (auto): split into "
                            "reasoning_content; deepseek-legacy: both (default auto)")
        g.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                       help="thinking tokens before the thinking is closed (-1 unlimited, 0 "
                            "no thinking; default -1)")
    if show:
        g.add_argument("--hide-reasoning", action="store_true",
                       help="do not show a reasoning model's thinking")
    g.add_argument("--reasoning", choices=SWITCHES, default="auto",
                   help="switch thinking on or off in the chat template (enable_thinking); "
                        "auto: the template's default")
    g.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help='extra chat template variables, e.g. \'{"enable_thinking": false}\'')


def reasoning_from_args(args: argparse.Namespace) -> ReasoningOptions:
    """The ReasoningOptions the flags ask for; a clear error for a bad value."""
    kwargs: Any = {}
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise MinferError(f"--chat-template-kwargs is not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise MinferError("--chat-template-kwargs must be a JSON object")
    try:
        return ReasoningOptions.build(fmt=getattr(args, "reasoning_format", "auto"),
                                      budget=getattr(args, "reasoning_budget", -1),
                                      switch=args.reasoning, template_kwargs=kwargs)
    except ValueError as exc:
        raise MinferError(f"--reasoning-budget: {exc}") from None
