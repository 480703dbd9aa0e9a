"""A request as it enters the engine: validated and tokenized where it arrives (the replica), then
sent to the engine core as a NewRequest, a plain value that crosses processes as it is."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from warpspec.config.engine import EngineConfig
from warpspec.errors import InvalidRequestError
from warpspec.sampling_params import SamplingParams
from warpspec.structured_output.grammar import GrammarCompiler
from warpspec.tokenizer import Tokenizer
from warpspec.workers.kv_groups import KVGroupLayout, kv_group_layout
from warpspec.workers.loader import resolve_dtype
from warpspec.workers.model_config import ModelConfig

Prompt = str | list[int]


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own, or one drawn from the engine's seed
    # When it arrived, by this process's perf_counter. Another process cannot read that clock: the
    # sender replaces it with waited_s, the seconds it had waited when sent (RayCoreClient.send).
    arrival_time: float = field(default_factory=time.perf_counter)
    waited_s: float | None = None

    def arrival_here(self) -> float:
        """The arrival time on this process's perf_counter."""
        return self.arrival_time if self.waited_s is None else time.perf_counter() - self.waited_s


class RequestValidator:
    """Refuses what the engine could never run, with a message naming the field and the limit, and
    tokenizes the rest. Runs wherever requests arrive, so a bad one never reaches the engine core: a
    structured output's grammar is compiled here once (and cached), so that one the grammar library
    refuses is refused by name before it is queued."""

    def __init__(self, tokenizer: Tokenizer | None, model: str, vocab_size: int, max_model_len: int,
                 num_kv_blocks: int, block_size: int, seed: int, eos_token_ids: list[int] | tuple[int, ...] = (),
                 has_draft: bool = False, kv_layout: KVGroupLayout | None = None, max_step_tokens: int = 0):
        """has_draft: the engine speculates with a draft model (a request may then ask for speculation).
        kv_layout, max_step_tokens: the KV groups a request's blocks come in (one group when None),
        and the most tokens a step runs (max_num_batched_tokens), which a chunked group holds at once."""
        self.tokenizer, self.model = tokenizer, model
        self.has_draft = has_draft
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.kv_layout, self.max_step_tokens = kv_layout, max_step_tokens
        self.seed_source = torch.Generator().manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The model's grammar compiler, built with the first structured request (~40 ms)."""
        if self.tokenizer is None:
            raise InvalidRequestError(f"structured_output needs the model's tokenizer; {self.model} has no "
                                      "tokenizer.json")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.hf.to_str(), self.vocab_size, self.eos_token_ids)
        return self._grammars

    def close(self) -> None:
        """Stop the grammar compiler's thread, if one was started."""
        if self._grammars is not None:
            self._grammars.close()

    def new_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> NewRequest:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.model} has no tokenizer.json: pass prompts as token ids")
            prompt_text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            prompt_text, prompt_ids = None, list(prompt)
            for t in prompt_ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise InvalidRequestError(f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens; max_model_len {self.max_model_len} "
                                      "leaves no room for output")
        longest = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        needs = ([-(-longest // self.block_size)] if self.kv_layout is None
                 else self.kv_layout.blocks_for(longest, self.block_size, self.max_step_tokens))
        if sum(needs) > self.num_kv_blocks:
            need = str(needs[0]) if self.kv_layout is None else self.kv_layout.describe_need(needs)
            raise InvalidRequestError(f"prompt + max_tokens needs {need} KV blocks but the cache has only "
                                      f"{self.num_kv_blocks}; lower max_tokens or grow the KV cache")
        if params.structured_output is not None:
            self.grammars.check(params.structured_output)
        if params.speculation and not self.has_draft:
            raise InvalidRequestError("speculation is true, but this engine has no draft model to speculate with "
                                      "(start it with a draft, or leave speculation out)")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seed_source))
        return NewRequest(request_id, prompt_text, prompt_ids, params, seed)


def resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """The engine's max_model_len: the model's limit unless a smaller one is asked for."""
    if requested is None:
        return max_position_embeddings
    if requested > max_position_embeddings:
        raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings "
                         f"{max_position_embeddings}")
    return requested


def check_kv_capacity(config: EngineConfig, model_config: ModelConfig) -> None:
    """Before any weight loads: a max_model_len asked for explicitly must fit one sequence in the KV
    cache, in every KV group at once (workers/kv_groups.py). Left to the model's own limit, a smaller
    cache stays allowed and a request that cannot fit is refused alone (RequestValidator)."""
    if config.max_model_len is None:
        return
    max_model_len = resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings)
    layout = kv_group_layout(model_config, config.cache.hybrid)
    needs = layout.blocks_for(max_model_len, config.cache.block_size, config.scheduler.max_num_batched_tokens)
    world_size, kv_heads = config.parallel.num_workers, model_config.num_key_value_heads
    num_kv_heads = kv_heads // world_size if kv_heads >= world_size else 1  # a rank's, as ModelRunner holds
    num_blocks = config.cache.resolve_num_blocks(model_config, num_kv_heads, resolve_dtype(config.dtype, model_config))
    if sum(needs) > num_blocks:
        source = ("num_kv_blocks" if config.cache.num_blocks is not None
                  else f"kv_cache_memory_gib {config.cache.memory_gib}")
        raise ValueError(f"max_model_len {max_model_len} needs {layout.describe_need(needs)} KV blocks for one "
                         f"sequence but the cache has {num_blocks} ({source}); lower max_model_len or grow the "
                         "KV cache")
