from __future__ import annotations

import pytest

from warpspec import InvalidRequestError, SamplingParams


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=2.5), "max_tokens must be an integer, got 2.5"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be finite, got nan"),
    (dict(temperature="hot"), "temperature must be a number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-2), "top_k must be >= -1, got -2"),
    (dict(seed="42"), "seed must be an integer, got '42'"),
    (dict(seed=True), "seed must be an integer, got True"),
    (dict(stop=[""]), "stop strings must be non-empty strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be >= 0"),
    (dict(logprobs=21), "logprobs must be at most 20, got 21"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be >= 0"),
])
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(presence_penalty=3), r"presence_penalty must be in \[-2, 2\], got 3"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty must be finite"),
])
def test_penalty_bounds(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)
