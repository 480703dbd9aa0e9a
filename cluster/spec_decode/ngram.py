"""Prompt lookup (n-gram) drafts: a request's next tokens guessed from its own text, no draft model.

The last n tokens of the text so far (prompt and output) are looked up among the earlier ones, for n
from prompt_lookup_max down to prompt_lookup_min; the tokens that followed the latest occurrence of
the longest suffix found are the drafts. Text that repeats what came before (code being edited, a
JSON record filled in again, a quoted passage) then drafts runs the target accepts whole, and text
that does not drafts nothing: the step is a plain decode. A proposal is a few array comparisons per
request, microseconds beside a target step.

The drafts are deterministic, so rejection sampling reads them as drawn from a distribution with all
its mass on the draft (Drafts.probs None): a sampled request accepts draft x with probability p(x)
and keeps the target's distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from warpspec.spec_decode.proposer import DraftRequest, Drafts


def lookup(tokens: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """The drafts after tokens [length]: what followed the latest earlier occurrence of its longest
    suffix of min_n..max_n tokens, at most num_drafts of them. [a b c d a b] with n 2: the suffix
    [a b] occurred at 0..1 -> [c d a b][:num_drafts]; with min_n 3 nothing matches -> []."""
    length = len(tokens)
    # Earlier positions holding the last token: each is where an occurrence of the suffix could end.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) if length > 1 else np.empty(0, dtype=np.int64)
    best, n = None, 1
    while ends.size:
        if n >= min_n:
            best = int(ends[-1])  # the latest occurrence of the n-token suffix
        if n == max_n:
            break
        # One token longer: the occurrences whose token before also matches the suffix's.
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
        n += 1
    if best is None:
        return []
    return tokens[best + 1 : best + 1 + num_drafts].tolist()


class NgramProposer:
    aux_layer_ids: tuple[int, ...] = ()  # reads no target features

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        # Per request its text so far, grown as positions arrive: a long prompt is converted once,
        # not at every step. (buffer, length): the buffer is doubled when full.
        self.texts: dict[str, tuple[np.ndarray, int]] = {}

    def warm_up(self) -> None:
        """Nothing compiles; having it lets the engine time the target's steps at start-up with
        stand-in requests, as for a draft model (the proposals it times cost microseconds)."""

    def propose(self, requests: list[DraftRequest], aux_hidden: list[torch.Tensor]) -> list[Drafts]:
        proposals = []
        for r in requests:
            tokens = self._text(r)
            drafts = lookup(tokens, self.min_n, self.max_n, r.num_drafts) if r.num_drafts else []
            if drafts and r.grammar is not None:
                # The run the grammar allows from the request's last token (the matcher stays where it was).
                drafts = drafts[: r.grammar.validate_tokens(drafts)]
            proposals.append(Drafts(drafts))
        return proposals

    def _text(self, r: DraftRequest) -> np.ndarray:
        """The request's tokens through its last known one (position first_position + num_positions)."""
        known = r.first_position + r.num_positions + 1
        buffer, length = self.texts.get(r.request_id, (np.empty(0, dtype=np.int64), 0))
        length = min(length, known)  # known tokens never change; a recomputed request may restart earlier
        if known > buffer.shape[0]:
            grown = np.empty(max(known, 2 * buffer.shape[0]), dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:known] = r.context[length:known]
        self.texts[r.request_id] = (buffer, known)
        return buffer[:known]

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.texts.pop(request_id, None)
