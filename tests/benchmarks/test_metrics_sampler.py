"""The dashboard's data as bench load reads it (benchmarks/metrics_sampler.py): Prometheus text to
series summed over replicas, histogram quantiles as Prometheus computes them, rates between reads,
and the plot written."""

from __future__ import annotations

import pytest

from warpspec.benchmarks.metrics_sampler import panels, plot, quantile, read_sample


def _endpoint(tokens: float, waiting: float, ttft_buckets: dict[str, float]) -> str:
    """Ray's endpoint for two replicas of one model, and a series of another exporter."""
    lines = ["# TYPE ray_warpspec_generation_tokens_total counter"]
    for replica in ("a", "b"):
        lines.append(f'ray_warpspec_generation_tokens_total{{model="m",ReplicaId="{replica}"}} {tokens / 2}')
    lines += ["# TYPE ray_warpspec_num_waiting_requests gauge",
              f'ray_warpspec_num_waiting_requests{{model="m",ReplicaId="a"}} {waiting}',
              "# TYPE ray_warpspec_time_to_first_token_seconds histogram"]
    for bound, count in ttft_buckets.items():
        lines.append(f'ray_warpspec_time_to_first_token_seconds_bucket{{model="m",le="{bound}"}} {count}')
    lines += [f'ray_warpspec_time_to_first_token_seconds_count{{model="m"}} {ttft_buckets["+Inf"]}',
              "# TYPE ray_node_cpu_count gauge", "ray_node_cpu_count 2"]
    return "\n".join(lines) + "\n"


def test_a_read_sums_replicas_and_keeps_only_the_dashboards_series():
    sample = read_sample(_endpoint(10, 3, {"0.1": 2, "0.5": 6, "+Inf": 8}), at=1.0)
    assert sample.values == {"generation_tokens_total": 10.0, "num_waiting_requests": 3.0}
    assert sample.buckets == {"time_to_first_token_seconds": {0.1: 2.0, 0.5: 6.0, float("inf"): 8.0}}


def test_quantiles_interpolate_within_a_bucket_as_histogram_quantile_does():
    buckets = {0.1: 2.0, 0.5: 6.0, 1.0: 8.0, float("inf"): 8.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (4 - 2) / (6 - 2))  # rank 4 of 8
    assert quantile(0.25, buckets) == pytest.approx(0.1)
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (7.92 - 6) / 2)
    assert quantile(0.99, {0.1: 1.0, float("inf"): 4.0}) == pytest.approx(0.1)  # past the last bound
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_panels_are_rates_and_quantiles_of_what_changed_between_reads(tmp_path):
    samples = [read_sample(_endpoint(0, 0, {"0.1": 0, "0.5": 0, "+Inf": 0}), at=0.0),
               read_sample(_endpoint(0, 0, {"0.1": 0, "0.5": 0, "+Inf": 0}), at=2.0),  # not exported anew
               read_sample(_endpoint(400, 5, {"0.1": 4, "0.5": 4, "+Inf": 4}), at=10.0),
               read_sample(_endpoint(600, 1, {"0.1": 4, "0.5": 8, "+Inf": 8}), at=20.0)]
    series = panels(samples)
    assert series["tokens/s"] == [(10.0, 40.0), (20.0, 20.0)]  # from the last read that moved: 400 in 10 s
    assert series["waiting requests"] == [(10.0, 5.0), (20.0, 1.0)]
    # The second interval's four first tokens all fell in (0.1, 0.5]: its median is 0.3 s.
    assert series["TTFT p50 (ms)"][1] == (20.0, pytest.approx(300.0))
    path = tmp_path / "dashboard.png"
    plot(samples, [(0.0, "plain")], "test", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
