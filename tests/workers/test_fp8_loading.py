"""FP8 weights: online quantization of a full-precision checkpoint, and loading the fbgemm_fp8 layout
Meta published for Llama 4 (generated here by tests/helpers/fp8_checkpoints.py from the same checkpoint).

Both paths quantize the same tensors with the same per-output-channel rule, so their logits must be
identical; and both must stay close to the unquantized model's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.fp8_checkpoints import make_fbgemm_fp8_checkpoint
from helpers.hf_checkpoints import make_text_checkpoint
from warpspec import LLM, SamplingParams
from warpspec.cli.main import main
from warpspec.kernels.fp8 import FP8_DTYPE
from warpspec.workers.distributed.comm import Communicator
from warpspec.workers.errors import CheckpointError
from warpspec.workers.kv_cache import allocate_kv_cache
from warpspec.workers.loader import load_model
from warpspec.workers.step import SequenceStep, StepInput

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # 5 experts (uneven over 2 ranks), MoE every other layer (dense MLPs too), untied lm_head.
    return make_text_checkpoint(tmp_path_factory.mktemp("fp32"), num_local_experts=5, interleave_moe_layer_step=2,
                                num_experts_per_tok=2, num_key_value_heads=2, attention_chunk_size=8,
                                tie_word_embeddings=False)


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoint, tmp_path_factory):
    return make_fbgemm_fp8_checkpoint(checkpoint, tmp_path_factory.mktemp("fbgemm_fp8"))


def prompt() -> list[int]:
    return torch.randint(3, 160, (24,), generator=torch.Generator().manual_seed(0)).tolist()


def prompt_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits at every position of one prefill."""
    dtype = model.model.embed_tokens.weight.dtype
    num_kv_heads = model.model.layers[0].self_attn.num_kv_heads
    model.bind_kv_cache(allocate_kv_cache(model.config, num_kv_heads, 16, BLOCK, dtype, torch.device("cpu")))
    step = StepInput.build([SequenceStep(tokens, 0, list(range(16)), logits_from=0)], block_size=BLOCK)
    with torch.inference_mode():
        hidden, _ = model(step.input_ids, step.positions, step)
        return model.compute_logits(hidden[step.logits_indices])


def test_online_fp8_quantizes_linears_and_experts_only(checkpoint):
    model = load_model(checkpoint, "float32", quantization="fp8")
    params = dict(model.named_parameters())
    layer0, layer1 = "model.layers.0.", "model.layers.1."  # dense, MoE
    for name in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "feed_forward.gate_up_proj.weight",
                 "feed_forward.down_proj.weight"):
        assert params[layer0 + name].dtype == FP8_DTYPE
        assert params[layer0 + name + "_scale"].shape == params[layer0 + name].shape[:1]
    experts = layer1 + "feed_forward.experts."
    assert params[experts + "gate_up_proj"].dtype == params[experts + "down_proj"].dtype == FP8_DTYPE
    assert params[experts + "gate_up_proj_scale"].shape == (5, 2 * 32)  # [E, 2I]
    assert params[experts + "down_proj_scale"].shape == (5, 64)  # [E, H]
    assert params[layer1 + "feed_forward.shared_expert.down_proj.weight"].dtype == FP8_DTYPE
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 layer1 + "feed_forward.router.weight", layer0 + "input_layernorm.weight"):
        assert params[name].dtype == torch.float32, name
    # Scales are per output channel: a row's scale is its own amax / 448.
    raw = load_file(checkpoint / "model.safetensors")
    o_proj = raw[layer0 + "self_attn.o_proj.weight"]
    torch.testing.assert_close(params[layer0 + "self_attn.o_proj.weight_scale"], o_proj.abs().amax(1) / 448)
    gate_up = raw[experts + "gate_up_proj"]  # [E, H, 2I]: scales over H
    torch.testing.assert_close(params[experts + "gate_up_proj_scale"], gate_up.abs().amax(1) / 448)
    full = load_model(checkpoint, "float32")
    assert model.load_report.param_bytes < 0.6 * full.load_report.param_bytes


