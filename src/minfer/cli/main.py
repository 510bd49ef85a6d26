"""The `minfer` console script: one sub-command per module in this package.

Each sub-command module exposes `register(subparsers)`, which adds its parser and sets
`func` (a callable taking the parsed namespace and returning an exit status). A MinferError
escaping a command is printed as one line and exits with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from minfer.errors import MinferError

# Sub-command modules, in the order `minfer --help` lists them.
COMMANDS = ("run", "chat", "serve", "bench", "info", "list", "pull", "tokenize", "viz")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minfer", description="Local LLM inference for GGUF models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"minfer.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name != f"minfer.cli.{name}_cmd":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except MinferError as exc:
        print(f"minfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
