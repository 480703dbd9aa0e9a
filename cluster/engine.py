"""The engine loop, as one step: schedule, run the model, sample, append, finish.

    sched = scheduler.schedule()      # who runs, how many tokens each (CPU bookkeeping)
    out = executor.execute(step)      # the model, in-process or across the Ray workers
    tokens = sample(...)              # for the sequences that reached their last token
    append, detokenize, check stops   # finished requests leave and free their blocks at once

Both front ends drive it: LLM (blocking, a batch at a time) and AsyncLLM (streaming, many users).
"""

from __future__ import annotations

import time

import torch

from warpspec.block_manager import BlockManager
from warpspec.config import EngineConfig
from warpspec.errors import EngineError
from warpspec.executor import make_executor
from warpspec.outputs import RequestOutput
from warpspec.sampler import sample, top_logprobs
from warpspec.sampling_params import InvalidRequestError, SamplingParams
from warpspec.scheduler import ScheduledSequence, Scheduler
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
        self.block_manager = BlockManager(self.executor.num_blocks, self.block_size,
                                          config.scheduler.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.seed_source = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Sequence] = {}

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
        longest = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        needed = self.block_manager.blocks_needed(longest)
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(f"prompt + max_tokens needs {needed} KV blocks but the cache has only "
                                      f"{self.block_manager.num_blocks}; lower max_tokens or grow the KV cache")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seed_source))
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        seq = Sequence(request_id, prompt_text, prompt_ids, params, torch.Generator().manual_seed(seed), detokenizer,
                       logprobs=[] if params.logprobs is not None else None)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # nothing comes before position 0 to predict it
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request_id {seq.request_id!r} is already in flight")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request now; its KV blocks are free before the next step. None if unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.finish("abort")
        return seq.to_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns an output for every request that gained tokens or finished,
        carrying the new tokens and text as a delta."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.perf_counter()
        plan = []
        for item in sched.scheduled:
            item.seq.first_scheduled_time = item.seq.first_scheduled_time or now
            plan.append(SequenceStep(item.token_ids, item.num_cached,
                                     self.block_manager.block_tables[item.seq.request_id], self._logits_from(item)))
        try:
            logits = self.executor.execute(StepInput.build(plan, self.block_size)).logits
        except EngineError:
            self._fail_all()
            raise
        self.scheduler.update_after_step(sched)

        sampling: list[ScheduledSequence] = []
        sample_rows: list[int] = []
        row = 0
        for item, p in zip(sched.scheduled, plan, strict=True):
            num_rows = len(p.token_ids) - p.logits_from
            if item.wants_prompt_logprobs:
                self._record_prompt_logprobs(item, logits[row : row + num_rows], item.num_cached + p.logits_from)
            if item.samples:
                sampling.append(item)
                sample_rows.append(row + num_rows - 1)
            row += num_rows
        if not sampling:
            return []
        seqs = [item.seq for item in sampling]
        last_logits = logits[sample_rows]
        token_ids = sample(last_logits, [s.params for s in seqs], [s.generator for s in seqs],
                           [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs]).tolist()
        if any(s.params.logprobs is not None for s in seqs):
            self._record_logprobs(seqs, last_logits, token_ids)
        now = time.perf_counter()
        outputs = []
        for seq, token in zip(seqs, token_ids, strict=True):
            seq.first_token_time = seq.first_token_time or now
            self._append_token(seq, token)
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)
                del self.requests[seq.request_id]
            outputs.append(seq.to_output(*seq.take_delta()))
        return outputs

    def _logits_from(self, item: ScheduledSequence) -> int:
        """First of the step's tokens whose logits are needed: all of them while prompt logprobs are
        being collected, else only the last one when it is sampled, else none."""
        if item.wants_prompt_logprobs:
            return 0
        return len(item.token_ids) - 1 if item.samples else len(item.token_ids)

    def _fail_all(self) -> None:
        """The replica cannot run steps: drop every request and its blocks, so nothing waits forever."""
        for seq in list(self.requests.values()):
            self.scheduler.remove(seq)
        self.requests.clear()

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- bookkeeping after sampling -------------------------------------------------------------

    def _decode_token(self, token_id: int) -> str | None:
        return self.tokenizer.token_text(token_id) if self.tokenizer else None

    def _record_prompt_logprobs(self, item: ScheduledSequence, logits: torch.Tensor, first_position: int) -> None:
        """Row j holds the logits at position first_position + j, which predict the next token. Only
        prompt positions not yet recorded are kept (a preempted request recomputes its prompt)."""
        seq = item.seq
        prompt = seq.prompt_token_ids
        start = len(seq.prompt_logprobs) - 1 - first_position  # first row predicting an unrecorded position
        end = min(len(prompt) - 1 - first_position, logits.shape[0])
        if start >= end:
            return
        targets = prompt[first_position + start + 1 : first_position + end + 1]
        seq.prompt_logprobs.extend(top_logprobs(torch.log_softmax(logits[start:end], dim=-1), targets,
                                                seq.params.prompt_logprobs, self._decode_token))

    def _record_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, token_ids: list[int]) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        for row, seq in enumerate(seqs):
            if seq.params.logprobs is not None:
                seq.logprobs.extend(top_logprobs(logprobs[row : row + 1], [token_ids[row]],
                                                 seq.params.logprobs, self._decode_token))

    def _append_token(self, seq: Sequence, token: int) -> None:
        params = seq.params
        seq.append_token(token)
        previous_len = len(seq.text)
        if seq.detokenizer is not None:
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
