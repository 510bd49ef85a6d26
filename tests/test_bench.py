"""`minfer bench`: llama-bench's rows, depth (`-d`) and the read-bandwidth roofline row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import minfer
from minfer.bench.bandwidth import read_bandwidth
from minfer.bench.runner import run_test
from minfer.cli.main import main
from minfer.errors import MinferError


def test_rows_carry_depth_and_llama_bench_labels(tiny_qwen2: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", str(tiny_qwen2), "-p", "8", "-n", "4", "-d", "0,16", "-r", "1", "-t", "1",
            "-o", "json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["n_depth"]) for r in rows] == [
        ("pp8", 0), ("tg4", 0), ("pp8 @ d16", 16), ("tg4 @ d16", 16)]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_each_thread_count_runs_on_an_engine_of_that_count(
        tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`-t 1,2` times one engine per count, each with that fixed count (not the default's
    adaptive decode), as llama-bench does."""
    from minfer.bench import runner

    seen: list[tuple[int, int | None, bool]] = []
    real = runner.run_test

    def recording(engine: Any, **kw: Any) -> Any:
        seen.append((kw["n_threads"], engine.n_threads, engine.tuner is not None))
        return real(engine, **kw)

    monkeypatch.setattr(runner, "run_test", recording)
    argv = ["bench", str(tiny_qwen2), "-p", "0", "-n", "2", "-r", "1", "-t", "1,2", "-o", "json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["n_threads"] for r in rows] == [1, 2]
    assert seen == [(1, 1, False), (2, 2, False)]


def test_set_threads_drops_the_engine_made_for_the_old_count(tiny_qwen2: Path) -> None:
    model = minfer.load(str(tiny_qwen2), n_ctx=32, backend="cpu", threads=1)
    first = model.engine()
    assert (model.threads, first.n_threads) == (1, 1)
    model.set_threads(2, adaptive=True)
    second = model.engine()
    assert second is not first
    assert (model.threads, model.adaptive_threads, second.n_threads) == (2, True, 2)
    with pytest.raises(MinferError, match="at least 1"):
        model.set_threads(0)


def test_a_depth_test_runs_after_depth_tokens_in_the_kv(tiny_qwen2: Path) -> None:
    model = minfer.load(str(tiny_qwen2), n_ctx=64, backend="cpu")
    engine = model.engine(64)
    calls: list[tuple[int, int]] = []
    forward = engine.forward

    def recording(tokens: Any, start_pos: int, **kw: Any) -> np.ndarray:
        calls.append((start_pos, len(tokens)))
        return forward(tokens, start_pos, **kw)

    engine.forward = recording  # type: ignore[method-assign]
    run_test(engine, model="m", backend="cpu", n_threads=1, n_gen=3, n_depth=20, reps=1)
    # per repetition (warm-up + 1): the depth prefill, one context token, then 3 timed steps
    rep = [(0, 20), (20, 1), (21, 1), (22, 1), (23, 1)]
    assert calls == rep + rep


def test_read_bandwidth_reads_the_whole_buffer() -> None:
    assert read_bandwidth(1, nbytes=8 << 20, passes=1) > 0  # the probe checks its own sum
    # a length the chunks do not divide: the last chunks are short or empty, none is skipped
    assert read_bandwidth(2, nbytes=8 * 1001, passes=1) > 0


def test_roofline_fraction_uses_the_readings_beside_each_repetition(
        tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.bench import bandwidth

    readings = iter([10.0, 20.0, 40.0, 99.0])  # the row's first reading, then one per rep
    monkeypatch.setattr(bandwidth, "read_bandwidth", lambda *a, **k: next(readings))
    argv = ["bench", str(tiny_qwen2), "-p", "0", "-n", "4", "-r", "2", "-t", "1",
            "--roofline", "-o", "json"]
    assert main(argv) == 0
    read, tg = json.loads(capsys.readouterr().out)
    assert read["test"] == "roofline" and read["gb_per_s"] == 10.0
    assert tg["test"] == "tg4" and tg["roofline_gb_per_s"] == 30.0  # mean of the two beside
    assert tg["roofline_fraction"] == pytest.approx(tg["gb_per_s"] / 30.0)
    assert next(readings) == 99.0  # exactly one reading per repetition
    # beside each, the model's own weights read: a real reading, the row's GB/s a share of it
    assert tg["weights_read_gb_per_s"] > 0
    assert tg["weights_read_fraction"] == pytest.approx(
        tg["gb_per_s"] / tg["weights_read_gb_per_s"])


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3moe"])
def test_the_read_set_is_every_matrix_a_decode_step_reads_whole(
        model: str, request: pytest.FixtureRequest) -> None:
    """Each matrix once (its backend copy where one was made), the token embedding only
    where it is also the output projection (tied): what `weights_read_bandwidth` reads."""
    path = request.getfixturevalue(model)
    engine = minfer.load(str(path), n_ctx=32, backend="cpu").engine()
    engine.forward([1, 2, 3], 0)
    engine.forward([4], 3)
    tensors = engine.weights.file.tensors
    tied = engine.hparams.tie_embeddings
    want = sum(t.nbytes for name, t in tensors.items()
               if len(t.shape) >= 2 and (tied or name != "token_embd.weight"))
    arrays = engine.weights.read_set(() if tied else ("token_embd.weight",))
    assert sum(a.nbytes for a in arrays) == want
    assert len({a.ctypes.data for a in arrays}) == len(arrays)  # none twice


def test_weights_read_bandwidth_reads_any_arrays() -> None:
    from minfer.bench.bandwidth import weights_read_bandwidth

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 255, 3 * 4099, dtype=np.uint8)
    arrays = [raw[1:].reshape(-1, 2), raw[:5], np.ones((64, 96), np.float32)]  # unaligned, tiny
    assert weights_read_bandwidth(arrays, 2, passes=1) > 0
    with pytest.raises(ValueError, match="no weight bytes"):
        weights_read_bandwidth([raw[:5]], 1)
