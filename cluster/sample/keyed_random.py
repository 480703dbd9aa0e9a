"""A request's randomness, keyed by (seed, absolute position, purpose) instead of by how much was
drawn before.

A generator that is consumed draw after draw makes a seeded request's tokens depend on its history
of steps: a preemption that recomputes it, or a step that verified fewer drafts, shifts every later
draw. Here each draw gets a fresh torch.Generator seeded with a hash of its key, in the way a
counter-based generator (Philox) is indexed: the noise that picks the token at position 57 is the
same whatever ran before it and whatever shares its batch.

Rejection sampling stays lossless: a position's draws decide its token once. Draws made for a
position in a step that never decided it (drafts after a rejection) revealed nothing about the
emitted tokens, so reusing them when the position comes round again keeps them fresh.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import IntEnum

import torch


class Purpose(IntEnum):
    # The token at a position drawn from the target's distribution: plain sampling, the bonus token
    # after every draft was accepted, and, under coupled verification, the draft's proposal too.
    SAMPLE = 0
    DRAFT = 1  # the draft's proposal at a position (rejection sampling)
    ACCEPT = 2  # the uniform that accepts or rejects the draft at a position
    RESIDUAL = 3  # the correction drawn from normalise(max(0, p - q)) after a rejection


@dataclass(frozen=True)
class KeyedRandom:
    seed: int

    def generator(self, position: int, purpose: Purpose) -> torch.Generator:
        """A generator for the draw at (position, purpose): seed 7, position 57, SAMPLE always gives
        the same stream."""
        key = b"".join(value.to_bytes(8, "little") for value in (self.seed, position, int(purpose)))
        digest = hashlib.blake2b(key, digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little"))
