"""`minfer imatrix`: llama-imatrix's statistics through the engine's tracing hook."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.cli.main import main
from minfer.engine.forward import Engine
from minfer.engine.trace import StepTracer
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import ir
from minfer.tools.imatrix import collect
from minfer.tools.quantize.imatrix_file import read
from tests import quantize_cases as qc

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 12


def test_sums_are_the_squared_inputs_of_every_block_matmul(tiny_qwen2: Path) -> None:
    model = minfer.load(tiny_qwen2)
    ids = model.tokenizer.encode(TEXT, special=False)
    f = GGUFFile.open(tiny_qwen2)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=32)
    im = collect(engine, ids, 32, bos=None, batch_size=32, max_chunks=2, dataset="t.txt")
    assert engine.tracer is None  # the collector is attached only while it collects
    assert (im.chunk_count, im.chunk_size, im.datasets) == (2, 32, ["t.txt"])
    matmuls = {n for n, t in f.tensors.items() if n.startswith("blk.") and len(t.shape) == 2}
    assert set(im.entries) == matmuls

    # the same forwards, every node's output captured: a MatMul's input is its source's output
    want: dict[str, np.ndarray] = {}
    tracer = StepTracer(capture=True)
    engine.tracer = tracer
    for i in range(2):
        engine.forward(ids[i * 32:(i + 1) * 32], 0, 32)
    for step in tracer.steps:
        graph = tracer.prepared[step.header["graph"]].graph
        for node in graph.nodes:
            if isinstance(node.op, ir.MatMul) and node.meta.weights[0] in matmuls:
                x = step.outputs[node.srcs[0]].reshape(32, -1).astype(np.float64)
                want[node.meta.weights[0]] = want.get(node.meta.weights[0], 0) + (x * x).sum(0)
    for name, e in im.entries.items():
        assert list(e.counts) == [64]
        np.testing.assert_allclose(e.sums, want[name], rtol=1e-5, err_msg=name)


def test_batches_under_16_rows_are_not_collected(tiny_qwen2: Path) -> None:
    model = minfer.load(tiny_qwen2)
    ids = model.tokenizer.encode(TEXT, special=False)
    f = GGUFFile.open(tiny_qwen2)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=32)
    assert collect(engine, ids, 32, bos=None, batch_size=8, max_chunks=1).entries == {}
    im = collect(engine, ids, 32, bos=None, batch_size=16, max_chunks=1, process_output=True)
    assert all(list(e.counts) == [32] for e in im.entries.values())
    assert "output.weight" not in im.entries  # tied: the head reads token_embd, as in llama.cpp


def test_cli_writes_an_imatrix_that_quantize_takes(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    src = qc.write_source("f32", tmp_path)
    text = tmp_path / "cal.txt"
    text.write_text(TEXT * 2)
    out = tmp_path / "im.gguf"
    assert main(["imatrix", str(src), "-f", str(text), "-o", str(out), "-c", "64",
                 "--chunks", "2", "--process-output"]) == 0
    im = read(out)
    assert im.chunk_count == 2 and im.chunk_size == 64 and im.datasets == [str(text)]
    assert "output.weight" in im.entries and "blk.7.ffn_down.weight" in im.entries
    dst = tmp_path / "q.gguf"
    assert main(["quantize", str(src), str(dst), "Q4_K_M", "--imatrix", str(out)]) == 0
    with GGUFFile.open(dst) as g:
        assert g.metadata["quantize.imatrix.entries_count"] == len(im.entries)
    assert main(["imatrix", str(src), "-f", str(text), "-c", "64", "-b", "0"]) != 0
    assert "-b must be" in capsys.readouterr().err
