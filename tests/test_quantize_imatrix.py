"""`minfer quantize --imatrix / --tensor-type`: ggml's weighted quantizers, the imatrix files, the
overrides.

The weighted rows are checked against tests/fixtures/quantize_imatrix_ggml.json: the bytes of
ggml-quants.c's quantize_<type>(…, quant_weights) (llama-cpp-python 0.3.36's source, built as
ggml-base is; scripts/make_imatrix_quant_fixtures.py), and live against such a build when
$MINFER_GGML_QUANTS_LIB names one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from minfer.cli.main import main
from minfer.gguf.reader import GGUFFile
from minfer.tools.quantize import MixOptions, QuantizeError, parse_ftype, quantize_model
from minfer.tools.quantize.gguf_out import raw_kv_entries
from minfer.tools.quantize.imatrix_file import Entry, Imatrix, read, write_gguf
from minfer.tools.quantize.mix import ModelShape, choose_types, parse_tensor_type_override
from minfer.tools.quantize.rows import quantize_rows
from tests import quantize_cases as qc

REF = json.loads(qc.IMATRIX_FIXTURE.read_text())


@pytest.mark.parametrize("qtype", qc.IMATRIX_TYPES, ids=lambda t: t.name)
def test_weighted_rows_are_ggmls(qtype: Any) -> None:
    x = qc.row_inputs()
    for name, qw in qc.imatrix_weights().items():
        got = quantize_rows(x, qtype, imatrix=qw[None])
        assert qc.sha256(got) == REF["rows"][qtype.name][name], (qtype.name, name)


def test_weighted_rows_live_against_ggml() -> None:
    import os

    lib = os.environ.get(qc.GGML_LIB_ENV)
    if not lib:
        pytest.skip(f"${qc.GGML_LIB_ENV} names no build of ggml-quants.c")
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((24, 768)) * rng.lognormal(0, 1, (24, 1))).astype(np.float32)
    qw = rng.lognormal(0, 2, 768).astype(np.float32)
    for qtype in qc.IMATRIX_TYPES:
        want = qc.ggml_quantize(lib, x, qtype, qw)
        np.testing.assert_array_equal(quantize_rows(x, qtype, imatrix=qw[None]), want,
                                      err_msg=qtype.name)


def test_each_expert_takes_its_own_vector() -> None:
    """Rows of a stacked [n_expert, rows, n] tensor, read in slabs that start anywhere, are
    quantized with their expert's importance (llama_tensor_quantize_impl's imatrix_for_row)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 256)).astype(np.float32)  # 3 experts of 4 rows
    qw = rng.lognormal(0, 1, (3, 256)).astype(np.float32)
    whole = np.concatenate([quantize_rows(x[4 * e:4 * e + 4], QT.Q4_K, imatrix=qw[e])
                            for e in range(3)])
    slab = quantize_rows(x[5:11], QT.Q4_K, imatrix=qw, first_row=5, rows_per_mat=4)
    np.testing.assert_array_equal(slab, whole[5:11])
    assert not np.array_equal(whole, quantize_rows(x, QT.Q4_K))
    np.testing.assert_array_equal(quantize_rows(x, QT.Q8_0, imatrix=qw, rows_per_mat=4),
                                  quantize_rows(x, QT.Q8_0))  # Q8_0 has no weighted form


def test_imatrix_gguf_round_trip_and_llama_quantizes_normalisation(tmp_path: Path) -> None:
    im = Imatrix(datasets=["wiki.txt"], chunk_count=7, chunk_size=512)
    im.entries["blk.0.ffn_down.weight"] = Entry(np.arange(1, 9, dtype=np.float32),
                                                np.array([4], np.int64))
    im.entries["blk.0.ffn_up_exps.weight"] = Entry(np.arange(8, dtype=np.float32),
                                                   np.array([2, 0], np.int64))
    write_gguf(tmp_path / "im.gguf", im)
    back = read(tmp_path / "im.gguf")
    assert (back.datasets, back.chunk_count, back.chunk_size) == (["wiki.txt"], 7, 512)
    assert back.has_metadata and not back.legacy
    for name, e in im.entries.items():
        np.testing.assert_array_equal(back.entries[name].sums, e.sums)
        np.testing.assert_array_equal(back.entries[name].counts, e.counts)
    with GGUFFile.open(tmp_path / "im.gguf") as f:
        assert f.metadata["general.type"] == "imatrix"
        assert list(f.tensors) == ["blk.0.ffn_down.weight.in_sum2", "blk.0.ffn_down.weight.counts",
                                   "blk.0.ffn_up_exps.weight.in_sum2",
                                   "blk.0.ffn_up_exps.weight.counts"]
        assert f.tensors["blk.0.ffn_up_exps.weight.in_sum2"].shape[:2] == (4, 2)
    w = back.quant_weights()
    np.testing.assert_allclose(w["blk.0.ffn_down.weight"], np.arange(1, 9) / 4)
    np.testing.assert_allclose(w["blk.0.ffn_up_exps.weight"], [0, 0.5, 1, 1.5, 1, 1, 1, 1])


