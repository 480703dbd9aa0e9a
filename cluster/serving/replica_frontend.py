"""One replica's engine as both front ends (gRPC and OpenAI HTTP) see it: AsyncLLM plus what serving
adds around each request (unique engine ids, metrics, a health verdict) and the replica's stats.

Plain class, no Ray Serve: the deployment composes it, tests and benchmarks can build it in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from warpspec.core.engine_core import Prompt
from warpspec.core.startup import StartupPhase, log_startup_table
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.errors import EngineError, EngineOverloadedError, InvalidRequestError, ReplicaDrainingError
from warpspec.outputs import RequestOutput
from warpspec.sampling_params import SamplingParams
from warpspec.serving.logs import log_access, serving_request
from warpspec.serving.metrics import ReplicaStats, ServingMetrics
from warpspec.serving.wire_errors import wire_error
from warpspec.tracing import RequestTrace

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

logger = logging.getLogger("warpspec.serving")


@dataclass
class ReplicaProcesses:
    """What a replica holds, for operators and the fault tests: its own process and, with Ray
    workers, its coordinator's and workers' (None / [] when the model runs in the replica)."""
    pid: int
    rss_bytes: int
    coordinator_pid: int | None
    worker_pids: list[int]
    num_rebuilds: int
    failure: str | None


@dataclass(frozen=True)
class ModelDescription:
    name: str  # what clients call the model (OpenAI `model`)
    path: str
    max_model_len: int
    num_workers: int
    drafter: str | None  # SpeculativeConfig.describe(): "eagle3 (<folder>)", "ngram (n 2-5)"; None: no drafts
    speculative_method: str | None
    num_speculative_tokens: int
    vocab_size: int
    dtype: str


class ReplicaFrontend:
    def __init__(self, llm: AsyncLLM, model_name: str | None = None, metrics: ServingMetrics | None = None,
                 stream_interval: int = 1, rebuild_on_failure: bool = True, stream_gap_s: float = 0.0,
                 stall_timeout_s: float = 0.0, tracer: Tracer | None = None):
        """stream_interval: streamed outputs after the first carry at least this many new tokens (the
        last may carry fewer). Every message costs the serving path a few ms (replica -> proxy -> client: measured
        +4 ms per token at one stream on 2 CPU cores), so fast models stream cheaper in bunches.
        stream_gap_s: after the first message, a stream sends at most one message per this many
        seconds, carrying every token produced since the last: a fast stream sends fewer, larger
        messages; a stream slower than the gap still sends each token as it comes.
        rebuild_on_failure: after a fatal step failure (a dead worker or coordinator) rebuild the engine
        in place (new actors, placement group, weights); the replica is unhealthy until it is back.
        stall_timeout_s: requests in flight and no step delivered for this long counts as such a
        failure (check_progress); 0: never.
        tracer: traces each request (warpspec.tracing.configure_tracing); None: no traces."""
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be a positive integer, got {stream_interval!r}")
        if not stream_gap_s >= 0:
            raise ValueError(f"stream_gap_s must be >= 0 seconds, got {stream_gap_s!r}")
        self.llm = llm
        self.stream_interval, self.stream_gap_s = stream_interval, stream_gap_s
        self.stall_timeout_s = stall_timeout_s
        self.tracer = tracer
        config = llm.config
        self.description = ModelDescription(
            name=model_name or Path(config.model).name, path=config.model,
            max_model_len=llm.max_model_len, num_workers=config.parallel.num_workers,
            drafter=config.speculative.describe(), speculative_method=config.speculative.method,
            num_speculative_tokens=config.speculative.num_speculative_tokens,
            vocab_size=llm.vocab_size, dtype=config.dtype)
        self.metrics = metrics
        # Set when a step failed for reasons other than load (a dead worker): the replica cannot serve
        # and its health check fails, so Serve replaces it.
        self.failure: str | None = None
        self.num_aborted = 0  # requests whose client went away before they finished
        self.rebuild_on_failure = rebuild_on_failure
        self.rebuild_task: asyncio.Task | None = None
        self.num_rebuilds = 0
        self.is_draining = False

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    async def stream(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     trace_headers: Mapping[str, str] | None = None,
                     operation: str = "text_completion") -> AsyncIterator[RequestOutput]:
        """AsyncLLM.generate under a replica-unique engine id; outputs carry the client's request_id
        (clients may reuse ids, even concurrently, without colliding). Closing the iterator aborts the
        request and frees its KV blocks. With a tracer, the request is traced (operation: the GenAI
        operation name, "text_completion" or "chat"), under the client's W3C traceparent from
        trace_headers when it sent a valid one."""
        self.check_health()
        client_id = request_id or uuid.uuid4().hex
        engine_id = f"{client_id}#{uuid.uuid4().hex[:12]}"
        finished = False
        held: list[RequestOutput] = []  # outputs not yet passed on (stream_interval > 1, or the gap)
        serving_request(client_id)
        trace = None if self.tracer is None else RequestTrace(self.tracer, operation, self.description.name, params,
                                                              trace_headers, client_id)
        failure: BaseException | None = None
        final: RequestOutput | None = None
        if trace is not None:
            serving_request(client_id, trace.trace_id)
        outputs = self.llm.generate(prompt, params, request_id=engine_id, trace=trace)
        loop = asyncio.get_running_loop()
        next_output: asyncio.Future | None = None  # the engine's next output, awaited across gaps
        sent_at = -float("inf")
        try:
            while True:
                try:
                    if held:  # tokens held only for the gap go out when it ends, even if no new token comes
                        if next_output is None:
                            next_output = asyncio.ensure_future(outputs.__anext__())
                        wait_s = max(0.0, sent_at + self.stream_gap_s - loop.time())
                        done, _ = await asyncio.wait({next_output}, timeout=wait_s)
                        if not done:
                            yield _merge_outputs(held)
                            held, sent_at = [], loop.time()
                            continue
                        out = next_output.result()
                    elif next_output is not None:  # still pending from before the gap ended
                        out = await next_output
                    else:
                        # Awaited in this task, not through a future: the output reaches this stream in
                        # the same turn of the event loop as the engine hands it on, so a stream keeps up
                        # with steps (the engine yields one turn between them) and pays no task per output.
                        out = await outputs.__anext__()
                except StopAsyncIteration:
                    break
                next_output = None
                out.request_id = client_id
                if out.finished:
                    finished, final = True, out
                    if self.metrics is not None:
                        self.metrics.record_finished(out)
                        self.metrics.record_stats(self.stats())
                held.append(out)
                # The first token goes out at once (time to first token); later ones in bunches of
                # stream_interval tokens, at most one message per stream_gap_s.
                num_held = sum(len(o.new_token_ids) for o in held)
                is_first = num_held == len(out.token_ids)
                gap_passed = loop.time() - sent_at >= self.stream_gap_s
                if out.finished or is_first or (num_held >= self.stream_interval and gap_passed):
                    yield _merge_outputs(held)
                    held, sent_at = [], loop.time()
                if out.finished:
                    break
        except BaseException as e:
            failure = e
            if not isinstance(e, Exception):
                raise  # cancelled or closed: abandoned
            finished = True  # refused or failed, not abandoned
            if isinstance(e, EngineError) and not isinstance(e, EngineOverloadedError | ReplicaDrainingError):
                self._fail(str(e).splitlines()[0])
            raise
        finally:
            # Closed early (client cancel, deadline, disconnect: CancelledError or GeneratorExit here):
            # closing AsyncLLM's stream aborts the request, which frees its KV blocks before the next step.
            if next_output is not None and not next_output.done():
                next_output.cancel()
                with contextlib.suppress(BaseException):
                    await next_output
            await outputs.aclose()
            if not finished:
                self.num_aborted += 1
            if trace is not None:
                trace.end(failure)
            status = "ok" if failure is None else "cancelled" if not isinstance(failure, Exception) \
                else wire_error(failure).grpc_code.name
            log_access(client_id, trace.trace_id if trace is not None else None, status,
                       final.finish_reason if final is not None else None, final.metrics if final is not None else {})
            serving_request(None)

    def tokenize(self, text: str) -> tuple[list[int], list[str]]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.description.path} has no tokenizer.json")
        if not text:
            raise InvalidRequestError("text is empty")
        ids = self.tokenizer.encode(text)
        return ids, [self.tokenizer.token_text(t) for t in ids]

    def stats(self) -> ReplicaStats:
        return ReplicaStats.of(self.llm.stats(), self.llm.num_in_flight, self.num_aborted, self.failure is None)

    def check_health(self) -> None:
        """Readiness: raises when the replica cannot serve now (Serve's health check, the gRPC health
        service, HTTP /ready): it is shutting down, its engine failed or is stuck, or it is rebuilding."""
        if self.is_draining:
            raise ReplicaDrainingError("this replica is shutting down; retry on another")
        if self.failure is not None:
            doing = " (rebuilding its workers)" if self.rebuild_task is not None else ""
            raise EngineError(f"this replica cannot serve{doing}: {self.failure}")

    def check_alive(self) -> None:
        """Liveness (HTTP /health, gRPC health service "liveness"): raises only when the replica cannot
        recover by itself, its engine failed and no rebuild is under way (rebuild_on_failure off, or
        the rebuild failed). A replica that is rebuilding or draining is alive: restarting its pod would
        only lose the work under way."""
        if self.failure is not None and self.rebuild_task is None:
            raise EngineError(f"this replica is down and not rebuilding: {self.failure}")

    def check_progress(self) -> None:
        """Called every second: a core that delivered no step for stall_timeout_s while requests are in
        flight is stuck (a hung collective, a stopped process), which no error reports. Its requests
        end with EngineError (UNAVAILABLE / 503) and the engine is rebuilt, as for a dead worker; the
        replica is unhealthy meanwhile. An engine that steps in this process (one local worker) blocks
        this very loop while stuck: then Serve's health check times out and Serve replaces the replica."""
        if not self.stall_timeout_s or self.failure is not None:
            return
        stalled_s = self.llm.stalled_s()
        if stalled_s > self.stall_timeout_s:
            error = EngineError(f"the engine core delivered no step for {stalled_s:.0f} s with "
                                f"{self.llm.num_in_flight} requests in flight (stall_timeout_s "
                                f"{self.stall_timeout_s:g}): it is stuck")
            self._fail(str(error), is_stuck=True)
            self.llm.fail_all(error)

    async def processes(self) -> ReplicaProcesses:
        import psutil

        coordinator_pid, worker_pids = (None, []) if self.failure is not None else await self.llm.process_ids()
        return ReplicaProcesses(os.getpid(), psutil.Process().memory_info().rss, coordinator_pid, worker_pids,
                                self.num_rebuilds, self.failure)

    async def warm_up(self) -> None:
        """One 2-token greedy request: the first step builds attention metadata paths and, with a draft,
        compiles it."""
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        async for _ in self.llm.generate([0, 1], params, request_id=f"warmup#{uuid.uuid4().hex[:12]}"):
            pass
        phases = [*self.llm.startup, StartupPhase("warm-up request", round(time.perf_counter() - start, 3), "2 tokens")]
        log_startup_table(phases)

    def _fail(self, reason: str, is_stuck: bool = False) -> None:
        """A step failed fatally, or the engine is stuck: refuse work (UNAVAILABLE, health failing) and
        rebuild the engine."""
        if self.failure is None:
            self.failure = reason
            logger.error("replica engine failed: %s; %s", reason,
                         "rebuilding it" if self.rebuild_on_failure else "it stays down")
        if self.rebuild_on_failure and self.rebuild_task is None:
            self.rebuild_task = asyncio.get_running_loop().create_task(self._rebuild(is_stuck))

    async def _rebuild(self, is_stuck: bool) -> None:
        start = time.monotonic()
        try:
            await self.llm.rebuild(is_stuck)
            await self.warm_up()
        except Exception as e:  # noqa: BLE001 - the replica stays unhealthy and Serve replaces it
            self.failure = f"{self.failure}; rebuilding failed: {(str(e).splitlines() or [''])[0]}"
            logger.exception("rebuilding the replica engine failed; it stays unhealthy")
            return
        finally:
            self.rebuild_task = None
        self.num_rebuilds += 1
        self.failure = None
        logger.warning("replica engine rebuilt in %.1f s", time.monotonic() - start)

    async def drain(self, timeout_s: float) -> int:
        """Stop accepting requests, let those in flight finish for up to timeout_s, then end the rest
        with ReplicaDrainingError (UNAVAILABLE / 503). Returns how many were cut off."""
        self.is_draining = True
        deadline = time.monotonic() + timeout_s
        while self.llm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        num_cut = self.llm.num_in_flight
        if num_cut:
            self.llm.fail_all(ReplicaDrainingError(f"this replica shut down before the request finished "
                                                   f"(drain timeout {timeout_s:g} s)"))
            await asyncio.sleep(0)  # let the streams see it before the engine goes away
        return num_cut

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Drain (see drain), then release the engine: with Ray workers, the coordinator, the workers
        and their placement group."""
        await self.drain(drain_timeout_s)
        if self.rebuild_task is not None:
            self.rebuild_task.cancel()
            with contextlib.suppress(BaseException):
                await self.rebuild_task
        await self.llm.shutdown()



def _merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """The last output, carrying the new tokens and text of all: [a: +[5], b: +[7, 9]] -> b: +[5, 7, 9]."""
    last = outputs[-1]
    if len(outputs) > 1:
        last.new_token_ids = [t for o in outputs for t in o.new_token_ids]
        last.new_text = "".join(o.new_text for o in outputs)
        last.num_steps = sum(o.num_steps for o in outputs)
        last.num_draft_tokens = sum(o.num_draft_tokens for o in outputs)
        last.prefill_chunks = tuple(chunk for o in outputs for chunk in o.prefill_chunks)
    return last
