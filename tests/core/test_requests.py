"""RequestValidator on its own, with no model: every request the engine could never run is refused
with the field and the limit named, and the rest become NewRequests with a seed of their own."""

import pytest

from warpspec import SamplingParams
from warpspec.core.requests import RequestValidator, resolve_max_model_len
from warpspec.errors import InvalidRequestError

VOCAB, MAX_LEN, BLOCKS, BLOCK = 100, 64, 6, 4  # 6 blocks of 4: at most 24 tokens a request


def validator(seed: int = 0) -> RequestValidator:
    return RequestValidator(None, "/models/ids-only", VOCAB, MAX_LEN, BLOCKS, BLOCK, seed)


@pytest.mark.parametrize("prompt,params,message", [
    ([1, 2], "greedy", "sampling params must be SamplingParams, got str"),
    ("hello", SamplingParams(), "/models/ids-only has no tokenizer.json: pass prompts as token ids"),
    ("", SamplingParams(), "prompt is empty"),
    ([], SamplingParams(), "prompt is empty"),
    ([1, VOCAB], SamplingParams(), r"prompt token id 100 is outside the vocabulary \[0, 100\)"),
    ([1, True], SamplingParams(), r"prompt token id True is outside the vocabulary"),
    ({"ids": [1]}, SamplingParams(), "prompt must be a string or a list of token ids, got dict"),
    (list(range(MAX_LEN)), SamplingParams(), "prompt has 64 tokens; max_model_len 64 leaves no room for output"),
    # 10 + 15 = 25 tokens -> 7 blocks of 4, one more than the cache holds.
    (list(range(10)), SamplingParams(max_tokens=15),
     r"prompt \+ max_tokens needs 7 KV blocks but the cache has only 6"),
])
def test_requests_the_engine_could_never_run_are_refused_naming_the_limit(prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        validator().new_request("r", prompt, params)


def test_a_valid_request_keeps_its_ids_and_its_own_seed_or_draws_one_from_the_engine_seed():
    fits = SamplingParams(max_tokens=14)  # 10 + 14 = 24 tokens: exactly 6 blocks
    request = validator().new_request("r", list(range(10)), fits)
    assert request.prompt is None and request.prompt_token_ids == list(range(10))
    assert validator().new_request("s", [1], SamplingParams(seed=7)).seed == 7
    # Drawn seeds follow the engine's seed: the same sequence for the same engine seed, another for another.
    def drawn(engine_seed: int) -> list[int]:
        same = validator(engine_seed)
        return [same.new_request(str(i), [1], SamplingParams()).seed for i in range(3)]

    assert drawn(1) == drawn(1) and len(set(drawn(1))) == 3 and drawn(2) != drawn(1)


def test_max_model_len_is_the_models_unless_a_smaller_one_is_asked_for():
    assert resolve_max_model_len(None, 4096) == 4096 and resolve_max_model_len(512, 4096) == 512
    with pytest.raises(ValueError, match="max_model_len 8192 exceeds the model's max_position_embeddings 4096"):
        resolve_max_model_len(8192, 4096)
