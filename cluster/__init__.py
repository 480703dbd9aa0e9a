"""warpspec: serving Llama 4 mixture-of-experts models with EAGLE-3 speculative decoding on Ray."""

from warpspec.llm import LLM
from warpspec.outputs import Logprob, RequestOutput
from warpspec.sampling_params import InvalidRequestError, SamplingParams
from warpspec.workers.errors import CheckpointError

__all__ = ["LLM", "CheckpointError", "InvalidRequestError", "Logprob", "RequestOutput", "SamplingParams"]
