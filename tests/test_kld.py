"""`minfer perplexity --kl-divergence-base / --kl-divergence`: llama-perplexity's file and numbers.

The file is built here by hand from llama.cpp's layout, and the statistics are recomputed in
float64 from llama.cpp's formulas (perplexity.cpp's log_softmax, kl_divergence and its
closing tables) on synthetic logits: minfer's must agree within 1e-4.
"""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from minfer.bench.kld import BaseFile, KLDResult, LogitsWriter, row_width
from minfer.cli.main import main

N_VOCAB = 301  # odd: the stored rows carry one uint16 of padding
N_CTX = 16


def _reference_rows(logits: np.ndarray) -> np.ndarray:
    """llama-perplexity's stored rows, written from its C (f32 arithmetic)."""
    f = np.float32
    out = np.zeros((len(logits), row_width(logits.shape[1])), np.uint16)
    for r, x in enumerate(logits.astype(f)):
        mx, mn = x.max(), x.min()
        mn = max(mn, f(mx - f(16)))
        lse = f(math.log(sum(float(np.exp(f(v - mx))) for v in x)))
        min_log_prob = f(f(mn - mx) - lse)
        scale = f(f(mx - mn) / f(65535))
        out[r, :4] = np.array([scale, min_log_prob], f).view(np.uint16)
        inv = f(1) / scale
        out[r, 4:4 + len(x)] = [int(np.rint(f(inv * f(v - mn)))) if v > mn else 0 for v in x]
    return out


def _synthetic(seed: int, n_chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, base logits and model logits (the base plus noise) for every scored row."""
    rng = np.random.default_rng(seed)
    n_scored = N_CTX - 1 - N_CTX // 2
    tokens = rng.integers(0, N_VOCAB, n_chunk * N_CTX).astype(np.int32)
    base = (rng.standard_normal((n_chunk * n_scored, N_VOCAB)) * 3).astype(np.float32)
    model = (base + rng.standard_normal(base.shape) * 0.7).astype(np.float32)
    return tokens, base, model


def _next_tokens(tokens: np.ndarray, chunk: int) -> np.ndarray:
    return tokens[chunk * N_CTX + N_CTX // 2 + 1:(chunk + 1) * N_CTX]


def _hand_built_file(tokens: np.ndarray, base: np.ndarray, n_chunk: int) -> bytes:
    head = b"_logits_" + struct.pack("<Iii", N_CTX, N_VOCAB, n_chunk)
    return head + tokens.astype("<i4").tobytes() + _reference_rows(base).astype("<u2").tobytes()


def test_the_base_file_is_llama_perplexitys_layout() -> None:
    n_chunk = 2
    tokens, base, _ = _synthetic(1, n_chunk)
    n_scored = len(base) // n_chunk
    buf = io.BytesIO()
    writer = LogitsWriter(buf, N_CTX, N_VOCAB, tokens)
    for c in range(n_chunk):
        writer.add_chunk(base[c * n_scored:(c + 1) * n_scored], _next_tokens(tokens, c))
    got = buf.getvalue()
    want = _hand_built_file(tokens, base, n_chunk)
    assert len(got) == len(want) == 20 + 4 * N_CTX * n_chunk + 2 * row_width(N_VOCAB) * len(base)
    assert got[:20 + 4 * N_CTX * n_chunk] == want[:20 + 4 * N_CTX * n_chunk]
    rows_got = np.frombuffer(got[20 + 4 * N_CTX * n_chunk:], "<u2").reshape(len(base), -1)
    rows_want = _reference_rows(base)
    # the header floats: equal up to the last bit of expf/log (numpy's vs glibc's)
    np.testing.assert_allclose(rows_got[:, :4].copy().view(np.float32),
                               rows_want[:, :4].copy().view(np.float32), rtol=1e-6)
    assert np.abs(rows_got[:, 4:].astype(int) - rows_want[:, 4:]).max() <= 1
    assert (rows_got[:, -1] == 0).all()  # the padding


def _float64_statistics(tokens: np.ndarray, base_rows: np.ndarray, model: np.ndarray,
                        n_chunk: int) -> dict[str, float]:
    """llama.cpp's kl_divergence statistics, recomputed in float64 from its formulas."""
    scale = base_rows[:, :4].copy().view(np.float32)[:, 0].astype(np.float64)
    mlp = base_rows[:, :4].copy().view(np.float32)[:, 1].astype(np.float64)
    log_pb = scale[:, None] * base_rows[:, 4:4 + N_VOCAB] + mlp[:, None]
    x = model.astype(np.float64)
    log_q = x - (x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)))[:, None]
    nxt = np.concatenate([_next_tokens(tokens, c) for c in range(n_chunk)])
    rows = np.arange(len(x))
    nll, nll_base = -log_q[rows, nxt], -log_pb[rows, nxt]
    kld = np.where(log_pb > -16, np.exp(log_pb) * (log_pb - log_q), 0).sum(1)
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    n = len(x)

    def mean_unc(v: np.ndarray) -> tuple[float, float]:
        return float(v.mean()), float(v.std() / math.sqrt(n - 1))

    (m, u), (mb, ub) = mean_unc(nll), mean_unc(nll_base)
    cov = float(((nll - m) * (nll_base - mb)).mean() / (n - 1))
    mse, mse_unc = mean_unc(p_diff ** 2)
    same = float((x.argmax(1) == log_pb.argmax(1)).mean())
    ks, ps = np.sort(kld), np.sort(p_diff)

    def pct(v: np.ndarray, frac: float) -> float:
        p = frac * (len(v) - 1)
        i = int(p)
        return float((1 - (p - i)) * v[i] + (p - i) * v[min(i + 1, len(v) - 1)])

    out = {"ppl": math.exp(m), "ppl_unc": math.exp(m) * u, "ppl_base": math.exp(mb),
           "ppl_base_unc": math.exp(mb) * ub, "ln_ppl_ratio": m - mb,
           "ln_ppl_ratio_unc": math.sqrt(u * u + ub * ub - 2 * cov),
           "ppl_diff": math.exp(m) - math.exp(mb),
           "ppl_diff_unc": math.sqrt((math.exp(m) * u) ** 2 + (math.exp(mb) * ub) ** 2
                                     - 2 * math.exp(m) * math.exp(mb) * cov),
           "kld_mean": float(kld.mean()), "kld_unc": mean_unc(kld)[1],
           "kld_max": float(ks[-1]), "kld_min": float(ks[0]),
           "kld_median": float(np.median(ks)), "p_diff_mean": float(p_diff.mean()),
           "p_diff_median": float(np.median(ps)), "p_diff_max": float(ps[-1]),
           "rms_p_diff": math.sqrt(mse), "rms_p_diff_unc": 0.5 / math.sqrt(mse) * mse_unc,
           "same_top": same, "same_top_unc": math.sqrt(same * (1 - same) / (n - 1))}
    for p in (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1):
        out[f"kld_p{p}"] = pct(ks, p / 100)
    for p in (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1):
        out[f"p_diff_p{p}"] = pct(ps, p / 100)
    return out


