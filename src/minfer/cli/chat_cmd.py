"""`minfer chat [MODEL]` (and `minfer run --cnv`): a multi-turn chat in the terminal.

Each turn prefills only what the conversation added since the last one (see
minfer.chat.session); `--verbose` prints the per-turn counts on stderr. `-p PROMPT` is the first
user message (`--single-turn`: answer it and exit). `--session FILE` restores a saved
conversation (one prefill of the history) and saves it again after every turn; a file that is
not a minfer session is refused, never overwritten. With stdin not a terminal, every input line
is one turn and replies are printed plainly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from minfer.cli.common import (
    add_model_args,
    add_reasoning_args,
    add_sampling_args,
    add_speculative_args,
    load_announcing_cold_start,
    reasoning_from_args,
    sampling_from_args,
    speculator_from_args,
    split_positionals,
)
from minfer.errors import MinferError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("chat", help="chat with a model (multi-turn REPL)",
                       description="Chat with a model: a REPL with /image /regen /clear /help "
                                   "/exit.")
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="model path or cached name (default model if omitted)")
    p.add_argument("-p", "--prompt", help="the first user message")
    p.add_argument("--single-turn", action="store_true",
                   help="answer one message (-p, or the first input) and exit")
    p.add_argument("--system", help="system message")
    p.add_argument("--multiline", action="store_true",
                   help="a message is several lines; an empty line sends it")
    p.add_argument("--color", choices=("auto", "on", "off"), default="auto",
                   help="colour output (default: auto, on when stdout is a terminal)")
    p.add_argument("--session", metavar="FILE",
                   help="restore the conversation from FILE and save it there after every turn")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="per-turn prefill counts on stderr")
    p.add_argument("-mm", "--mmproj", metavar="FILE",
                   help="the vision encoder, for /image (default: an mmproj*.gguf beside the "
                        "model)")
    p.add_argument("--no-mmproj", action="store_true",
                   help="no vision encoder: neither an mmproj beside the model nor one pulled "
                        "with an hf: model")
    add_model_args(p)
    add_sampling_args(p)
    add_reasoning_args(p, split=False)
    add_speculative_args(p)
    p.set_defaults(func=run)


def model_and_prompt(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(model, first prompt) from `chat`'s namespace or from `run --cnv`'s."""
    if hasattr(args, "positionals"):  # minfer run --cnv [MODEL] [PROMPT]
        return split_positionals(args)
    model = args.model_pos
    if model is not None and args.model_opt is not None:
        raise MinferError("model given twice (positional and -m)")
    return model if model is not None else args.model_opt, args.prompt


def run(args: argparse.Namespace) -> int:
    from minfer.chat import store
    from minfer.chat.repl import PipeReader, PromptReader, Repl, ReplOptions, ReplyWriter
    from minfer.chat.think import splitter_for

    model_arg, prompt = model_and_prompt(args)
    if args.n_predict < 0:
        raise MinferError("-n must be >= 0")
    session_path = Path(args.session).expanduser() if getattr(args, "session", None) else None
    saved = store.load(session_path) if session_path else None  # refuse before loading a model
    model, progress = load_announcing_cold_start(model_arg, args)
    if progress is not None:  # a first run: compile every prefill variant and decode, visibly
        model.warm_up(None, progress)
    session = make_session(model, args)
    if saved is not None:
        if saved.model and saved.model != model.name:
            print(f"note: {session_path} was saved with {saved.model}", file=sys.stderr)
        n = session.restore(saved.messages)
        if getattr(args, "verbose", False):
            print(f"[restored {len(saved.messages)} messages: prefilled {n} tokens]",
                  file=sys.stderr)
    single = bool(getattr(args, "single_turn", False))
    multiline = bool(getattr(args, "multiline", False))
    interactive = sys.stdin.isatty() and not (single and prompt is not None)
    color = _color(getattr(args, "color", "auto"))
    options = ReplOptions(multiline=multiline, color="on" if color else "off",
                          verbose=bool(getattr(args, "verbose", False)), single_turn=single,
                          first_prompt=prompt, interactive=interactive)
    reader = (PromptReader(multiline=multiline) if interactive
              else PipeReader(sys.stdin, multiline=multiline))
    writer = ReplyWriter(color=color, interactive=interactive,
                         hide_reasoning=bool(getattr(args, "hide_reasoning", False)),
                         splitter=splitter_for(model.chat_template.source))

    def save(s: Any) -> None:
        if session_path is not None:
            store.save(session_path, s.transcript(), model=model.name)

    banner = (f"minfer chat · {model.name} · n_ctx {session.n_ctx} · /help for commands, "
              "Ctrl-D to leave") if interactive else None
    return Repl(session, options, reader=reader, writer=writer, on_change=save,
                banner=banner).run()


def make_session(model: Any, args: argparse.Namespace) -> Any:
    from minfer.chat.session import ChatConfig, ChatSession
    from minfer.chat.think import reply_content_for

    engine = model.engine()
    params = sampling_from_args(args)
    sampler = model.sampler(params, args.seed, engine.n_ctx)
    config = ChatConfig(max_tokens=args.n_predict, stops=tuple(args.stop),
                        batch_size=args.batch_size)
    reasoning = reasoning_from_args(args)
    reasoning.check_model(model.chat_template.source, model.chat_template.variables)
    template = BoundTemplate(model.chat_template, reasoning.template_vars())
    return ChatSession(engine, model.tokenizer, template, sampler,
                       system=args.system, config=config,
                       speculator=speculator_from_args(model, args),
                       reply_content=reply_content_for(model.chat_template.source),
                       images=model.image_prompt if model.vision is not None else None)


def _color(choice: str) -> bool:
    if choice == "on":
        return True
    if choice == "off":
        return False
    return sys.stdout.isatty()


class BoundTemplate:
    """The chat template with the session's template variables (`--reasoning`,
    `--chat-template-kwargs`) bound."""

    def __init__(self, template: Any, variables: dict[str, Any]) -> None:
        self.template = template
        self.variables = variables

    def render(self, messages: Any, *, add_generation_prompt: bool = True) -> str:
        return str(self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                        **self.variables))
