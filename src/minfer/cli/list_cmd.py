"""`minfer list`: the models in the cache ($MINFER_HOME) with size, architecture, quantization."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table
from rich.text import Text

from minfer.cli.info_cmd import human_bytes
from minfer.store import list_models, minfer_home


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("list", help="list the models in the cache")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console()
    models = list_models()
    if not models:
        console.print(Text(f"no models in {minfer_home()} (try `minfer pull`)"))
        return 0
    table = Table(title=Text(str(minfer_home())), title_justify="left")
    for col in ("name", "size", "architecture", "quantization"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for m in models:
        arch = m.architecture or f"unreadable: {m.error}"
        table.add_row(Text(m.name), human_bytes(m.size), Text(arch), Text(m.quantization or "-"))
    console.print(table)
    return 0
