"""Speculative decoding figures: engine-wide (SpeculationStats) and per request (speculation_metrics),
with the one definition of acceptance length both use."""

from __future__ import annotations

from dataclasses import dataclass, field


def acceptance_length(num_accepted_tokens: int, num_verify_steps: int) -> float:
    """Mean tokens gained per verifying step: accepted drafts plus the one bonus/correction (0 without
    any). 2 steps accepting 3 and 1 of their drafts: (4 + 2) / 2 = 3.0."""
    return (num_accepted_tokens + num_verify_steps) / num_verify_steps if num_verify_steps else 0.0


def speculation_metrics(num_verify_steps: int, num_draft_tokens: int, num_accepted_tokens: int) -> dict[str, float]:
    """A request's speculation entries of RequestOutput.metrics; none when no step of it verified drafts."""
    if not num_verify_steps:
        return {}
    return {"acceptance_length": acceptance_length(num_accepted_tokens, num_verify_steps),
            "draft_tokens": num_draft_tokens, "accepted_draft_tokens": num_accepted_tokens}


@dataclass
class SpeculationStats:
    num_verify_steps: int = 0  # sequence-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_at: dict[int, int] = field(default_factory=dict)  # draft position -> times proposed
    accepted_at: dict[int, int] = field(default_factory=dict)  # draft position -> times accepted
    step_time_s: float = 0.0  # engine steps, in all
    draft_time_s: float = 0.0  # of which the proposer
    # Of the verify steps and accepted drafts, those of requests with a structured output: acceptance
    # under a grammar, reported beside acceptance without one.
    num_constrained_verify_steps: int = 0
    num_constrained_accepted_tokens: int = 0

    @property
    def draft_share(self) -> float:
        return self.draft_time_s / self.step_time_s if self.step_time_s else 0.0

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.num_accepted_tokens, self.num_verify_steps)

    @property
    def constrained_acceptance_length(self) -> float:
        """Over requests with a structured output only."""
        return acceptance_length(self.num_constrained_accepted_tokens, self.num_constrained_verify_steps)

    @property
    def free_acceptance_length(self) -> float:
        """Over requests without a structured output."""
        return acceptance_length(self.num_accepted_tokens - self.num_constrained_accepted_tokens,
                                 self.num_verify_steps - self.num_constrained_verify_steps)

    def acceptance_rate_at(self) -> list[float]:
        return [self.accepted_at.get(i, 0) / n for i, n in sorted(self.proposed_at.items())]

    def since(self, earlier: SpeculationStats) -> SpeculationStats:
        """What was counted after `earlier`, a copy taken before (copy.deepcopy): a measurement's own figures."""
        return SpeculationStats(
            self.num_verify_steps - earlier.num_verify_steps, self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            {i: n - earlier.proposed_at.get(i, 0) for i, n in self.proposed_at.items()},
            {i: n - earlier.accepted_at.get(i, 0) for i, n in self.accepted_at.items()},
            self.step_time_s - earlier.step_time_s, self.draft_time_s - earlier.draft_time_s,
            self.num_constrained_verify_steps - earlier.num_constrained_verify_steps,
            self.num_constrained_accepted_tokens - earlier.num_constrained_accepted_tokens)
