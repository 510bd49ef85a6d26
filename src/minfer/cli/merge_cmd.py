"""`minfer merge FIRST_PART OUT.gguf`: join a split set back into one GGUF (split keys dropped)."""

from __future__ import annotations

import argparse

from minfer.tools.split import merge_gguf


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("merge", help="merge a split GGUF set back into one file")
    p.add_argument("input", help="the first part, <name>-00001-of-0000N.gguf")
    p.add_argument("output", help="the merged .gguf to write (must not exist)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(merge_gguf(args.input, args.output, progress=not args.quiet))
    return 0