def test_fbgemm_checkpoint_gives_the_logits_of_online_quantization(checkpoint, fp8_checkpoint):
    tokens = prompt()
    from_checkpoint = load_model(fp8_checkpoint, "float32")
    assert "model.layers.1.feed_forward.experts" in from_checkpoint.load_report.fp8_modules
    online = load_model(checkpoint, "float32", quantization="fp8")
    assert from_checkpoint.load_report.fp8_modules == online.load_report.fp8_modules
    expected = prompt_logits(online, tokens)
    torch.testing.assert_close(prompt_logits(from_checkpoint, tokens), expected, atol=0, rtol=0)
    # quantization="fp8" on an FP8 checkpoint is the same thing.
    again = load_model(fp8_checkpoint, "float32", quantization="fp8")
    torch.testing.assert_close(prompt_logits(again, tokens), expected, atol=0, rtol=0)
    # FP8 reads about a quarter of the float32 bytes for the quantized tensors.
    assert from_checkpoint.load_report.bytes_read < 0.5 * load_model(checkpoint, "float32").load_report.bytes_read


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_logits_stay_close_to_full_precision(checkpoint, fp8_checkpoint, dtype):
    tokens = prompt()
    reference = prompt_logits(load_model(checkpoint, "float32"), tokens)
    got = prompt_logits(load_model(fp8_checkpoint, dtype), tokens)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # This random model (init std 0.2, peaked logits) amplifies weight errors: bf16 weights alone
    # move its logits by 3.9% (relative norm); FP8, with 4 fewer mantissa bits, measured 12.7% in
    # float32 and bf16 alike, the greedy token unchanged at 21 of 24 positions.
    relative = ((got - reference).norm() / reference.norm()).item()
    assert relative < 0.2
    agree = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= 0.75


def test_modules_to_not_convert_stay_in_full_precision(checkpoint, tmp_path):
    """Meta's FP8 release keeps some modules in bf16; warpspec reads which from the tensors' dtypes."""
    not_converted = ["lm_head", "feed_forward.router", "model.layers.0.self_attn", r".*shared_expert"]
    path = make_fbgemm_fp8_checkpoint(checkpoint, tmp_path / "partial", not_converted)
    model = load_model(path, "float32")
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float32
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" not in params
    assert params["model.layers.1.self_attn.qkv_proj.weight"].dtype == FP8_DTYPE
    assert params["model.layers.1.feed_forward.shared_expert.gate_up_proj.weight"].dtype == torch.float32
    assert params["model.layers.1.feed_forward.experts.gate_up_proj"].dtype == FP8_DTYPE
    reference = prompt_logits(load_model(checkpoint, "float32"), prompt())
    got = prompt_logits(model, prompt())
    assert ((got - reference).norm() / reference.norm()).item() < 0.2  # as in the test above


