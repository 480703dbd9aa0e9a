"""The engine core's loop: take the front end's messages, step while anything is unfinished, reply.

    front end                         CoreLoop (its own thread)
    submit(CoreInput) --> inbox  -->  apply aborts, then adds
                                      core.step() while anything is unfinished
    replies  <------------------------  StepReply: token ids, finish reasons, stats, failures

Plain Python over an EngineCore, with no Ray: the coordinator actor (coordinator/actor.py) hosts
one and streams its replies to the replica; a test builds one over a LocalExecutor and steps it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from warpspec.core.engine_core import EngineCore
from warpspec.core.inbox import CoreInbox
from warpspec.core.messages import CoreInput, StepReply
from warpspec.errors import StepFailedError


class CoreLoop:
    def __init__(self, core: EngineCore, reply_interval_ms: float = 0.0,
                 on_pass: Callable[[float], None] | None = None):
        """reply_interval_ms: steps that only add tokens to running requests are merged into one reply
        until this long after the last one (ParallelConfig.core_reply_interval_ms says why). on_pass:
        called with each pass's seconds (applying messages, the step, sampling, the draft)."""
        self.core = core
        self.reply_interval_s = reply_interval_ms / 1e3
        self.on_pass = on_pass
        self.inbox = CoreInbox()
        self.is_stepping = threading.Lock()  # held through each pass, so close() can wait it out

    def submit(self, message: CoreInput) -> None:
        """The front end's requests added and aborted; run() applies them before its next step."""
        self.inbox.put(message)

    def run(self) -> Iterator[StepReply]:
        """Apply the messages, step while anything is unfinished, and reply. Idle, it waits for a
        message. Ends when close() closes the inbox; a dead worker ends it with WorkerDiedError.

        A reply goes at once when it is urgent (StepReply.is_urgent), when messages were applied (an
        abort's freed blocks show in its stats), or when nothing is left to run; otherwise it is held
        and merged with the next ones, up to reply_interval_ms since the last reply sent."""
        core = self.core
        held, last_sent = None, time.monotonic()
        while True:
            messages = self.inbox.take(wait=held is None and not core.has_unfinished())
            if messages is None:
                return
            with self.is_stepping:
                reply = self._pass(messages)
            if reply is None:
                continue
            held = reply if held is None else held.then(reply)
            if (messages or held.is_urgent or not core.has_unfinished()
                    or time.monotonic() - last_sent >= self.reply_interval_s):
                yield held
                held, last_sent = None, time.monotonic()

    def _pass(self, messages: list[CoreInput]) -> StepReply | None:
        """Apply messages, then one step if anything is unfinished. None when neither happened."""
        core = self.core
        start = time.perf_counter()
        failures = [failure for message in messages for failure in self._apply(message)]
        deltas = []
        if core.has_unfinished():
            try:
                deltas = core.step()
            except StepFailedError as e:  # the core dropped that step's requests and serves the rest
                failures.append(e)
        elif not messages:
            return None
        reply = StepReply(deltas, core.stats(), core.spec_stats, failures, time.monotonic())
        if self.on_pass is not None:
            self.on_pass(time.perf_counter() - start)
        return reply

    def _apply(self, message: CoreInput) -> list[StepFailedError]:
        for request_id in message.aborts:
            self.core.abort(request_id)
        failures = []
        for request in message.adds:
            try:
                self.core.add_request(request)
            except Exception as e:  # noqa: BLE001 - one request the core cannot take must not end the loop
                failures.append(StepFailedError.caused_by([request.request_id], e))
        return failures

    def close(self, wait_s: float) -> None:
        """End the loop after the pass it is in, waiting at most wait_s for that pass (a step that
        never returns, a hung collective, must not keep the caller waiting forever)."""
        self.inbox.close()
        if self.is_stepping.acquire(timeout=wait_s):
            self.is_stepping.release()
