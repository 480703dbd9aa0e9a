"""Kept for one release: AsyncLLM now lives in warpspec.entrypoints.async_llm (the package layout
of issue 37). This path goes in the release after next."""

from warpspec.entrypoints.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
