"""A model sharded over Ray worker actors computes what the single-process model computes, with the
routed experts split by width (moe_parallel="tensor") or whole (moe_parallel="expert").

Checkpoints have an expert count the workers do not divide (5 over 2 and over 4), top-1 and top-2
routing and, at N=4, more workers than KV heads (KV heads replicated)."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_checkpoints import make_text_checkpoint
from helpers.waiting import free_cpus, wait_for_cpus
from warpspec import LLM, SamplingParams
from warpspec.errors import PlacementError

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=5, logprobs=2)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 160, (n,), generator=gen).tolist() for n in (30, 7, 19)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("sharded"), num_local_experts=5, interleave_moe_layer_step=2,
                                num_attention_heads=4, num_key_value_heads=2, attention_chunk_size=8,
                                floor_scale=4, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def single_process(checkpoint):
    with LLM(str(checkpoint), dtype="float32") as llm:
        return llm.generate(_prompts(), PARAMS)


def assert_same_outputs(got, expected) -> None:
    for out, ref in zip(got, expected, strict=True):
        assert out.token_ids == ref.token_ids
        for position in range(1, len(ref.prompt_logprobs)):
            for token, logprob in ref.prompt_logprobs[position].items():
                assert abs(out.prompt_logprobs[position][token].logprob - logprob.logprob) < 1e-4


@pytest.mark.parametrize("num_workers,dispatch,moe_parallel", [
    (1, "compiled", "tensor"), (2, "compiled", "tensor"), (2, "compiled", "expert"), (2, "actor", "tensor")])
def test_sharded_matches_single_process(ray_cluster, checkpoint, single_process, num_workers, dispatch,
                                        moe_parallel):
    with LLM(str(checkpoint), dtype="float32", num_workers=num_workers, executor="ray", dispatch=dispatch,
             moe_parallel=moe_parallel) as llm:
        assert_same_outputs(llm.generate(_prompts(), PARAMS), single_process)


@pytest.mark.parametrize("moe_parallel", ["tensor", "expert"])
def test_top2_routing_over_two_workers(ray_cluster, tmp_path_factory, moe_parallel):
    """Each token's two experts may live on different ranks (expert) or in slices on both (tensor)."""
    path = tmp_path_factory.mktemp("top2")
    make_text_checkpoint(path, num_local_experts=5, num_experts_per_tok=2, interleave_moe_layer_step=1,
                         num_attention_heads=4, num_key_value_heads=2)
    with LLM(str(path), dtype="float32") as llm:
        expected = llm.generate(_prompts(), PARAMS)
    with LLM(str(path), dtype="float32", num_workers=2, moe_parallel=moe_parallel) as llm:
        assert_same_outputs(llm.generate(_prompts(), PARAMS), expected)


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_vocabulary_the_workers_do_not_divide(ray_cluster, tmp_path, tie_word_embeddings):
    """509 ids over 2 ranks: padded shards of 255 rows (255 + 254 real). Before the padding, rank 0's
    gather assumed its own shard size for both ranks and returned wrong logits, ids past the vocabulary included."""
    path = make_text_checkpoint(tmp_path / "odd", vocab_size=509, num_local_experts=4, interleave_moe_layer_step=2,
                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie_word_embeddings)
    prompts = [[508, 3, 254, 255, 256, 17], [1, 2, 3]]  # ids at both ends of both shards
    with LLM(str(path), dtype="float32") as llm:
        expected = llm.generate(prompts, PARAMS)
    with LLM(str(path), dtype="float32", num_workers=2) as llm:
        got = llm.generate(prompts, PARAMS)
    assert_same_outputs(got, expected)
    assert all(0 <= t < 509 for out in got for t in out.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("moe_parallel", ["tensor", "expert"])
def test_four_workers_with_uneven_experts_vocabulary_and_replicated_kv_heads(ray_cluster, tmp_path, moe_parallel):
    # 510 ids over 4 ranks: shards of 128 rows, the last two with 127 real ones. Top-2 of 5 experts.
    path = make_text_checkpoint(tmp_path / "four", num_local_experts=5, num_experts_per_tok=2,
                                interleave_moe_layer_step=1, vocab_size=510, num_attention_heads=4,
                                num_key_value_heads=2, attention_chunk_size=8, floor_scale=4)
    with LLM(str(path), dtype="float32") as llm:
        expected = llm.generate(_prompts(), PARAMS)
    with LLM(str(path), dtype="float32", num_workers=4, moe_parallel=moe_parallel) as llm:
        infos = llm.engine.coordinator.info.workers
        assert_same_outputs(llm.generate(_prompts(), PARAMS), expected)
    sizes = [info.param_bytes for info in infos]
    if moe_parallel == "expert":  # 5 experts over 4 ranks: 2, 1, 1, 1
        assert sizes[0] > sizes[1] == sizes[2] == sizes[3]
    else:  # a quarter of every expert each
        assert sizes[0] == sizes[1] == sizes[2] == sizes[3]


def test_each_worker_reads_and_holds_only_its_shard(ray_cluster, tmp_path):
    path = make_text_checkpoint(tmp_path / "even", num_local_experts=4, interleave_moe_layer_step=1,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    with LLM(str(path), dtype="float32") as llm:
        model = llm.engine.executor.runner.model
        whole = model.load_report.param_bytes
        # Held whole by every rank: the norms and the MoE routers.
        replicated = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                         if name.endswith(("norm.weight", "router.weight")))
    with LLM(str(path), dtype="float32", num_workers=2) as llm:
        infos = llm.engine.coordinator.info.workers
    expected = (whole - replicated) / 2 + replicated
    for info in infos:
        assert info.bytes_read == info.param_bytes  # read from the file exactly what it keeps
        assert abs(info.param_bytes - expected) <= 0.1 * expected, (info, expected)


def test_decode_step_uses_two_collectives_per_layer(ray_cluster, checkpoint):
    """Per decode step: per layer, the fused reduction after attention and after the feed-forward
    (the embedding's reduction rides in layer 0's); then the final norm's and the logits gather."""
    num_layers = 4
    with LLM(str(checkpoint), dtype="float32", num_workers=2) as llm:
        # The core steps on its own, ahead of the caller: count over a whole request, in its steps.
        coordinator = llm.engine.coordinator
        coordinator.record_timings()
        before = coordinator.num_collectives()
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        after = coordinator.num_collectives()
        num_steps = len(coordinator.take_timings())
    assert num_steps == 3  # a prefill step and two decode steps, each a forward with the same collectives
    assert [a - b for a, b in zip(after, before, strict=True)] == [num_steps * (2 * num_layers + 2)] * 2


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """The checkpoint's kinds of layer in two (chunked and dense, then NoPE and MoE): what each rank
    compiles costs about 2.5 s per layer and graph. Its single process's outputs with it."""
    path = make_text_checkpoint(tmp_path_factory.mktemp("two-layers"), num_hidden_layers=2, no_rope_layers=[1, 0],
                                num_local_experts=5, interleave_moe_layer_step=2, num_attention_heads=4,
                                num_key_value_heads=2, attention_chunk_size=8, floor_scale=4,
                                tie_word_embeddings=False)
    with LLM(str(path), dtype="float32") as llm:
        return path, llm.generate(_prompts(), PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("comm_backend,joined", [("auto", "shm"), ("gloo", "gloo")])
def test_compiled_steps_over_two_workers_match_single_process(ray_cluster, two_layers, tmp_path, comm_backend,
                                                              joined):
    """Each rank runs its decode steps as one compiled graph, with collectives the compiler traces,
    and emits the eager single process's tokens and logprobs. A compiled step's collectives are not
    counted: over a prompt and two decode steps, only the prompt's show. On one host the ranks meet
    in shared memory unless told gloo."""
    checkpoint, single_process = two_layers
    num_layers = 2
    with LLM(str(checkpoint), dtype="float32", num_workers=2, enforce_eager=False, run_dir=str(tmp_path),
             comm_backend=comm_backend) as llm:
        assert [info.comm_backend for info in llm.engine.coordinator.info.workers] == [joined] * 2
        assert_same_outputs(llm.generate(_prompts(), PARAMS), single_process)
        coordinator = llm.engine.coordinator
        before = coordinator.num_collectives()
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        after = coordinator.num_collectives()
    assert [a - b for a, b in zip(after, before, strict=True)] == [2 * num_layers + 2] * 2


def test_impossible_splits_fail_before_loading(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="num_workers=3 must divide num_attention_heads=4"):
        LLM(str(checkpoint), num_workers=3)
    with pytest.raises(ValueError, match="moe_parallel must be one of tensor, expert, got 'experts'"):
        LLM(str(checkpoint), num_workers=2, moe_parallel="experts")
    # 3 experts over 4 ranks: fine split by width, impossible whole. The checkpoint's config is all
    # that is read (its weights are missing).
    few = make_text_checkpoint(tmp_path / "few", num_local_experts=3, num_attention_heads=4, num_key_value_heads=2)
    (few / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="num_workers=4 exceeds num_local_experts=3: with moe_parallel='expert'"):
        LLM(str(few), num_workers=4, moe_parallel="expert")
    # Split by width, every routed expert's intermediate size must divide (as the shared expert's must).
    narrow = make_text_checkpoint(tmp_path / "narrow", intermediate_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_workers=4 must divide intermediate_size=30"):
        LLM(str(narrow), num_workers=4, moe_parallel="tensor")
    with pytest.raises(ValueError, match="executor='local' runs one worker; num_workers=2 needs executor='ray'"):
        LLM(str(checkpoint), num_workers=2, executor="local")
    with pytest.raises(ValueError, match="num_workers must be a positive integer, got 0"):
        LLM(str(checkpoint), num_workers=0)


def test_more_workers_than_the_cluster_can_hold(ray_cluster, tmp_path):
    path = make_text_checkpoint(tmp_path / "wide", num_attention_heads=16, num_key_value_heads=16, head_dim=4,
                                num_local_experts=16, intermediate_size=16, intermediate_size_mlp=16)
    message = r"num_workers=16 needs 16 CPU \(one per worker\) but the Ray cluster has 8"
    with pytest.raises(PlacementError, match=message):
        LLM(str(path), num_workers=16)


def test_placement_that_cannot_be_satisfied_times_out(ray_cluster, checkpoint):
    from ray.util.placement_group import placement_group, remove_placement_group

    free = free_cpus(ray_cluster)
    # At most one CPU of the 8 stays free (a serving replica of another suite may hold one):
    # two workers cannot be placed.
    hog = placement_group([{"CPU": ray_cluster.cluster_resources()["CPU"] - 1}])
    ray_cluster.get(hog.ready(), timeout=30)
    try:
        with pytest.raises(PlacementError, match=r"could not place 2 workers .* within 2 s"):
            LLM(str(checkpoint), num_workers=2, placement_timeout_s=2)
    finally:
        remove_placement_group(hog)
    wait_for_cpus(ray_cluster, free)


def test_the_coordinator_keeps_step_timings_only_when_asked(ray_cluster, checkpoint):
    """A replica runs for months: the coordinator used to keep one DispatchTiming per step forever."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(checkpoint), dtype="float32", num_workers=1, executor="ray") as llm:
        coordinator = llm.engine.coordinator
        llm.generate([[1, 2, 3]], params)
        assert coordinator.take_timings() == []
        coordinator.record_timings()
        llm.generate([[1, 2, 3]], params)
        timings = coordinator.take_timings()
        assert len(timings) == 6 and all(t.wall_s >= t.slowest_compute_s > 0 for t in timings)  # prefill + 5 decodes
        assert coordinator.take_timings() == []  # taken, not kept
