"""One step format for prefill, decode and multi-token verification, and the auxiliary hidden states
EAGLE-3 reads."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_checkpoints import load_reference, make_text_checkpoint
from helpers.steps import build_step
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep, StepInput

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("runner"), attention_chunk_size=8, floor_scale=4,
                                interleave_moe_layer_step=2)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_step_equals_each_sequence_alone(checkpoint):
    """One step holding a 9-token prefill, a 4-token verification crossing a block boundary and a
    1-token decode gives every sequence the logits it gets when run by itself."""
    a, b, c = _tokens(1, 9), _tokens(2, 10), _tokens(3, 6)
    runner = ModelRunner(checkpoint, "float32", CacheConfig(block_size=BLOCK, num_blocks=32))
    assert runner.kv_layout.is_hybrid  # chunk 8: the chunked layers read from their chunk's start on
    tables = {"a": [0, 1, 2], "b": [3, 4, 5, 6], "c": [7, 8]}
    # Bring b (6 tokens) and c (5 tokens) into the cache first.
    runner.execute(build_step(runner, [SequenceStep(b[:6], 0, tables["b"], 5), SequenceStep(c[:5], 0, tables["c"], 4)]))
    mixed = runner.execute(build_step(runner, [SequenceStep(a, 0, tables["a"], 0),
                                               SequenceStep(b[6:], 6, tables["b"], 0),
                                               SequenceStep(c[5:], 5, tables["c"], 0)])).logits
    assert mixed.shape[0] == 9 + 4 + 1
    solo = ModelRunner(checkpoint, "float32", CacheConfig(block_size=BLOCK, num_blocks=32))
    expected = [solo.execute(build_step(solo, [SequenceStep(seq, 0, list(range(8)), 0)])).logits[-n:]
                for seq, n in ((a, 9), (b, 4), (c, 1))]
    torch.testing.assert_close(mixed, torch.cat(expected), atol=1e-4, rtol=1e-4)


def test_aux_hidden_states_are_the_streams_entering_those_layers(checkpoint):
    prompt = _tokens(4, 12)
    runner = ModelRunner(checkpoint, "float32", CacheConfig(block_size=BLOCK, num_blocks=8))
    out = runner.execute(build_step(runner, [SequenceStep(prompt, 0, [0, 1, 2], 11)], aux_layer_ids=[0, 2, 3]))
    reference = load_reference(checkpoint)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # transformers' hidden_states[i] is the input of layer i (hidden_states[0] the embeddings).
        expected = reference(ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states
    assert len(out.aux_hidden) == 3
    for got, layer_id in zip(out.aux_hidden, (0, 2, 3), strict=True):
        torch.testing.assert_close(got, expected[layer_id][0], atol=1e-5, rtol=1e-5)


def test_a_step_without_window_tables_is_refused_by_a_hybrid_cache(checkpoint):
    """Its chunked layers would write the full group's blocks in the tensor they share with it."""
    runner = ModelRunner(checkpoint, "float32", CacheConfig(block_size=BLOCK, num_blocks=8))
    with pytest.raises(ValueError, match="hybrid .*3 chunked KV groups.*no window tables"):
        runner.execute(StepInput.build([SequenceStep([5, 6], 0, [0], 0)], BLOCK))
