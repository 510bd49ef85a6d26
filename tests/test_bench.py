"""`minfer bench`: llama-bench's rows, depth (`-d`) and the read-bandwidth roofline row."""

from __future__ import annotations

import json
import math
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
    # beside each, the model's own weight arrays read (the held copies): a real reading, the
    # bytes the kernels read a share of it
    assert tg["weights_read_gb_per_s"] > 0
    assert tg["weights_read_fraction"] == pytest.approx(
        tg["held_gb_per_s"] / tg["weights_read_gb_per_s"])


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


def test_held_bytes_count_a_widened_type_at_its_copys_size(tmp_path: Path) -> None:
    """Q3_K matrices run from Q6_K copies (`reencode.widen`): the bytes minfer holds for a
    decode step exceed the file's by exactly the widening (210 / 110 bytes a block); the
    file's bytes by type add up to weight_bytes_per_token; bench's tg row reports both."""
    from minfer.bench.runner import (
        held_bytes_per_token,
        weight_bytes_by_type,
        weight_bytes_per_token,
    )
    from minfer.gguf.constants import GGMLQuantizationType as QType
    from minfer.tools.synth import write_tiny_model

    path = write_tiny_model(tmp_path / "q3k.gguf", n_embd=256, n_ff=256, weight_types={
        "ffn_down": QType.Q3_K, "default": QType.F16})
    engine = minfer.load(str(path), n_ctx=32, backend="cpu").engine()
    engine.forward([1, 2, 3], 0)
    engine.forward([4], 3)
    by_type = weight_bytes_by_type(engine)
    downs = [t.nbytes for name, t in engine.weights.file.tensors.items() if "ffn_down" in name]
    assert by_type["Q3_K"] == sum(downs)
    assert sum(by_type.values()) == weight_bytes_per_token(engine)
    assert held_bytes_per_token(engine) - weight_bytes_per_token(engine) == \
        sum(downs) * 100 // 110
    # a tg row counts both: GB/s of the file's bytes, and what the kernels read ("held")
    from minfer.cli.bench_cmd import _md

    row = run_test(engine, model="m", backend="cpu", n_threads=1, n_gen=2, reps=1)
    assert row.gb_per_s is not None and row.held_gb_per_s is not None
    assert row.held_gb_per_s / row.gb_per_s == pytest.approx(
        held_bytes_per_token(engine) / weight_bytes_per_token(engine))
    assert f"{row.gb_per_s:.1f}, held {row.held_gb_per_s:.1f} |" in _md([row], header=False)


@pytest.mark.parametrize("widen", [False, True], ids=["file-blocks", "widened"])
def test_held_bytes_of_iq2_xxs_are_the_files_unless_widened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, widen: bool) -> None:
    """IQ2_XXS (`reencode.READ_DIRECT`) is read from the file's blocks by default: no copy of
    it made or kept, the bytes held for a decode step the file's; under MINFER_IQ_WIDEN its
    exact Q7_K copies (276 / 66 bytes a block), held in their place."""
    from minfer.bench.runner import held_bytes_per_token, weight_bytes_per_token
    from minfer.gguf.constants import GGMLQuantizationType as QType
    from minfer.tools.synth import write_tiny_model

    if widen:
        monkeypatch.setenv("MINFER_IQ_WIDEN", "1")
    else:
        monkeypatch.delenv("MINFER_IQ_WIDEN", raising=False)
    path = write_tiny_model(tmp_path / "iq2.gguf", n_embd=256, n_ff=256, weight_types={
        "ffn_down": QType.IQ2_XXS, "default": QType.F16})
    engine = minfer.load(str(path), n_ctx=32, backend="cpu").engine()
    engine.forward([1, 2, 3], 0)
    engine.forward([4], 3)
    downs = {name: t.nbytes for name, t in engine.weights.file.tensors.items()
             if "ffn_down" in name}
    assert held_bytes_per_token(engine) - weight_bytes_per_token(engine) == (
        sum(downs.values()) * 210 // 66 if widen else 0)
    assert not any(engine.weights.has_copy(name) for name in downs)


def test_weights_read_bandwidth_reads_any_arrays() -> None:
    from minfer.bench.bandwidth import weights_read_bandwidth

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 255, 3 * 4099, dtype=np.uint8)
    arrays = [raw[1:].reshape(-1, 2), raw[:5], np.ones((64, 96), np.float32)]  # unaligned, tiny
    assert weights_read_bandwidth(arrays, 2, passes=1) > 0
    with pytest.raises(ValueError, match="no weight bytes"):
        weights_read_bandwidth([raw[:5]], 1)


