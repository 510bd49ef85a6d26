"""`minfer quantize` against llama.cpp: the same bytes, type by type and file by file.

Two sources of truth. tests/fixtures/quantize_llamacpp.json holds what llama.cpp
(llama-cpp-python 0.3.36, no importance matrix) wrote for deterministic synthetic inputs
(scripts/make_quantize_fixtures.py): these tests always run. With $MINFER_REF_PYTHON naming an
interpreter that has llama_cpp, the same comparisons also run live against it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QType

from minfer.tools.quantize import MixOptions, parse_ftype, parse_tensor_type, quantize_model
from minfer.tools.quantize.rows import quantize_rows
from tests import quantize_cases as qc

REF = json.loads(qc.FIXTURE.read_text())


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("quant")
    paths = {name: qc.write_source(name, work) for name in qc.SOURCES}
    for name, path in paths.items():
        assert qc.data_digest(path) == REF["sources"][name]["data"], (
            f"the synthetic source {name!r} changed (numpy or minfer.tools.synth): regenerate "
            "the fixture with scripts/make_quantize_fixtures.py")
    return paths


def _options(type_name: str, opts: dict[str, Any]) -> MixOptions:
    def tt(key: str) -> Any:
        return parse_tensor_type(opts[key]) if opts.get(key) else None

    return MixOptions(parse_ftype(type_name), pure=bool(opts.get("pure")),
                      output_tensor_type=tt("output_tensor_type"),
                      token_embedding_type=tt("token_embedding_type"))


def _quantize_case(case: str, sources: dict[str, Path], out_dir: Path) -> Path:
    source, type_name, opts = qc.CASES[case]
    dst = out_dir / f"{case}.gguf"
    quantize_model(sources[source], dst, _options(type_name, opts))
    return dst


def _tensor_mismatches(got: dict[str, str], want: dict[str, str]) -> list[str]:
    names = list(want) if list(got) == list(want) else ["<tensor order>", *want]
    return [f"{n}: minfer {got.get(n)} llama.cpp {want.get(n)}" for n in names
            if n == "<tensor order>" or got.get(n) != want[n]]


@pytest.mark.parametrize("qtype", qc.ROW_TYPES, ids=lambda t: t.name)
def test_rows_match_llamacpp_fixture(qtype: Any) -> None:
    """ggml_quantize_chunk's bytes for ties, zeros, tiny and heavy-tailed rows, per type."""
    got = quantize_rows(qc.row_inputs(), qtype)
    assert qc.sha256(got) == REF["rows"][qtype.name]


@pytest.mark.parametrize("case", list(qc.CASES))
def test_model_matches_llamacpp_fixture(case: str, sources: dict[str, Path],
                                        tmp_path: Path) -> None:
    """Every tensor's type (the mix's choices, fallbacks, overrides) and bytes; and the whole
    file (metadata, tensor order, alignment) when the source file itself is unchanged."""
    dst = _quantize_case(case, sources, tmp_path)
    want = REF["models"][case]
    assert _tensor_mismatches(qc.tensor_digests(dst), want["tensors"]) == []
    source = qc.CASES[case][0]
    if qc.sha256(sources[source].read_bytes()) == REF["sources"][source]["file_sha256"]:
        assert qc.sha256(dst.read_bytes()) == want["file_sha256"]


def test_q4_k_m_keeps_llamacpp_layers_at_higher_precision() -> None:
    """The mix itself, read from the fixture: attn_v and ffn_down at Q6_K exactly on the
    layers llama.cpp's use_more_bits picks (8 layers: 0, 3, 6, 7), output at Q6_K, and
    ffn_down's 96-wide rows falling back from Q4_K/Q6_K to Q5_0/Q8_0."""
    tensors = REF["models"]["Q4_K_M"]["tensors"]

    def kind(name: str) -> str:
        return tensors[name].split(":")[0]

    assert kind("output.weight") == "Q6_K"
    assert [kind(f"blk.{i}.attn_v.weight") for i in range(8)] == [
        "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [kind(f"blk.{i}.ffn_down.weight") for i in range(8)] == [
        "Q8_0", "Q5_0", "Q5_0", "Q8_0", "Q5_0", "Q5_0", "Q8_0", "Q8_0"]
    assert {kind(f"blk.{i}.attn_q.weight") for i in range(8)} == {"Q4_K"}
    assert {kind(f"blk.{i}.attn_output.weight") for i in range(8)} == {"Q5_0"}
    assert kind("blk.0.attn_norm.weight") == "F32"


def test_mxfp4_rows_match_gguf_py() -> None:
    """gguf-py's MXFP4 quantizer (the converter's) writes ggml's quantize_row_mxfp4_ref bytes too,
    so a file minfer converts and one llama.cpp's converter writes agree."""
    x = qc.row_inputs()
    want = quants.quantize(x, QType.MXFP4).reshape(x.shape[0], -1)
    assert np.array_equal(quantize_rows(x, QType.MXFP4), want)


