"""`minfer quantize` against llama.cpp: the same bytes, type by type and file by file.

Two sources of truth. tests/fixtures/quantize_llamacpp.json holds what llama.cpp
(llama-cpp-python 0.3.36, no importance matrix) wrote for deterministic synthetic inputs
(scripts/make_quantize_fixtures.py): these tests always run. With $MINFER_REF_PYTHON naming an
interpreter that has llama_cpp, the same comparisons also run live against it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

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
