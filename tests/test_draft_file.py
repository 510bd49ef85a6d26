"""The draft model's weights narrowed to Q4_0 (`minfer.engine.draft_file`): made once into the
cache, only for drafts wider than 5 bits a value, stale copies removed; the server and the API
load it (their tests: test_server_draft_process, test_speculative)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

from minfer.engine.speculative import draft_file, weight_bits
from minfer.gguf.reader import GGUFFile
from minfer.tools.synth import write_tiny_model


def test_a_wide_draft_is_narrowed_once_and_stale_copies_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINFER_HOME", str(tmp_path / "home"))
    src = write_tiny_model(tmp_path / "draft.gguf", seed=3)
    with GGUFFile.open(src) as f:
        assert weight_bits(f) > 5
    assert draft_file(src, "keep") == src
    out = draft_file(src)
    assert out.parent == tmp_path / "home" / "drafts" and out != src
    with GGUFFile.open(out) as f:
        assert weight_bits(f) <= 5
        kinds = {QT(t.ggml_type) for t in f.tensors.values() if len(t.shape) >= 2}
        assert QT.Q4_0 in kinds
        with GGUFFile.open(src) as g:
            assert list(f.metadata["tokenizer.ggml.tokens"]) == list(
                g.metadata["tokenizer.ggml.tokens"])
    made = out.stat().st_mtime_ns
    assert draft_file(src) == out and out.stat().st_mtime_ns == made  # made once
    assert draft_file(out) == out  # already narrow: loaded as it is
    os.utime(src, ns=(made + 10**9, made + 10**9))  # the source changed: a new copy
    other = write_tiny_model(tmp_path / "other.gguf", seed=4)
    fresh = draft_file(src)
    assert fresh != out and fresh.is_file()
    assert not out.exists()  # the stale copy went when the new one was made
    other_copy = draft_file(other)
    other.unlink()
    draft_file(write_tiny_model(tmp_path / "third.gguf", seed=5))
    assert not other_copy.exists() and fresh.exists()
    drafts = tmp_path / "home" / "drafts"
    dead = drafts / f"x-000000000000.q4_0.gguf.{2**22 + 12345}"  # beyond Linux's pid_max
    dead.write_bytes(b"partial")
    live = drafts / f"x-000000000000.q4_0.gguf.{os.getpid()}.part"
    live.write_bytes(b"partial")
    draft_file(write_tiny_model(tmp_path / "fourth.gguf", seed=6))
    assert not dead.exists() and live.exists()  # an unfinished copy of a live process stays
    with pytest.raises(ValueError, match="draft-quant"):
        draft_file(src, "q8_0")
