"""minfer against llama.cpp on i-quant files (issue 65): `minfer quantize --imatrix` writes
llama-quantize's file of every i-quant mix (MOSTLY_IQ1_S .. MOSTLY_IQ3_M) byte for byte, and
minfer runs llama-quantize's file of every i-quant type (IQ1_S .. IQ4_NL, TQ1_0 / TQ2_0) as
llama.cpp does.

tests/fixtures/iquant/ comes from benchmarks/make_iquant_fixtures.py (tests/iquant_cases.py
says what is run): llama-imatrix's matrices, llama-quantize's digests and run2 files,
llama.cpp's logits. The comparison with logits is the quantized files' one of
test_vs_llamacpp_families.py: every logit of the last prompt position within 0.5 (QUANT_ATOL,
the dense models' tolerance against llama.cpp; both engines quantize the activations to 8
bits, where one float-order difference can flip a code), and minfer's free-running greedy
continuation equal to llama.cpp's, or parting first at a step where llama.cpp's top-2 margin is
below 0.5. Measured (Intel Xeon Sapphire Rapids): <= 1.9e-6 on 20 of the 22 runs (largest
|logit| 4.3-6.9), 0.067 (IQ1_M) and 0.085 (IQ3_XXS) on the 20-token prompt; greedy equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.tools.quantize import MixOptions, QuantizeError, parse_ftype, quantize_model
from minfer.tools.quantize.mix import DEFAULT_TYPE
from tests import iquant_cases as ic
from tests import llamacpp_families as fam
from tests import quantize_cases as qc
from tests.test_vs_llamacpp_families import _check_greedy

REF = json.loads(ic.DIGESTS.read_text())
QUANT_ATOL = 0.5
# llama.cpp's i-quant rules: (output, token_embd, attn_q/k, attn_v, attn_output, layer 0's
# ffn_down) types in each mix of mix8 (n_gqa 2); the other tensors at the mix's default type
# (IQ3_XS: ffn_gate / ffn_up of layers 1-6 at IQ3_XXS)
_MIX_KINDS = {"IQ1_S": ("Q5_K", "Q2_K", "IQ1_S", "Q2_K", "IQ2_XXS", "Q2_K"),
              "IQ1_M": ("Q5_K", "Q2_K", "IQ1_M", "Q2_K", "IQ2_XXS", "Q2_K"),
              "IQ2_XXS": ("Q5_K", "Q2_K", "IQ2_XXS", "Q2_K", "IQ2_XXS", "Q2_K"),
              "IQ2_XS": ("Q5_K", "Q2_K", "IQ2_XS", "Q2_K", "IQ2_XS", "Q2_K"),
              "IQ2_S": ("Q5_K", "IQ3_S", "IQ2_XS", "IQ3_S", "IQ3_S", "IQ3_S"),
              "IQ2_M": ("Q5_K", "IQ3_S", "IQ2_S", "IQ3_S", "IQ3_S", "IQ3_S"),
              "IQ3_XXS": ("Q5_K", "IQ3_S", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ3_XXS"),
              "IQ3_XS": ("Q6_K", "IQ3_S", "IQ3_XXS", "IQ3_S", "IQ3_S", "IQ3_S"),
              "IQ3_S": ("Q6_K", "IQ3_S", "IQ3_S", "IQ3_S", "IQ3_S", "IQ3_S"),
              "IQ3_M": ("Q6_K", "IQ3_S", "IQ3_S", "Q4_K", "Q4_K", "Q4_K")}


def _source(name: str, tmp: Path) -> Path:
    src = ic.write_source(name, tmp)
    assert qc.data_digest(src) == REF["sources"][name], (
        f"the synthetic source {name!r} changed: remake benchmarks/make_iquant_fixtures.py")
    return src


def _minfer_quantize(type_name: str, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = _source("mix8", tmp)
    (tmp / ic.IMATRIX_NAME).write_bytes(ic.imatrix_file("mix8").read_bytes())
    monkeypatch.chdir(tmp)  # the imatrix by the relative name llama-quantize was given
    dst = tmp / f"minfer-{type_name}.gguf"
    quantize_model(src, dst, MixOptions(parse_ftype(type_name)), imatrix=ic.IMATRIX_NAME)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ic.MIX_TYPES)
def test_minfer_quantize_is_llama_quantize(type_name: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor's type (llama.cpp's very-low-bit mix, `_MIX_KINDS`) and bytes, and the
    whole file."""
    dst = _minfer_quantize(type_name, tmp_path, monkeypatch)
    want = REF["mix"][type_name]
    got = qc.tensor_digests(dst)
    assert [f"{n}: {got.get(n)} vs {d}" for n, d in want["tensors"].items() if got.get(n) != d
            ] == []
    assert list(got) == list(want["tensors"])
    assert qc.sha256(dst.read_bytes()) == want["file_sha256"]
    kinds = {n: d.split(":")[0] for n, d in want["tensors"].items()}
    out, embd, qk, v, o, down0 = _MIX_KINDS[type_name]
    default = DEFAULT_TYPE[parse_ftype(type_name)].name
    assert kinds["output.weight"] == out and kinds["token_embd.weight"] == embd
    assert kinds["blk.0.ffn_down.weight"] == down0 and kinds["blk.1.ffn_down.weight"] == default
    for i in range(8):
        assert [kinds[f"blk.{i}.attn_{t}.weight"] for t in "qkv"] == [qk, qk, v]
        assert kinds[f"blk.{i}.attn_output.weight"] == o
        up = "IQ3_XXS" if type_name == "IQ3_XS" and 1 <= i < 7 else default
        assert kinds[f"blk.{i}.ffn_gate.weight"] == kinds[f"blk.{i}.ffn_up.weight"] == up


