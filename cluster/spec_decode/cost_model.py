"""What a step costs on this machine: the figures each step's draft length is chosen from
(draft_length.py).

Four tables of seconds, each keyed by (number of sequences, length):
- target: uniform steps, every sequence running `length` new tokens (1: a decode, k + 1: a
  verification of k drafts), which run compiled or as CUDA graphs;
- mixed: steps of decodes and verifications of different lengths, `length` the longest, which run
  eagerly and cost more;
- draft: the proposer's work after a step, `length` drafts per request (0: the draft only reads the
  positions the target kept);
- host: the rest of a step (scheduling, sampling or verification, bookkeeping), `length` its longest
  share as for target: plain decoding pays it per step too, and so per token more often. Learnt
  from real steps only. Without it the bundled pair at batch 32 read as 1.06x faster with drafts; it
  was 1.25x. Its length matters: there a verification's took 1.17 ms against 0.63 for a plain
  decode's (medians of 96 and 381 steps), and one figure for both, learnt mostly from verifications,
  read plain decoding 9% slower than it was. A length not seen yet reads the nearest one's figure.

At warm-up the engine times the shapes it will serve (core/speculation.py, time_steps); then every real step
of a known shape moves its entry towards what it took, so the table follows the contexts that grow,
the other processes on the machine and the clocks. An entry observed at every step moves ALPHA of
the way; one last observed n steps ago (`advance` counts them) moves 1 - (1 - ALPHA)^n, at most
MAX_WEIGHT (one step is noisy): its figure is as stale as the steps that would have moved it.
Without that, when one length ran for a stretch its entry followed the growing contexts while the
other length's kept what it read long before: at batch 64 on the bundled pair target(64, 4) still
read its warm-up figure, 22.4 ms, after a hundred plain steps had moved target(64, 1) from 6.3 to
9.5 ms (draft_length.py runs such a length again now and then: REFRESH_STEPS).

A batch size with no entry reads between its two nearest neighbours (linearly), or past the largest
rising along the slope from the entry at half its size or below (never falling):

    target {(8, 4): 10 ms, (16, 4): 18 ms} -> (12, 4): 14 ms, (32, 4): 34 ms
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

ALPHA = 0.1  # a step's weight in its entry: the last ~10 steps of a shape dominate
MAX_STEP_RATIO = 2.0
MAX_WEIGHT = 0.5  # the most one step moves a stale figure


def _interpolate(points: dict[int, float], x: int, extrapolate: bool = True) -> float | None:
    """The value at x of the piecewise-linear curve through points {x: y}; flat below the smallest x;
    above the largest, rising along the slope from the point at half its x or below (never falling:
    a step of more sequences never costs less, and the slope between two neighbours is mostly noise);
    None without points, or outside them when not extrapolate."""
    if not points:
        return None
    if x in points:
        return points[x]
    xs = sorted(points)
    if not extrapolate and not xs[0] < x < xs[-1]:
        return None
    if x < xs[0]:
        return points[xs[0]]
    if x > xs[-1]:
        last = xs[-1]
        base = max((p for p in xs if p <= last // 2), default=xs[0])
        slope = (points[last] - points[base]) / (last - base) if last > base else points[last] / last
        return points[last] + max(0.0, slope) * (x - last)
    i = bisect.bisect(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


@dataclass
class StepCostModel:
    target: dict[tuple[int, int], float] = field(default_factory=dict)
    mixed: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[tuple[int, int], float] = field(default_factory=dict)
    host: dict[tuple[int, int], float] = field(default_factory=dict)
    steps: int = 0  # steps so far (advance)
    observed_at: dict[tuple[str, int, int], int] = field(default_factory=dict)  # (table, entry) -> steps then

    def target_time(self, num_seqs: int, query_len: int) -> float | None:
        return self._estimate(self.target, num_seqs, query_len)

    def mixed_time(self, num_seqs: int, max_query_len: int) -> float | None:
        """A mixed step never seen reads as a uniform one of its longest length: a lower bound."""
        seen = self._estimate(self.mixed, num_seqs, max_query_len)
        return seen if seen is not None else self.target_time(num_seqs, max_query_len)

    def draft_time(self, num_seqs: int, num_drafts: int) -> float | None:
        return self._estimate(self.draft, num_seqs, num_drafts)

    def host_time(self, num_seqs: int, query_len: int) -> float | None:
        """The rest of a step whose longest share is query_len tokens; before any such step, that of
        the nearest length seen (a plain decode's reads a verification's until one has run)."""
        seen = sorted({q for _, q in self.host}, key=lambda q: (abs(q - query_len), q))
        return self._estimate(self.host, num_seqs, seen[0]) if seen else None

    def set(self, step: str, num_seqs: int, length: int, seconds: float) -> None:
        """A figure timed at warm-up, taken as it is: step is "target", "mixed" or "draft"."""
        getattr(self, step)[num_seqs, length] = seconds
        self.observed_at[step, num_seqs, length] = self.steps

    def advance(self) -> None:
        """One step ran (the engine calls this once a step, whatever the step was)."""
        self.steps += 1

    def observe_target(self, num_seqs: int, query_len: int, seconds: float) -> None:
        before = self._estimate(self.target, num_seqs, query_len, extrapolate=False)
        self._observe("target", num_seqs, query_len, seconds, before)

    def observe_mixed(self, num_seqs: int, max_query_len: int, seconds: float) -> None:
        self._observe("mixed", num_seqs, max_query_len, seconds, self.mixed_time(num_seqs, max_query_len))

    def observe_draft(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        before = self._estimate(self.draft, num_seqs, num_drafts, extrapolate=False)
        self._observe("draft", num_seqs, num_drafts, seconds, before)

    def observe_host(self, num_seqs: int, query_len: int, seconds: float) -> None:
        before = self._estimate(self.host, num_seqs, query_len, extrapolate=False)
        self._observe("host", num_seqs, query_len, seconds, before)

    def rows(self) -> list[dict[str, float | int | str]]:
        """The table, one row per entry in milliseconds: stats(), /admin/stats, `warpspec bench dispatch`."""
        return [{"step": step, "num_seqs": num_seqs, "length": length, "ms": round(seconds * 1e3, 4)}
                for step, table in (("target", self.target), ("mixed", self.mixed), ("draft", self.draft),
                                    ("host", self.host))
                for (num_seqs, length), seconds in sorted(table.items())]

    @staticmethod
    def _estimate(table: dict[tuple[int, int], float], num_seqs: int, length: int,
                  extrapolate: bool = True) -> float | None:
        return _interpolate({n: s for (n, q), s in table.items() if q == length}, num_seqs, extrapolate)

    def _observe(self, step: str, num_seqs: int, length: int, seconds: float, before: float | None) -> None:
        """before: the figure so far, read between the entry's neighbours when it is new (a new entry
        past them starts from the step itself: a slope carried that far is a guess). The step's weight
        is ALPHA, or more for an entry not observed for several steps (the module's docstring). A step
        counts as at most MAX_STEP_RATIO times the figure: one slow step (the draft's KV cache growing,
        a page fault) does not become it, while a machine that really slowed down moves it ~10% a step."""
        table, seconds = getattr(self, step), max(seconds, 0.0)
        if before is None or before <= 0:
            table[num_seqs, length] = seconds
        else:
            last = self.observed_at.get((step, num_seqs, length), self.steps - 1)
            weight = min(MAX_WEIGHT, 1.0 - (1.0 - ALPHA) ** max(1, self.steps - last))
            table[num_seqs, length] = before + weight * (min(seconds, MAX_STEP_RATIO * before) - before)
        self.observed_at[step, num_seqs, length] = self.steps
