"""The Grafana dashboard's data during a benchmark: Ray's Prometheus endpoint read on a timer, and the
dashboard's main panels (k8s/grafana-dashboard.json) drawn from it with matplotlib.

What a Prometheus scraping the node would store, reduced the way the dashboard's queries reduce it:
counters to rates, histograms to quantiles per interval (histogram_quantile's linear interpolation
within a bucket), gauges summed over the replicas. Ray exports the replicas' metrics every few
seconds, so points are that far apart whatever the sampling period.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "ray_warpspec_"
COUNTERS = ("generation_tokens_total", "requests_total")
GAUGES = ("num_waiting_requests", "num_running_sequences", "kv_cache_usage_ratio")
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds")


@dataclass
class Sample:
    at: float  # seconds since the sampler started
    values: dict[str, float]  # counters and gauges, summed over their label sets
    buckets: dict[str, dict[float, float]]  # histogram -> upper bound -> cumulative count


def read_sample(text: str, at: float) -> Sample:
    """The dashboard's series from one read of a Prometheus text endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if not sample.name.startswith(PREFIX):
                continue
            if name in COUNTERS or name in GAUGES:
                values[name] = values.get(name, 0.0) + sample.value
            elif name.endswith("_bucket") and name.removesuffix("_bucket") in HISTOGRAMS:
                bounds = buckets.setdefault(name.removesuffix("_bucket"), {})
                bound = float(sample.labels["le"])
                bounds[bound] = bounds.get(bound, 0.0) + sample.value
    return Sample(at, values, buckets)


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """histogram_quantile over cumulative bucket counts {upper bound: count}; None without counts."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    previous_bound, previous_count = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return previous_bound
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (count - previous_count)
        previous_bound, previous_count = bound, count
    return previous_bound


@dataclass
class MetricsSampler:
    """Reads url (a Prometheus text endpoint) every period_s on a thread until stopped."""
    url: str
    period_s: float = 2.0
    samples: list[Sample] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)  # (seconds, what started then)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def start(self) -> MetricsSampler:
        self._thread.start()
        return self

    def mark(self, label: str) -> None:
        self.marks.append((time.monotonic() - self._start, label))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as reply:
                    text = reply.read().decode()
            except OSError:
                continue  # the endpoint is not up yet, or busy: the next read counts
            self.samples.append(read_sample(text, time.monotonic() - self._start))


def panels(samples: list[Sample]) -> dict[str, list[tuple[float, float | None]]]:
    """The dashboard's main series over time: between each two reads whose counters moved."""
    series: dict[str, list[tuple[float, float | None]]] = {
        "tokens/s": [], "TTFT p50 (ms)": [], "TTFT p99 (ms)": [], "TPOT p50 (ms)": [], "TPOT p99 (ms)": [],
        "waiting requests": [], "running sequences": [], "KV cache usage (%)": []}
    changed = [s for i, s in enumerate(samples) if i == 0 or s.values != samples[i - 1].values]
    for before, after in zip(changed, changed[1:], strict=False):
        dt = after.at - before.at
        series["tokens/s"].append((after.at, (after.values.get("generation_tokens_total", 0.0)
                                              - before.values.get("generation_tokens_total", 0.0)) / dt))
        for histogram, label in (("time_to_first_token_seconds", "TTFT"), ("time_per_output_token_seconds", "TPOT")):
            new = {bound: count - before.buckets.get(histogram, {}).get(bound, 0.0)
                   for bound, count in after.buckets.get(histogram, {}).items()}
            for q in (0.5, 0.99):
                value = quantile(q, new)
                series[f"{label} p{round(q * 100)} (ms)"].append((after.at, None if value is None else value * 1e3))
        series["waiting requests"].append((after.at, after.values.get("num_waiting_requests")))
        series["running sequences"].append((after.at, after.values.get("num_running_sequences")))
        usage = after.values.get("kv_cache_usage_ratio")
        series["KV cache usage (%)"].append((after.at, None if usage is None else 100 * usage))
    return series


def plot(samples: list[Sample], marks: list[tuple[float, str]], title: str, path: Path) -> None:
    """Four of the dashboard's panels, as the dashboard shows them for this run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = panels(samples)
    layout = [("Generated tokens/s", ["tokens/s"]), ("Time to first token", ["TTFT p50 (ms)", "TTFT p99 (ms)"]),
              ("Queue and batch", ["waiting requests", "running sequences"]),
              ("Time per output token", ["TPOT p50 (ms)", "TPOT p99 (ms)"]), ("KV cache", ["KV cache usage (%)"])]
    fig, axes = plt.subplots(len(layout), 1, figsize=(10, 2.2 * len(layout)), sharex=True)
    for ax, (panel, names) in zip(axes, layout, strict=True):
        for name in names:
            points = [(t, v) for t, v in series[name] if v is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=name)
        for at, _ in marks:
            ax.axvline(at, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(panel, fontsize=10, loc="left")
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    for at, label in marks:
        axes[0].annotate(label, (at, 1.0), xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                         va="top", ha="right")
    axes[-1].set_xlabel("seconds since the benchmark started")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