def test_mixes_refused_without_an_imatrix() -> None:
    """llama-quantize refuses every i-quant mix without a matrix but IQ3_S / IQ3_M (no IQ1 /
    IQ2 / IQ3_XXS tensor in them)."""
    assert [t for t in ic.MIX_TYPES if not REF["mix"][t]["refused_without_imatrix"]] == [
        "IQ3_S", "IQ3_M"]


@pytest.mark.parametrize("type_name", [t for t in ic.MIX_TYPES
                                       if REF["mix"][t]["refused_without_imatrix"]])
def test_refused_without_an_imatrix_as_llama_quantize(type_name: str, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="requires an importance matrix"):
        quantize_model(_source("mix8", tmp_path), tmp_path / "q.gguf",
                       MixOptions(parse_ftype(type_name)))
    assert not (tmp_path / "q.gguf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ic.MIX_TYPES)
def test_live_llama_quantize(type_name: str, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The same comparison against llama-quantize run now, when /tmp/llbuild has it."""
    if not (ic.LLBUILD / "llama-quantize").exists():
        pytest.skip("no llama.cpp tools in /tmp/llbuild")
    mine = _minfer_quantize(type_name, tmp_path, monkeypatch)
    ref = tmp_path / "llama.gguf"
    r = ic.llama_quantize(tmp_path / "iq-src-mix8.gguf", ref, type_name, tmp_path,
                          ic.imatrix_file("mix8"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert qc.sha256(mine.read_bytes()) == qc.sha256(ref.read_bytes())


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ic.RUN_TYPES)
def test_logits_on_llama_quantize_files(type_name: str) -> None:
    path = ic.run_file(type_name)
    assert fam.sha256(path) == REF["files"][type_name], f"{path} changed: remake the fixture"
    logits_ref = np.load(ic.LOGITS)
    f = GGUFFile.open(path)
    assert type_name.split("_")[0] in {t.type_name.split("_")[0] for t in f.tensors.values()}
    for p, ids in enumerate(ic.PROMPTS):
        key = f"{type_name}.{p}"
        engine = Engine(f, HParams.from_gguf(f), n_ctx=ic.N_CTX, kv_type="f32")
        logits = engine.forward(list(ids), 0, n_out=1)[-1]
        diff = float(np.abs(logits - logits_ref[f"{key}.logits"]).max())
        assert diff <= QUANT_ATOL, f"{key}: max |minfer - llama.cpp| {diff:.3g}"
        got: list[int] = []
        for i in range(fam.N_NEW):
            got.append(int(np.argmax(logits)))
            logits = engine.forward(got[-1:], len(ids) + i, n_out=1)[-1]
        _check_greedy(got, logits_ref[f"{key}.greedy"].tolist(), logits_ref[f"{key}.margins"],
                      QUANT_ATOL, key)
