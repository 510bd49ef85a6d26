"""`minfer list`: the models in the cache ($MINFER_HOME) with size, architecture, quantization;
`minfer list --catalogue`: the models `pull` (or a first use) can fetch by name."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table
from rich.text import Text

from minfer.cli.info_cmd import human_bytes
from minfer.store import list_models, minfer_home
from minfer.store.catalog import load_catalog


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("list", help="list the models in the cache")
    p.add_argument("--catalogue", "--catalog", action="store_true",
                   help="list the models that can be pulled by name instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.catalogue:
        console.print(catalogue_table())
        return 0
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


def catalogue_table() -> Table:
    """Each catalogue name (its aliases beside it), its download size and what it is."""
    catalog = load_catalog()
    aliases: dict[str, list[str]] = {}
    for alias, target in catalog.aliases.items():
        aliases.setdefault(target, []).append(alias)
    table = Table(title=Text("minfer pull NAME (or use NAME: fetched on first use)"),
                  title_justify="left")
    for col in ("name", "size", "description"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for name, entry in catalog.models.items():
        label = ", ".join([name, *aliases.get(name, [])])
        if name == catalog.default:
            label += " (default)"
        size = human_bytes(entry.size) if entry.size else "?"
        what = entry.description + (f" [{entry.hub}]" if entry.hub else "")
        table.add_row(Text(label), size, Text(what))
    return table