def test_legacy_dat_is_read(tmp_path: Path) -> None:
    name = b"blk.0.attn_q.weight"
    raw = struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 3, 4)
    raw += np.array([3, 6, 9, 12], "<f4").tobytes() + struct.pack("<ii", 5, 8) + b"wiki.txt"
    (tmp_path / "im.dat").write_bytes(raw)
    im = read(tmp_path / "im.dat")
    assert im.legacy and im.chunk_count == 5 and im.datasets == ["wiki.txt"]
    np.testing.assert_allclose(im.quant_weights()["blk.0.attn_q.weight"], [1, 2, 3, 4])


def _names(n_layer: int) -> list[tuple[str, tuple[int, ...], QT]]:
    out = [("output.weight", (256, 1000), QT.F32), ("token_embd.weight", (256, 1000), QT.F32)]
    for i in range(n_layer):
        out += [(f"blk.{i}.attn_q.weight", (256, 256), QT.F32),
                (f"blk.{i}.attn_v.weight", (256, 64), QT.F32),
                (f"blk.{i}.ffn_down.weight", (96, 256), QT.F32),
                (f"blk.{i}.ffn_up.weight", (256, 96), QT.F32)]
    return out


def test_tensor_type_overrides_come_first_and_skip_the_mix() -> None:
    shape = ModelShape("llama", 8, 4, 4)
    tensors = _names(8)
    base = choose_types(tensors, shape, MixOptions(parse_ftype("Q4_K_M")))
    over = (parse_tensor_type_override("BLK\\.0\\.ATTN_V=Q8_0"),
            parse_tensor_type_override("attn_v=q5_k"), parse_tensor_type_override("ffn_down=Q4_K"))
    got = choose_types(tensors, shape, MixOptions(parse_ftype("Q4_K_M"), tensor_types=over))
    assert over[0] == ("blk\\.0\\.attn_v", QT.Q8_0)  # lowercased, as llama-quantize does
    assert got["blk.0.attn_v.weight"] == QT.Q8_0  # the first matching pattern wins
    assert all(got[f"blk.{i}.attn_v.weight"] == QT.Q5_K for i in range(1, 8))
    assert base["blk.0.attn_v.weight"] == QT.Q6_K
    assert all(got[f"blk.{i}.ffn_down.weight"] == QT.Q5_0 for i in range(8))  # 96: fallback
    assert got["output.weight"] == base["output.weight"] == QT.Q6_K  # not quantizable by -tt
    assert got["blk.3.attn_q.weight"] == QT.Q4_K
    for bad in ("attn_q", "=q8_0", "attn_q=", "attn_q=Q9_9"):
        with pytest.raises(QuantizeError):
            parse_tensor_type_override(bad)


def test_an_imatrix_changes_the_q4_0_and_iq4_nl_rules() -> None:
    shape = ModelShape("llama", 8, 4, 4)
    tensors = [(n, (256, s[1]), t) for n, s, t in _names(8)]
    for ftype, without, with_im in (("Q4_0", QT.Q4_0, QT.Q4_1), ("Q5_0", QT.Q5_0, QT.Q5_1),
                                    ("IQ4_NL", QT.Q5_K, QT.IQ4_NL)):
        plain = choose_types(tensors, shape, MixOptions(parse_ftype(ftype)))
        im = choose_types(tensors, shape, MixOptions(parse_ftype(ftype), imatrix=True))
        assert plain["blk.0.ffn_down.weight"] == without
        assert im["blk.0.ffn_down.weight"] == with_im  # the first n_layer / 8 layers
        assert plain["blk.1.ffn_down.weight"] == im["blk.1.ffn_down.weight"]


