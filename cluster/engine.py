"""The engine loop: admit requests, run a step, sample, append, finish.

This is a simple batch scheduler: waiting requests are prefilled together as soon as the KV blocks
for their whole length (prompt + max_tokens) can be reserved, then all running sequences decode
together. Continuous batching with chunked prefill and preemption replaces the admission policy
in the engine issue; the runner interface (StepInput) already carries everything that needs.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from warpspec.block_manager import BlockManager
from warpspec.config import EngineConfig
from warpspec.errors import EngineError
from warpspec.executor import make_executor
from warpspec.outputs import RequestOutput
from warpspec.sampler import sample, top_logprobs
from warpspec.sampling_params import InvalidRequestError, SamplingParams
from warpspec.sequence import Sequence
from warpspec.tokenizer import IncrementalDetokenizer, Tokenizer
from warpspec.workers.step import SequenceStep, StepInput

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor = make_executor(config)
        self.model_config = self.executor.model_config
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.block_size = config.cache.block_size
        self.block_manager = BlockManager(self.executor.num_blocks, self.block_size)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.seed_source = torch.Generator().manual_seed(config.seed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return self.config.max_model_len

    # ---- requests -------------------------------------------------------------------------------

    def make_sequence(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Sequence:
        """Validate and tokenize a request without touching the batch."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.config.model} has no tokenizer.json: pass prompts as token ids")
            prompt_text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            prompt_text, prompt_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            for t in prompt_ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidRequestError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens; max_model_len {self.max_model_len} "
                                      "leaves no room for output")
        needed = self.block_manager.blocks_needed(self._reserved_tokens(len(prompt_ids), params))
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(f"prompt + max_tokens needs {needed} KV blocks but the cache has only "
                                      f"{self.block_manager.num_blocks}; lower max_tokens or grow the KV cache")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seed_source))
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        return Sequence(request_id, prompt_text, prompt_ids, params, torch.Generator().manual_seed(seed), detokenizer,
                        logprobs=[] if params.logprobs is not None else None)

    def add_sequence(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserved_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        return min(prompt_len + params.max_tokens, self.max_model_len)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns the requests that finished in it."""
        admitted = self._admit()
        seqs = admitted if admitted else list(self.running)
        if not seqs:
            return []
        plan = [self._plan(seq, is_prefill=bool(admitted)) for seq in seqs]
        step = StepInput.build(plan, self.block_size)
        try:
            logits = self.executor.execute(step).logits
        except EngineError:
            self._fail_all()
            raise
        # Each sequence's logits rows are consecutive; its last row predicts the next token.
        rows_per_seq = [len(p.token_ids) - p.logits_from for p in plan]
        last_rows = torch.tensor(rows_per_seq).cumsum(0) - 1
        if admitted:
            self._record_prompt_logprobs(seqs, logits, rows_per_seq)
        token_ids = sample(logits[last_rows], [s.params for s in seqs], [s.generator for s in seqs]).tolist()
        for seq, p in zip(seqs, plan, strict=True):
            seq.num_cached += len(p.token_ids)
        if any(s.params.logprobs is not None for s in seqs):
            self._record_logprobs(seqs, logits[last_rows], token_ids)
        finished = []
        now = time.perf_counter()
        for seq, token in zip(seqs, token_ids, strict=True):
            seq.first_token_time = seq.first_token_time or now
            self._append_token(seq, token)
            if seq.finish_reason is not None:
                finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self.block_manager.free(seq.request_id)
        return [seq.to_output() for seq in finished]

    def _fail_all(self) -> None:
        """The replica cannot run steps: drop every request and its blocks, so nothing waits forever."""
        for seq in [*self.running, *self.waiting]:
            self.block_manager.free(seq.request_id)
        self.running.clear()
        self.waiting.clear()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _admit(self) -> list[Sequence]:
        admitted = []
        max_seqs = self.config.scheduler.max_num_seqs
        while self.waiting and len(self.running) < max_seqs:
            seq = self.waiting[0]
            reserved = self._reserved_tokens(len(seq.prompt_token_ids), seq.params)
            if not self.block_manager.can_allocate(reserved):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq.request_id, reserved)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _plan(self, seq: Sequence, is_prefill: bool) -> SequenceStep:
        table = self.block_manager.block_tables[seq.request_id]
        if is_prefill:
            wants_prompt_logprobs = seq.params.prompt_logprobs is not None
            ids = seq.prompt_token_ids
            return SequenceStep(ids, 0, table, logits_from=0 if wants_prompt_logprobs else len(ids) - 1)
        return SequenceStep([seq.last_token_id], seq.num_cached, table, logits_from=0)

    # ---- bookkeeping after sampling -------------------------------------------------------------

    def _decode_token(self, token_id: int) -> str | None:
        return self.tokenizer.token_text(token_id) if self.tokenizer else None

    def _record_prompt_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, rows_per_seq: list[int]) -> None:
        start = 0
        for seq, rows in zip(seqs, rows_per_seq, strict=True):
            if seq.params.prompt_logprobs is not None:
                # Row i predicts prompt token i + 1; the last row predicts the first output token.
                logprobs = torch.log_softmax(logits[start : start + rows - 1], dim=-1)
                seq.prompt_logprobs = [None] + top_logprobs(
                    logprobs, seq.prompt_token_ids[1:], seq.params.prompt_logprobs, self._decode_token)
            start += rows

    def _record_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, token_ids: list[int]) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        for row, seq in enumerate(seqs):
            if seq.params.logprobs is not None:
                seq.logprobs.extend(top_logprobs(logprobs[row : row + 1], [token_ids[row]],
                                                 seq.params.logprobs, self._decode_token))

    def _append_token(self, seq: Sequence, token: int) -> None:
        params = seq.params
        seq.output_token_ids.append(token)
        if seq.detokenizer is not None:
            previous_len = len(seq.text)
            seq.text += seq.detokenizer.add([token])
            if self._check_stop_strings(seq, previous_len):
                return
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.finish("stop", token)
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length")
        if seq.finish_reason is not None and seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()
            self._check_stop_strings(seq, previous_len)

    def _check_stop_strings(self, seq: Sequence, previous_len: int) -> bool:
        """Finish seq if its text now contains a stop string; the text is cut before it."""
        for stop in seq.params.stop:
            # Only a match that overlaps the new text is new: search from len(stop) - 1 chars back.
            at = seq.text.find(stop, max(0, previous_len - len(stop) + 1))
            if at != -1:
                seq.text = seq.text[:at]
                seq.finish("stop", stop)
                return True
        return False
