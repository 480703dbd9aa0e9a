"""Part 3b of the GPU check: the EAGLE-3 draft a Maverick replica runs beside rank 0, timed.

A speculative step is not only the target's verification: the coordinator also runs the draft (one
Llama decoder layer at the target's width, unsharded, in bf16 as in NVIDIA's record setup) to
propose the next k tokens. Per step that is one catch-up forward over the k+1 positions just
verified (the accepted ones and the correction or bonus token) and k-1 forwards of one token each
(cluster/spec_decode/eagle3.py). The projection adds this time, and the engine's host time per step, to
the rank's.

The draft's widths are the published EAGLE-3 layout at Maverick's size; its MLP width and draft
vocabulary differ between published drafts, so both are parameters (defaults: Maverick's dense MLP
width, and the 32,000-token draft vocabulary of EAGLE-3's published Llama drafts: the draft's
lm_head over all 202,048 ids would read 2 GB per forward). Random weights: only the time matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from warpspec.benchmarks.maverick_rank import fill_random
from warpspec.benchmarks.timing import median_ms
from warpspec.kernels import PagedAttentionMetadata
from warpspec.workers.models.eagle3_draft import Eagle3Config, Eagle3Draft


@dataclass
class DraftShape:
    hidden: int = 5120
    heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 16384
    vocab: int = 202048
    draft_vocab: int = 32000
    context: int = 4096  # tokens already in the draft's KV cache of every sequence

    @classmethod
    def tiny(cls) -> DraftShape:
        return cls(hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=512, vocab=4096, draft_vocab=1024,
                   context=40)

    def config(self) -> Eagle3Config:
        return Eagle3Config(hidden_size=self.hidden, target_hidden_size=self.hidden, num_attention_heads=self.heads,
                            num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                            intermediate_size=self.intermediate, vocab_size=self.vocab,
                            draft_vocab_size=self.draft_vocab, rms_norm_eps=1e-5, rope_theta=500000.0,
                            aux_layer_ids=(1, 23, 44))


def build_draft(shape: DraftShape, device: torch.device, num_blocks: int, block_size: int,
                dtype=torch.bfloat16) -> Eagle3Draft:
    gen = torch.Generator(device=device).manual_seed(0)
    embed = torch.empty(shape.vocab, shape.hidden, dtype=dtype, device=device)
    with torch.device(device):
        draft = Eagle3Draft(shape.config(), embed, dtype)
    with torch.no_grad():
        fill_random("embed_tokens", embed, gen)
        for name, param in draft.named_parameters():
            fill_random(name, param, gen)
    draft.kv_cache = torch.zeros(2, num_blocks, block_size, shape.kv_heads, shape.head_dim, dtype=dtype,
                                 device=device)
    return draft.eval()


@torch.inference_mode()
def run_draft_simulation(shape: DraftShape, device: torch.device, repeats: int, num_speculative_tokens: int,
                         batches=(1, 8)) -> list[dict]:
    """Per batch: the catch-up forward (k+1 tokens a sequence), one single-token forward, and the
    draft's time per speculative step, catch-up + (k-1) single-token forwards, in ms."""
    k, block_size = num_speculative_tokens, 16
    blocks_per_seq = -(-(shape.context + 2 * (k + 1)) // block_size)
    draft = build_draft(shape, device, max(batches) * blocks_per_seq, block_size)
    rows = []
    for batch in batches:
        catch_up = _draft_inputs(shape, batch, k + 1, blocks_per_seq, block_size, device, draft.fc.dtype)
        one_token = _draft_inputs(shape, batch, 1, blocks_per_seq, block_size, device, draft.fc.dtype)
        catch_up_ms = median_ms(lambda i=catch_up: _propose(draft, i), device, repeats)
        step_ms = median_ms(lambda i=one_token: _propose(draft, i), device, repeats)
        rows.append({"batch": batch, "catch_up_ms": catch_up_ms, "single_token_ms": step_ms,
                     "draft_ms": catch_up_ms + (k - 1) * step_ms, "num_speculative_tokens": k})
    return rows


def _draft_inputs(shape: DraftShape, batch: int, query_len: int, blocks_per_seq: int, block_size: int,
                  device: torch.device, dtype: torch.dtype) -> tuple:
    """One draft forward's inputs: query_len new tokens for each of batch sequences with
    shape.context tokens cached. The catch-up reads the target's three hidden states through `fc`; a
    single-token step reads the draft's own previous output (hidden wide) and skips it."""
    num_tokens = batch * query_len
    seq_len = shape.context + query_len
    positions = torch.arange(shape.context, seq_len, device=device).repeat(batch)
    block_tables = torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    slot_mapping = (block_tables[:, :1].long() * block_size + positions.view(batch, query_len)).reshape(-1)
    query_start_loc = torch.arange(0, num_tokens + 1, query_len, device=device)
    meta = PagedAttentionMetadata(query_start_loc, torch.full((batch,), seq_len, device=device), block_tables,
                                  block_size, query_len, seq_len, num_tokens=num_tokens, is_uniform=True)
    width = 3 * shape.hidden if query_len > 1 else shape.hidden
    features = torch.zeros(num_tokens, width, dtype=dtype, device=device)
    token_ids = torch.full((num_tokens,), 7, device=device)
    return token_ids, features, positions, slot_mapping, meta


def _propose(draft: Eagle3Draft, inputs: tuple) -> torch.Tensor:
    """One draft forward and its greedy draft tokens (the argmax runs on the device, as in serving)."""
    logits, _ = draft(*inputs)
    return draft.to_target_ids(logits.max(dim=-1).indices)
