"""The new families' tiny fixtures against llama.cpp on the same files and token ids: the second
reference beside transformers' logits (issues #62, #63).

tests/fixtures/llamacpp_families.npz comes from benchmarks/make_llamacpp_family_fixtures.py:
llama-cpp-python 0.3.36 (2 threads, flash attention off, f32 KV) on LFM2, Qwen3.5, Qwen3.5-MoE,
gpt-oss, Gemma 4 (E2B-style, 26B MoE, 31B), SmolLM3, Phi-3 and Phi-3 LongRoPE (at a short
context and, `phi3_longrope.long`, past its 256 original positions), the converter's q8_0 twins
and llama.cpp's own Q8_0 / Q4_K_M of the f32 files, for three prompts each: the last prompt
position's logits, 16 greedy tokens and llama.cpp's top-2 margin at each step
(tests/llamacpp_families.py says how they are run).

How they are compared:
- f32 files: every logit within 1e-3 of the largest |logit| (F32_REL). Measured (Intel Xeon,
  Sapphire Rapids; both engines' AVX-512 code): <= 7e-6 relative on every family but Gemma 4,
  whose GELU rounds its input to f16 in both engines, so an f32 difference of one ulp can flip
  an f16 rounding: 2.7e-4 on the E2B-style model, 2e-5 on 26B / 31B.
- quantized files (the converter's q8_0 twins; llama.cpp's own Q8_0 and Q4_K_M of every f32
  file, which `minfer quantize` must reproduce byte for byte: the sha256 is checked): every
  logit within 0.5 (QUANT_ATOL), the tolerance of the dense models against llama.cpp
  (test_reference_llamacpp.py, test_gemma3_real.py). Both engines quantize the activations to 8
  bits per block, so one float-order difference that lands a value on a rounding boundary flips
  one code, and these tiny random models (weights of std 0.2-0.3) amplify it. Measured: <= 1.5e-6
  on 51 of the 60 runs, 0.04-0.09 on 8, and 0.42 on gemma4.q8_0's 40-token prompt, traced with
  llama.cpp's eval callback to layer 1's attention input at token 26: the two RMSNorm outputs one
  f32 ulp apart, one value at exactly 60.5 quantization steps in llama.cpp (code 60) and
  60.500015 in minfer (61), the difference growing from 1e-2 in that row's Q/K/V through six
  layers (llama.cpp's own f32 -> Q8_0 move on that prompt is 1.54).
- greedy: minfer's own greedy continuation (16 tokens, free-running) equals llama.cpp's, or
  first differs at a step where llama.cpp's top-2 margin is a near-tie: for f32 files below twice
  the logit tolerance (the most two values each within it can swap by), for quantized ones below
  0.5, as the dense models' tests. Past that step the two are different texts and nothing more
  is compared. Measured: every f32 run equal throughout; of the quantized ones three part, each
  at a step of llama.cpp's margin below 0.06 (gptoss-q8_0 step 15, gptoss.q4_k_m step 8,
  smollm3.q4_k_m step 15).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.tools.quantize import MixOptions, parse_ftype, quantize_model

from . import llamacpp_families as fam

REF = np.load(fam.OUT)
MODELS = [m for m in fam.MODELS if m.name not in fam.UNSUPPORTED]
F32_REL = 1e-3
QUANT_ATOL = 0.5  # and the quantized files' near-tie


def _tolerance(m: fam.Model, logits: np.ndarray) -> float:
    return QUANT_ATOL if m.quantized else F32_REL * float(np.abs(logits).max())


def _near_tie(m: fam.Model, logits: np.ndarray) -> float:
    return QUANT_ATOL if m.quantized else 2 * _tolerance(m, logits)


def _file(m: fam.Model, tmp: Path) -> Path:
    """The file llama.cpp ran: the fixture, or `minfer quantize` of it, which must be the bytes
    llama.cpp's quantizer wrote."""
    path = fam.FIXTURES / m.path
    if m.quantize:
        out = tmp / f"{m.name}.gguf"
        quantize_model(path, out, MixOptions(parse_ftype(m.quantize)))
        path = out
    assert str(REF[f"{m.name}.sha256"]) == fam.sha256(path), f"{m.name}: not llama.cpp's file"
    return path


def _engine(m: fam.Model, path: Path) -> Engine:
    f = GGUFFile.open(path)
    return Engine(f, HParams.from_gguf(f), n_ctx=m.n_ctx, kv_type="f32")


def _check_greedy(got: list[int], want: list[int], margins: np.ndarray, near_tie: float,
                  what: str) -> None:
    """got equals want, or first differs where want's own top-2 margin is below near_tie."""
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            assert margins[step] < near_tie, (
                f"{what}: diverged at step {step} ({a} vs {b}) where llama.cpp's top-2 margin "
                f"{margins[step]:.4f} is no near-tie (< {near_tie:.4f})")
            return


def test_fixture_covers_every_family_from_the_files_committed() -> None:
    """The reference was made from the GGUF files committed now (a remade fixture GGUF needs
    the llama.cpp runs remade: benchmarks/make_llamacpp_family_fixtures.py)."""
    archs = set()
    for m in MODELS:
        path = fam.FIXTURES / m.path
        if not m.quantize:  # (llama.cpp's quantizations: test_logits_and_greedy_match_llamacpp)
            assert str(REF[f"{m.name}.sha256"]) == fam.sha256(path), f"{path} changed: remake"
        archs.add(HParams.from_gguf(GGUFFile.open(path)).arch)
    assert archs == {"lfm2", "qwen35", "qwen35moe", "gpt-oss", "gemma4", "smollm3", "phi3"}
    assert not fam.UNSUPPORTED  # llama.cpp 0.3.36 loads every one of them
    for p, ids in enumerate(fam.PROMPTS):
        assert REF[f"prompt.{p}"].tolist() == list(ids)
    assert str(REF["version"]) == "0.3.36"


