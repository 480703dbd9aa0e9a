from __future__ import annotations

import torch

from warpspec.workers.step import SequenceStep, StepInput, StepOutput


def test_step_input_round_trips_through_msgpack():
    step = StepInput.build([SequenceStep([5, 6, 7], 0, [3], 2), SequenceStep([9], 17, [0, 4, 2, 8, 1], 0)], 4)
    back = StepInput.from_bytes(step.to_bytes())
    for name, value in vars(step).items():
        got = getattr(back, name)
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got, value), name
        else:
            assert got == value, name


def test_step_output_keeps_dtypes_including_bfloat16():
    out = StepOutput(torch.randn(2, 7), [torch.randn(3, 4).to(torch.bfloat16)], compute_s=0.25)
    back = StepOutput.from_bytes(out.to_bytes())
    assert torch.equal(back.logits, out.logits)
    assert back.aux_hidden[0].dtype == torch.bfloat16 and torch.equal(back.aux_hidden[0], out.aux_hidden[0])
    assert back.compute_s == 0.25
    assert StepOutput.from_bytes(StepOutput(None).to_bytes()).logits is None
