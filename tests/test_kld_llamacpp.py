"""minfer's KL-divergence file and statistics against llama.cpp's own `llama-perplexity`.

tests/fixtures/kld/ (benchmarks/make_kld_fixtures.py): llama-perplexity's base file of
`write_tiny_model()` in F32, minfer's base file of the same model and text, llama.cpp's logits
of the Q4_0 quantization on those chunks, and llama-perplexity's --kl-divergence tables on the
Q4_0 model against each file. Fed llama.cpp's own logits, minfer's statistics must be the ones
llama-perplexity printed, to its printed digits: that isolates the formulas from the engines'
logits. The live test (skipped without the binary) rerun both tools on each other's files.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from minfer.bench.kld import BaseFile, KLDResult, base_rows, parse_report, row_width
from minfer.cli.main import main
from minfer.gguf import GGUFFile
from minfer.tokenizer import load_tokenizer
from minfer.tools.synth import write_tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "kld"
FIXTURE = json.loads((FIXTURES / "llamacpp_kld.json").read_text())
TEXT = Path(__file__).parent / "fixtures" / FIXTURE["text"]
LLAMA_PERPLEXITY = os.environ.get("LLAMA_PERPLEXITY", "/tmp/llbuild/bin/llama-perplexity")
N_CTX, N_CHUNK = FIXTURE["n_ctx"], FIXTURE["n_chunk"]
N_VOCAB = 331  # write_tiny_model's vocabulary


def _base(name: str) -> bytes:
    return (FIXTURES / f"base_{name}.kld").read_bytes()


def _next_tokens(f: BaseFile, chunk: int) -> np.ndarray:
    return f.tokens[chunk * f.n_ctx + f.n_ctx // 2 + 1:(chunk + 1) * f.n_ctx]


def _llamacpp_logits() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "logits_llamacpp.npz") as z:
        return {k: z[k] for k in z.files}


def test_minfer_reads_llama_perplexitys_file(tmp_path: Path) -> None:
    """Header, the text's tokens, chunk after chunk of rows to the end of the file; and minfer's
    writer turns llama.cpp's own logits into llama-perplexity's rows bit for bit."""
    raw = _base("llamacpp")
    n_scored = N_CTX - 1 - N_CTX // 2
    assert len(raw) == 20 + 4 * N_CTX * N_CHUNK + 2 * row_width(N_VOCAB) * n_scored * N_CHUNK
    with open(FIXTURES / "base_llamacpp.kld", "rb") as fh:
        f = BaseFile.open(fh, "base_llamacpp.kld")
        assert (f.n_ctx, f.n_vocab, f.n_chunk, f.n_scored) == (N_CTX, N_VOCAB, N_CHUNK, n_scored)
        tok = load_tokenizer(GGUFFile.open(write_tiny_model(tmp_path / "f32.gguf")))
        assert not tok.add_bos  # (a vocabulary adding BOS would put it first in the file)
        assert f.tokens.tolist() == tok.encode(TEXT.read_text("utf-8"))[:N_CTX * N_CHUNK]
        logits = _llamacpp_logits()["f32"]
        chunks = list(f.chunks())
        assert fh.read() == b"" and len(chunks) == N_CHUNK
    for c in range(FIXTURE["f32_chunks"]):
        rows, _ = base_rows(logits[c * n_scored:(c + 1) * n_scored], _next_tokens(f, c))
        assert (rows[:, 4:] == chunks[c][:, 4:]).all()  # every 16-bit log-probability, padding
        np.testing.assert_allclose(rows[:, :4].copy().view(np.float32),  # scale, min log-prob
                                   chunks[c][:, :4].copy().view(np.float32), rtol=1e-6)
    # minfer's file of the same model and text: the same header and tokens, byte for byte
    head = 20 + 4 * N_CTX * N_CHUNK
    assert _base("minfer")[:head] == raw[:head] and len(_base("minfer")) == len(raw)


def _resolution(key: str) -> float:
    """Half the last printed digit of a statistic in llama-perplexity's tables."""
    if key == "cor":
        return 0.5e-4  # %6.2f %
    if key.startswith("p_diff") or key.startswith("rms_p_diff"):
        return 0.5e-5  # %6.3f %
    if key.startswith("same_top"):
        return 0.5e-5
    return 0.5e-6  # %10.6f


