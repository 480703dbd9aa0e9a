"""EAGLE-3 proposals: catch the draft up on the positions the target just verified, then run it
k - 1 more steps on its own output.

Position pairing (as in EAGLE and vLLM): the draft at position p reads the target's features at p
and the token at p + 1, and predicts the token at p + 2. With target tokens [a0 a1 a2] and a freshly
sampled a3: catch-up runs positions 0..2 on tokens [a1 a2 a3] and predicts d1 (for position 4) from
the last row; the next step runs position 3 on token d1 with the draft's own pre-norm output as the
feature, predicting d2; and so on. The draft's KV cache shares the target's block tables.
"""

from __future__ import annotations

import warnings

import torch

from warpspec.kernels import PagedAttentionMetadata
from warpspec.proposer import DraftRequest, Drafts
from warpspec.sampler import sample_from
from warpspec.workers.eagle3 import Eagle3Draft
from warpspec.workers.step import SequenceStep, StepInput


class CompiledWithFallback:
    """torch.compile of a tensors-in, tensors-out function; if compiling or running the compiled
    code fails, warn once and run the function eagerly from then on."""

    def __init__(self, fn, name: str):
        self.eager, self.name = fn, name
        self.compiled = torch.compile(fn, dynamic=True)
        self.failed = False

    def __call__(self, *args: torch.Tensor):
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception as error:  # noqa: BLE001 - any compiler failure means: run eagerly
                warnings.warn(f"torch.compile of {self.name} failed ({type(error).__name__}: {error}); "
                              "running it eagerly", stacklevel=2)
                self.failed = True
        return self.eager(*args)


class Eagle3Proposer:
    def __init__(self, draft: Eagle3Draft, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 compile: bool = True):
        c = draft.config
        self.device = torch.device(device)
        self.draft = draft.move_to(self.device)
        self.block_size = block_size
        self.aux_layer_ids = c.aux_layer_ids
        draft.kv_cache = torch.zeros(2, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                                     dtype=draft.fc.dtype, device=device)
        if compile:
            # The dense halves around attention take only tensors whose one varying size is the token
            # count, so one dynamic-shape graph serves every step.
            draft.before_attention = CompiledWithFallback(draft.before_attention, "the EAGLE-3 draft")
            draft.after_attention = CompiledWithFallback(draft.after_attention, "the EAGLE-3 draft")

    def _run(self, plan: list[SequenceStep], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = StepInput.build(plan, self.block_size).to(self.device)
        meta = PagedAttentionMetadata(step.query_start_loc, step.seq_lens, step.block_tables, self.block_size,
                                      step.max_query_len, step.max_seq_len)
        logits, prenorm = self.draft(step.input_ids, features, step.positions, step.slot_mapping, meta)
        return logits[step.logits_indices], prenorm[step.logits_indices]

    def _choose(self, logits: torch.Tensor, requests: list[DraftRequest]) -> tuple[list[int], torch.Tensor | None]:
        """Draft-vocab logits [n, draft_vocab] -> target token ids, and the target-vocab
        distributions they were drawn from (None when every request is greedy)."""
        if all(r.temperature == 0 for r in requests):
            return self.draft.to_target_ids(logits.argmax(dim=-1)).tolist(), None
        # Sampling happens on the CPU with per-request CPU generators (seeded requests reproduce on
        # any device); the distributions are a few thousand floats per request.
        logits = logits.float().cpu()
        temperature = torch.tensor([r.temperature or 1.0 for r in requests])
        draft_probs = (logits / temperature[:, None]).softmax(dim=-1)
        choice = sample_from(draft_probs, [r.generator for r in requests])
        greedy = torch.tensor([r.temperature == 0 for r in requests])
        choice = torch.where(greedy, logits.argmax(dim=-1), choice)
        target_vocab = self.draft.embed_tokens.shape[0]
        probs = torch.zeros(len(requests), target_vocab)
        probs.index_copy_(1, self.draft.to_target_ids(torch.arange(logits.shape[-1])).cpu(), draft_probs)
        return self.draft.to_target_ids(choice).tolist(), probs

    def release(self, request_ids: list[str]) -> None:
        pass  # no per-request state: the draft's KV lives in the request's own blocks

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], aux_hidden: list[torch.Tensor]) -> list[Drafts]:
        """aux_hidden: the step's captured hidden states (each [num_tokens, hidden])."""
        if not requests:
            return []
        features = torch.cat(aux_hidden, dim=-1).to(self.device, self.draft.fc.dtype)  # [num_tokens, 3 * hidden]
        plan = [SequenceStep(r.token_ids, r.first_position, r.block_table,
                             logits_from=r.num_positions - 1 if r.num_drafts else r.num_positions) for r in requests]
        rows = torch.cat([torch.arange(r.feature_start, r.feature_start + r.num_positions) for r in requests])
        logits, prenorm = self._run(plan, features[rows.to(self.device)])
        drafts = [Drafts([]) for _ in requests]
        active = [i for i, r in enumerate(requests) if r.num_drafts]
        probs_of: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step = 0
        while active:
            tokens, probs = self._choose(logits, [requests[i] for i in active])
            for row, (i, token) in enumerate(zip(active, tokens, strict=True)):
                drafts[i].token_ids.append(token)
                if probs is not None:
                    probs_of[i].append(probs[row])
            step += 1
            keep = [row for row, i in enumerate(active) if requests[i].num_drafts > step]
            if not keep:
                break
            active = [active[row] for row in keep]
            # Draft token j sits at position first_position + num_positions + j - 1.
            plan = [SequenceStep([drafts[i].token_ids[-1]], requests[i].first_position + requests[i].num_positions
                                 + step - 1, requests[i].block_table, 0) for i in active]
            logits, prenorm = self._run(plan, prenorm[keep])
        for i, probs in probs_of.items():
            if probs:
                drafts[i].probs = torch.stack(probs)
        return drafts
