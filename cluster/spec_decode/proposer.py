"""The proposer interface of speculative decoding: after each target step, bring the proposer up to
date on the positions the target kept and ask it for the next draft tokens of every decoding sequence.
Each drafter implements it in its own module (eagle3.py, ngram.py) and is named by one line of
methods.py. It runs beside the engine core, wherever the core runs (the caller's process with one
worker, the coordinator actor with Ray workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from warpspec.sample.keyed_random import KeyedRandom, Purpose

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass
class DraftRequest:
    request_id: str
    # The tokens at positions first_position + 1 ... first_position + num_positions: the draft reads the
    # target's features at p with the token at p + 1 (see eagle3.py).
    token_ids: list[int]
    first_position: int  # the first position the target computed (and kept) this step
    feature_start: int  # the row of first_position among the step's tokens (its aux hidden states)
    num_drafts: int  # draft tokens wanted for the next step; 0 only brings the proposer's state up to date
    block_table: list[int]
    temperature: float  # 0: greedy drafts
    random: KeyedRandom = field(repr=False)  # the request's own: seeded requests reproduce in any batch
    # Coupled verification (sample/rejection_sampler.py): propose with the noise the target samples with.
    coupled: bool = False
    # A structured output's matcher, after the request's last known token: drafts only what it allows
    # (and leave it where it was).
    grammar: LLMatcher | None = field(default=None, repr=False)
    # The request's tokens from position 0, through the last known one at least (a prompt's later
    # chunks may follow it): read during the call, never kept (the list is the engine's own).
    context: list[int] = field(default_factory=list, repr=False)

    @property
    def num_positions(self) -> int:
        return len(self.token_ids)

    def draft_generator(self, j: int) -> torch.Generator:
        """The generator draft j (0-based) is drawn with; it sits at position
        first_position + num_positions + 1 + j (the last token known is at first_position + num_positions)."""
        return self.random.generator(self.first_position + self.num_positions + 1 + j,
                                     Purpose.SAMPLE if self.coupled else Purpose.DRAFT)


@dataclass
class Drafts:
    token_ids: list[int]  # target vocabulary ids
    # [num_drafts, target_vocab] when sampled by rejection sampling's rules: what they were drawn from.
    # None: chosen greedily or by a deterministic rule (verification reads q as all on each draft).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    aux_layer_ids: tuple[int, ...]  # target layers whose entering hidden states the proposer reads

    def propose(self, requests: list[DraftRequest], aux_hidden: list[torch.Tensor]) -> list[Drafts]:
        """One Drafts per request, in order. aux_hidden: this step's captured hidden states, each
        [num_tokens, hidden] (empty when they stay where the proposer runs)."""

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state of finished or aborted requests."""
