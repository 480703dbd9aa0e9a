"""EAGLE-3 proposals: catch the draft up on the positions the target just verified, then run it
k - 1 more steps on its own output.

Position pairing (as in EAGLE and vLLM): the draft at position p reads the target's features at p
and the token at p + 1, and predicts the token at p + 2. With target tokens [a0 a1 a2] and a freshly
sampled a3: catch-up runs positions 0..2 on tokens [a1 a2 a3] and predicts d1 (for position 4) from
the last row; the next step runs position 3 on token d1 with the draft's own pre-norm output as the
feature, predicting d2; and so on. The draft's KV cache shares the target's block tables, so a
position's draft KV lives in the request's own block and is recomputed with it after a preemption.

The draft's own k - 1 steps write KV past the request's last known token, where the request may
hold no block yet. Those entries are scratch (the next catch-up overwrites them), so they go to
scratch blocks at the end of the draft's cache instead of taking blocks from the engine: the number
of drafts never depends on how full the KV cache is. An engine makes room for the scratch blocks of
max_num_seqs requests at start-up (scratch_reserve); the cache grows, copied whole, only past them.

On a CPU every steady-state draft step runs as one compiled graph. After a verification a request
catches up on 1 to k + 1 positions (the accepted drafts and the bonus token); that catch-up is padded
to k + 1 positions, repeating the last token and feature, so every request's looks alike and one
graph serves any mix of acceptances. The padded positions lie past the last known token, where
drafts write scratch KV anyway: their KV and logits are never read. Of the real positions only the
last one's output is read (by the next draft step), so a compiled catch-up writes KV for every row
and runs attention, the MLP and lm_head for that row alone. A catch-up over more positions (a
prompt, or a recompute after preemption) runs eagerly, with its dense halves compiled: on a CPU
saved whole like the step graphs (workers/compile/step_artifacts.py), so a later start loads them.

When every request drafts greedily and wants all k drafts (the steady state of greedy serving), the
padded catch-up, the k - 1 steps after it and the argmax between them are one compiled graph: a
draft step costs a few hundred microseconds here, and each separate graph call adds its guards, its
thread switch and the Python that builds its inputs. Each step's position, slot and context length
follow from the catch-up's inside the graph. Sampled drafts draw from per-request generators on the
host, so they keep one graph per step, as do the drafts of a structured output: each step's logits
are masked to what its grammar allows next (read at the draft vocabulary's ids), and its matcher
consumes each draft, then rolls them back. Where the grammar is complete, or allows no token the
draft knows, the draft proposes the grammar's first allowed token with certainty: every request
still drafts k tokens, so verification stays one uniform, compiled step. On a GPU that greedy
proposal replays a CUDA graph instead (workers/compile/draft_cuda_graphs.py); everything else runs as it
did, the dense halves compiled.
"""

from __future__ import annotations

import warnings

import torch

from warpspec.kernels import PagedAttentionMetadata, batch_invariant
from warpspec.sample.sampler import exponential_noise, greedy_tokens
from warpspec.spec_decode.draft_runner import (
    CompiledWithFallback,
    DraftGraphs,
    GraphKey,
    GraphToBuild,
    dense_half_graph,
    mark_rows_dynamic,
    tables_with_scratch,
    with_blocks,
)
from warpspec.spec_decode.proposer import DraftRequest, Drafts
from warpspec.structured_output.grammar import allowed_next, masked
from warpspec.workers.compile.compiled_step import MIN_BLOCKS, CountingCompiler, step_marker, widen_block_tables
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig
from warpspec.workers.compile.draft_cuda_graphs import DraftGraphRunner
from warpspec.workers.compile.step_artifacts import StepArtifacts, module_identity
from warpspec.workers.compile.torch_internals import mark_dynamic
from warpspec.workers.models.eagle3_draft import Eagle3Draft
from warpspec.workers.step import SequenceStep, StepInput, int_tensor, padded_block_tables

GREEDY_PROPOSAL = "greedy proposal"  # its graph's key in DraftGraphs.thread_counts