@pytest.mark.parametrize("base", ["llamacpp", "minfer"])
def test_statistics_are_llama_perplexitys_on_the_same_logits(base: str, tmp_path: Path) -> None:
    """llama-perplexity --kl-divergence on each file (its own, minfer's): minfer's statistics
    from the same file and llama.cpp's logits agree with every printed one to its last digit
    (PPL(Q), whose f32 NLLs differ by an ulp of expf/log, to 3e-8 of itself)."""
    printed = FIXTURE[f"{base}_base"]["llama_perplexity"]
    assert len(printed) == 43  # every statistic of the three tables was parsed
    q4 = _llamacpp_logits()["q4"]
    path = tmp_path / "base.kld"
    path.write_bytes(_base(base))
    result = KLDResult()
    with open(path, "rb") as fh:
        f = BaseFile.open(fh, str(path))
        for c, rows in enumerate(f.chunks()):
            result.add(q4[c * f.n_scored:(c + 1) * f.n_scored], rows, _next_tokens(f, c))
    got = result.stats()
    for key, want in printed.items():
        scale = got["ppl"] if key in ("ppl", "ppl_unc", "ppl_diff", "ppl_diff_unc") else want
        assert abs(got[key] - want) <= _resolution(key) * 1.001 + 3e-8 * abs(scale), key
        assert abs(got[key] - want) <= 1e-4 * max(1.0, abs(want)), key
    assert result.count == N_CHUNK * f.n_scored
    assert round(got["same_top"] * result.count) == round(printed["same_top"] * result.count)


def test_parse_report_reads_minfers_tables_back() -> None:
    rng = np.random.default_rng(0)
    result = KLDResult()
    logits = rng.standard_normal((120, 50)).astype(np.float32)
    noisy = (logits + 0.3 * rng.standard_normal(logits.shape)).astype(np.float32)
    nxt = rng.integers(0, 50, 120)
    result.add(noisy, base_rows(logits, nxt)[0], nxt)
    stats, parsed = result.stats(), parse_report(result.report())
    assert set(parsed) == set(stats) - {"count"}
    for key, value in parsed.items():
        assert value == pytest.approx(stats[key], abs=_resolution(key) * 1.001), key


def test_minfers_logits_give_llama_perplexitys_numbers_within_the_engines_difference() -> None:
    """The recorded runs of each tool's own --kl-divergence (each engine's Q4_0 logits) on the
    same files: PPL within 0.1%, mean KLD within 1e-4, the same top tokens."""
    for base in ("llamacpp", "minfer"):
        theirs, ours = (FIXTURE[f"{base}_base"][k] for k in ("llama_perplexity", "minfer"))
        assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-3)
        assert ours["ppl_base"] == pytest.approx(theirs["ppl_base"], abs=1e-6)
        assert abs(ours["kld_mean"] - theirs["kld_mean"]) < 1e-4
        assert ours["same_top"] == pytest.approx(theirs["same_top"], abs=1e-5)


# -- live: the two tools on each other's files ------------------------------------------------

needs_llama_perplexity = pytest.mark.skipif(not os.access(LLAMA_PERPLEXITY, os.X_OK),
                                            reason=f"no llama-perplexity at {LLAMA_PERPLEXITY}")


def _llama_perplexity(*args: str, tables: bool = False) -> str:
    """llama-perplexity's stdout. Its logger writes from a worker thread that the process's exit
    can cut short when stdout is a pipe (about one run in four on a 2-core host: only the first
    lines arrive), so a run asked for its closing `tables` is repeated, up to three times, until
    they are there."""
    cmd = [LLAMA_PERPLEXITY, "-t", "1", "-fa", "off", "-c", str(N_CTX), *args]
    for _ in range(3):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout
        if not tables or "KL divergence statistics" in out:
            break
    return out


@needs_llama_perplexity
def test_live_each_tool_reads_the_others_file(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """llama-perplexity writes a base file, minfer reads it; minfer writes one, llama-perplexity
    reads it: both files are the fixtures again, and llama-perplexity's tables on minfer's file
    are the recorded ones."""
    f32 = write_tiny_model(tmp_path / "f32.gguf")
    q4 = write_tiny_model(tmp_path / "q4_0.gguf", weight_types=QType.Q4_0)
    ours, theirs = tmp_path / "minfer.kld", tmp_path / "llamacpp.kld"
    _llama_perplexity("-m", str(f32), "-f", str(TEXT), "--chunks", str(N_CHUNK),
                      "--kl-divergence-base", str(theirs))
    assert theirs.read_bytes() == _base("llamacpp")
    assert main(["perplexity", str(f32), "-f", str(TEXT), "-c", str(N_CTX), "--chunks",
                 str(N_CHUNK), "-t", "1", "--json", "--kl-divergence-base", str(ours)]) == 0
    capsys.readouterr()
    assert ours.read_bytes() == _base("minfer")
    printed = parse_report(_llama_perplexity("-m", str(q4), "--kl-divergence-base", str(ours),
                                             "--kl-divergence", tables=True))
    assert printed == FIXTURE["minfer_base"]["llama_perplexity"]
    assert main(["perplexity", str(q4), "-t", "1", "--json", "--kl-divergence-base", str(theirs),
                 "--kl-divergence"]) == 0
    got = json.loads(capsys.readouterr().out)
    for key, value in FIXTURE["llamacpp_base"]["minfer"].items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
