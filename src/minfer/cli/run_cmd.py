"""`minfer run [MODEL] [PROMPT]`: one prompt in, streamed text out.

The chat template is applied unless `--raw`; text streams to stdout while the Prefill / Generated /
Total rates go to stderr. `--json` prints one object instead. `--dump-graph(-json) FILE` exports
the graph the prompt would run and exits. `--grammar(-file)`, `-j/--json-schema`, `-jf/
--json-schema-file` and `--json-object` constrain the output (checked before the model loads).
A reasoning model's thinking (`<think>` … `</think>`) is shown dimmed on a terminal, sent to
stderr when stdout is piped, dropped with `--hide-reasoning`; `--json` carries `content` and
`reasoning_content` beside `text` (`--reasoning-format`, `--reasoning-budget`, `--reasoning`,
`--chat-template-kwargs` as for serve). `--image FILE` (repeatable) puts images before the
prompt, read by the model's vision encoder (`-mm/--mmproj FILE`, else an mmproj*.gguf beside it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minfer import env
from minfer.chat.reasoning import ReplyPlan
from minfer.cli.common import (
    add_model_args,
    add_reasoning_args,
    add_sampling_args,
    add_speculative_args,
    load_announcing_cold_start,
    read_stdin_prompt,
    ready,
    reasoning_from_args,
    sampling_from_args,
    speculator_from_args,
    split_positionals,
)
from minfer.errors import MinferError
from minfer.sampling.mask import BannedTokens, chain

if TYPE_CHECKING:
    from minfer.engine.core.request import PromptRows


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate from one prompt",
                       description="Generate text from one prompt (chat template by default).")
    p.add_argument("positionals", nargs="*", metavar="[MODEL] [PROMPT]",
                   help="model (path or cached name) and prompt; prompt from stdin if omitted")
    p.add_argument("-p", "--prompt", help="the prompt (instead of a positional)")
    p.add_argument("-f", "--file", dest="prompt_file", metavar="FILE",
                   help="read the prompt from FILE (as llama-cli's -f)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never draw an end-of-generation token: run to -n (as llama.cpp's)")
    p.add_argument("--system", help="system message (chat template only)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    p.add_argument("--no-special", action="store_true",
                   help="treat special-token text in the prompt as plain text")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--top-logits", type=int, default=0, metavar="K",
                   help="with --json: the K highest raw logits at every sampled step")
    p.add_argument("--cnv", action="store_true", help="start an interactive chat instead")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image before the prompt (repeatable; needs the model's mmproj)")
    p.add_argument("-mm", "--mmproj", metavar="FILE",
                   help="the vision encoder (default: an mmproj*.gguf beside the model)")
    p.add_argument("--no-mmproj", action="store_true",
                   help="no vision encoder: neither an mmproj beside the model nor one pulled "
                        "with an hf: model")
    f = p.add_argument_group("fill-in-the-middle (code completion with a coder model's FIM "
                             "tokens; the prompt, if any, starts the cursor's line)")
    f.add_argument("--fim-prefix", metavar="TEXT", help="the text before the cursor")
    f.add_argument("--fim-suffix", metavar="TEXT", help="the text after the cursor")
    p.add_argument("--dump-graph", metavar="FILE", help="write the graph as Graphviz DOT and exit")
    p.add_argument("--dump-graph-json", metavar="FILE", help="write the graph as JSON and exit")
    p.add_argument("--dump-decode", action="store_true",
                   help="dump the decode-step graph instead of the prefill graph")
    add_model_args(p)
    add_sampling_args(p)
    add_grammar_args(p)
    add_speculative_args(p)
    add_reasoning_args(p)
    p.set_defaults(func=run)


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("constrained output").add_mutually_exclusive_group()
    g.add_argument("--grammar", metavar="GBNF", help="a GBNF grammar the output must follow")
    g.add_argument("--grammar-file", metavar="FILE", help="read the GBNF grammar from FILE")
    g.add_argument("-j", "--json-schema", metavar="SCHEMA",
                   help="the output is JSON valid against this JSON Schema")
    g.add_argument("-jf", "--json-schema-file", metavar="FILE",
                   help="read the JSON Schema from FILE")
    g.add_argument("--json-object", action="store_true", help="the output is any JSON object")


def grammar_from_args(args: argparse.Namespace) -> str | None:
    """The llguidance grammar the flags ask for (GrammarError when it is refused)."""
    if (args.grammar is None and not args.grammar_file and args.json_schema is None
            and not args.json_schema_file and not args.json_object):
        return None  # (llguidance is imported only when a grammar is asked for: 0.15 s)
    from minfer.sampling import grammar

    def read(path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise MinferError(f"cannot read {path}: {exc.strerror}") from None

    if args.grammar is not None or args.grammar_file:
        return grammar.gbnf_grammar(args.grammar if args.grammar is not None
                                    else read(args.grammar_file))
    if args.json_schema is not None or args.json_schema_file:
        return grammar.json_schema_grammar(args.json_schema if args.json_schema is not None
                                           else read(args.json_schema_file))
    return grammar.json_object_grammar() if args.json_object else None


def run(args: argparse.Namespace) -> int:
    if args.cnv:
        from minfer.cli import chat_cmd

        return int(chat_cmd.run(args))
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise MinferError("give the prompt with -p or -f, not both")
        try:
            args.prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise MinferError(f"cannot read {args.prompt_file}: {exc.strerror}") from None
    model_arg, prompt = split_positionals(args)
    args.grammar_text = grammar_from_args(args)  # refuse a bad grammar before loading the model
    fim = args.fim_prefix is not None or args.fim_suffix is not None
    # a warm start's engine binds its decode tape on its own thread while the prompt's ids
    # are made here (`ready` then waits for it)
    model, progress = load_announcing_cold_start(model_arg, args, wait=False)
    if fim:
        prompt_ids = model.infill_ids((args.fim_prefix or "") + (prompt or ""),
                                      args.fim_suffix or "")
        ready(model, progress)
        if progress is not None:
            model.warm_up(len(prompt_ids), progress)
        return generate_and_print(model, args, prompt_ids, speculator_from_args(model, args))
    if prompt is None:
        prompt = read_stdin_prompt()
    plan, embd = None, ()
    if args.raw:
        if args.image:
            raise MinferError("--image goes through the chat template: drop --raw")
        prompt_ids = model.tokenizer.encode(prompt, special=not args.no_special)
    else:
        messages: list[dict[str, Any]] = \
            [{"role": "system", "content": args.system}] if args.system else []
        # the images first, then the text (as llama.cpp's mtmd-cli places them)
        content = [{"type": "image", "path": f} for f in args.image]
        if content:  # (the vision encoder runs kernels: not beside the warm-up thread)
            ready(model, progress)
        messages.append({"role": "user", "content": [
            *content, {"type": "text", "text": prompt}] if content else prompt})
        prompt_ids, plan, embd = model.chat_images(messages,
                                                   reasoning=reasoning_from_args(args))
    ready(model, progress)
    if args.dump_graph or args.dump_graph_json:
        return dump_graphs(model, args, len(prompt_ids))
    if len(prompt_ids) > args.n_ctx:  # (llama.cpp refuses; the session grows to hold it)
        print(f"minfer: the prompt is {len(prompt_ids)} tokens, more than -c {args.n_ctx}: the "
              f"context grows to {model.session_n_ctx(len(prompt_ids))}", file=sys.stderr)
    if progress is not None:
        model.warm_up(len(prompt_ids), progress)
    return generate_and_print(model, args, prompt_ids, speculator_from_args(model, args), plan,
                              embd)


def dump_graphs(model: Any, args: argparse.Namespace, n_prompt: int) -> int:
    from minfer.graph.export import dump_json, to_dot

    engine = model.engine(n_prompt)
    engine.wait_ready()
    n_tokens = 1 if args.dump_decode else max(1, n_prompt)
    params = engine.params_for(n_tokens, 1)
    graph = engine.cache.get(params).graph
    if args.dump_graph:
        with open(args.dump_graph, "w", encoding="utf-8") as f:
            f.write(to_dot(graph, params))
    if args.dump_graph_json:
        with open(args.dump_graph_json, "w", encoding="utf-8") as f:
            f.write(dump_json(graph, params))
    print(f"graph: {len(graph.nodes)} nodes ({params.gtype.value}, n_tokens={n_tokens})",
          file=sys.stderr)
    return 0


def generate_and_print(model: Any, args: argparse.Namespace, prompt_ids: list[int],
                       speculator: Any = None, plan: ReplyPlan | None = None,
                       embd: Sequence[PromptRows] = ()) -> int:
    """Generate and print; plan: a chat reply's reasoning split and budget (None: raw); embd:
    the prompt's image rows."""
    from minfer.engine.generate import Finished, Piece

    if args.n_predict < 0:
        raise MinferError("-n must be >= 0")
    grammar_text = getattr(args, "grammar_text", None)
    mask = model.grammar_mask(grammar_text) if grammar_text else None
    banned = BannedTokens(model.tokenizer.eot_ids) if getattr(args, "ignore_eos", False) \
        else None
    t0 = time.perf_counter()
    finished: Finished | None = None
    events = model.stream(prompt_ids, max_tokens=args.n_predict, stop=args.stop, seed=args.seed,
                          top_logits=args.top_logits, sampling=sampling_from_args(args),
                          logit_mask=chain(mask, banned, plan.budget if plan else None),
                          speculator=speculator, constraint=mask, embd=embd)
    out_text = ReplyPrinter(plan, hide=getattr(args, "hide_reasoning", False))
    for event in events:
        if isinstance(event, Piece):
            if not args.json:
                out_text.push(event.text)
        else:
            finished = event
    total = time.perf_counter() - t0
    assert finished is not None
    if args.json:
        out: dict[str, Any] = {
            "prompt_ids": list(prompt_ids),
            "ids": finished.ids,
            "text": finished.text,
            "finish_reason": finished.reason,
            "timings": finished.timings.as_dict(),
        }
        if plan is not None:
            split = plan.split(finished.text)
            out["content"], out["reasoning_content"] = split.content, split.reasoning
        if finished.speculation is not None:
            out["speculative"] = finished.speculation.as_dict()
        if args.top_logits:
            out["top_logits"] = [[[i, v] for i, v in step] for step in finished.top_logits]
        print(json.dumps(out, ensure_ascii=False))
    else:
        out_text.finish()
        print()
    if finished.reason == "grammar" and mask is not None:
        print(f"Grammar:   {mask.stop_reason}", file=sys.stderr)
    print_rates(finished, total)
    return 0


