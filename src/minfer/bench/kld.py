"""KL divergence between two models on the same tokens, as llama.cpp's `llama-perplexity` does it.

`--kl-divergence-base FILE` writes the base model's log-probabilities in llama-perplexity's
binary format; `--kl-divergence` reads them back, runs this model on the same tokens and
compares. Either tool reads the other's file. The format (little-endian):

    "_logits_" | u32 n_ctx | i32 n_vocab | i32 n_chunk | i32 tokens[n_chunk * n_ctx]
    then per chunk, per scored row (positions n_ctx/2 .. n_ctx - 2: n_ctx - 1 - n_ctx/2 rows),
    nv = 2 * ((n_vocab + 1) / 2) + 4 uint16: f32 scale | f32 min_log_prob | q[n_vocab] (| pad)

with log p[i] ~= scale * q[i] + min_log_prob, q from the logits clipped 16 below their maximum.
The tokens are the text's own (BOS not substituted); each chunk is evaluated with its first
token replaced by BOS where the vocabulary adds one, as perplexity does.

Every statistic follows llama.cpp's arithmetic (f32 where it computes in f32, sums in f64):
per row the KL divergence sum_i p_base_i (log p_base_i - log p_i) over the base's
log-probabilities above -16, the NLL of the next token under both models, whether their top
tokens agree, and Δp = p(token) - p_base(token); `KLDResult.report` prints llama-perplexity's
closing tables (mean PPL(Q) and PPL(base), their ratio and difference with uncertainties,
KLD mean / percentiles, Δp, RMS Δp, the same-top-token rate) and `parse_report` reads such
tables back (minfer's or llama-perplexity's own) into `KLDResult.stats()`'s names.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from minfer.errors import MinferError

MAGIC = b"_logits_"
F32 = np.float32
ROW_BLOCK = 16  # rows processed at once (a row of a 152k vocabulary is 0.6 MB of f32)


def row_width(n_vocab: int) -> int:
    """uint16 values per stored row: the 4 of the two f32 header values, the vocabulary, even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (round half to even) of f32 values."""
    return np.rint(v).astype(np.int64)


def _log_sum_exp(logits: np.ndarray, mx: np.ndarray) -> np.ndarray:
    """(float) log(sum_i expf(logits_i - max)), the sum in f64 as llama.cpp takes it."""
    sum_exp = np.exp(logits - mx[:, None]).astype(np.float64).sum(axis=1)
    return np.log(sum_exp).astype(F32)


def base_rows(logits: np.ndarray, next_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama-perplexity's stored rows ([n, row_width] uint16) for f32 logits [n, n_vocab], and
    each row's NLL of its next token (f64)."""
    logits = np.asarray(logits, F32)
    n, n_vocab = logits.shape
    mx = logits.max(axis=1)
    mn = np.maximum(logits.min(axis=1), mx - F32(16))
    lse = _log_sum_exp(logits, mx)
    min_log_prob = (mn - mx) - lse
    scale = (mx - mn) / F32(65535)
    out = np.zeros((n, row_width(n_vocab)), np.uint16)
    head = np.stack([scale, min_log_prob], axis=1).astype(F32)
    out[:, :4] = head.view(np.uint16)
    live = scale != 0
    inv = np.where(live, F32(1) / np.where(live, scale, F32(1)), F32(0)).astype(F32)
    q = np.where(logits > mn[:, None], _nearest_int(inv[:, None] * (logits - mn[:, None])), 0)
    q[~live] = 0
    out[:, 4:4 + n_vocab] = q.astype(np.uint16)
    nll = (mx + lse) - logits[np.arange(n), next_tokens]
    return out, nll.astype(np.float64)


