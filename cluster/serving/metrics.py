"""A replica's Prometheus metrics, through ray.util.metrics so they appear on Ray's metrics endpoint
(each Ray node exports them; the replica's deployment and replica ids come along as tags).

Per request (at its end): time to first token, time per output token, prompt/generated token
counters, acceptance length. Per replica (sampled every second and after each request): queue
depth, running sequences, KV cache usage, prefix-cache hit rate, mean acceptance length (all requests,
and those with a structured output); with a draft, drafts proposed and accepted per draft position
(counters), the draft's share of step time, and the acceptance length of the last minute with a
flag (and a logged warning) when it falls below min_acceptance_length (AcceptanceWatch).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from warpspec.core.engine_stats import EngineStats
from warpspec.outputs import RequestOutput
from warpspec.spec_decode.speculation_stats import acceptance_length

logger = logging.getLogger(__name__)

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
    drafted_at: tuple[int, ...]  # drafts proposed at each draft position, in all (EngineStats)
    accepted_at: tuple[int, ...]  # and accepted
    draft_share: float  # of the engine's step time, the proposer's
    num_aborted: int  # requests whose client cancelled or disconnected mid-way
    is_healthy: bool
    # Under speculative_policy adaptive (EngineStats): the step cost table, the engine's acceptance
    # per draft position, and the draft length the last step chose.
    step_costs: tuple[tuple[str, int, int, float], ...] = ()
    acceptance_rates: tuple[float, ...] = ()
    draft_length: int | None = None
    # A hybrid KV cache (EngineStats): blocks held per KV group, and chunked blocks given back.
    kv_blocks_by_group: tuple[tuple[str, int], ...] = ()
    num_released_kv_blocks: int = 0

    @classmethod
    def of(cls, engine: EngineStats, num_in_flight: int, num_aborted: int, is_healthy: bool) -> ReplicaStats:
        return cls(**dataclasses.asdict(engine), num_in_flight=num_in_flight, num_aborted=num_aborted,
                   is_healthy=is_healthy)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


@dataclass
class AcceptanceWatch:
    """The acceptance length of the last window_s seconds, from the cumulative per-position counts of
    a replica's stats, and whether it fell below min_acceptance_length. A draft that does not match
    its target (made for another one, or the target retrained) shows as acceptance near 1.0, nothing
    accepted, while each step still pays the draft's time. Judged once the window holds
    min_verify_steps verifications; min_acceptance_length 0 never judges."""
    min_acceptance_length: float
    window_s: float = 60.0
    min_verify_steps: int = 64
    snapshots: deque = field(default_factory=deque)  # (time, verifications, accepted drafts) so far

    def update(self, now: float, drafted_at: tuple[int, ...], accepted_at: tuple[int, ...]) -> float | None:
        """The window's acceptance length, or None while it holds too few verifications. Every
        verification proposes a first draft, so drafted_at[0] counts them."""
        self.snapshots.append((now, drafted_at[0] if drafted_at else 0, sum(accepted_at)))
        # Keep the newest snapshot at or before the window's start: the window's baseline.
        while len(self.snapshots) > 1 and self.snapshots[1][0] <= now - self.window_s:
            self.snapshots.popleft()
        _, first_steps, first_accepted = self.snapshots[0]
        _, steps, accepted = self.snapshots[-1]
        if steps - first_steps < max(self.min_verify_steps, 1):
            return None
        return acceptance_length(accepted - first_accepted, steps - first_steps)

    def is_low(self, recent: float | None) -> bool:
        return recent is not None and recent < self.min_acceptance_length


class ServingMetrics:
    def __init__(self, model_name: str, drafter: str | None = None, min_acceptance_length: float = 0.0):
        """drafter: named in the low-acceptance warning (SpeculativeConfig.describe: "eagle3 (<folder>)");
        min_acceptance_length: below it over the last minute the warning fires (0: never)."""
        from ray.util import metrics

        tags = ("model",)
        self.default_tags = {"model": model_name}
        self.model_name, self.drafter = model_name, drafter
        self.watch = AcceptanceWatch(min_acceptance_length)
        self.is_low = False
        self.counted_drafted: list[int] = []  # per position, what the counters hold so far
        self.counted_accepted: list[int] = []
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
        self.drafted = metrics.Counter("warpspec_spec_decode_draft_tokens_total",
                                       "Drafts proposed, by draft position (1: the first draft of a step).",
                                       tag_keys=("model", "position"))
        self.accepted = metrics.Counter("warpspec_spec_decode_accepted_tokens_total",
                                        "Drafts accepted, by draft position.", tag_keys=("model", "position"))
        self.draft_share = metrics.Gauge("warpspec_draft_time_share", "Of the engine's step time, the draft's.",
                                         tag_keys=tags)
        self.recent_acceptance = metrics.Gauge(
            "warpspec_recent_acceptance_length", "Acceptance length over the last minute (0 until judged).",
            tag_keys=tags)
        self.low_acceptance = metrics.Gauge(
            "warpspec_low_acceptance", "1 while the last minute's acceptance length is below min_acceptance_length.",
            tag_keys=tags)
        for metric in (self.ttft, self.tpot, self.acceptance, self.prompt_tokens, self.generation_tokens,
                       self.queue_depth, self.running, self.kv_usage, self.prefix_hit_rate, self.acceptance_mean,
                       self.constrained_acceptance, self.draft_share, self.recent_acceptance, self.low_acceptance):
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
        self.draft_share.set(stats.draft_share)
        self._count_positions(stats.drafted_at, self.counted_drafted, self.drafted)
        self._count_positions(stats.accepted_at, self.counted_accepted, self.accepted)
        self.record_acceptance(self.watch.update(time.monotonic(), stats.drafted_at, stats.accepted_at))

    def _count_positions(self, totals: tuple[int, ...], counted: list[int], counter) -> None:
        """Counters take increments; the stats hold totals: add what came since the last snapshot."""
        counted.extend([0] * (len(totals) - len(counted)))
        for position, total in enumerate(totals):
            if total > counted[position]:  # Ray counters refuse increments of 0
                counter.inc(total - counted[position], tags={**self.default_tags, "position": str(position + 1)})
                counted[position] = total

    def record_acceptance(self, recent: float | None) -> None:
        """The last minute's acceptance length; warns once each time it falls below the minimum."""
        self.recent_acceptance.set(recent or 0.0)
        is_low = self.watch.is_low(recent)
        if is_low and not self.is_low:
            logger.warning("acceptance length %.2f over the last %g s is below min_acceptance_length %g: is the "
                           "drafter %s made for the target %s? Each step pays for drafts it does not keep",
                           recent, self.watch.window_s, self.watch.min_acceptance_length, self.drafter,
                           self.model_name)
        self.is_low = is_low
        self.low_acceptance.set(int(is_low))