@pytest.mark.parametrize("case", list(qc.FILE_CASES))
def test_fixture_file_matches_llamacpp_fixture(case: str, tmp_path: Path) -> None:
    """A committed converter-made GGUF quantized: every tensor's type and bytes, and the whole
    file's sha256 as llama.cpp recorded it."""
    src, type_name = qc.FILE_CASES[case]
    want = REF["files"][case]
    assert qc.sha256(src.read_bytes()) == want["source_sha256"], "the fixture GGUF changed"
    dst = tmp_path / "out.gguf"
    quantize_model(src, dst, MixOptions(parse_ftype(type_name)))
    assert _tensor_mismatches(qc.tensor_digests(dst), want["tensors"]) == []
    assert qc.sha256(dst.read_bytes()) == want["file_sha256"]


def test_mxfp4_moe_mix_is_llamacpps() -> None:
    """gpt-oss's mix, read from the fixture: the stacked experts MXFP4, every other matrix
    (output and token_embd too) Q8_0, the router, sinks, norms and biases kept at F32."""
    tensors = REF["files"]["gptoss-MXFP4_MOE"]["tensors"]
    kinds: dict[str, set[str]] = {}
    for name, digest in tensors.items():
        role = name.split(".", 2)[-1] if name.startswith("blk.") else name
        kinds.setdefault(role, set()).add(digest.split(":")[0])
    for proj in ("gate", "up", "down"):
        assert kinds[f"ffn_{proj}_exps.weight"] == {"MXFP4"}
        assert kinds[f"ffn_{proj}_exps.bias"] == {"F32"}
    for name in ("output.weight", "token_embd.weight", "attn_q.weight", "attn_k.weight",
                 "attn_v.weight", "attn_output.weight"):
        assert kinds[name] == {"Q8_0"}
    for name in ("ffn_gate_inp.weight", "attn_sinks.weight", "attn_norm.weight", "attn_q.bias"):
        assert kinds[name] == {"F32"}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(qc.FILE_CASES))
def test_fixture_file_matches_llama_quantize_live(case: str, tmp_path: Path) -> None:
    """The same file from llama.cpp's llama-quantize binary (/tmp/llbuild or
    $MINFER_LLAMA_QUANTIZE) and from minfer: one sha256."""
    exe = qc.llama_quantize_exe()
    if exe is None:
        pytest.skip(f"no llama-quantize binary: set {qc.LLAMA_QUANTIZE_ENV} or build "
                    f"{qc.LLAMA_QUANTIZE_DEFAULT}")
    src, type_name = qc.FILE_CASES[case]
    ref, mine = tmp_path / "llama.gguf", tmp_path / "minfer.gguf"
    subprocess.run([str(exe), str(src), str(ref), type_name], check=True, capture_output=True)
    quantize_model(src, mine, MixOptions(parse_ftype(type_name)))
    assert qc.sha256(mine.read_bytes()) == qc.sha256(ref.read_bytes())


def _live() -> str:
    exe = qc.llama_python()
    if exe is None:
        pytest.skip(f"llama.cpp reference not configured: set {qc.LLAMA_PYTHON_ENV} to a "
                    "python that can import llama_cpp (llama-cpp-python)")
    return exe


@pytest.mark.slow
@pytest.mark.parametrize("qtype", qc.ROW_TYPES, ids=lambda t: t.name)
def test_rows_match_llamacpp_live(qtype: Any, tmp_path: Path) -> None:
    exe = _live()
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((64, 1024)) * rng.uniform(1e-3, 1.0, (64, 1))).astype(np.float32)
    got = quantize_rows(x, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    ref = qc.llama_quantize_rows(exe, x, qtype, 1024 // block * size, tmp_path)
    bad = np.nonzero((got != ref).any(axis=1))[0]
    assert bad.size == 0, f"rows {bad[:10].tolist()} differ"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["Q4_K_M", "Q2_K", "Q5_K_S", "Q4_K_M-pure", "tied-Q4_K_M",
                                  "Q3_K_M-overrides", "tied-IQ4_NL"])
def test_model_matches_llamacpp_live(case: str, sources: dict[str, Path],
                                     tmp_path: Path) -> None:
    exe = _live()
    mine = _quantize_case(case, sources, tmp_path)
    source, type_name, opts = qc.CASES[case]
    ref = tmp_path / "llama.gguf"
    qc.llama_quantize(exe, sources[source], ref, int(parse_ftype(type_name)), opts)
    assert _tensor_mismatches(qc.tensor_digests(mine), qc.tensor_digests(ref)) == []
    a, b = mine.read_bytes(), ref.read_bytes()
    first = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    assert a == b, f"files differ (sizes {len(a)} / {len(b)}, first differing byte {first})"
