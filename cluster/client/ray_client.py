"""The engine core as the replica sees it when the core runs in the coordinator actor (Ray workers).

Same surface as EngineCore for LLM and AsyncLLM (new_request, add_request, abort, has_unfinished,
step, stats), but the core steps on its own: the requests added and aborted go to the coordinator
as they come (send(), fire-and-forget), and each step's new tokens come back on one long-lived
stream (core/messages.py). step() reads the next reply, blocking; for AsyncLLM, read_outputs() reads
them in a thread of its own and hands each step's outputs to the event loop.
Requests are validated and tokenized here, so a bad one never reaches the core. The replies carry
token ids, no text: the front end's OutputProcessor detokenizes them, as for a core in its process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable

from warpspec.client.coordinator_handle import CoordinatorHandle
from warpspec.config.engine import EngineConfig
from warpspec.core.engine_stats import EngineStats
from warpspec.core.messages import CoreInput, RequestDelta, StepReply
from warpspec.core.requests import NewRequest, Prompt, RequestValidator, resolve_max_model_len
from warpspec.errors import EngineError, InvalidRequestError, StepFailedError
from warpspec.sampling_params import SamplingParams
from warpspec.spec_decode.speculation_stats import SpeculationStats
from warpspec.tokenizer import Tokenizer
from warpspec.workers.kv_groups import kv_group_layout


class RayCoreClient:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.coordinator = CoordinatorHandle(config)
        self.model_config = self.coordinator.model_config
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.model_config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.validator = RequestValidator(self.tokenizer, config.model, self.model_config.vocab_size,
                                          self.max_model_len, self.coordinator.num_blocks, config.cache.block_size,
                                          config.seed, self.model_config.eos_token_ids,
                                          has_draft=config.speculative.enabled,
                                          kv_layout=kv_group_layout(self.model_config, config.cache.hybrid),
                                          max_step_tokens=config.scheduler.max_num_batched_tokens)
        self.requests: set[str] = set()  # added and not yet finished or aborted
        self.pending_adds: list[NewRequest] = []  # not yet sent to the core
        self.pending_aborts: list[str] = []
        self.num_sent = 0  # CoreInputs sent: the next one's number
        self.failure: EngineError | None = None  # what ended the core's stream: every later read raises it
        self.core_stats = EngineStats(self.coordinator.num_blocks, self.coordinator.num_blocks, 0, 0, 0.0, 0.0)
        self.spec_stats = SpeculationStats()
        self.startup = self.coordinator.startup  # placement, then the coordinator's phases (core/startup.py)

    # ---- requests -------------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> NewRequest:
        """Validate and tokenize a request, here in the replica."""
        return self.validator.new_request(request_id, prompt, params)

    def add_request(self, request: NewRequest) -> None:
        if self.failure is not None:  # the core is gone: nothing would ever answer
            raise self.failure
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
        self.requests.add(request.request_id)
        self.pending_adds.append(request)

    def abort(self, request_id: str) -> None:
        """Drop a request: never sent, it is forgotten here; sent, the core frees its KV blocks before
        its next step once send() has passed the abort on."""
        if request_id not in self.requests:
            return
        self.requests.discard(request_id)
        unsent = [r for r in self.pending_adds if r.request_id != request_id]
        if len(unsent) == len(self.pending_adds):
            self.pending_aborts.append(request_id)
        self.pending_adds = unsent

    def has_unfinished(self) -> bool:
        """Requests the core will still reply for (aborted ones need no reply)."""
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return self.core_stats.num_waiting + len(self.pending_adds)

    def stats(self) -> EngineStats:
        """The core's figures after its last step, with requests not yet sent counted as waiting."""
        return dataclasses.replace(self.core_stats, num_waiting=self.num_waiting)

    # ---- the core's stream ----------------------------------------------------------------------

    def send(self) -> None:
        """Send the requests added and aborted since the last send, if any; returns at once."""
        if not (self.pending_adds or self.pending_aborts):
            return
        now = time.perf_counter()  # queue time and TTFT count from the arrival here
        adds = [dataclasses.replace(r, waited_s=now - r.arrival_time) for r in self.pending_adds]
        self.coordinator.submit(CoreInput(self.num_sent, adds, self.pending_aborts))
        self.num_sent += 1
        self.pending_adds, self.pending_aborts = [], []

    def step(self) -> list[RequestDelta]:
        """Send what is pending, then wait for the core's next step. Raises the first request failure
        it reports (StepFailedError), after dropping every failed request."""
        self.send()
        with self._core_failure_ends_every_request():
            reply = self.coordinator.next_reply()
        outputs, failures = self._take(reply)
        if failures:
            raise failures[0]
        return outputs

    def read_outputs(self, loop: asyncio.AbstractEventLoop,
                     on_step: Callable[[list[RequestDelta], list[StepFailedError]], None],
                     on_end: Callable[[Exception], None]) -> threading.Thread:
        """Read the core's replies until its stream ends, in a thread of its own that blocks in Ray's
        wait; each step's outputs reach on_step on loop, where this engine's state is kept, and the
        stream's end (a dead coordinator or worker, shutdown) reaches on_end there. The read blocks
        off the loop; each reply is handed over in one call_soon_threadsafe."""
        def take(reply: StepReply) -> None:
            on_step(*self._take(reply))

        def end(error: Exception) -> None:
            # Whatever ended the stream (a dead worker or coordinator, a bug in the core's loop), the
            # loop is gone: so is every request, and nothing would answer new ones.
            if not isinstance(error, EngineError):
                first_line = (str(error).splitlines() or [""])[0][:200]
                error = EngineError(f"the engine core stopped ({type(error).__name__}: {first_line})")
            self._core_gone(error)
            on_end(error)

        def read() -> None:
            while True:
                try:
                    reply = self.coordinator.next_reply()
                except Exception as e:  # noqa: BLE001 - handed to the loop, which fails the streams
                    with contextlib.suppress(RuntimeError):  # the loop closed first: nobody is waiting
                        loop.call_soon_threadsafe(end, e)
                    return
                try:
                    loop.call_soon_threadsafe(take, reply)
                except RuntimeError:  # the loop has closed
                    return

        thread = threading.Thread(target=read, name="core-replies", daemon=True)
        thread.start()
        return thread

    @contextlib.contextmanager
    def _core_failure_ends_every_request(self):
        try:
            if self.failure is not None:
                raise self.failure
            yield
        except EngineError as e:
            self._core_gone(e)
            raise

    def _core_gone(self, error: EngineError) -> None:
        """The workers or the coordinator are gone: so is every request, and later ones are refused."""
        self.requests.clear()
        self.failure = error

    def _take(self, reply: StepReply) -> tuple[list[RequestDelta], list[StepFailedError]]:
        self.core_stats, self.spec_stats = reply.stats, reply.spec_stats
        for failure in reply.failures:
            self.requests.difference_update(failure.request_ids)
        deltas = []
        for delta in reply.deltas:
            if delta.request_id not in self.requests:  # aborted here since the core ran the step
                continue
            deltas.append(delta)
            if delta.finished:
                self.requests.discard(delta.request_id)
        return deltas, reply.failures

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """timeout_s: how long the coordinator may take to stop its loop and workers before it is
        killed (0 for a stuck one: it would never answer)."""
        self.coordinator.shutdown(timeout_s)
