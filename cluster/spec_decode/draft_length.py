"""How many drafts each request verifies at the next step: 0 .. k, chosen from what steps cost here
and how often drafts are accepted, so that speculation never makes the batch slower.

A request gains E_i(n) tokens from a step that verifies n of its drafts, and the step costs the
target's verification plus the draft's proposals (cost_model.py, measured):

    E_i(n) = 1 + r_i[0] + ... + r_i[n - 1]
    rate(k) = sum_i E_i(n_i) / (T_target(b, k + 1) + T_draft(b, k) + T_host(b, k + 1)),  n_i = min(k, most_i)

r_i[j] is the chance that draft j + 1 is accepted, every draft before it accepted too: a moving
estimate per request, started from the engine-wide estimate and updated by its own verifications.
The step takes the k of the largest rate, among the lengths whose steps run compiled or as CUDA
graphs (the engine's query lengths less one: 0 and k_max; an eager engine tries every length).
k = 0 is a plain decode; the draft then reads what the target kept once every 128 positions (a
prompt at once: the prefix cache shares only blocks the draft has read). A draft length chosen last
stays unless plain decoding beats it by SWITCH_MARGIN. A length that has not run for REFRESH_STEPS
steps runs once when the model puts it within REFRESH_MARGIN of the best: only a length that runs
keeps its figures current (cost_model.py), and a stale figure that reads too dear would otherwise
never run again to be corrected. Worked example, b = 32, host time aside: T_target(32, 1) = 9 ms,
T_target(32, 4) = 19 ms, T_draft(32, 0) = 1 ms, T_draft(32, 3) = 4 ms, r = [0.8, 0.6, 0.4]: rate(0) =
32 / 10 ms = 3.2 tokens/ms, rate(3) = 32 x 2.8 / 23 ms = 3.9: draft.

A request that cannot take k drafts (near max_tokens, with penalties, opted out) takes fewer and
the step becomes a mixed one, costed as such. Seeded sampled requests verified by rejection
sampling take as many as they can at every step, whatever the others do: their tokens depend on
how many drafts each step verified, and a length chosen from timings would make them depend on the
crowd and on the machine (the crowd-invariance of issue 21). Gumbel-max coupling would free them
(its tokens do not depend on the length), but it accepted 16% fewer drafts at temperature 1.0
(benchmarks/results/2026-12-01-seeded-speculation-cpu.md); with coupled_verification on, they are
chosen for like any other request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The engine-wide estimate follows the last ~500 verifications (after the first 500, averaged): the
# requests' prior, and what a request that stopped drafting relaxes to. At 0.02 (~50, less than one
# step at batch 64) it froze at whatever step came before a stretch of plain decoding, and plain is
# chosen after low ones: at the end of runs at batch 64 it read 3.03 and 2.76 tokens a verification
# where the runs realised 3.40-3.44; at 0.002, 3.47-3.48.
ENGINE_ALPHA = 0.002
REQUEST_ALPHA = 0.2  # a request's own follows its last few verifications
# A request that drafts nothing learns nothing: each such step moves its estimate this far back towards
# the engine's, so a bad stretch does not stop its speculation for good.
RELAX = 0.1
MIN_OBSERVED = 16  # verifications before the engine-wide estimate is trusted: until then every step drafts k
# Plain decoding must beat the draft length chosen last by this much to replace it: drafting again
# after plain steps catches the draft up on them in one eager call, which the model does not hold.
# With the host time in the model it took the bundled pair at batch 32 (where k = 3 beat plain
# decoding by 1.2x) from 0.89x to 0.99x fixed k = 3 (one sitting each). A switch back to drafting
# needs none: a plain step's costs are all in the model.
SWITCH_MARGIN = 0.1
# A length not run for REFRESH_STEPS steps whose modelled rate is within REFRESH_MARGIN of the best
# runs for one step, so that its figures follow the contexts and the machine too. At most one step in
# REFRESH_STEPS is slower than the best by the model, and by less than REFRESH_MARGIN: ~0.5% at most.
REFRESH_STEPS = 32
REFRESH_MARGIN = 0.15


@dataclass
class AcceptanceEstimate:
    rates: list[float]  # [k] the chance draft j + 1 is accepted
    counts: list[int] = field(default_factory=list)  # [k] verifications that reached position j

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * len(self.rates)

    def expected_tokens(self, num_drafts: int) -> float:
        return 1.0 + sum(self.rates[:num_drafts])

    def observe(self, num_drafts: int, num_accepted: int, alpha: float, average_first: bool = False) -> None:
        """One verification of num_drafts drafts, num_accepted of them accepted. average_first: weigh
        the first 1 / alpha observations equally (a plain mean), then move alpha of the way."""
        for j in range(min(num_drafts, len(self.rates))):
            self.counts[j] += 1
            weight = max(alpha, 1.0 / self.counts[j]) if average_first else alpha
            self.rates[j] += weight * (float(j < num_accepted) - self.rates[j])

    def relax(self, towards: AcceptanceEstimate, weight: float) -> None:
        self.rates = [r + weight * (t - r) for r, t in zip(self.rates, towards.rates, strict=True)]

    def copy(self) -> AcceptanceEstimate:
        return AcceptanceEstimate(list(self.rates))


@dataclass
class DraftWant:
    """One request that will sample at the next step."""
    most: int  # drafts it may take (0: none)
    acceptance: AcceptanceEstimate
    fixed: bool = False  # takes `most` whatever the step chooses


class DraftLengthPolicy:
    def __init__(self, max_drafts: int, lengths: tuple[int, ...], costs, adaptive: bool = True, padded: bool = False):
        """lengths: the draft lengths a step may choose from (0 and max_drafts where steps are
        compiled; every one otherwise). costs: the engine's StepCostModel. adaptive False: every
        request takes as many drafts as it may (speculative_policy fixed). padded: shorter
        verifications are padded to the step's length (compiled steps), so a step costs what a
        uniform one of its longest length does."""
        self.padded = padded
        self.max_drafts = max_drafts
        self.lengths = tuple(sorted(set(lengths) | {max_drafts}))
        self.costs = costs
        self.adaptive = adaptive
        self.acceptance = AcceptanceEstimate([0.0] * max_drafts)  # engine-wide
        self.num_observed = 0
        self.last_choice: int | None = None  # the step-wide length chosen last (None: not chosen by rate)
        self.num_chosen: dict[int, int] = {}  # step-wide length -> steps that ran it (by rate, or a refresh)
        self.incumbent: int | None = None  # the length chosen last, kept unless another wins by SWITCH_MARGIN
        self.num_steps = 0  # steps chosen for by rate
        self.last_run: dict[int, int] = {}  # step-wide length -> the step it last ran (none: the first)
        self.num_refreshes = 0  # steps that ran a stale length (REFRESH_STEPS)

    def new_estimate(self) -> AcceptanceEstimate:
        """A request's own estimate, started from the engine's."""
        return self.acceptance.copy()

    def observe(self, request: AcceptanceEstimate, num_drafts: int, num_accepted: int) -> None:
        self.num_observed += 1
        self.acceptance.observe(num_drafts, num_accepted, ENGINE_ALPHA, average_first=True)
        request.observe(num_drafts, num_accepted, REQUEST_ALPHA)

    def choose(self, wants: list[DraftWant]) -> list[int]:
        """Drafts per request for the next step, in order."""
        self.last_choice = None
        most = [w.most for w in wants]
        if not self.adaptive or not wants or self.num_observed < MIN_OBSERVED:
            return most
        counts_of, rates = {}, {}
        for k in self.lengths:
            counts_of[k] = [w.most if w.fixed else min(k, w.most) for w in wants]
            rates[k] = self.tokens_per_s(wants, counts_of[k])
            if rates[k] is None:  # a shape never timed: draft as many as may be, as a fixed policy would
                return most
        # Ties go to the shorter length, tried first: the same rate for less work.
        chosen = max(self.lengths, key=lambda k: rates[k] * (1 + SWITCH_MARGIN if k == self.incumbent and k else 1))
        self.incumbent = chosen
        self.num_steps += 1
        stale = [k for k in self.lengths if k != chosen and rates[k] >= (1 - REFRESH_MARGIN) * rates[chosen]
                 and self.num_steps - self.last_run.get(k, 0) >= REFRESH_STEPS]
        if stale:
            chosen = min(stale, key=lambda k: self.last_run.get(k, 0))  # the longest unrun
            self.num_refreshes += 1
        self.last_run[chosen] = self.num_steps
        self.last_choice, best = chosen, counts_of[chosen]
        self.num_chosen[chosen] = self.num_chosen.get(chosen, 0) + 1
        for want, count in zip(wants, best, strict=True):
            if count == 0 and want.most:
                want.acceptance.relax(self.acceptance, RELAX)
        return best

    def tokens_per_s(self, wants: list[DraftWant], counts: list[int]) -> float | None:
        """The modelled rate of a step where request i verifies counts[i] drafts."""
        num_seqs, longest = len(counts), max(counts)
        # The engine pads shorter verifications to a compiled length (Scheduler.pad_to_compiled).
        uniform = min(counts) == longest or (self.padded and longest in self.lengths)
        target = (self.costs.target_time(num_seqs, longest + 1) if uniform
                  else self.costs.mixed_time(num_seqs, longest + 1))
        draft = self.costs.draft_time(num_seqs, longest)
        if target is None or draft is None:
            return None
        host = self.costs.host_time(num_seqs, longest + 1) or 0.0  # learnt from real steps: none before the first
        tokens = sum(w.acceptance.expected_tokens(n) for w, n in zip(wants, counts, strict=True))
        return tokens / max(target + draft + host, 1e-9)
