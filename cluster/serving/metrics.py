"""A replica's Prometheus metrics, through ray.util.metrics so they appear on Ray's metrics endpoint
(each Ray node exports them; the replica's deployment and replica ids come along as tags).

Per request (at its end): time to first token, time per output token, prompt/generated token
counters, acceptance length. Per replica (sampled every second and after each request): queue
depth, running sequences, KV cache usage, prefix-cache hit rate, mean acceptance length (all requests,
and those with a structured output).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from warpspec.core.stats import EngineStats
from warpspec.outputs import RequestOutput

# Seconds. TTFT spans queueing and prefill; TPOT one decode step (or a fraction, when speculating).
TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
ACCEPTANCE_BUCKETS = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0]


@dataclass
class ReplicaStats:
    """A snapshot of one replica: its engine's EngineStats plus what serving adds. Also what the admin
    call and the tests read."""
    num_kv_blocks: int
    num_free_kv_blocks: int  # includes blocks held only by the prefix cache (free to evict)
    num_running: int
    num_waiting: int  # in the scheduler's queue plus submitted but not yet admitted
    num_in_flight: int  # open request streams
    prefix_cache_hit_rate: float  # over all prompt tokens admitted so far
    acceptance_length: float  # engine-wide mean; 0 without speculation
    constrained_acceptance_length: float  # the same over requests with a structured output
    num_aborted: int  # requests whose client cancelled or disconnected mid-way
    is_healthy: bool

    @classmethod
    def of(cls, engine: EngineStats, num_in_flight: int, num_aborted: int, is_healthy: bool) -> ReplicaStats:
        return cls(**dataclasses.asdict(engine), num_in_flight=num_in_flight, num_aborted=num_aborted,
                   is_healthy=is_healthy)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


class ServingMetrics:
    def __init__(self, model_name: str):
        from ray.util import metrics

        tags = ("model",)
        self.default_tags = {"model": model_name}
        self.ttft = metrics.Histogram("warpspec_time_to_first_token_seconds", "Arrival to first output token.",
                                      boundaries=TTFT_BUCKETS, tag_keys=tags)
        self.tpot = metrics.Histogram("warpspec_time_per_output_token_seconds",
                                      "Mean time between output tokens of a request, after the first.",
                                      boundaries=TPOT_BUCKETS, tag_keys=tags)
        self.acceptance = metrics.Histogram("warpspec_request_acceptance_length",
                                            "Tokens gained per verifying target step, per request.",
                                            boundaries=ACCEPTANCE_BUCKETS, tag_keys=tags)
        self.prompt_tokens = metrics.Counter("warpspec_prompt_tokens_total", "Prompt tokens of finished requests.",
                                             tag_keys=tags)
        self.generation_tokens = metrics.Counter("warpspec_generation_tokens_total",
                                                 "Tokens generated (rate = tokens/s).", tag_keys=tags)
        self.requests = metrics.Counter("warpspec_requests_total", "Finished requests by finish reason.",
                                        tag_keys=("model", "finish_reason"))
        self.queue_depth = metrics.Gauge("warpspec_num_waiting_requests", "Requests waiting to be scheduled.",
                                         tag_keys=tags)
        self.running = metrics.Gauge("warpspec_num_running_sequences", "Sequences in the running batch.",
                                     tag_keys=tags)
        self.kv_usage = metrics.Gauge("warpspec_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.",
                                      tag_keys=tags)
        self.prefix_hit_rate = metrics.Gauge("warpspec_prefix_cache_hit_rate",
                                             "Prompt tokens found in the prefix cache / prompt tokens admitted.",
                                             tag_keys=tags)
        self.acceptance_mean = metrics.Gauge("warpspec_acceptance_length", "Engine-wide mean acceptance length.",
                                             tag_keys=tags)
        self.constrained_acceptance = metrics.Gauge(
            "warpspec_constrained_acceptance_length",
            "Mean acceptance length of requests with a structured output (grammar-masked drafts).", tag_keys=tags)
        for metric in (self.ttft, self.tpot, self.acceptance, self.prompt_tokens, self.generation_tokens,
                       self.queue_depth, self.running, self.kv_usage, self.prefix_hit_rate, self.acceptance_mean,
                       self.constrained_acceptance):
            metric.set_default_tags(self.default_tags)

    def record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if "time_to_first_token_s" in m:
            self.ttft.observe(m["time_to_first_token_s"])
        if "time_per_output_token_s" in m:
            self.tpot.observe(m["time_per_output_token_s"])
        if "acceptance_length" in m:
            self.acceptance.observe(m["acceptance_length"])
        # Ray counters refuse increments of 0.
        if m.get("prompt_tokens"):
            self.prompt_tokens.inc(m["prompt_tokens"])
        if out.token_ids:
            self.generation_tokens.inc(len(out.token_ids))
        self.requests.inc(1, tags={**self.default_tags, "finish_reason": out.finish_reason or "unknown"})

    def record_stats(self, stats: ReplicaStats) -> None:
        self.queue_depth.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.acceptance_mean.set(stats.acceptance_length)
        self.constrained_acceptance.set(stats.constrained_acceptance_length)
