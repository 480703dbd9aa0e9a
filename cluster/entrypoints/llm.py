"""The blocking, batch-at-a-time API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from warpspec.client import make_core_client
from warpspec.config.options import engine_config
from warpspec.core.requests import Prompt
from warpspec.core.startup import StartupPhase
from warpspec.entrypoints.output_processor import OutputProcessor
from warpspec.errors import InvalidRequestError
from warpspec.outputs import RequestOutput
from warpspec.sampling_params import SamplingParams
from warpspec.spec_decode.proposer import Proposer


class LLM:
    """Offline generation over a checkpoint folder (of a family workers/models/ serves), in this
    process (num_workers=1) or sharded over num_workers Ray worker actors (a local Ray cluster is
    started unless RAY_ADDRESS names one).

    >>> with LLM(model="path/to/checkpoint", dtype="float32") as llm:
    ...     outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    """

    def __init__(self, model: str, dtype: str = "auto", max_model_len: int | None = None,
                 proposer: Proposer | None = None, **options: Any):
        """options: any engine option by name (warpspec.config.options.ENGINE_OPTIONS: KV cache,
        scheduler, num_workers and the rest of the parallel layout, the draft, ...). proposer: a
        speculative-decoding proposer of your own (warpspec.spec_decode.proposer.Proposer) instead of the
        EAGLE-3 draft that `draft` names."""
        self.config = engine_config(model, dtype=dtype, max_model_len=max_model_len, **options)
        self.engine = make_core_client(self.config, proposer)
        self.output_processor = OutputProcessor(self.engine.tokenizer, self._abort_in_core)
        self._next_request = 0

    @property
    def tokenizer(self):
        return self._engine().tokenizer

    @property
    def startup(self) -> list[StartupPhase]:
        """What the engine did before its first request, phase by phase, with times (core/startup.py)."""
        return self._engine().startup.phases

    def generate(self, prompts: Prompt | SequenceABC[Prompt],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string or a list of token ids; a single prompt may be passed bare. One
        SamplingParams applies to all prompts, or pass one per prompt."""
        engine = self._engine()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC):
            raise InvalidRequestError(f"prompts must be a string, a list of token ids or a list of prompts, "
                                      f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, SequenceABC)
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        # Validate the whole batch before any of it runs.
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            try:
                requests.append(engine.new_request(f"offline-{self._next_request + i}", prompt, params))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}") from None
        self._next_request += len(requests)
        for request in requests:
            self.output_processor.add(request)
            engine.add_request(request)
        finished: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm) as progress:
                while engine.has_unfinished():
                    for out in self.output_processor.process(engine.step()):
                        if out.finished:
                            finished[out.request_id] = out
                            progress.update()
        except BaseException:
            # A failed step (or Ctrl-C) ends the whole call: its other requests leave the engine too,
            # so the next generate does not run them.
            for request in requests:
                engine.abort(request.request_id)
                self.output_processor.abort(request.request_id)
            raise
        return [finished[request.request_id] for request in requests]

    def _abort_in_core(self, request_id: str) -> None:
        """A stop string ended the request: free its KV blocks before the next step (with Ray workers,
        the core hears of it at once, not with the next generate call)."""
        self.engine.abort(request_id)
        if self.config.parallel.uses_ray:
            self.engine.send()

    def shutdown(self) -> None:
        """Release the model, its KV cache and, on Ray, the coordinator, workers and their placement
        group. Idempotent."""
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None

    def _engine(self):
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down")
        return self.engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