def print_rates(finished: Any, total_s: float) -> None:
    t = finished.timings
    n_gen = len(finished.ids) + (finished.eot_id is not None)
    lines = [
        f"Prefill:   {t.prefill_tokens} tokens in {t.prefill_s:.2f} s "
        f"({t.as_dict()['prefill_tokens_per_s']:.1f} tok/s)",
        f"Generated: {n_gen} tokens in {t.decode_s:.2f} s "
        f"({t.as_dict()['decode_tokens_per_s']:.1f} tok/s), stopped by {finished.reason}",
        f"Total:     {t.prefill_tokens + n_gen} tokens in {total_s:.2f} s",
    ]
    spec = getattr(finished, "speculation", None)
    if spec is not None:
        lines.append(f"Drafted:   {spec.drafted} tokens, {spec.accepted} accepted "
                     f"({100 * spec.acceptance:.1f} %) in {spec.steps} verify steps")
    if env.flag("MINFER_TIMING"):
        lines.append(f"Timing:    forward {t.prefill_s + t.decode_s:.3f} s, "
                     f"sampling {t.sample_s:.3f} s "
                     f"({1000 * t.sample_s / max(1, n_gen):.2f} ms/token)")
    print("\n".join(lines), file=sys.stderr)


class ReplyPrinter:
    """Streamed reply text to stdout; a reasoning model's thinking dimmed before it on a
    terminal, to stderr when stdout is piped, or nowhere (hide)."""

    def __init__(self, plan: ReplyPlan | None, *, hide: bool = False) -> None:
        self.split = plan.stream() if plan is not None else None
        self.hide = hide
        self.tty = sys.stdout.isatty()
        self.thought = False  # some thinking was shown on stdout

    def push(self, text: str) -> None:
        if self.split is None:
            self._content(text)
        else:
            self._pieces(*self.split.push(text))

    def finish(self) -> None:
        if self.split is not None:
            self._pieces(*self.split.finish())

    def _pieces(self, content: str, thought: str) -> None:
        if thought and not self.hide:
            if self.tty:
                sys.stdout.write(f"\x1b[2m{thought}\x1b[0m")
                self.thought = True
            else:
                sys.stderr.write(thought)
                sys.stderr.flush()
        self._content(content)

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.thought:  # a blank line between the dimmed thinking and the answer
            sys.stdout.write("\n\n")
            self.thought = False
        sys.stdout.write(text)
        sys.stdout.flush()
