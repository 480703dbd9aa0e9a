"""Checkpoints warpspec writes are real Hugging Face checkpoints: transformers loads them and agrees."""

from __future__ import annotations

import torch

from helpers.hf_checkpoints import load_reference, reference_logprobs
from warpspec import LLM, SamplingParams
from warpspec.training.random_checkpoint import create_random_checkpoint


def test_transformers_loads_what_warpspec_writes(tmp_path):
    path = create_random_checkpoint(tmp_path / "ckpt", "tiny", std=0.3)
    reference = load_reference(path)  # raises on any missing or unexpected tensor
    prompt = [1, 17, 200, 33, 90, 4, 511, 8]
    expected = reference_logprobs(reference, prompt)
    with LLM(str(path), dtype="float32") as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
