"""Where numba keeps the compiled kernels, keyed on their sources so that an edit is never stale.

numba's own cache checks only the modification time and size of the file that holds a jitted
function. minfer's kernels inline LLVM IR from helper modules (`simd*.py`, `simd.llvm.py`), so an
edit there, or an upgrade that ships a changed helper beside an unchanged caller, would load
stale machine code. Importing this module (the kernel packages do, first) points numba at
`$MINFER_HOME/numba/<hash>` (default `~/.cache/minfer/numba/...`), the hash covering every
compiled module's source: any change selects a fresh folder; numba still keys each entry on
its own version and the CPU. An explicit `NUMBA_CACHE_DIR` wins.

Each minfer version so leaves a folder behind, and it holds that version's repacked weights too
(`engine/shared_weights.py`, hundreds of MB per model). `mark_used` stamps the folder of the
running version; `prune_other_versions` (run when a version first warms up or writes repacked
weights) deletes the folders of other versions unused for `STALE_DAYS`, and their repacked
weights after `STALE_DERIVED_DAYS` (a second to remake, should that version run again).

`lean_cache_loads` (the console script's processes) loads cached kernels without what only a
compilation needs, and keeps numba's runtime's machine code in the folder too (`nrt-*.bin`).

`load_generated` imports kernel source rendered from a template (one function per type, where a
closure factory could not be cached: numba caches only functions of a real source file whose
callees are module globals) from a file written once into that folder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, cast

import numpy as np
from numba import typeof
from numba.core import config
from numba.core.dispatcher import Dispatcher

from minfer.store.catalog import minfer_home

_T = TypeVar("_T")

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
        files.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return files


def prime() -> None:
    """Make numba ready to load cached kernels now, off the caller's path (a warm start's
    engine does it on its warming thread). After `lean_cache_loads` that is numba's runtime
    (NRT) alone, which cached machine code links against; otherwise numba's typing and target
    contexts too (what its first cache load would build: 0.2-0.3 s of imports and
    registrations under the GIL)."""
    from numba.core.registry import cpu_target
    from numba.core.runtime import nrt

    if _lean:
        nrt.rtsys.initialize(cpu_target.target_context)
        return
    cpu_target.target_context.refresh()
    cpu_target.typing_context.refresh()


_lean = False


def lean_cache_loads() -> None:
    """For a process that runs only minfer's kernels (the console script): numba loads a
    kernel from its disk cache without first refreshing its typing and target contexts. That
    refresh imports and registers every lowering numba has (its sets, dicts, datetimes,
    random, linear algebra with scipy's BLAS where installed): 0.2-0.3 s of a warm start
    (Intel SPR), none of it used by machine code loaded from the cache, which links against
    numba's runtime only (initialized here instead). A cache miss compiles as before: numba's
    compiler refreshes both contexts itself before it types anything. Other compiled code in
    the process would meet the same rule, so a library (`minfer.api`) leaves this off.

    numba's third-party extensions (`numba_extensions` entry points) are not looked up either:
    minfer's kernels use none, and the lookup reads every installed distribution's metadata
    on the first call through a dispatcher (18 ms in a virtual environment of 200 packages).
    Nor is a loaded kernel's bitcode parsed until a compilation links it in
    (`_defer_linking_modules`)."""
    global _lean
    from numba.core import caching, entrypoints
    from numba.core.runtime import nrt

    if _lean or not all(hasattr(caching.Cache, name) for name in (
            "_load_overload", "_guard_against_spurious_io_errors")):
        return  # (a numba whose cache reads differently: its own load, refresh included)
    entrypoints._already_initialized = True

    def load_overload(self: Any, sig: Any, target_context: Any) -> Any:
        nrt.rtsys.initialize(target_context)  # idempotent
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)

    caching.Cache.load_overload = load_overload  # type: ignore[method-assign]
    _defer_linking_modules()
    _lean_environments()
    _cached_runtime()
    _checked_cache_paths()
    _lean = True


def _checked_cache_paths() -> None:
    """numba checks that a function's cache folder is writable (a folder made, a temporary file
    made and deleted) as it makes each dispatcher: ~200 times for 7 folders as minfer's kernel
    modules import (5 ms of a warm start). Here each folder is checked once a process."""
    from numba.core import caching

    check = getattr(caching._CacheLocator, "ensure_cache_path", None)
    if check is None:
        return
    checked: set[str] = set()

    def ensure_cache_path(self: Any) -> None:
        path = self.get_cache_path()
        if path not in checked:
            check(self)
            checked.add(path)

    caching._CacheLocator.ensure_cache_path = ensure_cache_path  # type: ignore[method-assign]


def _cached_runtime() -> None:
    """numba's runtime (NRT) compiles its LLVM module in every process before the first kernel
    loads (17.5 ms CPU of a warm start, Intel SPR, on the warm-up thread). Here its machine
    code is kept beside the kernels (`nrt-<key>.bin`, keyed as numba keys a cached kernel: its
    version, llvmlite's, the target triple, CPU name and features) and loaded as a cached kernel
    is; a file that is missing or does not load is compiled as numba compiles it, and written."""
    import pickle

    import llvmlite
    import numba
    from numba.core.runtime import nrtdynmod

    if not all(hasattr(nrtdynmod, name) for name in ("compile_nrt_functions",
                                                       "create_nrt_module")):
        return
    compile_runtime = nrtdynmod.compile_nrt_functions

    def cached_runtime(ctx: Any) -> Any:
        codegen = ctx.codegen()
        try:
            key = repr((numba.__version__, llvmlite.__version__, codegen.magic_tuple()))
            root = getattr(config, "CACHE_DIR", "") or str(cache_dir())
            path = Path(root) / f"nrt-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin"
        except Exception:  # (a codegen that describes itself otherwise)
            return compile_runtime(ctx)
        with contextlib.suppress(Exception):  # (missing, or unreadable: compiled below)
            return codegen.unserialize_library(pickle.loads(path.read_bytes()))
        ir_mod, library = nrtdynmod.create_nrt_module(ctx)  # compile_nrt_functions, kept
        library.enable_object_caching()
        library.add_ir_module(ir_mod)
        library.finalize()
        with contextlib.suppress(OSError):
            _write_bytes(path, pickle.dumps(library.serialize_using_object_code()))
        return library

    nrtdynmod.compile_nrt_functions = cached_runtime


def _lean_environments() -> None:
    """A cached kernel brings the environments of the functions compiled into it, each
    rebuilt around its module's names, the module imported for them. numba's own helpers'
    (`numba.np.arrayobj`, behind an `np.empty`, which imports numba's strings, hashing and
    sorts: 16 ms of a warm start, Intel SPR) get their module's name alone instead while that
    module is not imported: only object-mode code reads an environment's names (numba's
    `pylowering`), and minfer compiles none; nopython code reads its constants, kept as
    numba keeps them. The stand-in pickles as numba's own (a cache written by a lean process
    reads the same everywhere)."""
    from numba.core import environment

    if not all(hasattr(environment, name) for name in ("_rebuild_env", "lookup_environment",
                                                        "Environment")):
        return
    rebuild = environment._rebuild_env

    def lean_rebuild_env(modname: Any, consts: Any, env_name: Any) -> Any:
        if (isinstance(modname, str) and modname.startswith("numba.")
                and modname not in sys.modules
                and environment.lookup_environment(env_name) is None):
            env = environment.Environment({"__name__": modname})
            env.consts[:] = consts
            env.env_name = env_name
            environment.Environment._memo[env_name] = env
            return env
        return rebuild(modname, consts, env_name)

    for attr in ("__module__", "__name__", "__qualname__"):
        setattr(lean_rebuild_env, attr, getattr(rebuild, attr))
    environment._rebuild_env = lean_rebuild_env


def _defer_linking_modules() -> None:
    """A cached kernel comes as its machine code (an object file) and the LLVM bitcode of its
    module, which numba parses at once: for the names the object defines, and for inlining
    into a later compilation that calls the kernel. Here the names come from the object's
    ELF symbol table, and the bitcode is parsed only if a compilation links the kernel in:
    a warm start's kernels (0.9 MB of bitcode for the dev model) skip ~60 ms of parsing (AMD
    EPYC Zen 3). Objects in other formats (macOS, Windows), or that this reader cannot make
    out, load as numba loads them."""
    from numba.core.codegen import CPUCodeLibrary

    if not all(hasattr(CPUCodeLibrary, name) for name in (
            "_unserialize", "_get_module_for_linking", "enable_object_caching",
            "_set_compiled_object", "_finalize_final_module")):
        return
    unserialize = CPUCodeLibrary._unserialize.__func__  # type: ignore[attr-defined]
    for_linking = CPUCodeLibrary._get_module_for_linking

    def lean_unserialize(cls: Any, codegen: Any, state: Any) -> Any:
        name, kind, data = state
        symbols = elf_defined_symbols(data[0]) if kind == "object" else None
        if symbols is None:
            return unserialize(cls, codegen, state)
        library = codegen.create_library(name)
        library.enable_object_caching()
        library._set_compiled_object(data[0])
        library._minfer_bitcode = data[1]
        library._finalize_final_module()
        codegen._engine._defined_symbols |= symbols
        return library

    def module_for_linking(self: Any) -> Any:
        bitcode = self.__dict__.pop("_minfer_bitcode", None)
        if bitcode is not None:
            import llvmlite.binding as ll

            self._shared_module = ll.parse_bitcode(bitcode)
        return for_linking(self)

    CPUCodeLibrary._unserialize = classmethod(lean_unserialize)  # type: ignore[assignment]
    CPUCodeLibrary._get_module_for_linking = module_for_linking  # type: ignore[method-assign]


_ELF_SECTION = np.dtype([("name", "<u4"), ("type", "<u4"), ("flags", "<u8"), ("addr", "<u8"),
                         ("offset", "<u8"), ("size", "<u8"), ("link", "<u4"), ("info", "<u4"),
                         ("align", "<u8"), ("entsize", "<u8")])
_ELF_SYMBOL = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                        ("value", "<u8"), ("size", "<u8")])


def elf_defined_symbols(obj: bytes) -> set[str] | None:
    """The names of the functions and data an ELF64 little-endian object file defines; None
    for an object in another format."""
    if obj[:6] != b"\x7fELF\x02\x01":
        return None
    try:
        return _elf_symbols(obj)
    except (ValueError, IndexError, OverflowError):  # (an offset outside the bytes)
        return None


def _elf_symbols(obj: bytes) -> set[str]:
    shoff = int.from_bytes(obj[0x28:0x30], "little")
    shnum = int.from_bytes(obj[0x3C:0x3E], "little")
    sections = np.frombuffer(obj, _ELF_SECTION, shnum, shoff)
    symtabs = sections[sections["type"] == 2]  # SHT_SYMTAB
    if not len(symtabs):
        raise ValueError("no symbol table")
    names: set[str] = set()
    for symtab in symtabs:
        strtab = sections[symtab["link"]]
        strings = obj[int(strtab["offset"]):int(strtab["offset"] + strtab["size"])]
        syms = np.frombuffer(obj, _ELF_SYMBOL, int(symtab["size"]) // _ELF_SYMBOL.itemsize,
                             int(symtab["offset"]))
        kinds = syms["info"] & 0xF  # STT_OBJECT, STT_FUNC
        keep = ((kinds == 1) | (kinds == 2)) & (syms["shndx"] != 0) & (syms["name"] != 0)
        for start in syms["name"][keep].tolist():
            names.add(strings[start:strings.index(b"\0", start)].decode())
    return names


def direct(call: Callable[[], _T]) -> Callable[[], _T]:
    """A bound call (`functools.partial` of a numba function, positional arguments only) as a
    call of the machine code for its arguments' types, loaded or compiled now: the dispatcher's
    per-call type lookup is done once (a five-array call: 0.89 µs through the dispatcher,
    0.42 µs direct, on an AMD EPYC; a 0.5B decode step makes ~550 calls). Valid only while
    every argument keeps its type, as an op tape's fixed buffers do. Calls of any other form
    are returned as they are. Binding a tape makes ~600 such calls over a few dozen distinct
    (function, types) pairs: each pair's machine code is looked up once per process."""
    if not (isinstance(call, functools.partial) and isinstance(call.func, Dispatcher)
            and not call.keywords):
        return call
    sig = tuple(_numba_type(a) for a in call.args)
    entry = _entries.get((call.func, sig))
    if entry is None:
        entry = _entries[(call.func, sig)] = call.func.compile(sig)
        _kernels[entry] = call.func
    return cast(Callable[[], _T], functools.partial(entry, *call.args))


