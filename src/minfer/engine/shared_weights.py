"""Repacked weights one machine's engines share: made once, kept as files, mapped by every engine.

An engine repacks its Q4_0 / Q5_0 / Q8_0 / Q4_K weights into the layout its kernels read
(`ModelWeights.derived`), a private copy per process: two engines on one machine (replicas of
`minfer serve --ray`) would hold two. With `MINFER_SHARE_WEIGHTS=1` the first engine writes each
repacked matrix to `<kernel cache>/derived/<model tag>-<tensor>-<layout>.t<type>.npy` (or to the
folder `MINFER_SHARE_WEIGHTS` names, when it is a path), under a temporary name renamed when
complete, and maps it back; the others wait for it (a lock file per matrix) and map the file.
The mappings are copy-on-write (nothing can change the file) and read through the page cache,
so the machine holds one copy however many engines map it.

The folder sits inside the kernel cache folder, whose name hashes the kernels' sources: a
changed layout lands in a fresh folder, never a stale one. The model tag hashes the GGUF's path,
size and modification time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ENV = "MINFER_SHARE_WEIGHTS"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def folder_from_env() -> Path | None:
    """The folder `MINFER_SHARE_WEIGHTS` names (a path), or None for the default ("1")."""
    value = os.environ.get(ENV, "")
    return Path(value) if value not in ("", "0", "1") else None


def model_tag(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


class SharedStore:
    """The shared files of one model's derived matrices."""

    def __init__(self, model_path: Path, folder: Path | None = None) -> None:
        folder = folder or folder_from_env()
        if folder is None:
            from minfer.jit_cache import cache_dir

            folder = cache_dir() / "derived"
        self.folder = folder
        self.tag = model_tag(model_path)

    def _stem(self, name: str, form: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.tag}-{name}-{form}")

    @contextlib.contextmanager
    def claim(self, name: str, form: str) -> Iterator[None]:
        """Hold the matrix's lock file: the engine that makes it first, others wait, then map."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{self._stem(name, form)}.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def load(self, name: str, form: str) -> tuple[np.ndarray, int] | None:
        """(the mapped matrix, its type id), or None when no engine has stored it yet."""
        hits = sorted(self.folder.glob(self._stem(name, form) + ".t*.npy"))
        if not hits:
            return None
        qtype = int(hits[0].name.rsplit(".t", 1)[1].removesuffix(".npy"))
        return np.asarray(np.load(hits[0], mmap_mode="c")), qtype

    def store(self, name: str, form: str, matrix: np.ndarray, qtype: int) -> np.ndarray:
        """Write matrix for the other engines; the mapped file, to use in place of matrix."""
        final = self.folder / f"{self._stem(name, form)}.t{qtype}.npy"
        tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, matrix, allow_pickle=False)
        os.replace(tmp, final)
        return np.asarray(np.load(final, mmap_mode="c"))
