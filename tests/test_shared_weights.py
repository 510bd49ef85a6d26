"""Repacked weights shared between engines (MINFER_SHARE_WEIGHTS): the first engine stores them,
a second maps them without repacking, and both compute exactly what a private copy computes."""

from __future__ import annotations

from pathlib import Path

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

    if not packable(QType.Q4_0, 512):
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
    second, e2 = _logits(wide_model)
    np.testing.assert_array_equal(first, private)
    np.testing.assert_array_equal(second, private)
    for (name, form), (arr, qtype) in e2.weights._derived.items():
        mine, my_type = e0.weights._derived[(name, form)]
        assert qtype == my_type and arr.shape == mine.shape
        assert not arr.flags.owndata  # a view of the mapped file, not a copy
        np.testing.assert_array_equal(arr, mine)