def kernel_call(step: Callable[[], Any]) -> tuple[Any, tuple[Any, ...]] | None:
    """(the function, its arguments) of a call `direct` made (the numba function, not its
    machine code's entry), or of any partial with positional arguments; None for other calls."""
    if not isinstance(step, functools.partial) or step.keywords:
        return None
    return _kernels.get(step.func, step.func), step.args


_entries: dict[tuple[Dispatcher, tuple[Any, ...]], Callable[..., Any]] = {}
_kernels: dict[Callable[..., Any], Dispatcher] = {}  # each entry's numba function


def _numba_type(a: object) -> Any:
    """numba's type of an argument: `typeof`, memoised for arrays on what it reads of them
    (class, dtype, rank, layout, writability, alignment), for bools, floats and numpy numbers
    on their class, for ints within int64 (the type numba gives them all); ~30 us a call
    otherwise, and a tape binding types a few hundred scalars."""
    kind = type(a)
    key: tuple[Any, ...]
    if isinstance(a, np.ndarray):
        flags = a.flags
        key = (kind, a.dtype, a.ndim, flags.c_contiguous, flags.f_contiguous, flags.writeable,
               flags.aligned)
    elif isinstance(a, int) and kind is int:
        if not -(2**63) <= a < 2**63:
            return typeof(a)
        key = (int,)
    elif kind is bool or kind is float or issubclass(kind, np.number | np.bool_):
        key = (kind,)
    else:
        return typeof(a)
    t = _types.get(key)
    if t is None:
        t = _types[key] = _array_type(cast(np.ndarray, a)) if kind is np.ndarray else typeof(a)
    return t