def _imatrix_for(src: Path, path: Path, skip: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    im = Imatrix(datasets=["calibration.txt"], chunk_count=3, chunk_size=64)
    with GGUFFile.open(src) as f:
        for name, t in f.tensors.items():
            if name.startswith("blk.") and len(t.shape) == 2 and name != skip:
                im.entries[name] = Entry(rng.lognormal(0, 1, t.shape[0]).astype(np.float32) * 64,
                                         np.array([64], np.int64))
    write_gguf(path, im)
    return im.quant_weights()


def test_quantize_with_an_imatrix(tmp_path: Path) -> None:
    src = qc.write_source("f32", tmp_path)
    skip = "blk.2.attn_q.weight"
    weights = _imatrix_for(src, tmp_path / "im.gguf", skip)
    dst = tmp_path / "q.gguf"
    report = quantize_model(src, dst, MixOptions(parse_ftype("Q4_0")),
                            imatrix=tmp_path / "im.gguf")
    assert report.types["blk.0.ffn_down.weight"][1] == QT.Q4_1  # the imatrix rule
    with GGUFFile.open(src) as f, GGUFFile.open(dst) as g:
        for name, (_, new) in report.types.items():
            t = f.tensors[name]
            if new == QT.F32 or (name not in weights and name != skip):
                continue
            x = f.raw(name).view(np.float32).reshape(t.n_rows, t.shape[0])
            want = quantize_rows(x, new, imatrix=weights.get(name))
            np.testing.assert_array_equal(g.raw(name).reshape(want.shape), want, err_msg=name)
        q = f.raw("blk.0.attn_q.weight").view(np.float32)
        q = q.reshape(f.tensors["blk.0.attn_q.weight"].n_rows, -1)
        assert not np.array_equal(g.raw("blk.0.attn_q.weight").reshape(-1),  # weighted bytes
                                  quantize_rows(q, QT.Q4_0).reshape(-1))
    keys = [k for k, _ in raw_kv_entries(dst)]
    assert keys[-6:] == ["general.quantization_version", "general.file_type",
                         "quantize.imatrix.file", "quantize.imatrix.dataset",
                         "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"]
    with GGUFFile.open(dst) as g:
        assert g.metadata["quantize.imatrix.file"] == str(tmp_path / "im.gguf")
        assert g.metadata["quantize.imatrix.dataset"] == "calibration.txt"
        assert g.metadata["quantize.imatrix.entries_count"] == len(weights)
        assert g.metadata["quantize.imatrix.chunks_count"] == 3


def test_a_wrong_sized_importance_is_refused(tmp_path: Path) -> None:
    src = qc.write_source("f32", tmp_path)
    im = Imatrix(datasets=["x"], chunk_count=1, chunk_size=8)
    im.entries["blk.0.attn_q.weight"] = Entry(np.ones(100, np.float32), np.array([1], np.int64))
    write_gguf(tmp_path / "bad.gguf", im)
    with pytest.raises(QuantizeError, match="imatrix size 100 is different"):
        quantize_model(src, tmp_path / "q.gguf", MixOptions(parse_ftype("Q4_K_M")),
                       imatrix=tmp_path / "bad.gguf")


def test_cli_takes_imatrix_and_tensor_types(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    src = qc.write_source("f32", tmp_path)
    _imatrix_for(src, tmp_path / "im.gguf", "")
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(src), str(out), "Q4_K_M", "--imatrix", str(tmp_path / "im.gguf"),
                 "--tensor-type", "attn_q=q8_0", "--tensor-type", "ffn_up=Q5_K"]) == 0
    with GGUFFile.open(out) as g:
        assert g.tensors["blk.0.attn_q.weight"].type_name == "Q8_0"
        assert g.tensors["blk.4.ffn_up.weight"].type_name == "Q5_K"
        assert "quantize.imatrix.file" in g.metadata
    assert main(["quantize", str(src), str(tmp_path / "x.gguf"), "Q4_K_M", "--tensor-type",
                 "attn_q"]) != 0
    assert "PATTERN=TYPE" in capsys.readouterr().err
