"""The replica's metrics reach Ray's Prometheus endpoint (what a Prometheus scraping the Ray node sees)."""

from __future__ import annotations

import time
import urllib.request

import pytest

from helpers.grafana_dashboard import dashboard_metrics
from warpspec.cli.client import GenerationClient

pytestmark = pytest.mark.slow

EXPECTED = ["warpspec_time_to_first_token_seconds_bucket", "warpspec_time_per_output_token_seconds_bucket",
            "warpspec_prompt_tokens_total", "warpspec_generation_tokens_total", "warpspec_requests_total",
            "warpspec_num_waiting_requests", "warpspec_num_running_sequences", "warpspec_kv_cache_usage_ratio",
            "warpspec_prefix_cache_hit_rate", "warpspec_acceptance_length", "warpspec_constrained_acceptance_length",
            "warpspec_draft_time_share", "warpspec_recent_acceptance_length", "warpspec_low_acceptance"]
DRAFT_ONLY = {"ray_warpspec_spec_decode_draft_tokens_total", "ray_warpspec_spec_decode_accepted_tokens_total",
              "ray_warpspec_request_acceptance_length"}


def test_metrics_on_the_ray_metrics_endpoint(ray_cluster, serving_stack):
    with GenerationClient(serving_stack.grpc_target, timeout=30) as client:
        for _ in range(2):
            client.generate("def main():", max_tokens=4, temperature=0.0)
    port = next(n["MetricsExportPort"] for n in ray_cluster.nodes() if n["Alive"])
    deadline, missing = time.monotonic() + 30, EXPECTED
    while missing and time.monotonic() < deadline:  # exported every few seconds
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                text = reply.read().decode()
        except OSError:
            text = ""
        missing = [name for name in EXPECTED if f"ray_{name}" not in text]
        # k8s/grafana-dashboard.json's series, but those recorded only with a draft (this stack has none;
        # tests/k8s holds them to metrics.py's names).
        missing += [name for name in dashboard_metrics() - DRAFT_ONLY if name not in text]
        if missing:
            time.sleep(1)
    assert not missing, f"not on Ray's metrics endpoint: {missing}"
    assert 'model="tiny"' in text and 'finish_reason="length"' in text