@pytest.mark.parametrize("m", MODELS, ids=[m.name for m in MODELS])
def test_logits_and_greedy_match_llamacpp(m: fam.Model, tmp_path: Path) -> None:
    path = _file(m, tmp_path)
    for p, ids in enumerate(fam.PROMPTS):
        ref = REF[f"{m.name}.{p}.logits"]
        want = REF[f"{m.name}.{p}.greedy"].tolist()
        margins = REF[f"{m.name}.{p}.margins"]
        tol = _tolerance(m, ref)
        engine = _engine(m, path)
        logits = engine.forward(list(ids), 0, n_out=1)[-1]
        diff = float(np.abs(logits - ref).max())
        assert diff <= tol, f"{m.name} prompt {p}: max |minfer - llama.cpp| {diff:.3g} > {tol:.3g}"
        got: list[int] = []
        for i in range(fam.N_NEW):
            got.append(int(np.argmax(logits)))
            logits = engine.forward(got[-1:], len(ids) + i, n_out=1)[-1]
        _check_greedy(got, want, margins, _near_tie(m, ref), f"{m.name} prompt {p}")


@pytest.mark.slow
def test_live_llamacpp_still_gives_the_fixture() -> None:
    """Re-run llama.cpp ($MINFER_REF_PYTHON or /tmp/refvenv) and hold it to the committed
    runs with the same tolerances: its build on this CPU reproduces the reference."""
    python = fam.ref_python()
    if python is None:
        pytest.skip(f"no llama-cpp-python: set ${fam.REF_PYTHON_ENV} or make "
                    f"{fam.DEFAULT_REF_PYTHON}")
    live = fam.run_llamacpp(python, tuple(MODELS))
    assert str(live["version"]) == str(REF["version"])
    for m in MODELS:
        for p in range(len(fam.PROMPTS)):
            key = f"{m.name}.{p}"
            ref = REF[f"{key}.logits"]
            tol = _tolerance(m, ref)
            assert float(np.abs(live[f"{key}.logits"] - ref).max()) <= tol, key
            _check_greedy(live[f"{key}.greedy"].tolist(), REF[f"{key}.greedy"].tolist(),
                          REF[f"{key}.margins"], _near_tie(m, ref), key)


# (model, prompt, transformers' fixture, its key): the runs whose prompt is that fixture's ids
_HF = [("lfm2", 1, "lfm2/logits.npz", "hf"), ("qwen35", 1, "qwen35/logits.npz", "hf"),
       ("qwen35moe", 1, "qwen35/logits_moe.npz", "hf"), ("gptoss", 0, "gptoss/logits.npz", "hf"),
       ("gemma4", 0, "gemma4/logits.npz", "gemma4.hf_gelu_table"),
       ("gemma4_26b", 0, "gemma4/logits.npz", "gemma4_26b.hf_gelu_table"),
       ("gemma4_31b", 0, "gemma4/logits.npz", "gemma4_31b.hf_gelu_table"),
       ("smollm3", 0, "families/logits.npz", "smollm3.hf"),
       ("phi3", 0, "families/logits.npz", "phi3.hf"),
       ("phi3_longrope", 0, "families/logits.npz", "phi3_longrope.hf")]


@pytest.mark.parametrize(("name", "p", "npz", "key"), _HF, ids=[h[0] for h in _HF])
def test_the_two_references_agree(name: str, p: int, npz: str, key: str) -> None:
    """llama.cpp and transformers (float32 / float64; Gemma 4 with ggml's f16-table GELU, as
    both engines compute it) agree within 1e-3 of the largest logit at the same position.
    Measured: <= 3e-6 relative, Gemma 4 E2B-style 1.7e-4 (its f16 GELU rounding)."""
    hf = np.load(fam.FIXTURES / npz)
    n = len(fam.PROMPTS[p])
    assert hf["ids"].tolist()[:n] == list(fam.PROMPTS[p])
    want, got = hf[key][n - 1], REF[f"{name}.{p}.logits"]
    assert float(np.abs(got - want).max()) <= F32_REL * float(np.abs(want).max())


def test_greedy_check_allows_only_near_ties() -> None:
    margins = np.array([1.0, 0.01, 1.0])
    _check_greedy([1, 2, 3], [1, 2, 3], margins, 0.02, "same")
    _check_greedy([1, 5, 9], [1, 2, 3], margins, 0.02, "near-tie at step 1")
    with pytest.raises(AssertionError, match="no near-tie"):
        _check_greedy([4, 2, 3], [1, 2, 3], margins, 0.02, "confident step 0")


def test_gemma4_and_phi3_are_read_by_llamacpp_through_metadata_only_copies(
        tmp_path: Path) -> None:
    """The copies llama.cpp reads differ from the committed files in metadata alone."""
    gguf = pytest.importorskip("gguf")
    for rel, pad in (("gemma4/gemma4.gguf", 320 - 254), ("families/phi3.gguf", 0),
                     ("lfm2/lfm2.gguf", None)):
        src = fam.FIXTURES / rel
        copy = fam.loadable_copy(src, tmp_path / src.stem)
        if pad is None:
            assert copy == src  # nothing to change
            continue
        a, b = gguf.GGUFReader(src), gguf.GGUFReader(copy)
        assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors, strict=True):
            assert ta.tensor_type == tb.tensor_type and np.array_equal(ta.data, tb.data)
        tokens = b.fields["tokenizer.ggml.tokens"].contents()
        assert len(tokens) == len(a.fields["tokenizer.ggml.tokens"].contents()) + pad == 320
        assert "phi3" not in str(b.fields["general.name"].contents())