# -- perplexity ---------------------------------------------------------------------------------

PPL_REF = json.loads((Path(__file__).parent / "fixtures" / "perplexity_llamacpp.json").read_text())


def test_perplexity_scores_the_second_half_of_each_whole_chunk() -> None:
    from minfer.bench.perplexity import chunks, perplexity

    seen: list[list[int]] = []

    def scorer(chunk: list[int]) -> list[float]:
        seen.append(chunk)
        return [-float(t % 3) for t in chunk[1:]]

    ids = list(range(10, 31))  # 21 tokens: two whole chunks of 8, the rest left out
    result = perplexity(scorer, ids, 8, bos=1)
    assert seen == [[1, *range(11, 18)], [1, *range(19, 26)]]
    scored = [t % 3 for t in [15, 16, 17, 23, 24, 25]]  # positions 5..7 of each chunk
    assert result.n_scored == 6 and result.n_chunks == 2
    assert math.isclose(result.ppl, math.exp(sum(scored) / 6))
    mean = sum(scored) / 6
    var = sum(s * s for s in scored) / 6 - mean * mean
    assert math.isclose(result.error, math.sqrt(var / 5) * result.ppl)
    assert len(result.running) == 2 and perplexity(scorer, ids, 8, None).n_chunks == 2
    assert chunks(ids, 8, None, max_chunks=1) == [ids[:8]]
    with pytest.raises(MinferError, match="needs at least 16"):
        chunks(ids[:15], 8, None)


def test_perplexity_cli_is_the_engines_own_likelihood(tiny_qwen2: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Every scored token's logprob is the log-softmax of a whole-chunk forward's row."""
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile

    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 6)
    assert main(["perplexity", str(tiny_qwen2), "-f", str(text), "-c", "32", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    model = minfer.load(tiny_qwen2)
    ids = model.tokenizer.encode(text.read_text(), special=False)
    f = GGUFFile.open(tiny_qwen2)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=32)
    nll = []
    for i in range(len(ids) // 32):
        chunk = ids[i * 32:(i + 1) * 32]
        x = engine.forward(chunk, 0, 32).astype(np.float64)
        lse = x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))
        nll += [lse[j] - x[j, chunk[j + 1]] for j in range(16, 31)]
    assert got["n_tokens"] == len(ids) and got["n_scored"] == len(nll) == 15 * (len(ids) // 32)
    assert math.isclose(got["ppl"], math.exp(np.mean(nll)), rel_tol=1e-4)


def test_perplexity_needs_two_chunks_of_text(tiny_qwen2: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("short")
    assert main(["perplexity", str(tiny_qwen2), "-f", str(text), "-c", "32"]) != 0
    assert "needs at least 64" in capsys.readouterr().err


@pytest.mark.real_model
@pytest.mark.parametrize("case", PPL_REF["cases"], ids=[c["model"] for c in PPL_REF["cases"]])
def test_perplexity_is_llama_cpps(case: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's perplexity of the same text, chunks and BOS (a BPE model and Gemma's SPM):
    within 1% at the end, 2.5% after each chunk (measured: 0.5B 0.3% and 0.8% after its first
    chunk of 63 scored tokens; Gemma-3-270M 0.35%, 1.6% after its first, Intel SPR)."""
    from minfer.store.download import pull

    text = Path(__file__).parent / "fixtures" / PPL_REF["text"]
    argv = ["perplexity", str(pull(case["model"], progress=False)), "-f", str(text), "-c",
            str(case["n_ctx"]), "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["n_tokens"] == case["n_tokens"]
    np.testing.assert_allclose(got["running"], case["running"], rtol=0.025)
    assert got["ppl"] == pytest.approx(case["ppl"], rel=0.01)