def test_fp8_router_from_a_checkpoint_that_quantized_it(checkpoint, tmp_path):
    """transformers converts every nn.Linear not listed, the router included: such a checkpoint loads
    with an FP8 router."""
    path = make_fbgemm_fp8_checkpoint(checkpoint, tmp_path / "router", ["lm_head"])
    model = load_model(path, "float32")
    assert model.model.layers[1].feed_forward.router.weight.dtype == FP8_DTYPE
    assert torch.isfinite(prompt_logits(model, prompt())).all()


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("moe_parallel", ["tensor", "expert"])
def test_sharded_load_slices_and_scales(checkpoint, fp8_checkpoint, rank, moe_parallel):
    """Rank `rank` of 2, loaded in-process (no collective runs while loading). From the FP8
    checkpoint every rank holds exact slices of the one-rank weights and scales (a row-parallel
    layer's whole-row scales apply to its column half as they are). Online, column-parallel rows are
    quantized whole, so they slice the same way; a row-parallel rank quantizes its own columns."""
    comm = Communicator(rank, 2)
    whole = dict(load_model(fp8_checkpoint, "float32").named_parameters())
    shard = dict(load_model(fp8_checkpoint, "float32", comm=comm, moe_parallel=moe_parallel).named_parameters())
    online = dict(load_model(checkpoint, "float32", comm=comm, quantization="fp8",
                             moe_parallel=moe_parallel).named_parameters())
    qkv, o_proj = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    gate_up, down = "model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.1.feed_forward.experts.down_proj"
    # qkv rows: 4 query heads of 16 dims -> 2 per rank; 2 KV heads -> 1 per rank.
    rows = torch.cat([torch.arange(32 * rank, 32 * rank + 32), 64 + torch.arange(16 * rank, 16 * rank + 16),
                      96 + torch.arange(16 * rank, 16 * rank + 16)])
    cols = slice(32 * rank, 32 * rank + 32)
    for params in (shard, online):
        assert torch.equal(params[qkv].view(torch.uint8), whole[qkv][rows].view(torch.uint8))
        assert torch.equal(params[qkv + "_scale"], whole[qkv + "_scale"][rows])
    assert torch.equal(shard[o_proj].view(torch.uint8), whole[o_proj][:, cols].view(torch.uint8))
    assert torch.equal(shard[o_proj + "_scale"], whole[o_proj + "_scale"])
    original = load_file(checkpoint / "model.safetensors")[o_proj][:, cols]
    torch.testing.assert_close(online[o_proj + "_scale"], original.abs().amax(1) / 448)
    assert torch.all(online[o_proj + "_scale"] <= whole[o_proj + "_scale"])  # a half's amax <= the row's

    if moe_parallel == "expert":  # 5 experts: 3 on rank 0, 2 on rank 1, whole
        first, end = (0, 3) if rank == 0 else (3, 5)
        for params in (shard, online):
            for name in (gate_up, down):
                assert torch.equal(params[name].view(torch.uint8), whole[name][first:end].view(torch.uint8))
                assert torch.equal(params[name + "_scale"], whole[name + "_scale"][first:end])
        return
    # Every expert, this rank's half of the intermediate width: gate and up columns side by side
    # (quantized per column, so online they slice exactly too), and the same rows of down_proj.
    inter = whole[down].shape[1]
    half = slice(inter // 2 * rank, inter // 2 * (rank + 1))
    gate_up_cols = torch.cat([torch.arange(inter)[half], inter + torch.arange(inter)[half]])
    for params in (shard, online):
        assert torch.equal(params[gate_up].view(torch.uint8), whole[gate_up][:, :, gate_up_cols].view(torch.uint8))
        assert torch.equal(params[gate_up + "_scale"], whole[gate_up + "_scale"][:, gate_up_cols])
    assert torch.equal(shard[down].view(torch.uint8), whole[down][:, half].view(torch.uint8))
    assert torch.equal(shard[down + "_scale"], whole[down + "_scale"])  # whole-column scales apply as they are
    original = load_file(checkpoint / "model.safetensors")[down][:, half]
    torch.testing.assert_close(online[down + "_scale"], original.abs().amax(1) / 448)
    assert torch.all(online[down + "_scale"] <= whole[down + "_scale"])  # half a column's amax <= the column's


def test_unknown_quantization_names_the_field_and_choices(checkpoint):
    with pytest.raises(ValueError, match=r"quantization must be one of fp8 .* got 'int4'"):
        load_model(checkpoint, "float32", quantization="int4")


def test_checkpoint_quantized_another_way_is_refused(checkpoint, tmp_path):
    path = make_fbgemm_fp8_checkpoint(checkpoint, tmp_path / "gptq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported; warpspec loads fbgemm_fp8"):
        load_model(path, "float32")


def test_missing_or_misshaped_scale_is_reported(fp8_checkpoint, tmp_path):
    tensors = load_file(fp8_checkpoint / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    for case, edit in (("missing", lambda t: t.pop(name)),
                       ("misshaped", lambda t: t.__setitem__(name, t[name][:3]))):
        path = tmp_path / case
        path.mkdir()
        (path / "config.json").write_text((fp8_checkpoint / "config.json").read_text())
        broken = dict(tensors)
        edit(broken)
        save_file(broken, str(path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=name):
            load_model(path, "float32")


PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=5)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 160, (n,), generator=gen).tolist() for n in (21, 9)]


