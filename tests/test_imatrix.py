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
        for node in graph.nodes:  # a fused gate / up node: both its weights read its input
            if isinstance(node.op, ir.MatMul | ir.FusedGateUp):
                x = step.outputs[node.srcs[0]].reshape(32, -1).astype(np.float64)
                for name in node.meta.weights[:2 if isinstance(node.op, ir.FusedGateUp) else 1]:
                    want[name] = want.get(name, 0) + (x * x).sum(0)
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


MOE = Path(__file__).parent / "fixtures" / "moe" / "qwen2moe.gguf"


def test_experts_get_their_own_sums_and_counts() -> None:
    """A routed expert tensor's rows: one per expert, counted per routed (row, slot) pair, as
    llama-imatrix collects a MUL_MAT_ID; gate and up read the MoE input row for each of its
    slots, so their sums over the experts are n_used times the rows' own squares."""
    model = minfer.load(MOE)
    ids = model.tokenizer.encode(TEXT, special=False)
    f = GGUFFile.open(MOE)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=32)
    im = collect(engine, ids, 32, bos=None, batch_size=32, max_chunks=2)
    exps = [n for n in f.tensors if "_exps." in n]
    assert exps and set(exps) <= set(im.entries)
    assert "blk.0.ffn_gate_inp_shexp.weight" in im.entries  # a matmul in llama.cpp
    n_used = f.metadata["qwen2moe.expert_used_count"]
    for name in exps:
        e = im.entries[name]
        assert len(e.counts) == 8 and e.counts.sum() == 64 * n_used, name
        assert e.sums.shape == (8 * f.tensors[name].shape[0],)
        zero = np.repeat(e.counts == 0, len(e.sums) // 8)
        assert (e.sums[zero] == 0).all() and (e.sums[~zero] > 0).any()
    gate, up = (im.entries[f"blk.1.ffn_{w}_exps.weight"] for w in ("gate", "up"))
    np.testing.assert_array_equal(gate.sums, up.sums)
    shared = im.entries["blk.1.ffn_up_shexp.weight"]  # the same rows (the ffn norm's output)
    np.testing.assert_allclose(gate.sums.reshape(8, -1).sum(0), n_used * shared.sums,
                               rtol=1e-5)
    # what quantize takes: the mean square per expert, 1 where an expert saw no row
    qw = im.quant_weights()["blk.1.ffn_down_exps.weight"].reshape(8, -1)
    down = im.entries["blk.1.ffn_down_exps.weight"]
    for x in range(8):
        want = (down.sums.reshape(8, -1)[x] / down.counts[x] if down.counts[x] else 1.0)
        np.testing.assert_allclose(qw[x], want, rtol=1e-6)


def test_legacy_dat_as_llama_imatrix_writes_it(tmp_path: Path) -> None:
    """--output-format dat: save_imatrix_legacy's layout, read back to the same importance
    as the GGUF form (an expert that saw no row: 1), entries with no data left out."""
    import struct

    from minfer.tools.quantize.imatrix_file import Entry, Imatrix, write_gguf, write_legacy

    im = Imatrix(datasets=["cal.txt"], chunk_count=3, chunk_size=64)
    rng = np.random.default_rng(0)
    im.entries["blk.0.attn_q.weight"] = Entry(rng.random(32, np.float32) * 100,
                                              np.array([192], np.int64))
    im.entries["blk.0.ffn_up_exps.weight"] = Entry(rng.random(3 * 32, np.float32) * 50,
                                                   np.array([70, 0, 122], np.int64))
    im.entries["blk.0.ffn_down_exps.weight"] = Entry(np.zeros(2 * 32, np.float32),
                                                     np.array([0, 0], np.int64))
    write_legacy(tmp_path / "im.dat", im)
    write_gguf(tmp_path / "im.gguf", im)
    raw = (tmp_path / "im.dat").read_bytes()
    assert struct.unpack_from("<i", raw)[0] == 2
    assert raw.endswith(struct.pack("<ii", 3, 7) + b"cal.txt")
    dat, gg = read(tmp_path / "im.dat"), read(tmp_path / "im.gguf")
    assert dat.legacy and list(dat.entries) == ["blk.0.attn_q.weight", "blk.0.ffn_up_exps.weight"]
    assert list(dat.entries["blk.0.ffn_up_exps.weight"].counts) == [2]  # ceil(122 / 64)
    assert (dat.chunk_count, dat.datasets) == (3, ["cal.txt"])
    want, got = gg.quant_weights(), dat.quant_weights()
    for name in dat.entries:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)


def test_cli_output_format_dat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = qc.write_source("f32", tmp_path)
    text = tmp_path / "cal.txt"
    text.write_text(TEXT * 2)
    dat = tmp_path / "im.dat"
    assert main(["imatrix", str(src), "-f", str(text), "-o", str(dat), "-c", "64",
                 "--chunks", "2", "--output-format", "dat"]) == 0
    assert dat.read_bytes()[:4] != b"GGUF" and read(dat).legacy
    other = tmp_path / "im2.dat"  # as llama-imatrix: the suffix alone does not choose it
    assert main(["imatrix", str(src), "-f", str(text), "-o", str(other), "-c", "64",
                 "--chunks", "2"]) == 0
    assert other.read_bytes()[:4] == b"GGUF"
    assert "--output-format dat" in capsys.readouterr().err
    a, b = read(dat).quant_weights(), read(other).quant_weights()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6)
