"""Prometheus metrics through prometheus_client, one `CollectorRegistry` per server.

Several servers run in one process (the tests; a Ray replica per engine), so no metric is
registered in prometheus_client's global registry: each `Metrics` owns its registry, and
`render()` is that registry's exposition (`generate_latest`, the text format 0.0.4), the
/metrics body. Every name starts with `minfer_`. Counters and histograms are updated from the
engine thread and the event loop (prometheus_client locks each); gauges are read from
callbacks at scrape time (the scheduler's live numbers), so they are never stale. The
counters' and histograms' `_created` series are left out: a sum over replicas
(`merge_expositions`, Ray's front) would add timestamps up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Counter(prometheus_client.Counter):
    def total(self) -> float:
        """The count, summed over every label set."""
        return sum(s.value for family in self.collect() for s in family.samples
                   if s.name.endswith("_total"))


class Metrics:
    """Every metric the server exports; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.requests = Counter("minfer_requests_total", "HTTP requests by endpoint and status",
                                ("endpoint", "status"), registry=None)
        self.prompt_tokens = Counter("minfer_prompt_tokens_total", "Prompt tokens received",
                                     registry=None)
        self.cached_tokens = Counter("minfer_prompt_tokens_cached_total",
                                     "Prompt tokens served from the prompt cache", registry=None)
        self.generated_tokens = Counter("minfer_generated_tokens_total", "Tokens generated",
                                        registry=None)
        self.draft_tokens = Counter("minfer_draft_tokens_total",
                                    "Tokens proposed by speculative decoding and verified",
                                    registry=None)
        self.draft_accepted = Counter("minfer_draft_tokens_accepted_total",
                                      "Proposed tokens the model kept", registry=None)
        self.rejected = Counter("minfer_requests_rejected_total",
                                "Requests refused because the queue was full", registry=None)
        self.ttft = Histogram("minfer_time_to_first_token_seconds",
                              "Time from submission to the first generated token",
                              buckets=TTFT_BUCKETS, registry=None)
        self.tpot = Histogram("minfer_time_per_output_token_seconds",
                              "Time between consecutive generated tokens", buckets=TPOT_BUCKETS,
                              registry=None)
        self._gauges: list[tuple[str, str, Callable[[], float]]] = []
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge whose value `read()` gives at each scrape."""
        self._gauges.append((name, doc, read))

    def collect(self) -> Iterator[Metric]:
        """Every family, as the registry asks at a scrape: counters, gauges, histograms."""
        for counter in (self.requests, self.prompt_tokens, self.cached_tokens,
                        self.generated_tokens, self.draft_tokens, self.draft_accepted,
                        self.rejected):
            yield from _without_created(counter.collect())
        for name, doc, read in self._gauges:
            yield GaugeMetricFamily(name, doc, value=read())
        for histogram in (self.ttft, self.tpot):
            yield from _without_created(histogram.collect())

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def _without_created(families: Iterable[Metric]) -> Iterator[Metric]:
    for family in families:
        family.samples = [s for s in family.samples if s.name != family.name + "_created"]
        yield family


def merge_expositions(texts: Iterable[str]) -> str:
    """Several servers' /metrics bodies as one: each series summed across them (counters,
    histogram buckets, sums and counts add up; so do the gauges: queue depth, slots, KV cells
    are totals over the servers). Families keep the order the first body gives them; values
    are written as `render()` writes them, so one body merges into itself."""
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
        out.extend(f"{name} {floatToGoString(v)}" for name, v in series[family].items())
    return "\n".join(out) + "\n" if out else ""