def _array_type(a: np.ndarray) -> Any:
    """numba's `typeof` of a plain ndarray, as its `_typeof_ndarray` makes it, less the test
    for a masked array (which imports numpy.ma: 12 ms of a warm start); `typeof` itself where
    the dtype is one numba does not take (its error)."""
    from numba.core import errors, types
    from numba.np import numpy_support

    try:
        dtype = numpy_support.from_dtype(a.dtype)
    except errors.NumbaNotImplementedError:
        return typeof(a)
    return types.Array(dtype, a.ndim, numpy_support.map_layout(a),
                       readonly=not a.flags.writeable)


_types: dict[tuple[Any, ...], Any] = {}


def install_stamp() -> str:
    """Where this copy of the package lives and when its compiled sources were written: numba
    keys its cache entries on both (the source path names the entry, the file's modification
    time validates it), so the same sources installed elsewhere, or reinstalled, compile again
    although `sources_digest` is unchanged. For markers that claim the cache is warm."""
    mtimes = ",".join(str(f.stat().st_mtime_ns) for f in _source_files())
    return f"{_PACKAGE}:{hashlib.sha256(mtimes.encode()).hexdigest()[:16]}"


def cache_dir() -> Path:
    return minfer_home() / "numba" / sources_digest()


USED_STAMP = "last-used"
STALE_DAYS = 14.0
STALE_DERIVED_DAYS = 1.0
_DIGEST_NAME = re.compile(r"[0-9a-f]{16}")
_marked = False


