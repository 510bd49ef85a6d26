"""The `minfer` console script: one sub-command per module in this package.

Each sub-command module exposes `register(subparsers)`, which adds its parser and sets
`func` (a callable taking the parsed namespace and returning an exit status). A MinferError
escaping a command is printed as one line and exits with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import os
import sys

from minfer.errors import MinferError

# Commands that end with every file they wrote closed: the console script exits from them
# without tearing the interpreter down (module by module, LLVM's JIT state, numba's thread
# pool: 0.3 s after a `minfer run`), once the output is flushed and the exit handlers ran.
QUICK_EXIT = frozenset({"run", "chat", "embed", "info", "list", "tokenize"})

# Commands that load one model through `common.load_announcing_cold_start`, which ends their
# start-up (`common.started`): the console script runs them with the cyclic garbage collector
# off until then.
DEFERRED_GC = frozenset({"run", "chat"})

# Sub-command modules, in the order `minfer --help` lists them.
COMMANDS = ("run", "chat", "serve", "embed", "bench", "perplexity", "info", "list", "pull",
            "tokenize", "viz", "quantize", "split", "merge", "convert")


# Commands whose parser another command's module registers (a pair of inverse commands).
MODULE_OF = {"merge": "split", "perplexity": "bench"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with `only` (a sub-command's name) just that sub-command's
    parser: the others' modules are not imported, which a warm start would pay for."""
    parser = argparse.ArgumentParser(
        prog="minfer", description="Local LLM inference for GGUF models."
    )
    from minfer import __version__

    parser.add_argument("--version", action="version", version=f"minfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(subparsers=sub.choices)
    names = COMMANDS if only not in COMMANDS else (only,)
    for name in dict.fromkeys(MODULE_OF.get(n, n) for n in names):
        try:
            module = importlib.import_module(f"minfer.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name != f"minfer.cli.{name}_cmd":
                raise
            continue
        module.register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse a command line; a sub-command's options and positionals may come in any order
    (`minfer run MODEL --raw -n 32 "prompt"`), as users type them."""
    commands: dict[str, argparse.ArgumentParser] = parser.get_default("subparsers")
    if argv and argv[0] in commands:
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parse(parser, argv)
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
    except BrokenPipeError:  # the reader went away (`minfer run … | head`): stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process killed by SIGPIPE


def entry() -> None:
    """The console script: `main`, then for QUICK_EXIT commands a quick exit. Its process runs
    no compiled code but minfer's: numba loads its cached kernels without building its
    compiler's contexts (`jit_cache.lean_cache_loads`). For DEFERRED_GC commands the cyclic
    garbage collector waits for the model to be ready: start-up allocates long-lived objects
    only (modules, numba's types, a vocabulary's lists and maps), which ~240 collections
    would walk again and again (60 ms of a 1 s warm `minfer run`, Intel SPR)."""
    command = sys.argv[1] if len(sys.argv) > 1 else None
    if command in DEFERRED_GC:
        gc.disable()
    from minfer import jit_cache

    jit_cache.lean_cache_loads()
    rc = main()
    if command in QUICK_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # a closed pipe (`minfer run … | head`)
            rc = rc or 141
        atexit._run_exitfuncs()  # what the interpreter runs at exit: logging, finalizers
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
