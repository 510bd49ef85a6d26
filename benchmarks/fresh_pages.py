"""Drop the page cache of a model's files before a timed run, so both engines read fresh pages.

Not part of the test suite; imported by the side-by-side benchmarks (`--stale-pages` keeps the
cache as it is). On the shared KVM hosts these benchmarks run on, page-cache pages left idle for
an hour or two read much slower than fresh ones: the 0.5B's decode step went 29.8 -> 23.3 ms
(Intel Xeon, Sapphire Rapids, 2 threads) once its repacked weight files were evicted and read
again, and the same bytes copied into fresh anonymous memory gave 20.5-21.7 ms, while a 1 GiB
fresh read probe stayed at 29 GB/s. Whichever engine happens to read older pages loses by that
much, so a comparison evicts the GGUF, minfer's repacked copies of it and any draft model
before each engine's run (`posix_fadvise(DONTNEED)`: clean pages only, nothing is written; the
next read comes from disk, which each benchmark's warm-up absorbs).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def model_files(*models: str | Path) -> list[Path]:
    """The GGUFs and the repacked weight files minfer keeps for them (`engine.shared_weights`),
    in every kernel cache folder (another checkout's `--minfer-tree` has its own)."""
    from minfer.engine.shared_weights import SharedStore, folder_from_env

    files: list[Path] = []
    for model in models:
        path = Path(model)
        store = SharedStore(path)
        files.append(path)
        # <kernel cache>/<sources digest>/derived, or the one folder MINFER_SHARE_WEIGHTS names
        where = (store.folder.glob(f"{store.tag}*.npy") if folder_from_env() is not None else
                 store.folder.parent.parent.glob(f"*/{store.folder.name}/{store.tag}*.npy"))
        files += sorted(where)
    return files


def drop_pages(paths: Iterable[Path]) -> int:
    """Evict each file's clean pages from the page cache; the bytes dropped (the files' sizes)."""
    total = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total
