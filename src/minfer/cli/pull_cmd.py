"""`minfer pull [NAME]`: fetch a catalogue model into the cache (idempotent, resumable)."""

from __future__ import annotations

import argparse

from minfer.store import pull
from minfer.store.catalog import default_model_name


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pull", help="download a catalogue model into the cache")
    p.add_argument("name", nargs="?", help="catalogue name (default: the default model)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = pull(args.name or default_model_name(), progress=not args.quiet)
    print(path)
    return 0
