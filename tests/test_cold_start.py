"""The first run's kernel compilation (`minfer.engine.warmup`): a plan with one item per kernel,
the work shared with a helper process, a marker that makes later runs silent, and what a person
sees: progress at a terminal before the first token, one plain line elsewhere."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minfer.engine import warmup
from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile


def _engine(path: Path) -> Engine:
    f = GGUFFile.open(path)
    return Engine(f, HParams.from_gguf(f), n_ctx=64)


class _Record:
    def __init__(self) -> None:
        self.total = -1
        self.seen: list[tuple[int, str]] = []
        self.finished = False

    def start(self, total: int) -> None:
        self.total = total

    def advance(self, done: int, label: str) -> None:
        self.seen.append((done, label))

    def finish(self) -> None:
        self.finished = True


def test_plan_has_one_item_per_kernel_of_the_first_graphs(tiny_qwen2: Path) -> None:
    engine = _engine(tiny_qwen2)
    items = warmup.plan(engine, warmup.default_shapes(5, 512))
    labels = [i.label for i in items]
    for params in {i.params for i in items}:  # the prefill's kernels, then the decode's
        of_graph = [i.label for i in items if i.params == params]
        assert len(of_graph) == len(set(of_graph))
    assert {"MatMul q8_0", "MatMul q5_0 f32", "MatMul q4_0", "GetRows f16", "Attn"} <= set(labels)
    assert all(engine.cache.get(i.params).graph.nodes[i.node_id].backend == "cpu" for i in items)


def test_warm_up_with_a_helper_then_the_marker_skips_it(tiny_qwen3: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from numba.core import config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path), raising=False)
    engine = _engine(tiny_qwen3)
    record = _Record()
    shapes = warmup.default_shapes(7, 512)
    assert warmup.warm_up(engine, shapes, progress=record,
                          helper=warmup.helper_for(engine, min_spare=0))
    assert record.finished and record.seen[-1] == (record.total, "done")
    assert record.total == len(warmup.plan(engine, shapes)) > 5
    assert list(tmp_path.glob("warm-*"))
    assert not warmup.warm_up(engine, shapes, progress=_Record())  # warm: nothing to do
    # the placeholder runs left the engine usable: a forward equals a fresh engine's
    tokens = [5, 17, 99, 3, 250, 42, 7]
    assert np.array_equal(engine.forward(tokens, 0), _engine(tiny_qwen3).forward(tokens, 0))


def test_without_a_terminal_one_line_and_no_bar() -> None:
    out = io.StringIO()
    progress = warmup.TerminalProgress(out)
    progress.announce()
    progress.start(12)
    for i in range(12):
        progress.advance(i, "MatMul q8_0")
    progress.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "compiling the CPU kernels" in lines[0]


@pytest.mark.slow
def test_a_cold_start_at_a_terminal_shows_progress_before_the_first_token(
        tiny_qwen2: Path, tmp_path: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "TERM": "xterm",
           "MINFER_BACKEND": "cpu", "COLUMNS": "160"}
    argv = ["-m", "minfer.cli.main", "run", str(tiny_qwen2), "--raw", "-n", "3", "--temp", "0",
            "Hello"]
    child = pexpect.spawn(sys.executable, argv, env=env, encoding="utf-8", timeout=600,
                          dimensions=(40, 160))
    try:
        child.expect("first run on this machine", timeout=60)  # before the model loads
        child.expect(r"compiling kernels.*\d+/\d+")  # the bar: items done of the total
        child.expect(r"kernels compiled in \d+ s")  # then the answer, then the rates
        child.expect("Prefill:")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    again = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and "compil" not in again.stderr  # warm: nothing said


def test_the_marker_belongs_to_one_installed_copy_of_the_sources(
        tiny_qwen2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numba names a cache entry by its source's path and validates it by the source's
    modification time: the same sources installed elsewhere, or rewritten by a reinstall, compile
    again, so a marker written by another copy must not announce a warm start."""
    from minfer import jit_cache

    source = tmp_path / "kernel.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(jit_cache, "_source_files", lambda: [source])
    stamp = jit_cache.install_stamp()
    f = GGUFFile.open(tiny_qwen2)
    here = warmup.marker_path(f, kv_type="f16", batch_invariant=False)
    os.utime(source, ns=(1, 1))  # reinstalled: same bytes, another modification time
    assert jit_cache.install_stamp() != stamp
    assert warmup.marker_path(f, kv_type="f16", batch_invariant=False) != here
    monkeypatch.setattr(jit_cache, "_PACKAGE", tmp_path / "elsewhere")
    assert str(tmp_path / "elsewhere") in jit_cache.install_stamp()
