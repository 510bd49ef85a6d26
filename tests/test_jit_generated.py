"""Kernel source generated from templates (minfer.jit_cache.load_generated): written once per
source into the numba cache folder, imported from that file, cached by numba like any module."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from numba.core import config

from minfer import jit_cache
from minfer.backends.cpu.kernels.linear import row_drivers
from minfer.tools.quantize import rows

_SOURCE = '''
from numba import njit


@njit(cache=True)
def twice(x):
    return 2 * x
'''


@pytest.fixture
def cache_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    return tmp_path


def test_generated_module_is_written_once_and_cached_by_numba(cache_folder: Path) -> None:
    mod = jit_cache.load_generated("minfer_test_generated_twice", _SOURCE)
    path = Path(mod.__file__ or "")
    assert path.parent == cache_folder / "generated" and path.read_text() == _SOURCE
    assert mod.twice(21) == 42
    # numba wrote its index for the function beside the other cached kernels
    assert list(cache_folder.rglob("*twice*.nbi"))
    stamp = path.stat().st_mtime_ns
    again = jit_cache.load_generated("minfer_test_generated_twice", _SOURCE)
    assert again.__file__ == mod.__file__ and path.stat().st_mtime_ns == stamp
    changed = jit_cache.load_generated("minfer_test_generated_twice", _SOURCE.replace("2 *", "3 *"))
    assert changed.__file__ != mod.__file__ and changed.twice(2) == 6


def test_unwritable_cache_folder_warns_and_still_runs(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be: mkdir fails
    monkeypatch.setattr(config, "CACHE_DIR", str(blocked))
    with pytest.warns(UserWarning, match="compiled on every run"):
        mod = jit_cache.load_generated("minfer_test_generated_blocked", _SOURCE)
    assert mod.twice(np.int64(4)) == 8
    shutil.rmtree(Path(mod.__file__ or "").parent)  # the private folder it fell back to


def test_generated_drivers_are_cached_dispatchers() -> None:
    """Every matmul driver (dense and its stacked-expert `_x` form) and quantizer row driver
    comes from its generated file, with numba's disk cache on (the point of generating files
    rather than closures)."""
    dense = [getattr(row_drivers, n) for n in dir(row_drivers)
             if n.startswith("mv_") and not n.endswith("_x")]
    # 34 types: Q7_K (the IQ2 types' widened copy) and its interleaved form, the table-lookup
    # IQ4_NL / IQ4_XS / MXFP4 and theirs, Q2_K / TQ2_0 and theirs, TQ1_0, the grid-fetching
    # IQ2_XXS / IQ3_XXS / IQ3_S / IQ2_XS / IQ2_S (their default) among them; each with its
    # stacked-expert form and its region parts
    assert len(dense) == 34
    drivers = [*dense, *(row_drivers.expert_form(d) for d in dense)]
    drivers += [getattr(row_drivers._M, f"{d.py_func.__name__}{part}")
                for d in dense for part in ("_part", "_x_part")]
    drivers += list(rows._DRIVERS.values())
    assert len(drivers) == 4 * 34 + 19  # 34 dense drivers' four forms, 19 quantizer row drivers
    for d in drivers:
        assert d.py_func.__code__.co_filename.endswith(".py")
        assert Path(d.py_func.__code__.co_filename).parent.name == "generated"
        assert d._cache.__class__.__name__ == "FunctionCache"


def test_other_versions_folders_are_pruned_when_unused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINFER_HOME", str(tmp_path))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    root = tmp_path / "numba"
    now = 2_000_000_000.0
    day = 86400.0

    def version(name: str, idle_days: float) -> Path:
        folder = root / name
        (folder / "derived").mkdir(parents=True)
        (folder / "derived" / "w.npy").write_bytes(b"x")
        stamp = folder / jit_cache.USED_STAMP
        stamp.touch()
        os.utime(stamp, (now - idle_days * day, now - idle_days * day))
        return folder

    mine = jit_cache.cache_dir()
    (mine / "derived").mkdir(parents=True)
    recent, idle, old = version("a" * 16, 0.5), version("b" * 16, 3), version("c" * 16, 30)
    other = root / "not-a-version"
    other.mkdir()
    gone = jit_cache.prune_other_versions(now=now)
    assert sorted(gone) == sorted([idle / "derived", old])
    assert (recent / "derived" / "w.npy").exists() and (mine / "derived").exists()
    assert idle.exists() and not (idle / "derived").exists() and not old.exists()
    assert other.exists()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert jit_cache.prune_other_versions(now=now + 100 * day) == []
