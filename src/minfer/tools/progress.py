"""A byte-count progress bar for the file tools (split, merge, convert).

On a terminal it is a rich bar on stderr that clears itself when done; elsewhere (a pipe, a
log file, CI) it prints exactly one line when the work is finished, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

Advance = Callable[[int], None]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


@contextmanager
def byte_progress(description: str, total: int, *, enabled: bool = True) -> Iterator[Advance]:
    """Yield `advance(n_bytes)`; a bar on a TTY, one summary line otherwise, nothing if disabled."""
    if not enabled:
        yield lambda n: None
        return
    if sys.stderr.isatty():
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)
        return
    done = 0
    t0 = time.perf_counter()

    def advance(n: int) -> None:
        nonlocal done
        done += n

    yield advance
    elapsed = time.perf_counter() - t0
    print(f"{description}: {_mb(done)} in {elapsed:.1f} s", file=sys.stderr)
