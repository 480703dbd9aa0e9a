"""The whole model with every op on its Triton kernel (interpreted on CPU) generates exactly what
Hugging Face transformers generates: the kernels compose, not just pass one by one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers.hf_checkpoints import load_reference, make_text_checkpoint, reference_greedy  # noqa: E402
from warpspec import LLM, SamplingParams  # noqa: E402


def test_greedy_through_triton_kernels_matches_transformers(tmp_path, monkeypatch):
    # MoE on every layer with QK-norm and 4:1 GQA, a layer of chunked attention of 8, then a NoPE
    # one, block size 4: prompts of 3 and 13 tokens cross blocks and chunks while decoding. Two
    # layers: the kernels run interpreted, and the time goes with the layers.
    path = make_text_checkpoint(tmp_path / "ckpt", num_hidden_layers=2, no_rope_layers=[1, 0],
                                interleave_moe_layer_step=1, use_qk_norm=True, attention_chunk_size=8,
                                floor_scale=4, attn_scale=0.5)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=gen).tolist() for n in (3, 13)]
    reference = load_reference(path)
    expected = [reference_greedy(reference, p, 12) for p in prompts]
    monkeypatch.setenv("WARPSPEC_KERNELS", "triton")
    import warpspec.kernels.triton.attention as triton_attention

    calls = []
    original = triton_attention.paged_attention_triton
    monkeypatch.setattr(triton_attention, "paged_attention_triton", lambda *a: calls.append(1) or original(*a))
    with LLM(str(path), dtype="float32", block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert calls, "the Triton attention kernel never ran"
    assert [o.token_ids for o in outs] == expected
