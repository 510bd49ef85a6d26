"""`minfer split IN.gguf OUT_PREFIX`: llama-gguf-split's split (same names, keys and layout);
`minfer merge FIRST_PART OUT.gguf`: join a split set back into one GGUF (split keys dropped)."""

from __future__ import annotations

import argparse

from minfer.cli.info_cmd import human_bytes
from minfer.tools.split import merge_gguf, parse_size, split_gguf


def register(subparsers: argparse._SubParsersAction) -> None:
    """Both commands: `split` and its inverse `merge`."""
    m = subparsers.add_parser("merge", help="merge a split GGUF set back into one file")
    m.add_argument("input", help="the first part, <name>-00001-of-0000N.gguf")
    m.add_argument("output", help="the merged .gguf to write (must not exist)")
    m.add_argument("--quiet", action="store_true", help="no progress bar")
    m.set_defaults(func=run_merge)
    p = subparsers.add_parser(
        "split", help="split a GGUF into parts llama.cpp and minfer load (gguf-split)")
    p.add_argument("input", help="the GGUF to split (a file, or the first part of a set)")
    p.add_argument("output", help="output prefix (a trailing .gguf is dropped)")
    limit = p.add_mutually_exclusive_group()
    limit.add_argument("--split-max-size", metavar="N(K|M|G)",
                       help="max tensor bytes per part, decimal units (e.g. 200M, 4G)")
    limit.add_argument("--split-max-tensors", type=int, metavar="N",
                       help="max tensors per part (default 128)")
    p.add_argument("--no-tensor-first-split", action="store_true",
                   help="put only metadata in the first part")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    max_bytes = parse_size(args.split_max_size) if args.split_max_size else None
    max_tensors = None if max_bytes is not None else (args.split_max_tensors or 128)
    parts = split_gguf(args.input, args.output, max_bytes=max_bytes, max_tensors=max_tensors,
                       no_tensor_first=args.no_tensor_first_split, dry_run=args.dry_run,
                       progress=not args.quiet)
    for path, part in parts:
        print(f"{path}  {len(part.tensors)} tensors  {human_bytes(part.size(3))}")
    return 0


def run_merge(args: argparse.Namespace) -> int:
    print(merge_gguf(args.input, args.output, progress=not args.quiet))
    return 0
