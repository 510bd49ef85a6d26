"""Repacked weights kept as files: made once, then mapped by every engine and every later run.

An engine repacks its Q4_0 / Q5_0 / Q8_0 / Q4_K / Q6_K weights into the layout its kernels read
(`ModelWeights.derived`). Kept in process memory, that copy is made again by every run (0.4-0.6 s
of a warm start for the development model, most of it the kernel zero-filling fresh pages) and
once more by every engine on the machine (replicas of `minfer serve --ray`). So the first engine
writes each repacked matrix to `<kernel cache>/derived/<model tag>-<tensor>-<layout>.t<type>.npy`
(or to the folder `MINFER_SHARE_WEIGHTS` names, when it is a path), under a temporary name
renamed when complete, and maps it back; the others (and later runs) map the file, waiting for
one still being written (a lock file per matrix). The mappings are copy-on-write (nothing can
change the file) and read through the page cache, so the machine holds one copy however many
engines map it.

On by default for model files of `MIN_MODEL_BYTES` or more (a smaller one repacks in
milliseconds); `MINFER_SHARE_WEIGHTS=0` keeps the copies in memory, `=1` shares whatever the
size. The files take about the size of the repacked tensors (376 MB for the development model);
nothing is written when the disk would keep less than `FREE_MARGIN` free, and a write that fails
leaves the engine with its in-memory copy (the same numbers either way).

The folder sits inside the kernel cache folder, whose name hashes the kernels' sources: a
changed layout lands in a fresh folder, never a stale one. The model tag hashes the GGUF's path,
then its size and modification time: the files of an earlier version of the same path are
deleted when the new version's are first written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from minfer import env

ENV = "MINFER_SHARE_WEIGHTS"
MIN_MODEL_BYTES = 64 << 20
FREE_MARGIN = 1 << 30  # bytes the disk keeps free after a matrix is written


# the header `np.save` writes for a C-ordered array of a plain dtype (format 1.0)
_NPY_HEADER = re.compile(rb"\x93NUMPY\x01\x00(..)\{'descr': '([<>|][a-z][0-9]+)', "
                         rb"'fortran_order': False, 'shape': \(((?:[0-9]+, ?)*[0-9]*)\), \} *\n",
                         re.DOTALL)


def map_npy(path: Path) -> np.ndarray:
    """An .npy file mapped copy-on-write, as `np.load(path, mmap_mode="c")` maps it: the header
    `np.save` writes for these matrices read with one match, not numpy's parser (0.1 ms less
    a file: a warm start maps ~170); any other header goes to `np.load`."""
    with open(path, "rb") as f:
        head = f.read(512)
        m = _NPY_HEADER.match(head)
        if m is None or 10 + int.from_bytes(m.group(1), "little") != m.end():
            return np.asarray(np.load(path, mmap_mode="c"))
        shape = tuple(int(d) for d in m.group(3).split(b",") if d.strip())
        dtype = np.dtype(m.group(2).decode())
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    # (a body shorter than the header says: ValueError, as from np.load)
    return np.frombuffer(mm, dtype, count=int(np.prod(shape, dtype=np.int64)),
                         offset=m.end()).reshape(shape)


def enabled(model_bytes: int) -> bool:
    """Whether a model file of this size gets file-backed repacked weights."""
    value = env.get(ENV)
    if value == "":
        return model_bytes >= MIN_MODEL_BYTES
    return value != "0"


def folder_from_env() -> Path | None:
    """The folder `MINFER_SHARE_WEIGHTS` names (a path), or None for the default ("1")."""
    value = env.get(ENV)
    return Path(value) if value not in ("", "0", "1") else None


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def model_tag(path: Path) -> str:
    """16 hex digits for the path, then 16 for this version of its file."""
    st = path.stat()
    return _digest(str(path.resolve())) + _digest(f"{st.st_size}\0{st.st_mtime_ns}")


class SharedStore:
    """The shared files of one model's derived matrices."""

    def __init__(self, model_path: Path, folder: Path | None = None) -> None:
        folder = folder or folder_from_env()
        if folder is None:
            from minfer.jit_cache import cache_dir

            folder = cache_dir() / "derived"
        self.folder = folder
        self.tag = model_tag(model_path)
        self._listed: dict[str, Path] | None = None  # stem -> file, read once by `mapped`
        self._pruned = False

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

    def mapped(self, name: str, form: str) -> tuple[np.ndarray, int] | None:
        """`load` without the lock, from one listing of the folder: files are complete once
        they have their name, so a warm start maps them all without a lock file each."""
        if self._listed is None:
            try:
                self._listed = {p.name.rsplit(".t", 1)[0]: p for p in self.folder.iterdir()
                                if p.name.endswith(".npy")}
            except OSError:
                self._listed = {}
        hit = self._listed.get(self._stem(name, form))
        return None if hit is None else self._map(hit)

    def load(self, name: str, form: str) -> tuple[np.ndarray, int] | None:
        """(the mapped matrix, its type id), or None when no engine has stored it yet."""
        hits = sorted(self.folder.glob(self._stem(name, form) + ".t*.npy"))
        return self._map(hits[0]) if hits else None

    @staticmethod
    def _map(path: Path) -> tuple[np.ndarray, int] | None:
        qtype = int(path.name.rsplit(".t", 1)[1].removesuffix(".npy"))
        try:
            return map_npy(path), qtype
        except (OSError, ValueError):  # cut short outside our atomic rename (a full disk...)
            with contextlib.suppress(OSError):
                path.unlink()
            return None

    def store(self, name: str, form: str, matrix: np.ndarray, qtype: int) -> np.ndarray:
        """Write matrix for the other engines and later runs; the mapped file, to use in place
        of matrix (or matrix itself where the disk is too full or refuses the write)."""
        self._prune()
        final = self.folder / f"{self._stem(name, form)}.t{qtype}.npy"
        tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
        try:
            if shutil.disk_usage(self.folder).free < matrix.nbytes + FREE_MARGIN:
                return matrix
            with open(tmp, "wb") as fh:
                np.save(fh, matrix, allow_pickle=False)
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            print(f"minfer: repacked weights kept in memory ({final.parent}: {exc.strerror})",
                  file=sys.stderr)
            return matrix
        hit = self._map(final)
        return matrix if hit is None else hit[0]

    def _prune(self) -> None:
        """Delete the files of other versions of this model's path, and what other minfer
        versions left in the kernel cache (`jit_cache.prune_other_versions`), once per store."""
        if self._pruned:
            return
        self._pruned = True
        if folder_from_env() is None:
            from minfer.jit_cache import prune_other_versions

            prune_other_versions()
        where, mine = self.tag[:16], self.tag
        for p in self.folder.glob(f"{where}*"):
            if not p.name.startswith(mine):
                with contextlib.suppress(OSError):
                    p.unlink()
