"""`minfer pull [NAME | hf:ORG/REPO[:QUANT|:FILE]]`: fetch a catalogue model into the cache, or
a GGUF from the Hugging Face Hub into its cache (idempotent, resumable) with the repo's mmproj
(vision encoder) as `llama-server -hf` picks it (`--no-mmproj`: the model alone). A catalogue entry
shipped as a checkpoint (all-minilm-l6-v2) is converted to GGUF once downloaded."""

from __future__ import annotations

import argparse

from minfer.convert.convert import convert_checkpoint
from minfer.store import pull
from minfer.store.catalog import default_model_name
from minfer.store.hub import pull_hub
from minfer.store.hub_select import is_hub_ref


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pull", help="download a catalogue model, or hf:ORG/REPO[:QUANT] from the Hub")
    p.add_argument("name", nargs="?", help="catalogue name (default: the default model) or "
                   "hf:ORG/REPO[:QUANT|:FILE.gguf] from the Hugging Face Hub")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-mmproj", action="store_true",
                   help="hf: only the model file, not the repo's mmproj (vision encoder)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.name and is_hub_ref(args.name):
        path = pull_hub(args.name, progress=not args.quiet, mmproj=not args.no_mmproj)
    else:
        path = pull(args.name or default_model_name(), progress=not args.quiet,
                    converter=convert_checkpoint)
    print(path)
    return 0