class Eagle3Proposer:
    def __init__(self, draft: Eagle3Draft, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 compile: bool = True, deterministic: bool = False, num_speculative_tokens: int = 3,
                 cuda_graphs: CudaGraphConfig | None = None, scratch_blocks: int = 0):
        """deterministic: draft in kernels/batch_invariant.py's mode, eagerly (the mode's float64
        weight copies are made on first use, a side effect torch.compile would not keep).
        num_speculative_tokens: k, the most drafts a request asks for; catch-ups are padded to k + 1.
        cuda_graphs: on a CUDA device (compiled, not deterministic), replay greedy proposals of these
        batch sizes and lengths as CUDA graphs (workers/compile/draft_cuda_graphs.py); on a CPU, a largest
        batch size of 1 (max_num_seqs 1) leaves out the compiled steps' graphs for several requests.
        scratch_blocks: room for scratch blocks after the engine's, made up front
        (draft_runner.scratch_reserve):
        the cache grows past them only when a step needs more, and growing copies the whole cache
        (2 GiB of a small model's default one took most of an engine's warm-up)."""
        c = draft.config
        self.deterministic = deterministic
        self.device = torch.device(device)
        self.draft = draft.move_to(self.device)
        self.block_size = block_size
        self.aux_layer_ids = c.aux_layer_ids
        self.num_blocks = num_blocks  # the engine's; scratch blocks follow them (see _with_scratch)
        # [draft_vocab] target id of every draft id, on the CPU where drafts are sampled.
        self.target_ids = self.draft.to_target_ids(torch.arange(c.draft_vocab_size)).cpu()
        draft.kv_cache = torch.zeros(2, num_blocks + scratch_blocks, block_size, c.num_key_value_heads, c.head_dim,
                                     dtype=draft.fc.dtype, device=device)
        # Its block count grows with scratch blocks (_with_scratch): symbolic in the compiled steps,
        # which would otherwise be built again at every growth.
        mark_dynamic(draft.kv_cache, 1)
        self.catch_up_len = num_speculative_tokens + 1
        self.several_requests = cuda_graphs is None or cuda_graphs.several_sequences
        self.decode_compiler: CountingCompiler | None = None
        self.compiled_decode: CompiledWithFallback | None = None
        self.catch_up_compiler: CountingCompiler | None = None
        self.compiled_catch_up: CompiledWithFallback | None = None
        self.greedy_proposal_compiler: CountingCompiler | None = None
        self.compiled_greedy_proposal: CompiledWithFallback | None = None
        self.draft_graphs: DraftGraphRunner | None = None
        if cuda_graphs is not None and compile and not deterministic and self.device.type == "cuda":
            self.draft_graphs = DraftGraphRunner(self._greedy_proposal_forward, cuda_graphs.batch_sizes,
                                                 -(-cuda_graphs.max_model_len // block_size), block_size)
        # Keyed by (the query length of a step graph, or GREEDY_PROPOSAL; whether it runs one request).
        self.graphs = DraftGraphs()
        if compile and not deterministic:
            artifacts = None
            if self.device.type == "cpu":
                # Saved whole and loaded by name (workers/compile/step_artifacts.py): their guards refuse every
                # later start, as the KV cache is marked dynamic for its whole life and the draft's
                # rotary and vocabulary-map tensors were made outside inference mode. The name holds
                # what the graphs are specialized on: the draft's weights' shapes, its config, the
                # block size and the catch-up length; thread counts and step shapes are in the key.
                artifacts = StepArtifacts(f"{module_identity(draft)} {block_size} {self.catch_up_len}",
                                          check_guards=False)
            # The dense halves around attention take only tensors whose one varying size is the token
            # count, so one dynamic-shape graph serves every step; on a CPU saved whole as well, keyed
            # by what else they specialize on (dense_half_graph), instead of traced at every start.
            for name in ("before_attention", "after_attention"):
                half = getattr(draft, name)
                whole = CountingCompiler(half, artifacts, mark_rows_dynamic) if artifacts is not None else None
                setattr(draft, name, CompiledWithFallback(half, "the EAGLE-3 draft", compiled=whole,
                                                          graph_of=dense_half_graph if whole is not None else None))
            if artifacts is not None:
                # The k - 1 steps after the catch-up run one token per request: on a CPU the whole
                # step, attention included, is one compiled graph (workers/compile/compiled_step.py).
                self.decode_compiler = CountingCompiler(self._decode_forward, artifacts, step_marker(5))
                self.compiled_decode = CompiledWithFallback(self._decode_forward, "the EAGLE-3 draft's decode step",
                                                            compiled=self.decode_compiler)
                self.catch_up_compiler = CountingCompiler(self._catch_up_forward, artifacts, step_marker(5))
                self.compiled_catch_up = CompiledWithFallback(self._catch_up_forward, "the EAGLE-3 draft's catch-up",
                                                              compiled=self.catch_up_compiler)
                self.greedy_proposal_compiler = CountingCompiler(self._greedy_proposal_forward, artifacts,
                                                                 step_marker(5))
                self.compiled_greedy_proposal = CompiledWithFallback(
                    self._greedy_proposal_forward, "the EAGLE-3 draft's greedy proposal",
                    compiled=self.greedy_proposal_compiler)

    def _run(self, plan: list[SequenceStep], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = StepInput.build(plan, self.block_size).to(self.device)
        if self.compiled_decode is not None and step.max_query_len == 1:
            logits, prenorm = self.graphs.run(self.compiled_decode, self._compiled_inputs(step, features),
                                                 self._graph_of(step))
        else:
            meta = PagedAttentionMetadata(step.query_start_loc, step.seq_lens, step.block_tables, self.block_size,
                                          step.max_query_len, step.max_seq_len)
            logits, prenorm = self.draft(step.input_ids, features, step.positions, step.slot_mapping, meta)
        return logits[step.logits_indices], prenorm[step.logits_indices]

    def _padded_catch_up(self, requests: list[DraftRequest], features: torch.Tensor, tables: list[list[int]],
                         ) -> tuple[StepInput, torch.Tensor, torch.Tensor]:
        """Every request's catch-up padded to catch_up_len positions (module docstring): the step, its
        feature rows, and the row of each request's last real position."""
        n = self.catch_up_len
        plan = [SequenceStep(r.token_ids + r.token_ids[-1:] * (n - r.num_positions), r.first_position, table, 0)
                for r, table in zip(requests, tables, strict=True)]
        rows = int_tensor([r.feature_start + min(j, r.num_positions - 1) for r in requests for j in range(n)])
        last = int_tensor([i * n + r.num_positions - 1 for i, r in enumerate(requests)])
        step = StepInput.build(plan, self.block_size).to(self.device)
        return step, features[rows.to(self.device)], last.to(self.device)

    def _run_padded_catch_up(self, requests: list[DraftRequest], features: torch.Tensor,
                             tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded catch-up as one compiled step; the logits and pre-norm output at the last real
        position of each request that wants drafts (as _run returns them)."""
        step, features, last = self._padded_catch_up(requests, features, tables)
        logits, prenorm = self.graphs.run(self.compiled_catch_up, self._compiled_inputs(step, features, last),
                                             self._graph_of(step))
        wants_drafts = torch.tensor([bool(r.num_drafts) for r in requests], device=self.device)
        return logits[wants_drafts], prenorm[wants_drafts]

    def _run_greedy_proposal(self, requests: list[DraftRequest], features: torch.Tensor,
                             tables: list[list[int]], spare_block: int) -> list[list[int]]:
        """Every request's k greedy drafts (target ids) from one compiled graph (module docstring), or
        on a GPU one CUDA graph; spare_block: a block no table holds, a CUDA graph's pad block."""
        inputs = self._greedy_proposal_args(requests, features, tables)
        if self.draft_graphs is not None:
            try:
                drafts = self.draft_graphs.run(inputs, spare_block, self.draft.kv_cache)
            except Exception as error:  # noqa: BLE001 - a capture that fails: run without graphs from now on
                warnings.warn(f"CUDA graphs of the EAGLE-3 draft failed ({type(error).__name__}: {error}); "
                              "proposing without them", stacklevel=2)
                self.draft_graphs, drafts = None, None
            if drafts is not None:
                return drafts.tolist()
        if self.compiled_greedy_proposal is None:  # a GPU proposal the graphs do not take
            return self._greedy_proposal_forward(*inputs).tolist()
        return self.graphs.run(self.compiled_greedy_proposal, inputs, (GREEDY_PROPOSAL, len(requests) == 1)).tolist()

    def _greedy_proposal_args(self, requests: list[DraftRequest], features: torch.Tensor,
                              tables: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """The arguments of _greedy_proposal_forward for requests (their tables with scratch)."""
        step, features, last = self._padded_catch_up(requests, features, tables)
        # The whole tables, not the catch-up's: the steps after it write up to k - 1 positions further.
        full_tables = padded_block_tables(tables, max(MIN_BLOCKS, max(map(len, tables))))
        return self._greedy_proposal_inputs(step, features, full_tables.to(self.device), last)

    @staticmethod
    def _compiled_inputs(step: StepInput, features: torch.Tensor,
                         last_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The arguments of _decode_forward, or with last_rows of _catch_up_forward: block tables
        widened (workers/compile/compiled_step.py)."""
        block_tables = widen_block_tables(step.block_tables)
        return (step.input_ids, features, step.positions, step.query_start_loc, step.seq_lens, block_tables,
                step.slot_mapping, *(() if last_rows is None else (last_rows,)))

    @staticmethod
    def _greedy_proposal_inputs(step: StepInput, features: torch.Tensor, block_tables: torch.Tensor,
                                last: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The arguments of _greedy_proposal_forward."""
        return (step.input_ids, features, step.positions, step.query_start_loc, step.seq_lens, block_tables,
                step.slot_mapping, last)

    @staticmethod
    def _graph_of(step: StepInput) -> GraphKey:
        return step.max_query_len, len(step.seq_lens) == 1

    # Two entry points over _uniform_forward, not one with the query length as an argument: each
    # has its own code object, so each CountingCompiler counts only its own graphs.
    def _decode_forward(self, input_ids, features, positions, query_start_loc, seq_lens, block_tables, slot_mapping):
        """One token per request, logits for each: the draft's whole step."""
        return self._uniform_forward(input_ids, features, positions, query_start_loc, seq_lens, block_tables,
                                     slot_mapping, 1)

    def _catch_up_forward(self, input_ids, features, positions, query_start_loc, seq_lens, block_tables,
                          slot_mapping, last_rows):
        """catch_up_len tokens per request (the target's features): the logits and pre-norm output
        at each request's last real row (last_rows)."""
        # Unused: only the last rows attend, with one-row-per-request metadata of their own.
        del query_start_loc, seq_lens
        logits, prenorm, _ = self._last_rows_of_catch_up(input_ids, features, positions, block_tables, slot_mapping,
                                                         last_rows)
        return logits, prenorm

    def _last_rows_of_catch_up(self, input_ids, features, positions, block_tables, slot_mapping, last_rows):
        """The padded catch-up: KV for every row, then attention, MLP and logits only at last_rows,
        the one row per request whose output the next draft step reads. The others' outputs were
        never read: only their KV is (a 4-row catch-up's lm_head, MLP and attention then run on 1).
        Returns the logits, pre-norm outputs and positions of last_rows."""
        q, residual = self.draft.write_kv(input_ids, features, positions, slot_mapping)
        position = positions[last_rows]
        one_token_each = torch.arange(last_rows.shape[0] + 1, device=last_rows.device)
        meta = PagedAttentionMetadata(one_token_each, position + 1, block_tables, self.block_size, 1,
                                      block_tables.shape[1] * self.block_size, num_tokens=last_rows.shape[0],
                                      is_uniform=True)
        logits, prenorm = self.draft.attend(q[last_rows], residual[last_rows], meta)
        return logits, prenorm, position

    def _greedy_proposal_forward(self, input_ids, features, positions, query_start_loc, seq_lens, block_tables,
                                 slot_mapping, last_rows):
        """The padded catch-up (last_rows: each request's last real row), then k - 1 single-token
        steps, each on the argmax of the one before: [num_requests, k] drafts as target ids. A
        step's position is the one after the last; its slot and context length follow from it."""
        del query_start_loc, seq_lens  # as in _catch_up_forward
        logits, prenorm, position = self._last_rows_of_catch_up(input_ids, features, positions, block_tables,
                                                                slot_mapping, last_rows)
        one_token_each = torch.arange(last_rows.shape[0] + 1, device=last_rows.device)
        drafts = [self.draft.to_target_ids(logits.argmax(dim=-1))]
        for _ in range(self.catch_up_len - 2):
            position = position + 1
            block = block_tables.gather(1, (position // self.block_size)[:, None])[:, 0].long()
            slot = block * self.block_size + position % self.block_size
            logits, prenorm = self._uniform_forward(drafts[-1], prenorm, position, one_token_each, position + 1,
                                                    block_tables, slot, 1)
            drafts.append(self.draft.to_target_ids(logits.argmax(dim=-1)))
        return torch.stack(drafts, dim=1)

    def _uniform_forward(self, input_ids, features, positions, query_start_loc, seq_lens, block_tables, slot_mapping,
                         query_len: int):
        meta = PagedAttentionMetadata(query_start_loc, seq_lens, block_tables, self.block_size, query_len,
                                      block_tables.shape[1] * self.block_size, num_tokens=input_ids.shape[0],
                                      is_uniform=True)
        return self.draft(input_ids, features, positions, slot_mapping, meta)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Build the compiled graphs before the first request needs them (DraftGraphs.warm_up): the
        padded catch-up, the decode step and the greedy proposal, each for one request and (unless
        requests run one at a time: several_requests) for two; then the dense halves a prompt's
        catch-up runs. The steps write into the first blocks, which no request holds yet. Then the
        step graphs check only the guards that tell them apart (CountingCompiler.seal)."""
        if self.compiled_decode is None:
            return
        graphs = [entry for one in ((True, False) if self.several_requests else (True,))
                  for entry in self._warm_up_graphs(1 if one else 2)]
        # The longest builds first, so that none starts last: the greedy proposals (k - 1 steps
        # unrolled), then the catch-ups, each for several requests (dynamic sizes) before one.
        self.graphs.warm_up(graphs, self._warm_up_prompt,
                            first=lambda graph: (graph[0] != GREEDY_PROPOSAL, graph[0] == 1, graph[1]))
        for compiler in (self.catch_up_compiler, self.decode_compiler, self.greedy_proposal_compiler):
            compiler.seal()

    @torch.inference_mode()
    def _warm_up_prompt(self) -> None:
        """A prompt of two catch-ups, through the dense halves' graphs."""
        target_width = 3 * self.draft.config.target_hidden_size
        prompt = [SequenceStep([0] * 2 * self.catch_up_len, 0, self._warm_up_table(), 2 * self.catch_up_len - 1)]
        self._run(prompt, torch.zeros(2 * self.catch_up_len, target_width, dtype=self.draft.fc.dtype,
                                      device=self.device))

    def _warm_up_table(self) -> list[int]:
        """The first blocks, enough for a prompt of two catch-ups: every warm-up request's table."""
        return list(range(-(-2 * self.catch_up_len // self.block_size)))

    def _warm_up_graphs(self, num_requests: int) -> list[GraphToBuild]:
        """For each step graph, (its key, its compiled and its eager function, the arguments of a step
        of num_requests requests). The requests share one table: their KV lands
        in the same scratch slots."""
        one = num_requests == 1
        table = self._warm_up_table()
        catch_up = StepInput.build([SequenceStep([0] * self.catch_up_len, 0, table, 0)] * num_requests,
                                   self.block_size).to(self.device)
        decode = StepInput.build([SequenceStep([0], 0, table, 0)] * num_requests, self.block_size).to(self.device)
        catch_up_features = torch.zeros(catch_up.num_tokens, 3 * self.draft.config.target_hidden_size,
                                        dtype=self.draft.fc.dtype, device=self.device)
        decode_features = torch.zeros(num_requests, self.draft.config.hidden_size, dtype=self.draft.fc.dtype,
                                      device=self.device)
        last = torch.arange(1, num_requests + 1, device=self.device) * self.catch_up_len - 1
        full_tables = widen_block_tables(torch.tensor([table] * num_requests, dtype=torch.int32)).to(self.device)
        return [((self.catch_up_len, one), self.compiled_catch_up, self._catch_up_forward,
                 self._compiled_inputs(catch_up, catch_up_features, last)),
                ((1, one), self.compiled_decode, self._decode_forward, self._compiled_inputs(decode, decode_features)),
                ((GREEDY_PROPOSAL, one), self.compiled_greedy_proposal, self._greedy_proposal_forward,
                 self._greedy_proposal_inputs(catch_up, catch_up_features, full_tables, last))]

    def _choose(self, logits: torch.Tensor, requests: list[DraftRequest],
                step: int) -> tuple[list[int], torch.Tensor | None]:
        """Draft-vocab logits [n, draft_vocab] -> each request's draft number `step` as a target token
        id, and the target-vocab distributions they were drawn from (None when every request is
        greedy or coupled: verification then needs only the tokens)."""
        if all(r.temperature == 0 for r in requests):
            return self.draft.to_target_ids(greedy_tokens(logits)).tolist(), None
        # Sampling happens on the CPU with per-request keyed generators (seeded requests reproduce on
        # any device); the distributions are a few thousand floats per request.
        logits = logits.float().cpu()
        temperature = torch.tensor([r.temperature or 1.0 for r in requests])
        draft_probs = (logits / temperature[:, None]).softmax(dim=-1)
        target_vocab = self.draft.embed_tokens.shape[0]
        target_ids = self.target_ids
        noise = torch.stack([
            # Coupled: the target's own noise row at this position, read at the draft vocabulary's ids.
            exponential_noise([r.draft_generator(step)], target_vocab)[0, target_ids] if r.coupled
            else exponential_noise([r.draft_generator(step)], logits.shape[-1])[0] for r in requests])
        choice = greedy_tokens(draft_probs / noise)  # the exponential race of sampler.sample_from
        greedy = torch.tensor([r.temperature == 0 for r in requests])
        choice = torch.where(greedy, greedy_tokens(logits), choice)
        probs = None
        if not all(r.coupled or r.temperature == 0 for r in requests):
            probs = torch.zeros(len(requests), target_vocab)
            probs.index_copy_(1, target_ids, draft_probs)
        return self.draft.to_target_ids(choice).tolist(), probs

    def _masked_by_grammar(self, logits: torch.Tensor, requests: list[DraftRequest],
                           ) -> tuple[torch.Tensor, list[int | None]]:
        """Draft-vocab logits [n, draft_vocab] with each structured request's row masked (-inf) to
        what its grammar allows next, its target-vocab mask read at the draft vocabulary's ids; and
        per row the token to draft instead of the draft's choice, or None: where the grammar is
        complete, or allows no token of the draft's vocabulary, the first token it allows (eos, or a
        forced token: then the target accepts it)."""
        rows = [row for row, r in enumerate(requests) if r.grammar is not None]
        allowed_target = allowed_next([requests[row].grammar for row in rows], self.draft.embed_tokens.shape[0])
        allowed = torch.ones(logits.shape, dtype=torch.bool)
        allowed[rows] = allowed_target[:, self.target_ids]
        forced: list[int | None] = [None] * len(requests)
        for row, allowed_row, target_row in zip(rows, allowed[rows], allowed_target, strict=True):
            if requests[row].grammar.is_stopped() or not allowed_row.any():
                forced[row] = int(target_row.nonzero()[0, 0]) if target_row.any() else 0
                allowed[row] = True  # its logits stay finite; the forced token replaces the choice
        return masked(logits, allowed), forced

    def _with_scratch(self, requests: list[DraftRequest], padded: bool) -> tuple[list[list[int]], int]:
        """Each request's block table, extended with scratch blocks up to the last position its draft
        steps write: first_position + num_positions + num_drafts - 2, or the padded catch-up's last,
        first_position + catch_up_len - 1, when that is further; and the first block after them, which
        no table holds (in the cache when CUDA graphs need it as their pad block)."""
        last = [r.first_position + max(r.num_positions + r.num_drafts - 1, self.catch_up_len if padded else 0) - 1
                for r in requests]
        tables, next_scratch = tables_with_scratch([r.block_table for r in requests], last, self.num_blocks,
                                                   self.block_size)
        self.draft.kv_cache = with_blocks(self.draft.kv_cache, next_scratch + (self.draft_graphs is not None))
        return tables, next_scratch

    def release(self, request_ids: list[str]) -> None:
        pass  # no per-request state: the draft's KV lives in the request's own blocks

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], aux_hidden: list[torch.Tensor]) -> list[Drafts]:
        """aux_hidden: the step's captured hidden states (each [num_tokens, hidden])."""
        if not requests:
            return []
        with batch_invariant.deterministic(self.deterministic):
            return self._propose(requests, aux_hidden)

    def _propose(self, requests: list[DraftRequest], aux_hidden: list[torch.Tensor]) -> list[Drafts]:
        features = torch.cat(aux_hidden, dim=-1).to(self.device, self.draft.fc.dtype)  # [num_tokens, 3 * hidden]
        fits = all(r.num_positions <= self.catch_up_len for r in requests)
        greedy = all(r.temperature == 0 and r.num_drafts == self.catch_up_len - 1 and r.grammar is None
                     for r in requests)
        # The padded catch-up: compiled on a CPU; on a GPU only inside a greedy proposal's CUDA graph.
        padded = fits and (self.compiled_catch_up is not None or (self.draft_graphs is not None and greedy))
        tables, spare_block = self._with_scratch(requests, padded)
        if padded and greedy:
            return [Drafts(tokens) for tokens in self._run_greedy_proposal(requests, features, tables, spare_block)]
        if padded:
            logits, prenorm = self._run_padded_catch_up(requests, features, tables)
        else:
            plan = [SequenceStep(r.token_ids, r.first_position, r.block_table,
                                 logits_from=r.num_positions - 1 if r.num_drafts else r.num_positions)
                    for r in requests]
            rows = torch.cat([torch.arange(r.feature_start, r.feature_start + r.num_positions) for r in requests])
            logits, prenorm = self._run(plan, features[rows.to(self.device)])
        drafts = [Drafts([]) for _ in requests]
        active = [i for i, r in enumerate(requests) if r.num_drafts]
        probs_of: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step = 0
        consumed = [0] * len(requests)  # drafts each request's matcher consumed, rolled back at the end
        try:
            while active:
                forced: list[int | None] = [None] * len(active)
                if any(requests[i].grammar is not None for i in active):
                    logits, forced = self._masked_by_grammar(logits, [requests[i] for i in active])
                tokens, probs = self._choose(logits, [requests[i] for i in active], step)
                for row, (i, token) in enumerate(zip(active, tokens, strict=True)):
                    if forced[row] is not None:
                        # Drafted with certainty (q is one-hot there): every request still drafts all its
                        # tokens, so the verification stays uniform and runs compiled.
                        token = forced[row]
                        if probs is not None:
                            probs[row] = 0.0
                            probs[row, token] = 1.0
                    drafts[i].token_ids.append(token)
                    grammar = requests[i].grammar
                    if grammar is not None and not grammar.is_stopped():
                        grammar.consume_token(token)  # allowed: its mask said so
                        consumed[i] += 1
                    if probs is not None:
                        probs_of[i].append(probs[row])
                step += 1
                keep = [row for row, i in enumerate(active) if requests[i].num_drafts > step]
                if not keep:
                    break
                active = [active[row] for row in keep]
                # The step reading draft j (1-based) runs at position first_position + num_positions + j - 1:
                # the draft pairs position p with the token at p + 1.
                plan = [SequenceStep([drafts[i].token_ids[-1]], requests[i].first_position
                                     + requests[i].num_positions + step - 1, tables[i], 0) for i in active]
                logits, prenorm = self._run(plan, prenorm[keep])
        finally:
            for r, n in zip(requests, consumed, strict=True):
                if n:
                    r.grammar.rollback(n)
        for i, probs in probs_of.items():
            if probs:
                drafts[i].probs = torch.stack(probs)
        return drafts
