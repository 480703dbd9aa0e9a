"""The engine core's step: schedule, run the model, sample, append, finish.

    sched = scheduler.schedule()      # who runs, how many tokens each (CPU bookkeeping)
    out = executor.execute(plan)      # the model: in-process, or the coordinator's workers
    tokens = sample(...) / verify_batch()  # one token, or the accepted drafts plus one, per sequence
    append, check eos / stop tokens / length  # finished requests leave and free their blocks at once
    speculation.propose(...)          # when speculating: the next step's draft tokens, as many per
                                      # request as the measured step costs say pay (speculation.py)

A request with a structured output waits outside the scheduler until its grammar's matcher is built
(off this thread); then every row it samples or verifies is masked to what its grammar allows after
the tokens, and drafts, before that row (structured_output/grammar.py), so verification stays
lossless against the constrained distribution, and each token it appends advances its matcher.

A step returns token ids, never text: one RequestDelta per request that gained tokens or finished.
Detokenization, stop strings and the outputs users see are the front end's (entrypoints/output_processor.py),
which aborts a request here when a stop string ends it. The front ends: LLM (blocking, a batch at
a time) and AsyncLLM (streaming, many users). With one local worker the core runs in their process
over a LocalExecutor; with Ray workers a CoreLoop (core_loop.py) steps it inside the replica's
coordinator actor over a DriverExecutor (coordinator/actor.py), and the front ends reach it through
a RayCoreClient (client/ray_client.py). The core knows its executor only by the Executor protocol.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Protocol

import torch

from warpspec.config.engine import EngineConfig
from warpspec.core.block_manager import BlockManager
from warpspec.core.engine_stats import EngineStats
from warpspec.core.messages import RequestDelta
from warpspec.core.requests import NewRequest, Prompt, RequestValidator, resolve_max_model_len
from warpspec.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from warpspec.core.sequence import Sequence
from warpspec.core.speculation import DRAFT_BACKLOG, Speculation
from warpspec.core.startup import StartupTimer
from warpspec.core.warm_up import STAND_IN_PROMPT_ID, WARM_UP_PROMPT_TOKENS, graphs_built_by, run_stand_in_prompt
from warpspec.errors import EngineError, InvalidRequestError, StepFailedError
from warpspec.outputs import PositionLogprobs
from warpspec.sample.keyed_random import KeyedRandom
from warpspec.sample.rejection_sampler import verify_batch
from warpspec.sample.sampler import sample, top_logprobs
from warpspec.sampling_params import SamplingParams
from warpspec.spec_decode.cost_model import StepCostModel
from warpspec.spec_decode.methods import load_proposer
from warpspec.spec_decode.proposer import Proposer
from warpspec.spec_decode.speculation_stats import SpeculationStats
from warpspec.structured_output.grammar import masked
from warpspec.tokenizer import Tokenizer
from warpspec.workers.kv_groups import kv_group_layout
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.step import SequenceStep, StepOutput, StepPlan


class Executor(Protocol):
    """Where the core's steps run (executor/local.py, executor/driver.py)."""
    model_config: ModelConfig
    num_blocks: int  # KV cache blocks every rank holds

    def warm_up(self, aux_layer_ids: list[int]) -> None:
        """Build any compiled step graphs, before the first step."""

    def embedding_table(self) -> torch.Tensor | None:
        """The target's whole embedding table where this process holds it (one rank), else None."""

    def execute(self, plan: StepPlan) -> StepOutput:
        """One step on every rank: rank 0's logits, and the hidden states aux_layer_ids asked for."""

    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, proposer: Proposer | None = None,
                 startup: StartupTimer | None = None):
        """executor: where steps run (executor/: a LocalExecutor in this process, or the coordinator's
        DriverExecutor over Ray workers). proposer: drafts for speculative decoding; None loads the
        drafter config.speculative.method names (spec_decode/methods.py; none without one). A given
        proposer speculates config.speculative.num_speculative_tokens tokens whatever the config's
        method. startup: the phases timed so far (the executor's); the core adds the draft and the
        compiles (startup.py)."""
        self.config = config
        self.startup = startup if startup is not None else StartupTimer()
        self.executor = executor
        self.model_config = self.executor.model_config
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.model_config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.block_size = config.cache.block_size
        if proposer is None and config.speculative.enabled:
            with self.startup.phase("draft"):
                proposer = self._load_proposer()
        self.proposer = proposer
        # The target layers whose entering hidden states the proposer reads, asked for at every step.
        self.aux_layer_ids = list(proposer.aux_layer_ids) if proposer is not None else []
        # The draft's KV at a block's last position pairs it with the token after the block: a
        # cached block is reusable only by requests that continue it with the same token.
        self.kv_layout = kv_group_layout(self.model_config, config.cache.hybrid)
        self.block_manager = BlockManager(self.executor.num_blocks, self.block_size,
                                          config.scheduler.enable_prefix_caching,
                                          key_by_next_token=self.proposer is not None,
                                          num_window_groups=self.kv_layout.num_window_groups,
                                          chunk_size=self.kv_layout.chunk_size)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.validator = RequestValidator(self.tokenizer, config.model, self.model_config.vocab_size,
                                          self.max_model_len, self.block_manager.num_blocks, self.block_size,
                                          config.seed, self.model_config.eos_token_ids,
                                          has_draft=self.proposer is not None,
                                          kv_layout=self.kv_layout,
                                          max_step_tokens=config.scheduler.max_num_batched_tokens)
        self.requests: dict[str, Sequence] = {}
        self.compiling: dict[str, tuple[Sequence, Future]] = {}  # structured requests awaiting their matcher
        self.left_request_ids: list[str] = []  # finished or aborted since the executor last heard
        self.spec_stats = SpeculationStats()
        self.step_costs = StepCostModel()
        self.speculation = None if self.proposer is None else Speculation(
            config, self.proposer, self.executor, self.block_manager, self.kv_layout, self.max_model_len,
            self.step_costs)
        self.draft_lengths = None if self.speculation is None else self.speculation.policy
        self.times_gpu_steps = self.speculation is not None and self.speculation.times_gpu_steps
        self._warm_up()

    def _warm_up(self) -> None:
        """Let the ranks, and the draft, build their compiled step graphs before the first request
        (ModelRunner.warm_up, Eagle3Proposer.warm_up; no-ops where nothing compiles)."""
        if self.config.enforce_eager:
            self.executor.warm_up(self.aux_layer_ids)  # nothing to build: not a phase
        else:
            with self.startup.phase("compile target steps") as phase:
                phase.detail = graphs_built_by(lambda: self.executor.warm_up(self.aux_layer_ids), "rank 0")
        warm_up_draft = getattr(self.proposer, "warm_up", None)  # a proposer need not compile anything
        if warm_up_draft is None:
            with self.startup.phase("warm-up prompt") as phase:
                phase.detail = self._warm_up_prefill(with_draft=False)
            return  # nor take stand-in requests: its step costs are learnt from real steps
        if self.config.enforce_eager or not self.config.speculative.compile_draft:
            warm_up_draft()  # a proposer of the caller's own may warm up without compiling
        else:
            with self.startup.phase("compile draft steps") as phase:
                phase.detail = graphs_built_by(warm_up_draft, "draft")
        with self.startup.phase("warm-up prompt") as phase:
            phase.detail = self._warm_up_prefill(with_draft=True)
        k = self.draft_lengths.max_drafts
        # A cache too small to hold the stand-ins' backlog: the costs are learnt from real steps alone.
        if self.draft_lengths.adaptive and self.executor.num_blocks * self.block_size > DRAFT_BACKLOG + 2 * k:
            with self.startup.phase("time steps") as phase:
                phase.detail, stand_in_ids = self.speculation.time_steps()
            self.left_request_ids.extend(stand_in_ids)

    def _warm_up_prefill(self, with_draft: bool) -> str:
        """A stand-in prompt as long as a step and the cache allow (warm_up.run_stand_in_prompt)."""
        num_tokens = min(WARM_UP_PROMPT_TOKENS, self.config.scheduler.max_num_batched_tokens, self.max_model_len - 1,
                         self.executor.num_blocks * self.block_size)
        self.left_request_ids.append(STAND_IN_PROMPT_ID)
        return run_stand_in_prompt(self.executor, self.kv_layout, self.block_size, num_tokens,
                                   self.model_config.vocab_size, self.aux_layer_ids,
                                   (self.proposer, self.draft_lengths.max_drafts) if with_draft else None)

    def _load_proposer(self) -> Proposer:
        # With one shard (in this process, or the coordinator's only one) a draft model shares the
        # target's embedding table; over more, no process holds it whole and the draft reads it from
        # the checkpoint.
        return load_proposer(self.config, self.model_config, self.executor.num_blocks,
                             self.executor.embedding_table())

    # ---- requests -------------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> NewRequest:
        """Validate and tokenize a request without touching the batch (the front end's first step)."""
        return self.validator.new_request(request_id, prompt, params)

    def add_request(self, request: NewRequest) -> None:
        """Admit a request validated here or elsewhere (RequestValidator: the replica, over Ray)."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
        params = request.params
        seq = Sequence(request.request_id, request.prompt, list(request.prompt_token_ids), params,
                       KeyedRandom(request.seed), new_logprobs=[] if params.logprobs is not None else None,
                       arrival_time=request.arrival_here())
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # nothing comes before position 0 to predict it
        if self.proposer is not None:
            seq.num_drafted = 0
        self.requests[request.request_id] = seq
        if params.structured_output is not None:
            self.compiling[request.request_id] = seq, self.validator.grammars.submit(params.structured_output)
        else:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request now (a client gone, a stop string the front end found); its KV blocks are
        free before the next step. Unknown ids are ignored: the request may have finished meanwhile."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        if request_id in self.compiling:
            self.compiling.pop(request_id)[1].cancel()
        self.scheduler.remove(seq)
        self._release(request_id)
        seq.finish("abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.compiling)

    def stats(self) -> EngineStats:
        blocks, spec = self.block_manager, self.spec_stats
        # The cost table only where it is used: it travels with every step's reply over Ray.
        policy = self.draft_lengths if self.draft_lengths is not None and self.draft_lengths.adaptive else None
        positions = range(max(spec.proposed_at, default=-1) + 1)
        return EngineStats(num_kv_blocks=blocks.num_blocks, num_free_kv_blocks=blocks.num_free_blocks,
                           num_running=len(self.scheduler.running), num_waiting=self.num_waiting,
                           prefix_cache_hit_rate=blocks.stats.hit_rate,
                           acceptance_length=spec.acceptance_length,
                           constrained_acceptance_length=spec.constrained_acceptance_length,
                           drafted_at=tuple(spec.proposed_at.get(i, 0) for i in positions),
                           accepted_at=tuple(spec.accepted_at.get(i, 0) for i in positions),
                           draft_share=spec.draft_share,
                           step_costs=tuple((r["step"], r["num_seqs"], r["length"], r["ms"])
                                            for r in self.step_costs.rows()) if policy else (),
                           acceptance_rates=tuple(policy.acceptance.rates) if policy else (),
                           draft_length=policy.last_choice if policy else None,
                           kv_blocks_by_group=tuple(zip([group.name for group in self.kv_layout.groups],
                                                        blocks.blocks_held(), strict=True))
                           if self.kv_layout.is_hybrid else (),
                           num_released_kv_blocks=blocks.num_released_blocks)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.compiling)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one model step; returns a delta for every request that gained tokens or finished.

        Raises EngineError when the workers are gone (every request is dropped: nothing can run), and
        StepFailedError for any other failure, after aborting only the requests this step ran."""
        step_start = time.perf_counter()
        self._admit_compiled()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.compiling:  # nothing else to run: wait a little for a grammar rather than spin
                wait([future for _, future in self.compiling.values()], timeout=0.005, return_when=FIRST_COMPLETED)
            return []
        try:
            return self._run_step(sched, step_start)
        except EngineError:
            self._fail_all()
            raise
        except Exception as e:
            # Left in the batch, the same requests would fail the same way at every step from now on.
            request_ids = [item.seq.request_id for item in sched.scheduled]
            for request_id in request_ids:
                self.abort(request_id)
            raise StepFailedError.caused_by(request_ids, e) from e

    def _admit_compiled(self) -> None:
        """Schedule the structured requests whose matchers are built. One whose grammar failed to build
        (it compiled at the boundary, so this is not the request's fault) fails alone."""
        failed = []
        for request_id, (seq, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                seq.grammar = future.result()
            except Exception as e:  # noqa: BLE001 - reported to the request as a StepFailedError
                failed.append((request_id, e))
                continue
            self.scheduler.add(seq)
        if failed:
            for request_id, _ in failed:
                self.abort(request_id)
            raise StepFailedError.caused_by([request_id for request_id, _ in failed], failed[0][1])

    def _run_step(self, sched: SchedulerOutput, step_start: float) -> list[RequestDelta]:
        now = run_start = time.perf_counter()
        plan = []
        graphs = self.config.cuda_graph_config()
        padded_len = self.scheduler.pad_to_compiled(sched.scheduled, graphs.query_lens if graphs else (),
                                                    self.max_model_len)
        for item in sched.scheduled:
            item.seq.first_scheduled_time = item.seq.first_scheduled_time or now
            # [t, d1] padded to 4: [t, d1, d1, d1]; the padding's KV lands past the last known token,
            # where a rejected draft's would (rewritten before it is read), and its logits are not read.
            token_ids = item.token_ids + item.token_ids[-1:] * (padded_len - len(item.token_ids))
            request_id = item.seq.request_id
            plan.append(SequenceStep(token_ids, item.num_cached, self.block_manager.block_tables[request_id],
                                     self._logits_from(item), request_id,
                                     self.block_manager.window_tables[request_id]))
        left, self.left_request_ids = self.left_request_ids, []
        execute_start = time.perf_counter()
        output = self.executor.execute(StepPlan(plan, self.block_size, self.aux_layer_ids, left,
                                                self.kv_layout.chunk_size))
        if self.times_gpu_steps:  # the GPU's work is queued: wait for it, or the step reads as its launch
            torch.cuda.synchronize()
        execute_s = time.perf_counter() - execute_start
        logits = output.logits

        # Per scheduled sequence, the row of `logits` at its last known token: the sampled row, or the
        # first of the k + 1 rows a verification reads.
        sample_rows, row = [], 0
        for item, p in zip(sched.scheduled, plan, strict=True):
            sample_rows.append(row + len(item.token_ids) - len(item.draft_token_ids) - 1 - p.logits_from)
            if item.wants_prompt_logprobs:
                self._record_prompt_logprobs(item, logits[row : row + len(p.token_ids) - p.logits_from],
                                             item.num_cached + p.logits_from)
            row += len(p.token_ids) - p.logits_from
        emitted = self._choose_tokens(sched.scheduled, sample_rows, logits)

        num_rejected: dict[str, int] = {}
        outputs, finished = [], []
        now = time.perf_counter()
        for item in sched.scheduled:
            seq, prompt_len = item.seq, len(item.seq.prompt_token_ids)
            num_prompt = min(prompt_len, item.num_cached + len(item.token_ids)) - item.num_cached
            if num_prompt > 0 and seq.first_token_time is None:
                seq.prefill_chunks.append((run_start - seq.arrival_time, now - seq.arrival_time, num_prompt))
        for item, (tokens, logprobs) in zip(sched.scheduled, emitted, strict=True):
            if tokens is None:
                continue
            seq = item.seq
            seq.first_token_time = seq.first_token_time or now
            if item.draft_token_ids:
                accepted = len(tokens) - 1
                num_rejected[seq.request_id] = len(item.draft_token_ids) - accepted
                self.speculation.count_acceptance(self.spec_stats, seq, len(item.draft_token_ids), accepted)
            num_appended = 0
            for token in tokens:
                self._append_token(seq, token)
                num_appended += 1
                if seq.finish_reason is not None:
                    finished.append(seq)
                    break
            if logprobs is not None:
                # Only the tokens appended: an eos among the accepted drafts drops those after it.
                seq.new_logprobs.extend(logprobs[:num_appended])
        draft_s = 0.0
        if self.speculation is not None:
            draft_start = time.perf_counter()
            self.speculation.propose(sched.scheduled, [len(p.token_ids) for p in plan], output.aux_hidden,
                                     num_rejected)
            draft_s = time.perf_counter() - draft_start
            self.spec_stats.draft_time_s += draft_s
        # After the draft: a block enters the prefix cache only with the draft's KV written too.
        self.scheduler.update_after_step(sched, num_rejected)
        for seq in finished:
            self.scheduler.remove(seq)
            del self.requests[seq.request_id]
            self._release(seq.request_id)
        for item, (tokens, _) in zip(sched.scheduled, emitted, strict=True):
            if tokens is not None:
                outputs.append(item.seq.take_delta(len(item.draft_token_ids)))
        step_s = time.perf_counter() - step_start
        self.spec_stats.step_time_s += step_s
        if self.speculation is not None:
            self.speculation.observe_step(sched.scheduled, plan, execute_s, step_s - execute_s - draft_s)
        return outputs

    def _choose_tokens(self, scheduled: list[ScheduledSequence], sample_rows: list[int], logits: torch.Tensor,
                       ) -> list[tuple[list[int] | None, list[PositionLogprobs] | None]]:
        """Per scheduled sequence: the tokens to append (one sampled token, or the verified drafts
        plus the correction/bonus), or None when it is mid-prefill; and their logprobs when asked."""
        emitted: list[tuple[list[int] | None, list[PositionLogprobs] | None]] = [(None, None)] * len(scheduled)
        choose_from = self._masked(scheduled, sample_rows, logits)  # logprobs stay the model's own
        plain = [i for i, item in enumerate(scheduled) if item.samples and not item.draft_token_ids]
        if plain:
            rows = [sample_rows[i] for i in plain]
            seqs = [scheduled[i].seq for i in plain]
            tokens = sample(choose_from[rows], [s.params for s in seqs], [s.random for s in seqs],
                            [s.num_tokens for s in seqs], [s.prompt_token_ids for s in seqs],
                            [s.output_token_ids for s in seqs]).tolist()
            for i, row, token in zip(plain, rows, tokens, strict=True):
                emitted[i] = [token], self._logprobs(scheduled[i].seq, logits[row : row + 1], [token])
        verifying = [i for i, item in enumerate(scheduled) if item.samples and item.draft_token_ids]
        if verifying:
            seqs = [scheduled[i].seq for i in verifying]
            verified = verify_batch(choose_from, [sample_rows[i] for i in verifying],
                                    [scheduled[i].draft_token_ids for i in verifying], [s.draft_probs for s in seqs],
                                    [s.params for s in seqs], [s.random for s in seqs], [s.num_tokens for s in seqs],
                                    coupled=self.config.speculative.coupled_verification)
            for i, seq, tokens in zip(verifying, seqs, verified, strict=True):
                emitted[i] = tokens, self._logprobs(seq, logits[sample_rows[i] : sample_rows[i] + len(tokens)], tokens)
        return emitted

    def _masked(self, scheduled: list[ScheduledSequence], sample_rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits with every row a structured request samples or verifies masked (-inf) to what its
        grammar allows there: its first row after the tokens so far, each next row after the drafts
        before it. logits itself when no request of the step has a grammar."""
        matchers = [(item.seq.grammar, row, item.draft_token_ids)
                    for item, row in zip(scheduled, sample_rows, strict=True)
                    if item.samples and item.seq.grammar is not None]
        if not matchers:
            return logits
        return masked(logits, self.validator.grammars.fill_masks(matchers, logits.shape[0]))

    def _release(self, request_id: str) -> None:
        """Tell the executor (with the next step) and the proposer (with its next call) to forget a
        request that left."""
        self.left_request_ids.append(request_id)
        if self.speculation is not None:
            self.speculation.release(request_id)

    def _logits_from(self, item: ScheduledSequence) -> int:
        """First of the step's tokens whose logits are needed: all of them while prompt logprobs are
        being collected, else the last known token's and the drafts' when it is sampled, else none.
        A request recomputed after a preemption verifies its drafts after a long chunk: [t0 .. t9 d1 d2]
        -> logits from t9."""
        if item.wants_prompt_logprobs:
            return 0
        if not item.samples:
            return len(item.token_ids)
        return len(item.token_ids) - len(item.draft_token_ids) - 1

    def _fail_all(self) -> None:
        """The replica cannot run steps: drop every request and its blocks, so nothing waits forever."""
        for seq in list(self.requests.values()):
            self.scheduler.remove(seq)
        self.requests.clear()
        self.compiling.clear()

    def shutdown(self) -> None:
        self.validator.close()
        self.executor.shutdown()

    # ---- bookkeeping after sampling -------------------------------------------------------------

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
                                                seq.params.prompt_logprobs))

    def _logprobs(self, seq: Sequence, logits: torch.Tensor, token_ids: list[int]) -> list[PositionLogprobs] | None:
        """logits [len(token_ids), vocab]: the rows that chose token_ids. Token ids only: the front end
        decodes them."""
        if seq.params.logprobs is None:
            return None
        return top_logprobs(torch.log_softmax(logits, dim=-1), token_ids, seq.params.logprobs)

    def _append_token(self, seq: Sequence, token: int) -> None:
        params = seq.params
        seq.append_token(token)
        if seq.grammar is not None and not seq.grammar.consume_token(token):
            raise RuntimeError(f"the grammar of {seq.request_id!r} refused token {token} that its mask allowed "
                               f"({seq.grammar.get_error()[:200]})")
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.finish("stop", token)
        elif seq.grammar is not None and seq.grammar.is_stopped():  # complete: nothing but eos could follow
            seq.finish("stop")
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length")
