"""The engine as the replica sees it when the engine core runs in the coordinator actor (Ray workers).

Same surface as LLMEngine for LLM and AsyncLLM (make_sequence, add_sequence, abort, has_unfinished,
step, stats), but a step is one call: the requests added and aborted since the last step go to the
coordinator, which schedules, runs the workers, samples or verifies beside rank 0's logits, drafts,
and answers with each request's new tokens (core_messages.py). Requests are validated and tokenized
here, so a bad one never reaches the core; OutputAssembler rebuilds full outputs from the deltas.
"""

from __future__ import annotations

import dataclasses
import time

from warpspec.config import EngineConfig
from warpspec.core_messages import RequestDelta
from warpspec.engine_stats import EngineStats
from warpspec.errors import EngineError, StepFailedError
from warpspec.outputs import RequestOutput
from warpspec.requests import NewRequest, Prompt, RequestValidator, resolve_max_model_len
from warpspec.sampling_params import InvalidRequestError, SamplingParams
from warpspec.spec_stats import SpeculationStats
from warpspec.tokenizer import Tokenizer


class OutputAssembler:
    """One request's output, grown from the core's deltas: [5] + [7, 9] -> token_ids [5, 7, 9]."""

    def __init__(self, request: NewRequest):
        self.output = RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, "", [], None,
                                    logprobs=[] if request.params.logprobs is not None else None)

    def add(self, delta: RequestDelta) -> RequestOutput:
        out = self.output
        out.token_ids = out.token_ids + delta.new_token_ids
        out.text = delta.text if delta.text is not None else out.text + delta.new_text
        if delta.new_logprobs is not None and out.logprobs is not None:
            out.logprobs = out.logprobs + delta.new_logprobs
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        out.finish_reason, out.stop_reason, out.metrics = delta.finish_reason, delta.stop_reason, delta.metrics
        # A fresh object per step: a consumer may hold the previous one.
        return dataclasses.replace(out, new_token_ids=delta.new_token_ids, new_text=delta.new_text)


class RemoteEngine:
    def __init__(self, config: EngineConfig):
        from warpspec.ray_executor import RayExecutor

        self.config = config
        self.executor = RayExecutor(config)
        self.model_config = self.executor.model_config
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.model_config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.validator = RequestValidator(self.tokenizer, config.model, self.model_config.vocab_size,
                                          self.max_model_len, self.executor.num_blocks, config.cache.block_size,
                                          config.seed)
        self.requests: dict[str, OutputAssembler] = {}  # added and not yet finished or aborted
        self.pending_adds: list[NewRequest] = []  # not yet sent to the core
        self.pending_aborts: list[str] = []
        self.core_stats = EngineStats(self.executor.num_blocks, self.executor.num_blocks, 0, 0, 0.0, 0.0)
        self.spec_stats = SpeculationStats()

    # ---- requests -------------------------------------------------------------------------------

    def make_sequence(self, request_id: str, prompt: Prompt, params: SamplingParams) -> NewRequest:
        return self.validator.new_request(request_id, prompt, params)

    def add_sequence(self, request: NewRequest) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = OutputAssembler(request)
        self.pending_adds.append(request)

    def abort(self, request_id: str) -> None:
        """Drop a request; the core frees its KV blocks at the start of the next step."""
        if self.requests.pop(request_id, None) is None:
            return
        unsent = [r for r in self.pending_adds if r.request_id != request_id]
        if len(unsent) == len(self.pending_adds):
            self.pending_aborts.append(request_id)
        self.pending_adds = unsent

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pending_aborts)

    @property
    def num_waiting(self) -> int:
        return self.core_stats.num_waiting + len(self.pending_adds)

    def stats(self) -> EngineStats:
        """The core's figures after its last step, with requests not yet sent counted as waiting."""
        return dataclasses.replace(self.core_stats, num_waiting=self.num_waiting)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        now = time.perf_counter()  # queue time and TTFT count from the arrival here
        adds = [dataclasses.replace(r, waited_s=now - r.arrival_time) for r in self.pending_adds]
        aborts = self.pending_aborts
        self.pending_adds, self.pending_aborts = [], []
        try:
            reply = self.executor.core_step(adds, aborts)
        except StepFailedError as e:  # the core dropped that step's requests and serves the rest
            for request_id in e.request_ids:
                self.requests.pop(request_id, None)
            raise
        except EngineError:  # the workers or the coordinator are gone: so is every request
            self.requests.clear()
            raise
        self.core_stats, self.spec_stats = reply.stats, reply.spec_stats
        outputs = []
        for delta in reply.deltas:
            assembler = self.requests.get(delta.request_id)
            if assembler is None:
                continue
            outputs.append(assembler.add(delta))
            if delta.finish_reason is not None:
                del self.requests[delta.request_id]
        return outputs

    def shutdown(self) -> None:
        self.executor.shutdown()