def mark_used() -> None:
    """Stamp this version's kernel folder as in use now (once per process)."""
    global _marked
    if _marked or os.environ.get("NUMBA_CACHE_DIR"):
        return
    _marked = True
    stamp = cache_dir() / USED_STAMP
    with contextlib.suppress(OSError):
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()


def _last_used(folder: Path) -> float:
    stamp = folder / USED_STAMP
    try:
        return stamp.stat().st_mtime if stamp.exists() else folder.stat().st_mtime
    except OSError:
        return time.time()


def prune_other_versions(now: float | None = None) -> list[Path]:
    """Delete what other minfer versions left under `$MINFER_HOME/numba` and no longer use (see
    the module's docstring); nothing where `NUMBA_CACHE_DIR` chose the folder. The paths
    deleted."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return []
    now = time.time() if now is None else now
    mine = cache_dir()
    gone: list[Path] = []
    with contextlib.suppress(OSError):
        for folder in mine.parent.iterdir():
            if folder == mine or not folder.is_dir() or not _DIGEST_NAME.fullmatch(folder.name):
                continue
            idle_days = (now - _last_used(folder)) / 86400
            target = (folder if idle_days > STALE_DAYS
                      else folder / "derived" if idle_days > STALE_DERIVED_DAYS else None)
            if target is not None and target.exists():
                shutil.rmtree(target, ignore_errors=True)
                gone.append(target)
    return gone


if not os.environ.get("NUMBA_CACHE_DIR"):
    config.CACHE_DIR = str(cache_dir())  # type: ignore[attr-defined]


def _write_once(path: Path, source: str) -> None:
    """Write `source` to `path` unless it is there: its name is the source's hash, so an
    existing file holds the same source and is left alone (its modification time, which numba's
    cache index checks, stays put). Written under a private name and renamed, so a concurrent
    process (the warm-up helper) never imports half a file."""
    if not path.exists():
        _write_bytes(path, source.encode())


def _write_bytes(path: Path, data: bytes) -> None:
    """`data` to `path`, under a private name renamed into place (a concurrent reader sees
    the whole file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def load_generated(module_name: str, source: str) -> ModuleType:
    """Import `source` as `module_name` from `<numba cache folder>/generated/<stem>_<hash>.py`
    (a changed source lands in a fresh file, and so in a fresh numba cache entry); numba's
    `cache=True` then works on its functions as on any module's."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    root = getattr(config, "CACHE_DIR", "") or str(cache_dir())
    path = Path(root) / "generated" / f"{module_name.rsplit('.', 1)[-1]}_{digest}.py"
    try:
        _write_once(path, source)
    except OSError as e:  # an unwritable cache: the kernels still run, compiled every time
        warnings.warn(f"minfer: cannot write generated kernels to {path} ({e}); they will be "
                      "compiled on every run", stacklevel=2)
        path = Path(tempfile.mkdtemp(prefix="minfer-kernels-")) / path.name
        _write_once(path, source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