class LogitsWriter:
    """Writes the base file as a perplexity run goes: header and tokens, then chunk by chunk."""

    def __init__(self, out: BinaryIO, n_ctx: int, n_vocab: int, tokens: np.ndarray) -> None:
        n_chunk = len(tokens) // n_ctx
        self.out = out
        out.write(MAGIC + struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
        out.write(np.asarray(tokens[:n_chunk * n_ctx], "<i4").tobytes())

    def add_chunk(self, logits: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
        """One chunk's scored rows; returns their NLLs."""
        nll = np.empty(len(logits))
        for r0 in range(0, len(logits), ROW_BLOCK):
            rows, nll[r0:r0 + ROW_BLOCK] = base_rows(logits[r0:r0 + ROW_BLOCK],
                                                     next_tokens[r0:r0 + ROW_BLOCK])
            self.out.write(rows.astype("<u2").tobytes())
        return nll


@dataclass
class BaseFile:
    """A base file's header and tokens; `chunks` reads its rows chunk by chunk."""

    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # [n_chunk * n_ctx] int32
    stream: BinaryIO

    @property
    def n_scored(self) -> int:
        return self.n_ctx - 1 - self.n_ctx // 2

    @classmethod
    def open(cls, stream: BinaryIO, name: str) -> BaseFile:
        if stream.read(8) != MAGIC:
            raise MinferError(f"{name} does not look like a file containing log-probabilities "
                              "(llama-perplexity --kl-divergence-base)")
        head = stream.read(12)
        if len(head) < 12:
            raise MinferError(f"{name}: failed reading n_ctx, n_vocab, n_chunk")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", head)
        if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
            raise MinferError(f"{name}: n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}")
        raw = stream.read(4 * n_ctx * n_chunk)
        if len(raw) < 4 * n_ctx * n_chunk:
            raise MinferError(f"{name}: failed reading the evaluation tokens")
        return cls(n_ctx, n_vocab, n_chunk, np.frombuffer(raw, "<i4").astype(np.int32), stream)

    def chunks(self) -> Iterator[np.ndarray]:
        """Each chunk's rows, [n_scored, row_width] uint16."""
        nv = row_width(self.n_vocab)
        size = 2 * nv * self.n_scored
        for i in range(self.n_chunk):
            raw = self.stream.read(size)
            if len(raw) < size:
                raise MinferError(f"failed reading log-probs for chunk {i}")
            yield np.frombuffer(raw, "<u2").reshape(self.n_scored, nv)


def compare_rows(logits: np.ndarray, base: np.ndarray, next_tokens: np.ndarray
                 ) -> dict[str, np.ndarray]:
    """llama.cpp's per-row comparison of this model's f32 logits with the base's stored rows:
    kld (f64), p_diff (f32), nll and nll_base (f32), same_top (bool)."""
    logits = np.asarray(logits, F32)
    n, n_vocab = logits.shape
    rows = np.arange(n)
    mx = logits.max(axis=1)
    imax = logits.argmax(axis=1)
    lse = _log_sum_exp(logits, mx)
    head = np.ascontiguousarray(base[:, :4]).view(F32)
    scale, min_log_prob = head[:, 0], head[:, 1]
    q = base[:, 4:4 + n_vocab]
    nll = (mx + lse) - logits[rows, next_tokens]
    nll_base = -(scale * q[rows, next_tokens].astype(F32) + min_log_prob)
    p_log_base = scale[:, None] * q.astype(F32) + min_log_prob[:, None]
    imax_base = p_log_base.argmax(axis=1)
    term = np.exp(p_log_base) * ((p_log_base - logits) + (mx + lse)[:, None])
    kld = np.where(p_log_base > F32(-16), term, F32(0)).astype(np.float64).sum(axis=1)
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    return {"kld": kld, "p_diff": p_diff.astype(F32), "nll": nll.astype(F32),
            "nll_base": nll_base.astype(F32), "same_top": imax == imax_base}


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def covariance(sum_a: float, sum_b: float, sum_ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sum_ab / count - (sum_a / count) * (sum_b / count)) / (count - 1)


def percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile of sorted f32 values (interpolated, in f32)."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = F32(fraction) * F32(len(values) - 1)
    ip = int(p)
    p -= F32(ip)
    return float((F32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def median(values: np.ndarray) -> float:
    n = len(values)
    if n % 2 == 0:
        return float(F32(0.5) * (values[n // 2] + values[n // 2 - 1]))
    return float(values[n // 2])


@dataclass
class KLDResult:
    """llama.cpp's kl_divergence_result: sums over the scored rows, and each row's KLD and Δp."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: np.ndarray, base: np.ndarray, next_tokens: np.ndarray) -> None:
        """Scored rows of one chunk: this model's logits, the base's stored rows."""
        for r0 in range(0, len(logits), ROW_BLOCK):
            r = compare_rows(logits[r0:r0 + ROW_BLOCK], base[r0:r0 + ROW_BLOCK],
                             next_tokens[r0:r0 + ROW_BLOCK])
            nll = r["nll"].astype(np.float64)
            nll_base = r["nll_base"].astype(np.float64)
            p_diff = r["p_diff"].astype(np.float64)
            self.sum_nll += float(nll.sum())
            self.sum_nll2 += float((r["nll"] * r["nll"]).astype(np.float64).sum())
            self.sum_nll_base += float(nll_base.sum())
            self.sum_nll_base2 += float((r["nll_base"] * r["nll_base"]).astype(np.float64).sum())
            self.sum_nll_nll_base += float((r["nll"] * r["nll_base"]).astype(np.float64).sum())
            self.sum_kld += float(r["kld"].sum())
            self.sum_kld2 += float((r["kld"] * r["kld"]).sum())
            p_diff2 = (r["p_diff"] * r["p_diff"]).astype(np.float64)  # f32 product, as in C
            self.sum_p_diff += float(p_diff.sum())
            self.sum_p_diff2 += float(p_diff2.sum())
            self.sum_p_diff4 += float((p_diff2 * p_diff2).sum())
            self.max_p_diff = max(self.max_p_diff, float(np.abs(r["p_diff"]).max()))
            self.n_same_top += int(r["same_top"].sum())
            self.count += len(nll)
            self.kld_values.append(r["kld"].astype(F32))
            self.p_diff_values.append(r["p_diff"])

    # -- the statistics llama-perplexity prints ------------------------------------------------
    def stats(self) -> dict[str, float]:
        n = self.count
        log_ppl = mean_and_uncertainty(self.sum_nll, self.sum_nll2, n)
        log_base = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, n)
        cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, n)
        ppl = math.exp(log_ppl[0])
        ppl_base = math.exp(log_base[0])
        ratio = log_ppl[0] - log_base[0]
        ratio_unc = math.sqrt(max(0.0, log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov))
        ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
        diff_unc2 = ppl_unc ** 2 + base_unc ** 2 - 2 * ppl * ppl_base * cov
        kld = mean_and_uncertainty(self.sum_kld, self.sum_kld2, n)
        p_diff = mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, n)
        mse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, n)
        rms = math.sqrt(mse[0])
        same = self.n_same_top / n if n else 0.0
        kv = np.sort(np.concatenate(self.kld_values)) if n else np.zeros(1, F32)
        pv = np.sort(np.concatenate(self.p_diff_values)) if n else np.zeros(1, F32)
        out = {
            "count": float(n), "ppl": ppl, "ppl_unc": ppl_unc, "ppl_base": ppl_base,
            "ppl_base_unc": base_unc,
            "cor": cov / (log_ppl[1] * log_base[1]) if log_ppl[1] * log_base[1] else 0.0,
            "ln_ppl_ratio": ratio, "ln_ppl_ratio_unc": ratio_unc,
            "ppl_ratio": math.exp(ratio), "ppl_ratio_unc": math.exp(ratio) * ratio_unc,
            "ppl_diff": ppl - ppl_base, "ppl_diff_unc": math.sqrt(max(0.0, diff_unc2)),
            "kld_mean": kld[0], "kld_unc": kld[1], "kld_max": float(kv[-1]),
            "kld_median": median(kv), "kld_min": float(kv[0]),
            "p_diff_mean": p_diff[0], "p_diff_unc": p_diff[1], "p_diff_max": float(pv[-1]),
            "p_diff_median": median(pv), "p_diff_min": float(pv[0]),
            "rms_p_diff": rms, "rms_p_diff_unc": 0.5 / rms * mse[1] if rms else 0.0,
            "same_top": same,
            "same_top_unc": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
        }
        for pct in KLD_PERCENTILES:
            out[f"kld_p{pct}"] = percentile(kv, pct / 100)
        for pct in P_DIFF_PERCENTILES:
            out[f"p_diff_p{pct}"] = percentile(pv, pct / 100)
        return out

    def chunk_line(self, chunk: int) -> str:
        """The running line llama-perplexity prints after each chunk."""
        s = self.stats()
        return (f"{chunk:4d}    {s['ppl']:9.4f} ± {s['ppl_unc']:9.4f}    "
                f"{s['ln_ppl_ratio']:10.5f} ± {s['ln_ppl_ratio_unc']:10.5f}    "
                f"{s['kld_mean']:10.5f} ± {s['kld_unc']:10.5f}    "
                f"{100 * s['rms_p_diff']:6.3f} ± {100 * s['rms_p_diff_unc']:6.3f} %    "
                f"{100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:6.3f} %")

    def report(self) -> str:
        """llama-perplexity's closing tables (it prints them from 100 scored tokens on)."""
        s = self.stats()
        lines = [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_unc']:10.6f}",
            f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_unc']:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor']:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± "
            f"{s['ln_ppl_ratio_unc']:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_unc']:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_unc']:10.6f}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_unc']:10.6f}",
            f"Maximum KLD: {s['kld_max']:10.6f}",
            *(f"{_pct_label(p)}   KLD: {s[f'kld_p{p}']:10.6f}" for p in KLD_PERCENTILES[:4]),
            f"Median  KLD: {s['kld_median']:10.6f}",
            *(f"{_pct_label(p)}   KLD: {s[f'kld_p{p}']:10.6f}" for p in KLD_PERCENTILES[4:]),
            f"Minimum KLD: {s['kld_min']:10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * s['p_diff_mean']:6.3f} ± {100 * s['p_diff_unc']:5.3f} %",
            f"Maximum Δp: {100 * s['p_diff_max']:6.3f}%",
            *(f"{_pct_label(p)}   Δp: {100 * s[f'p_diff_p{p}']:6.3f}%"
              for p in P_DIFF_PERCENTILES[:5]),
            f"Median  Δp: {100 * s['p_diff_median']:6.3f}%",
            *(f"{_pct_label(p)}   Δp: {100 * s[f'p_diff_p{p}']:6.3f}%"
              for p in P_DIFF_PERCENTILES[5:]),
            f"Minimum Δp: {100 * s['p_diff_min']:6.3f}%",
            f"RMS Δp    : {100 * s['rms_p_diff']:6.3f} ± {100 * s['rms_p_diff_unc']:5.3f} %",
            f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:5.3f} %",
        ]
        return "\n".join(lines)


# the percentiles llama-perplexity prints, high to low (as numbers in the statistic names)
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
P_DIFF_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def _pct_label(p: float) -> str:
    return f"{p:4.1f}%"


CHUNK_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          "
                "KL Divergence              Δp RMS            Same top p")


def _report_labels() -> dict[str, tuple[str, str | None, float]]:
    """Each closing-table label (spaces collapsed): its statistic, its uncertainty's, the factor
    the table prints it with."""
    labels: dict[str, tuple[str, str | None, float]] = {
        "Mean PPL(Q)": ("ppl", "ppl_unc", 1.0),
        "Mean PPL(base)": ("ppl_base", "ppl_base_unc", 1.0),
        "Cor(ln(PPL(Q)), ln(PPL(base)))": ("cor", None, 100.0),
        "Mean ln(PPL(Q)/PPL(base))": ("ln_ppl_ratio", "ln_ppl_ratio_unc", 1.0),
        "Mean PPL(Q)/PPL(base)": ("ppl_ratio", "ppl_ratio_unc", 1.0),
        "Mean PPL(Q)-PPL(base)": ("ppl_diff", "ppl_diff_unc", 1.0),
        "Mean KLD": ("kld_mean", "kld_unc", 1.0),
        "Mean Δp": ("p_diff_mean", "p_diff_unc", 100.0),
        "RMS Δp": ("rms_p_diff", "rms_p_diff_unc", 100.0),
        "Same top p": ("same_top", "same_top_unc", 100.0),
    }
    for name, key, factor, pcts in (("KLD", "kld", 1.0, KLD_PERCENTILES),
                                    ("Δp", "p_diff", 100.0, P_DIFF_PERCENTILES)):
        for word, stat in (("Maximum", "max"), ("Median", "median"), ("Minimum", "min")):
            labels[f"{word} {name}"] = (f"{key}_{stat}", None, factor)
        for p in pcts:
            labels[f"{_pct_label(p).strip()} {name}"] = (f"{key}_p{p}", None, factor)
    return labels


_VALUE = re.compile(r"^\s*(-?[\d.]+)\s*%?\s*(?:±\s*(-?[\d.]+)\s*%?)?\s*$")


def parse_report(text: str) -> dict[str, float]:
    """The statistics of llama-perplexity's (or `KLDResult.report`'s) closing tables, by
    `KLDResult.stats()`'s names, as fractions where the table prints percentages."""
    labels = _report_labels()
    out: dict[str, float] = {}
    for line in text.splitlines():
        label, colon, rest = line.partition(":")
        entry = labels.get(" ".join(label.split())) if colon else None
        m = _VALUE.match(rest) if entry else None
        if entry is None or m is None:
            continue
        key, unc_key, factor = entry
        out[key] = float(m.group(1)) / factor
        if unc_key is not None and m.group(2) is not None:
            out[unc_key] = float(m.group(2)) / factor
    return out