def prompt_logprob_gaps(got, expected) -> torch.Tensor:
    """Differences in the log-probability of the actual prompt token, at every position."""
    return torch.tensor([abs(out.prompt_logprobs[i][token].logprob - ref.prompt_logprobs[i][token].logprob)
                         for out, ref in zip(got, expected, strict=True)
                         for i, token in enumerate(ref.prompt_token_ids) if i > 0])


def max_prompt_logprob_gap(got, expected) -> float:
    return prompt_logprob_gaps(got, expected).max().item()


def test_llm_quantization_option_and_its_errors(checkpoint, fp8_checkpoint, capsys):
    with LLM(str(fp8_checkpoint), dtype="float32") as llm:
        from_checkpoint = llm.generate(prompts(), PARAMS)
    with LLM(str(checkpoint), dtype="float32", quantization="fp8") as llm:
        online = llm.generate(prompts(), PARAMS)
    assert [o.token_ids for o in online] == [o.token_ids for o in from_checkpoint]
    assert max_prompt_logprob_gap(online, from_checkpoint) == 0.0
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        LLM(str(checkpoint), quantization="fp16")
    assert main(["generate", "--model", str(checkpoint), "--quantization", "fp8", "--prompt-token-ids",
                 ",".join(map(str, prompts()[1])), "--max-tokens", "8", "--ignore-eos", "--dtype", "float32",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == online[1].token_ids


@pytest.mark.parametrize("moe_parallel", ["tensor", "expert"])
def test_two_ranks(ray_cluster, checkpoint, fp8_checkpoint, moe_parallel):
    """Over 2 Ray workers (heads and MLP widths halved; 5 experts split by width, or 3 + 2 whole) each
    rank reads its slices of the FP8 checkpoint, or quantizes its own slices of the full-precision one."""
    with LLM(str(fp8_checkpoint), dtype="float32") as llm:
        expected = llm.generate(prompts(), PARAMS)
    with LLM(str(fp8_checkpoint), dtype="float32", num_workers=2, moe_parallel=moe_parallel) as llm:
        sharded = llm.generate(prompts(), PARAMS)
        workers = llm.engine.coordinator.info.workers
    assert [o.token_ids for o in sharded] == [o.token_ids for o in expected]
    assert max_prompt_logprob_gap(sharded, expected) < 1e-4  # only the reduction order differs
    if moe_parallel == "expert":
        assert workers[0].param_bytes > workers[1].param_bytes  # 3 experts vs 2
    else:
        assert workers[0].param_bytes == workers[1].param_bytes  # half of every expert each
    # Online, a row-parallel layer's rank quantizes its half of each row with that half's own amax
    # (test_sharded_load_slices_and_scales), not the whole row's: as close to full precision as one
    # rank is, not equal to it. This random model amplifies small weight changes (see above).
    with LLM(str(checkpoint), dtype="float32", num_workers=2, quantization="fp8", moe_parallel=moe_parallel) as llm:
        online = llm.generate(prompts(), PARAMS)
    with LLM(str(checkpoint), dtype="float32") as llm:
        full = llm.generate(prompts(), PARAMS)
    one_rank_error = prompt_logprob_gaps(expected, full).mean().item()
    two_rank_error = prompt_logprob_gaps(online, full).mean().item()
    assert two_rank_error < 1.5 * one_rank_error  # measured: 0.22 vs 0.21 nats on average
