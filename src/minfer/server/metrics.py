"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand.

prometheus_client is not a dependency; the format is small: `# HELP`, `# TYPE`, then one
`name{label="value"} number` line per series, histograms as cumulative `_bucket{le=...}` lines
plus `_sum` and `_count`. Every name starts with `minfer_`. Counters and histograms are updated
from the engine thread and the event loop, so each metric holds a lock; gauges are read from a
callback at scrape time (the scheduler's live numbers), so they are never stale.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable

LabelValues = tuple[str, ...]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Iterable[str], values: Iterable[str]) -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Counter:
    kind = "counter"

    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.label_names = name, doc, labels
        self._values: dict[LabelValues, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def total(self) -> float:
        with self._lock:
            return sum(self._values.values())

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.label_names:
            items = [((), 0.0)]
        return [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self.name, self.doc, self._read = name, doc, read

    def samples(self) -> list[str]:
        return [f"{self.name} {_num(self._read())}"]


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc = name, doc
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def samples(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            running += n
            out.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {running}')
        out.append(f"{self.name}_sum {_num(total)}")
        out.append(f"{self.name}_count {running}")
        return out


class Metrics:
    """Every metric the server exports; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.requests = Counter("minfer_requests_total", "HTTP requests by endpoint and status",
                                ("endpoint", "status"))
        self.prompt_tokens = Counter("minfer_prompt_tokens_total", "Prompt tokens received")
        self.cached_tokens = Counter("minfer_prompt_tokens_cached_total",
                                     "Prompt tokens served from the prompt cache")
        self.generated_tokens = Counter("minfer_generated_tokens_total", "Tokens generated")
        self.draft_tokens = Counter("minfer_draft_tokens_total",
                                    "Tokens proposed by speculative decoding and verified")
        self.draft_accepted = Counter("minfer_draft_tokens_accepted_total",
                                      "Proposed tokens the model kept")
        self.rejected = Counter("minfer_requests_rejected_total",
                                "Requests refused because the queue was full")
        self.ttft = Histogram("minfer_time_to_first_token_seconds",
                              "Time from submission to the first generated token", TTFT_BUCKETS)
        self.tpot = Histogram("minfer_time_per_output_token_seconds",
                              "Time between consecutive generated tokens", TPOT_BUCKETS)
        self._gauges: list[Gauge] = []

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self._gauges.append(Gauge(name, doc, read))

    def render(self) -> str:
        lines: list[str] = []
        metrics: list[Counter | Gauge | Histogram] = [
            self.requests, self.prompt_tokens, self.cached_tokens, self.generated_tokens,
            self.draft_tokens, self.draft_accepted, self.rejected, *self._gauges, self.ttft,
            self.tpot,
        ]
        for m in metrics:
            lines.append(f"# HELP {m.name} {m.doc}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            lines.extend(m.samples())
        return "\n".join(lines) + "\n"


def merge_expositions(texts: Iterable[str]) -> str:
    """Several servers' /metrics bodies as one: each series summed across them (counters,
    histogram buckets, sums and counts add up; so do the gauges: queue depth, slots, KV cells
    are totals over the servers). Families keep the order the first body gives them."""
    headers: dict[str, list[str]] = {}  # family -> its HELP / TYPE lines
    series: dict[str, dict[str, float]] = {}  # family -> series -> summed value
    for text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                family = parts[2] if len(parts) > 2 else family
                lines = headers.setdefault(family, [])
                if line not in lines:
                    lines.append(line)
                series.setdefault(family, {})
            elif line.strip():
                name, _, value = line.rpartition(" ")
                values = series.setdefault(family, {})
                values[name] = values.get(name, 0.0) + float(value)
    out: list[str] = []
    for family, lines in headers.items():
        out.extend(lines)
        out.extend(f"{name} {_num(v)}" for name, v in series[family].items())
    return "\n".join(out) + "\n" if out else ""
