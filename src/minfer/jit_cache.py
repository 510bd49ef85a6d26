"""Where numba keeps the compiled kernels, keyed on their sources so that an edit is never stale.

numba's own cache checks only the modification time and size of the file that holds a jitted
function. minfer's kernels inline LLVM IR from helper modules (`simd*.py`, `_llvm.py`), so an
edit there, or an upgrade that ships a changed helper beside an unchanged caller, would load
stale machine code. Importing this module (the kernel packages do, first) points numba at
`$MINFER_HOME/numba/<hash>` (default `~/.cache/minfer/numba/...`), the hash covering every
compiled module's source: any change selects a fresh folder; numba still keys each entry on
its own version and the CPU. An explicit `NUMBA_CACHE_DIR` wins.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import config

from minfer.store.catalog import minfer_home

_PACKAGE = Path(__file__).resolve().parent
_SOURCES = ("backends/cpu/kernels", "engine/kv_shift.py", "tools/quantize")


def sources_digest() -> str:
    """sha256 (16 hex digits) over the compiled modules' source files, in a fixed order."""
    h = hashlib.sha256()
    for f in _source_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _source_files() -> list[Path]:
    files: list[Path] = []
    for rel in _SOURCES:
        p = _PACKAGE / rel
        files.extend(sorted(p.glob("*.py")) if p.is_dir() else [p])
    return files


def install_stamp() -> str:
    """Where this copy of the package lives and when its compiled sources were written: numba
    keys its cache entries on both (the source path names the entry, the file's modification
    time validates it), so the same sources installed elsewhere, or reinstalled, compile again
    although `sources_digest` is unchanged. For markers that claim the cache is warm."""
    mtimes = ",".join(str(f.stat().st_mtime_ns) for f in _source_files())
    return f"{_PACKAGE}:{hashlib.sha256(mtimes.encode()).hexdigest()[:16]}"


def cache_dir() -> Path:
    return minfer_home() / "numba" / sources_digest()


if not os.environ.get("NUMBA_CACHE_DIR"):
    config.CACHE_DIR = str(cache_dir())  # type: ignore[attr-defined]
