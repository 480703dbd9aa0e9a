"""The front end's half of a request (vLLM v1's output processor): turns the engine core's token-id
deltas into the outputs users see. Per request it holds the detokenizer, appends text token by token,
checks stop strings, decodes the tokens of logprobs and flushes the text at the end; when a stop
string ends a request, it aborts it in the core so that its KV blocks free before the next step.

    core step -> [RequestDelta(new_token_ids=[5, 7, 9])]    # token ids, eos / length, logprobs
    process   -> text += "He", "llo", " w"                   # one token at a time
                 stop=["lo"] matches in "Hello": text "Hel", token_ids [5, 7]; 9 is dropped
                 abort_in_core(request_id)                    # the core has not finished it

Every front end uses one: LLM, AsyncLLM in-process, and AsyncLLM / LLM over RayCoreClient, whose core
in the coordinator then sends no text.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from warpspec.core.messages import RequestDelta
from warpspec.core.requests import NewRequest
from warpspec.outputs import PositionLogprobs, RequestOutput
from warpspec.spec_decode.speculation_stats import speculation_metrics
from warpspec.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestState:
    """One request's output as the user sees it, grown delta by delta."""

    def __init__(self, request: NewRequest, tokenizer: Tokenizer | None):
        params = request.params
        self.request_id, self.params = request.request_id, params
        self.prompt, self.prompt_token_ids = request.prompt, request.prompt_token_ids
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
                            if tokenizer is not None else None)
        self.token_ids: list[int] = []
        self.text = ""
        self.num_streamed_chars = 0
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # What metrics a stop string's finish needs that only the core knew: those fixed at the first
        # token (queue time, TTFT, cached prompt tokens), and the drafts verified since.
        self.start_metrics: dict[str, float] = {}
        self.first_token_time: float | None = None  # this process's clock
        self.num_verify_steps = self.num_draft_tokens = self.num_accepted_tokens = 0

    def add(self, delta: RequestDelta) -> bool:
        """Append a delta's tokens, as far as a stop string lets them; True when a stop string ended
        the request here. The delta's logprobs must already be decoded."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics and not self.token_ids:  # the first delta
            self.start_metrics = delta.metrics
            self.first_token_time = time.perf_counter()
        if delta.num_draft_tokens:
            self.num_verify_steps += 1
            self.num_draft_tokens += delta.num_draft_tokens
            self.num_accepted_tokens += len(delta.new_token_ids) - 1
        previous_len = len(self.text)
        for i, token in enumerate(delta.new_token_ids):
            self.token_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append(delta.new_logprobs[i])
            previous_len = len(self.text)
            if self.detokenizer is not None:
                self.text += self.detokenizer.add([token])
                if self._check_stop_strings(previous_len):
                    return True  # any later tokens of this step (accepted drafts) are dropped
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            if self.detokenizer is not None:
                self.text += self.detokenizer.flush()
                self._check_stop_strings(previous_len)
        return False

    def _check_stop_strings(self, previous_len: int) -> bool:
        """Finish if the text now contains a stop string; the text is cut before it."""
        for stop in self.params.stop:
            # Only a match that overlaps the new text is new: search from len(stop) - 1 chars back.
            at = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def stop_string_metrics(self, delta: RequestDelta) -> dict[str, float]:
        """The metrics of a request a stop string ended at token len(self.token_ids) of delta: the
        core's final ones when it finished the request in the same step (an eos or the length limit
        later in it), else what it said at the first token and the drafts counted since; with the
        output tokens counted here, since the core's may include the dropped ones."""
        num_tokens = len(self.token_ids)
        if delta.finished:
            metrics = dict(delta.metrics)
            core_tokens = int(metrics["completion_tokens"])
            tpot = metrics.pop("time_per_output_token_s", None)
            if tpot is not None and num_tokens > 1:  # the same span over fewer tokens
                metrics["time_per_output_token_s"] = tpot * (core_tokens - 1) / (num_tokens - 1)
        else:
            metrics = dict(self.start_metrics)
            metrics.update(speculation_metrics(self.num_verify_steps, self.num_draft_tokens,
                                               self.num_accepted_tokens))
            if self.first_token_time is not None and num_tokens > 1:
                metrics["time_per_output_token_s"] = (time.perf_counter() - self.first_token_time) / (num_tokens - 1)
        metrics["completion_tokens"] = num_tokens
        return metrics

    def output(self, new_token_ids: list[int], metrics: dict[str, float]) -> RequestOutput:
        new_text = self.text[self.num_streamed_chars :]
        self.num_streamed_chars = len(self.text)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.text, list(self.token_ids),
                             self.finish_reason, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                             stop_reason=self.stop_reason, metrics=metrics, new_token_ids=new_token_ids,
                             new_text=new_text)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, abort_in_core: Callable[[str], None]):
        """abort_in_core: drops a request from the engine core (EngineCore.abort, or RayCoreClient.abort
        and a send), for the requests a stop string ends before the core does."""
        self.tokenizer = tokenizer
        self.abort_in_core = abort_in_core
        self.requests: dict[str, RequestState] = {}

    def add(self, request: NewRequest) -> None:
        self.requests[request.request_id] = RequestState(request, self.tokenizer)

    def abort(self, request_id: str) -> None:
        """Forget a request (aborted, failed, or its stream gone); unknown ids are ignored."""
        self.requests.pop(request_id, None)

    def process(self, deltas: list[RequestDelta]) -> list[RequestOutput]:
        """One step's deltas -> one output per request still here, each carrying what it adds to the
        previous one; finished requests are forgotten."""
        outputs = []
        for delta in deltas:
            state = self.requests.get(delta.request_id)
            if state is None:  # aborted here since the core ran the step
                continue
            self._decode_logprobs(delta)
            num_before = len(state.token_ids)
            stopped_here = state.add(delta)
            metrics = {}
            if stopped_here:
                metrics = state.stop_string_metrics(delta)
                if not delta.finished:
                    self.abort_in_core(delta.request_id)
            elif state.finish_reason is not None:
                metrics = delta.metrics
            out = state.output(state.token_ids[num_before:], metrics)
            out.num_steps, out.num_draft_tokens = delta.num_steps, delta.num_draft_tokens
            out.prefill_chunks = delta.prefill_chunks
            outputs.append(out)
            if state.finish_reason is not None:
                del self.requests[delta.request_id]
        return outputs

    def _decode_logprobs(self, delta: RequestDelta) -> None:
        """Fill in each Logprob's decoded_token, for the new positions and the prompt's."""
        if self.tokenizer is None:
            return
        positions = list(delta.new_logprobs or [])
        positions += [p for p in delta.prompt_logprobs or [] if p is not None]
        for position in positions:
            for token_id, logprob in position.items():
                logprob.decoded_token = self.tokenizer.token_text(token_id)
