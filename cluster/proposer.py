"""The proposer interface of speculative decoding: after each target step, propose the next draft
tokens of every decoding sequence. EAGLE-3 is one implementation (eagle3_proposer.py); n-gram or
MTP proposers fit behind the same two methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from warpspec.sequence import Sequence


@dataclass
class DraftRequest:
    seq: Sequence
    first_position: int  # the first position the target computed (and kept) this step
    num_positions: int  # how many it computed and kept (rejected drafts excluded)
    features: torch.Tensor | None  # [num_positions, 3 * hidden]: their hidden states, if asked for
    num_drafts: int  # draft tokens wanted for the next step; 0 only brings the proposer's state up to date
    block_table: list[int]


class Proposer(Protocol):
    aux_layer_ids: tuple[int, ...]  # target layers whose entering hidden states the proposer reads

    def propose(self, requests: list[DraftRequest]) -> None:
        """Set seq.draft_token_ids (target ids) and, for sampled requests, seq.draft_probs
        ([num_drafts, target_vocab], the distributions the drafts were drawn from)."""