def test_statistics_are_llama_perplexitys_formulas() -> None:
    n_chunk = 20  # 140 scored rows: past llama.cpp's 100 for the closing tables
    tokens, base, model = _synthetic(2, n_chunk)
    raw = _hand_built_file(tokens, base, n_chunk)
    f = BaseFile.open(io.BytesIO(raw), "synthetic")
    assert (f.n_ctx, f.n_vocab, f.n_chunk) == (N_CTX, N_VOCAB, n_chunk)
    assert (f.tokens == tokens).all()
    result = KLDResult()
    n_scored = f.n_scored
    for c, rows in enumerate(f.chunks()):
        result.add(model[c * n_scored:(c + 1) * n_scored], rows, _next_tokens(tokens, c))
    got = result.stats()
    want = _float64_statistics(tokens, _reference_rows(base), model, n_chunk)
    assert got["count"] == n_chunk * n_scored
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert 0.3 < got["same_top"] < 1  # the noise moves some top tokens, not all
    report = result.report()
    assert f"Mean    KLD: {got['kld_mean']:10.6f}" in report
    assert f"Same top p: {100 * got['same_top']:6.3f}" in report
    assert "99.9%   KLD" in report and " 5.0%   Δp" in report and "RMS Δp" in report


def test_a_file_that_is_not_a_base_file_is_refused() -> None:
    from minfer.errors import MinferError

    with pytest.raises(MinferError, match="does not look like"):
        BaseFile.open(io.BytesIO(b"GGUF" + bytes(40)), "x.gguf")


def test_the_cli_writes_a_base_file_and_reads_it_back(tiny_qwen2: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Base run: the same PPL as plain perplexity, a file of the text's chunks; the model against
    its own file: KLD ~ 0 (only the file's 16-bit rounding), the same top token everywhere."""
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 8)
    logits = tmp_path / "base.kld"
    assert main(["perplexity", str(tiny_qwen2), "-f", str(text), "-c", "32", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["perplexity", str(tiny_qwen2), "-f", str(text), "-c", "32", "--json",
                 "--kl-divergence-base", str(logits)]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["ppl"] == pytest.approx(plain["ppl"], rel=1e-4)
    with open(logits, "rb") as fh:
        f = BaseFile.open(fh, str(logits))
        assert (f.n_ctx, f.n_chunk) == (32, plain["n_chunks"])
        assert len(list(f.chunks())) == f.n_chunk and fh.read() == b""
    assert main(["perplexity", str(tiny_qwen2), "--kl-divergence-base", str(logits),
                 "--kl-divergence", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["count"] == plain["n_scored"]
    assert got["same_top"] == 1.0 and abs(got["kld_mean"]) < 1e-4
    assert got["ppl"] == pytest.approx(plain["ppl"], rel=1e-4)
    assert got["ppl_base"] == pytest.approx(plain["ppl"], rel=1e-3)
    assert main(["perplexity", str(tiny_qwen2), "--kl-divergence"]) != 0
    assert "--kl-divergence-base FILE" in capsys.readouterr().err
