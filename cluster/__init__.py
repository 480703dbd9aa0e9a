"""warpspec: serving Llama 4 mixture-of-experts models (and dense Llama) with speculative decoding on Ray.

The public names load on first use, so that importing a submodule that needs no Ray (the kernels,
the GPU check run on a machine that has torch and Triton only) does not import Ray."""

import importlib

_PUBLIC = {
    "LLM": "warpspec.entrypoints.llm",
    "Logprob": "warpspec.outputs",
    "RequestOutput": "warpspec.outputs",
    "InvalidRequestError": "warpspec.errors",
    "SamplingParams": "warpspec.sampling_params",
    "CheckpointError": "warpspec.errors",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'warpspec' has no attribute {name!r}")
