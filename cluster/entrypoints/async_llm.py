"""The streaming engine front end for many concurrent users (the serving layer builds on it).

Requests are added to and aborted from the engine as they come, on the event loop. The engine core
emits token ids; an OutputProcessor here turns each step's deltas into outputs (text, stop strings)
and hands each to its request's queue:
- in-process (one local worker), it runs the engine's steps while anything is unfinished;
- with Ray workers the engine core steps on its own in the coordinator: the requests added and
  aborted in one turn of the event loop go to it in one fire-and-forget message, and a reader
  thread (RayCoreClient.read_outputs) hands each step's reply to the loop. No blocking call runs on
  the event loop.
A stop string found here aborts its request in the core: in-process at once, before the next step;
with Ray workers in the next message, so the core may run it a step or two more, unseen.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from warpspec.client import make_core_client
from warpspec.config.engine import EngineConfig
from warpspec.config.options import engine_config
from warpspec.core.engine_stats import EngineStats
from warpspec.core.messages import RequestDelta
from warpspec.core.requests import Prompt
from warpspec.core.startup import StartupPhase
from warpspec.entrypoints.output_processor import OutputProcessor
from warpspec.errors import EngineError, EngineOverloadedError, InvalidRequestError, StepFailedError
from warpspec.outputs import RequestOutput
from warpspec.sampling_params import SamplingParams
from warpspec.tracing import RequestTrace
from warpspec.workers.compile.cpu_threads import in_a_passing_thread

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, model: str | EngineConfig, **options: Any):
        """AsyncLLM(model, **options) as LLM(model, **options) (any engine option by name), or
        AsyncLLM(config) with an EngineConfig."""
        config = model if isinstance(model, EngineConfig) else engine_config(model, **options)
        if isinstance(model, EngineConfig) and options:
            raise TypeError("AsyncLLM(config) takes no options: they are the config's")
        self.config = config
        self.engine = make_core_client(config)
        self.output_processor = OutputProcessor(self.engine.tokenizer, self._abort_in_core)
        self.streams: dict[str, asyncio.Queue] = {}
        self.wakeup: asyncio.Event | None = None
        self.loop_task: asyncio.Task | None = None
        self.is_rebuilding = False
        self.core_is_remote = config.parallel.uses_ray  # a RayCoreClient: the core steps in the coordinator
        self.is_send_scheduled = False
        self.reader: threading.Thread | None = None  # reads the RayCoreClient's replies
        self.last_progress = time.monotonic()  # the core's last step result, or the first request since idle

    @classmethod
    def from_options(cls, model: str, **options: Any) -> AsyncLLM:
        """Same keyword arguments as LLM."""
        return cls(engine_config(model, **options))

    @classmethod
    async def create(cls, model: str, **options: Any) -> AsyncLLM:
        """from_options, built in a thread: loading weights and starting Ray workers block for seconds.
        The thread ends once the engine is built: an in-process engine then steps on the event loop's
        thread, the only one that computes (workers/compile/cpu_threads.py says why that matters)."""
        return await in_a_passing_thread(cls.from_options, model, **options)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def startup(self) -> list[StartupPhase]:
        """What the engine (the latest, after a rebuild) did before its first request (core/startup.py)."""
        return self.engine.startup.phases

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def num_in_flight(self) -> int:
        """Open request streams (admitted or not)."""
        return len(self.streams)

    def stats(self) -> EngineStats:
        """The engine's snapshot: with Ray workers, the core's after its last step, with requests not
        yet sent to it counted as waiting."""
        return self.engine.stats()

    def stalled_s(self) -> float:
        """Seconds since the core last delivered a step while requests are in flight; 0 when idle. A
        core that is stuck (a hung collective, a stopped process) neither answers nor fails, so only
        this shows it."""
        return time.monotonic() - self.last_progress if self.streams else 0.0

    async def process_ids(self) -> tuple[int | None, list[int]]:
        """(coordinator pid, worker pids) with Ray workers; (None, []) when the model runs in this process."""
        if not self.config.parallel.uses_ray:
            return None, []
        coordinator = self.engine.coordinator
        return await asyncio.to_thread(lambda: (coordinator.coordinator_pid(), coordinator.worker_pids()))

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                       trace: RequestTrace | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: each carries the new token ids and text since the previous
        one; the last has finish_reason set and the full text. Closing the iterator early (a client
        that went away) aborts the request. Bad requests raise InvalidRequestError and a full queue
        EngineOverloadedError, both before anything is queued. trace: the request's spans
        (warpspec.tracing), told of its validation and of each output; its owner ends it."""
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if self.is_rebuilding:
            raise EngineError("the engine is being rebuilt after a failure; retry shortly")
        if request_id in self.streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight")
        with trace.validating() if trace is not None else contextlib.nullcontext():
            request = self.engine.new_request(request_id, prompt, params)
        limit = self.config.scheduler.max_waiting_requests
        if self.engine.num_waiting >= limit:
            raise EngineOverloadedError(f"engine overloaded: {limit} requests already waiting "
                                        "(max_waiting_requests); retry later")
        self.engine.add_request(request)  # raises, with Ray workers, once the engine core is gone
        self.output_processor.add(request)
        if not self.streams:  # busy from now: the stall clock starts here, not at the last step before idling
            self.last_progress = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        self._wake()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if trace is not None:
                    trace.on_output(item)
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            self.output_processor.abort(request_id)  # a no-op once finished; a failed one is forgotten too
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks are released before the next step."""
        self.engine.abort(request_id)
        self.output_processor.abort(request_id)
        self._wake()

    def _abort_in_core(self, request_id: str) -> None:
        """A stop string ended the request here: the core is told (its stream has its output already)."""
        self.engine.abort(request_id)
        if self.core_is_remote:
            self._wake()  # the abort leaves with this turn's message

    def fail_all(self, error: BaseException) -> None:
        """End every stream in flight with error (each request is aborted, its KV blocks freed)."""
        for request_id, queue in list(self.streams.items()):
            queue.put_nowait(error)
            self.abort(request_id)

    async def rebuild(self, is_stuck: bool = False) -> None:
        """Replace the engine with a fresh one from the same config, after a fatal failure (a dead
        worker or coordinator, or a stuck core: is_stuck, whose coordinator is killed without waiting
        for an answer): new actors, placement group and weights, an empty KV and prefix cache. The old
        engine's requests have already failed. Builds in a thread, so the event loop keeps answering
        (health checks, requests refused meanwhile)."""
        self.is_rebuilding = True
        try:
            # Anything still in flight was on the failed engine (a request admitted as it failed).
            self.fail_all(EngineError("the engine failed and is being rebuilt; retry shortly"))
            await self._stop_loop()  # it steps the old engine
            old, self.reader = self.engine, None  # the old reader ends with the old engine's stream
            if is_stuck and self.core_is_remote:  # it would never answer its shutdown call: kill it at once
                await asyncio.to_thread(old.shutdown, 0.0)
            else:
                await asyncio.to_thread(old.shutdown)
            self.engine = await in_a_passing_thread(make_core_client, self.config)
        finally:
            self.is_rebuilding = False

    async def shutdown(self) -> None:
        await self._stop_loop()
        await asyncio.to_thread(self.engine.shutdown)  # with Ray: the coordinator's shutdown call

    async def _stop_loop(self) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
            self.loop_task = None

    def _wake(self) -> None:
        if self.core_is_remote:
            if self.reader is None:
                engine, loop = self.engine, asyncio.get_running_loop()
                self.reader = engine.read_outputs(loop, lambda outs, fails: self._deliver_step(outs, fails, engine),
                                                  lambda error: self._core_ended(error, engine))
            if not self.is_send_scheduled:  # at the end of this turn of the loop: one message for all
                self.is_send_scheduled = True
                # In no request's context: Serve cancels a request with ray.cancel, which also cancels
                # the Ray tasks it submitted that have not run yet, and this message carries other
                # requests' adds too (ray-project/ray#52476; Serve's own long poll does the same).
                asyncio.get_running_loop().call_soon(self._send, context=contextvars.Context())
            return
        if self.loop_task is None or self.loop_task.done():
            self.wakeup = asyncio.Event()
            self.loop_task = asyncio.get_running_loop().create_task(self._run_steps())
        self.wakeup.set()

    def _send(self) -> None:
        self.is_send_scheduled = False
        try:
            self.engine.send()
        except Exception as error:  # noqa: BLE001 - a message that cannot leave must not leave its requests waiting
            logger.exception("sending requests to the engine core failed")
            self._fail_streams(error)

    def _core_ended(self, error: Exception, engine) -> None:
        if engine is self.engine:  # not an engine replaced by rebuild()
            self._fail_streams(error)

    async def _run_steps(self) -> None:
        """In-process: step the engine while anything is unfinished."""
        while True:
            if not self.engine.has_unfinished():
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            try:
                # The step (the model itself) runs on the event loop's own thread, and the loop serves
                # other coroutines between steps. Run in a worker thread instead, it contends with the
                # loop for the GIL and torch starts a second OpenMP pool: measured 1.5-1.7x slower
                # steps on 2 cores (19 ms vs 11 ms per decode step at 32 requests).
                deltas, failures = self.engine.step(), []
            except StepFailedError as error:  # the engine aborted that step's requests; the rest go on
                deltas, failures = [], [error]
            except Exception as error:  # noqa: BLE001 - the model is broken: every waiting request must learn of it
                deltas, failures = [], []
                self._fail_streams(error)
            self._deliver_step(deltas, failures)
            await asyncio.sleep(0)  # let the streams and new requests in before the next step

    def _deliver_step(self, deltas: list[RequestDelta], failures: list[StepFailedError], engine=None) -> None:
        if engine is not None and engine is not self.engine:  # a reply from an engine replaced by rebuild()
            return
        self.last_progress = time.monotonic()
        for error in failures:
            logger.error("an engine step failed; its %d requests fail: %s", len(error.request_ids), error)
            for request_id in error.request_ids:
                self.output_processor.abort(request_id)
                self._deliver(request_id, error)
        for out in self.output_processor.process(deltas):
            self._deliver(out.request_id, out)

    def _fail_streams(self, error: BaseException) -> None:
        for queue in self.streams.values():
            queue.put_nowait(error)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        queue = self.streams.get(request_id)
        if queue is not None:  # None: its client has gone (and its request was aborted)
            queue.put_nowait(item)
