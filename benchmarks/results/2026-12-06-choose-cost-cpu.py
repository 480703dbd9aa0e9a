"""What the adaptive draft-length policy's choice costs the host a step, timed alone: a cost table shaped
like an engine's after its start-up timing (batch sizes 1-64, lengths 0 and 3), every request wanting 3
drafts, timeit over 5,000 calls per batch size.

    python benchmarks/results/2026-12-06-choose-cost-cpu.py
"""

import timeit

from warpspec.spec_decode.cost_model import StepCostModel
from warpspec.spec_decode.draft_length import AcceptanceEstimate, DraftLengthPolicy, DraftWant

CALLS = 5000

costs = StepCostModel()
for b in (1, 2, 4, 8, 16, 32, 64):
    for q in (1, 4):
        costs.set("target", b, q, 0.001 * (1 + b / 8) * (1 + (q > 1)))
        costs.observe_host(b, q, 0.0002)
    costs.set("draft", b, 0, 0.00003 * b)
    costs.set("draft", b, 3, 0.001 * (1 + b / 16))
for batch in (2, 8, 64):
    policy = DraftLengthPolicy(3, (0, 3), costs, adaptive=True, padded=True)
    policy.num_observed = 100  # past MIN_OBSERVED: the choice is made by rate
    policy.acceptance = AcceptanceEstimate([0.9, 0.8, 0.7])
    wants = [DraftWant(3, policy.new_estimate()) for _ in range(batch)]
    seconds = timeit.timeit(lambda wants=wants, policy=policy: policy.choose(wants), number=CALLS) / CALLS
    print(f"batch {batch}: choose {seconds * 1e6:.1f} us a step, chose k = {policy.last_choice}")
