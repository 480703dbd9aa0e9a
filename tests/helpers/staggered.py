"""Requests that arrive at chosen steps of an engine's own loop, as continuous batching sees them, and
what the steps made of them."""

from __future__ import annotations

from warpspec.entrypoints.output_processor import OutputProcessor
from warpspec.outputs import RequestOutput


def run_staggered(engine, requests) -> dict[str, RequestOutput]:
    """requests: (request id, prompt, params, the step it arrives at). Steps the EngineCore until every
    request has finished, its deltas through an OutputProcessor as LLM does; returns each one's final
    output by id."""
    processor = OutputProcessor(engine.tokenizer, engine.abort)
    finished, step = {}, 0
    pending = sorted(requests, key=lambda r: r[3])
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            request_id, prompt, params, _ = pending.pop(0)
            request = engine.new_request(request_id, prompt, params)
            processor.add(request)
            engine.add_request(request)
        for out in processor.process(engine.step()):
            if out.finished:
                finished[out.request_id] = out
        step += 1
    return finished


def count_unfinished_chunks(engine) -> list[int]:
    """[n]: the scheduled shares that stop short of their sequence's last known token (a prompt cut by
    the token budget, or a recompute's), counted as the engine steps from now on."""
    counts, schedule = [0], engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        counts[0] += sum(not item.samples for item in out.scheduled)
        return out

    engine.scheduler.schedule = counting_schedule
    return counts
