"""Repacked weights shared between engines (MINFER_SHARE_WEIGHTS): the first engine stores them,
a second maps them without repacking, and both compute exactly what a private copy computes."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from minfer.engine import shared_weights
from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.tools.synth import write_tiny_model

TOKENS = [5, 17, 99, 3, 250, 42, 7, 8]


def _logits(path: Path) -> tuple[np.ndarray, Engine]:
    f = GGUFFile.open(path)
    e = Engine(f, HParams.from_gguf(f), n_ctx=32, n_threads=1)
    return e.forward(TOKENS, 0, n_out=len(TOKENS)), e


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows wide enough for the repacked layouts (Q8_0, Q4_0, Q5_0, Q4_K)."""
    from gguf import GGMLQuantizationType as QType

    from minfer.backends.cpu.kernels import packable

    if not packable(QType.Q4_0, 512, 512):
        pytest.skip("no repacked layouts on this CPU (needs AVX512-VNNI)")
    types = {"token_embd": QType.Q8_0, "ffn_down": QType.Q4_0, "ffn_gate": QType.Q4_K,
             "ffn_up": QType.Q5_0, "default": QType.Q5_0}
    return write_tiny_model(tmp_path_factory.mktemp("wide") / "wide.gguf", n_embd=512,
                            n_head=8, n_head_kv=2, n_ff=768, weight_types=types, seed=3)


def test_engines_share_the_repacked_weights(wide_model: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shared_weights.ENV, raising=False)
    private, e0 = _logits(wide_model)
    assert len(e0.weights._derived) >= 4

    monkeypatch.setenv(shared_weights.ENV, str(tmp_path))
    first, _ = _logits(wide_model)  # repacks and stores
    files = sorted(tmp_path.glob("*.npy"))
    assert len(list(tmp_path.glob("*.lock"))) == len(files)
    assert len(files) == len(e0.weights._derived)
    assert not list(tmp_path.glob("*.tmp"))

    def no_store(*args: object) -> None:
        raise AssertionError("a second engine must map the stored weights, not repack")

    monkeypatch.setattr(shared_weights.SharedStore, "store", no_store)
    released: list[str] = []
    real_release = GGUFFile.release

    def release(self: GGUFFile, name: str, rows: tuple[int, int] | None = None) -> None:
        released.append(name)
        real_release(self, name, rows)

    monkeypatch.setattr(GGUFFile, "release", release)
    second, e2 = _logits(wide_model)
    # the file's pages of every mapped copy are let go (an earlier reader may have touched them)
    assert {name for name, _ in e2.weights._derived} <= set(released)
    assert all(e2.weights.has_copy(name) for name, _ in e2.weights._derived)
    assert not e2.weights.has_copy("output_norm.weight")
    np.testing.assert_array_equal(first, private)
    np.testing.assert_array_equal(second, private)
    for (name, form), (arr, qtype) in e2.weights._derived.items():
        mine, my_type = e0.weights._derived[(name, form)]
        assert qtype == my_type and arr.shape == mine.shape
        assert not arr.flags.owndata  # a view of the mapped file, not a copy
        np.testing.assert_array_equal(arr, mine)


def test_on_by_default_for_models_worth_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shared_weights.ENV, raising=False)
    assert not shared_weights.enabled(shared_weights.MIN_MODEL_BYTES - 1)
    assert shared_weights.enabled(shared_weights.MIN_MODEL_BYTES)
    monkeypatch.setenv(shared_weights.ENV, "0")
    assert not shared_weights.enabled(10 * shared_weights.MIN_MODEL_BYTES)
    monkeypatch.setenv(shared_weights.ENV, "1")
    assert shared_weights.enabled(1)


def _model_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def test_a_new_version_of_the_model_replaces_the_old_files(tmp_path: Path) -> None:
    path, folder = _model_file(tmp_path), tmp_path / "derived"
    m = np.arange(64, dtype=np.uint8).reshape(4, 16)
    old = shared_weights.SharedStore(path, folder)
    with old.claim("w", "packed"):
        np.testing.assert_array_equal(old.store("w", "packed", m, 7), m)
    assert old.mapped("w", "packed") is not None
    os.utime(path, ns=(1, 1))  # the file changed: another version
    new = shared_weights.SharedStore(path, folder)
    assert new.tag[:16] == old.tag[:16] and new.tag != old.tag
    assert new.mapped("w", "packed") is None
    with new.claim("w", "packed"):
        new.store("w", "packed", m + 1, 7)
    assert {p.name.split("-")[0] for p in folder.iterdir()} == {new.tag}


def test_a_full_disk_keeps_the_matrix_in_memory(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    store = shared_weights.SharedStore(_model_file(tmp_path), tmp_path / "derived")
    m = np.ones((4, 16), dtype=np.uint8)
    monkeypatch.setattr(shared_weights.shutil, "disk_usage",
                        lambda _: SimpleNamespace(free=shared_weights.FREE_MARGIN))
    with store.claim("w", "packed"):
        assert store.store("w", "packed", m, 7) is m
    assert not list((tmp_path / "derived").glob("*.npy"))


def test_a_damaged_file_is_deleted_and_made_again(tmp_path: Path) -> None:
    store = shared_weights.SharedStore(_model_file(tmp_path), tmp_path / "derived")
    store.folder.mkdir()
    bad = store.folder / f"{store.tag}-w-packed.t7.npy"
    bad.write_bytes(b"\x93NUMPY cut short")
    assert store.mapped("w", "packed") is None
    assert not bad.exists()


@pytest.mark.parametrize("array", [
    np.arange(24, dtype=np.uint8).reshape(4, 6), np.arange(60, dtype=np.int16).reshape(3, 4, 5),
    np.zeros((5, 0), np.float32), np.arange(7, dtype=">i4"), np.array(2.5),
    np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.arange(3).astype([("a", "<i2")]),
], ids=["u8", "i16-3d", "empty", "big-endian", "0-dim", "fortran", "record"])
def test_map_npy_maps_what_np_load_maps(tmp_path: Path, array: np.ndarray) -> None:
    """The quick header match gives np.load's array (the forms it does not match go to
    np.load), writable and copy-on-write: a write changes the mapping, not the file."""
    path = tmp_path / "m.npy"
    np.save(path, array)
    got = shared_weights.map_npy(path)
    want = np.load(path, mmap_mode="c")
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert got.flags.writeable
    if got.size:
        got.reshape(-1)[:1] = got.reshape(-1)[1:2] if got.size > 1 else 0
        assert np.array_equal(np.load(path), array)


def test_map_npy_refuses_a_body_shorter_than_its_header(tmp_path: Path) -> None:
    path = tmp_path / "cut.npy"
    np.save(path, np.arange(1000, dtype=np.uint8).reshape(10, 100))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError):
        shared_weights.map_npy(path)
