"""`minfer tokenize`: show how a model's tokenizer cuts text, or the prompt a chat renders to.

    minfer tokenize [MODEL] TEXT [--json] [--no-special]
    minfer tokenize [MODEL] --chat FILE [--json]
    minfer tokenize [MODEL] --jsonl [--no-special]

With two positionals the first is the model; with one it is the text and the default model is
used (`-m/--model` names the model too). TEXT or FILE `-` reads stdin. A chat FILE is JSON:
`{"messages": [...], "tools": [...], "add_generation_prompt": true}` (other keys are passed to
the template; a bare list is taken as the messages). `--jsonl` reads one JSON string per stdin
line and writes one `{"ids": [...], "pieces": [...]}` line per input, in order, with one model
load for all of them. MODEL may be a vocabulary-only GGUF (no tensors): only the tokenizer
metadata is read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from minfer.errors import MinferError


class TokenizeInputError(MinferError):
    """A TEXT or chat FILE `minfer tokenize` cannot use (missing, unreadable, bad JSON)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tokenize", help="show token ids and pieces of a text, or a rendered chat prompt",
        description="Tokenize TEXT with MODEL's tokenizer, or render a chat FILE with its "
                    "chat template and tokenize the prompt.")
    p.add_argument("args", nargs="*", metavar="[MODEL] TEXT",
                   help="model (optional) and text; '-' reads the text from stdin")
    p.add_argument("-m", "--model", help="model path or name (default: the default model)")
    p.add_argument("--chat", metavar="FILE",
                   help="JSON file with messages/tools/add_generation_prompt ('-' = stdin)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--jsonl", action="store_true",
                   help="read one JSON string per stdin line, write one JSON object per line")
    p.add_argument("--no-special", action="store_true",
                   help="do not parse control-token texts such as <|im_start|>")
    p.set_defaults(func=run)


def _split_positionals(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(model, text) from the positionals, `-m` and `--chat`."""
    pos = list(args.args)
    if args.jsonl and args.chat is not None:
        raise TokenizeInputError("--jsonl and --chat cannot be combined")
    n_text = 0 if args.chat is not None or args.jsonl else 1
    if len(pos) > n_text + 1 or (args.model is not None and len(pos) > n_text):
        raise TokenizeInputError(f"too many arguments: {' '.join(pos)}")
    if len(pos) < n_text:
        raise TokenizeInputError("missing TEXT (or use --chat FILE)")
    model = args.model if args.model is not None else (pos[0] if len(pos) > n_text else None)
    text = pos[-1] if n_text else None
    return model, text


def _read(source: str, what: str) -> str:
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TokenizeInputError(f"cannot read {what} {source}: {reason}") from None


def load_chat_request(source: str) -> dict[str, Any]:
    """Parse and check a chat FILE: messages (list of objects), tools (list or null), flags."""
    try:
        data = json.loads(_read(source, "chat file"))
    except json.JSONDecodeError as exc:
        raise TokenizeInputError(f"{source}: invalid JSON: {exc}") from None
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict):
        raise TokenizeInputError(f"{source}: expected an object with \"messages\"")
    messages = data.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise TokenizeInputError(f"{source}: \"messages\" must be a list of objects")
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise TokenizeInputError(f"{source}: \"tools\" must be a list")
    if not isinstance(data.get("add_generation_prompt", True), bool):
        raise TokenizeInputError(f"{source}: \"add_generation_prompt\" must be true or false")
    return data


def _jsonl(tok: Any, special: bool) -> None:
    """One `{"ids", "pieces"}` line per JSON-string stdin line, flushed as each is done."""
    for number, line in enumerate(sys.stdin, start=1):
        try:
            text = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TokenizeInputError(f"stdin line {number}: invalid JSON: {exc}") from None
        if not isinstance(text, str):
            raise TokenizeInputError(f"stdin line {number}: expected a JSON string, got "
                                     f"{type(text).__name__}")
        ids = tok.encode(text, special=special)
        sys.stdout.write(json.dumps({"ids": ids, "pieces": [tok.piece(i) for i in ids]},
                                    ensure_ascii=False) + "\n")
        sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from minfer.gguf.reader import GGUFFile
    from minfer.sampling.tool_calls import history_for
    from minfer.tokenizer import ChatTemplate, Tokenizer
    from minfer.tools.fetch import resolve

    model, text = _split_positionals(args)
    request = load_chat_request(args.chat) if args.chat is not None else None
    if text == "-":
        text = sys.stdin.read()
    f = GGUFFile.open(resolve(model))
    tok = Tokenizer.from_gguf(f)
    if args.jsonl:
        _jsonl(tok, special=not args.no_special)
        return 0
    if request is not None:
        template = ChatTemplate.from_gguf(f, tok)
        extra = {k: v for k, v in request.items()
                 if k not in ("messages", "tools", "add_generation_prompt")}
        # the server's and Model.render_chat's rendering path (tool calls as templates read them)
        messages = history_for(request["messages"], template.source, template.variables,
                               request.get("tools"))
        prompt = template.render(messages, tools=request.get("tools"),
                                 add_generation_prompt=request.get("add_generation_prompt", True),
                                 **extra)
        ids = tok.encode_prompt(prompt)
        if args.json:
            print(json.dumps({"text": prompt, "ids": ids}, ensure_ascii=False))
        else:
            print(prompt)
            print(f"{ids}\n({len(ids)} tokens)")
        return 0
    assert text is not None
    ids = tok.encode(text, special=not args.no_special)
    pieces = [tok.piece(i) for i in ids]
    if args.json:
        print(json.dumps({"ids": ids, "pieces": pieces}, ensure_ascii=False))
    else:
        for i, piece in zip(ids, pieces, strict=True):
            print(f"{i:>7} -> {piece!r}")
    return 0
