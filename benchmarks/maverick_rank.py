"""Part 3 of the GPU check: one rank of Llama 4 Maverick on 8 GPUs, simulated on one GPU.

The rank's shard is built as a one-rank model with the shard's widths (40 query / 8 KV heads -> 5 / 1,
dense MLP 16384 -> 2048, shared expert 8192 -> 1024, vocabulary 202048 -> 25256 rows), in FP8 with
random weights (embeddings, lm_head, norms and router in bf16), in either layout of the routed
experts: all 128 at 1/8 of their width 8192 (moe_parallel="tensor"), or 16 of them whole
("expert"). The all-reduces the real rank would run are absent here; the projection adds them back
at a stated NVLink latency. Routing picks among the rank's own experts, so every token lands on this
rank: exact for the tensor layout (every rank computes every token), the busiest rank for the expert
layout (an upper bound for the others).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from warpspec.benchmarks.timing import median_ms
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig, CudaGraphRunner
from warpspec.workers.kv_cache import allocate_kv_cache
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.models.decoder import GatedMLP
from warpspec.workers.models.llama4 import Llama4ForCausalLM
from warpspec.workers.models.registry import load_model_config
from warpspec.workers.quantization import convert_to_fp8, is_online_fp8_module
from warpspec.workers.step import SequenceStep, StepInput

WORLD_SIZE = 8


@dataclass
class RankShape:
    num_layers: int = 48
    hidden: int = 5120
    heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128
    experts: int = 128
    expert_inter: int = 8192
    dense_inter: int = 16384
    vocab: int = 202048
    moe_step: int = 2
    context: int = 4096  # tokens already in the KV cache of every sequence
    moe_parallel: str = "tensor"  # the routed experts' layout (see the module docstring)

    @classmethod
    def tiny(cls) -> RankShape:
        return cls(num_layers=4, hidden=256, heads=40, kv_heads=8, head_dim=32, experts=32, expert_inter=128,
                   dense_inter=256, vocab=4096, context=40)

    def shard_config(self) -> ModelConfig:
        split_by_width = self.moe_parallel == "tensor"
        raw = {
            "architectures": ["Llama4ForCausalLM"], "vocab_size": self.vocab // WORLD_SIZE,
            "hidden_size": self.hidden,
            "intermediate_size": self.expert_inter // WORLD_SIZE if split_by_width else self.expert_inter,
            "intermediate_size_mlp": self.dense_inter // WORLD_SIZE, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.heads // WORLD_SIZE, "num_key_value_heads": self.kv_heads // WORLD_SIZE,
            "head_dim": self.head_dim, "num_experts_per_tok": 1,
            "num_local_experts": self.experts if split_by_width else self.experts // WORLD_SIZE,
            "interleave_moe_layer_step": self.moe_step, "use_qk_norm": False, "attention_chunk_size": 8192,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "max_position_embeddings": 1 << 20,
        }
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(raw))
            return load_model_config(d)


def build_rank(shape: RankShape, device: torch.device, dtype=torch.bfloat16) -> Llama4ForCausalLM:
    config = shape.shard_config()
    with torch.device(device):
        model = Llama4ForCausalLM(config, dtype)
        for layer in model.model.layers:  # the shared expert is tensor-parallel: 1/8 of its width
            if hasattr(layer.feed_forward, "shared_expert") and shape.moe_parallel == "expert":
                layer.feed_forward.shared_expert = GatedMLP(shape.hidden, shape.expert_inter // WORLD_SIZE,
                                                             model.comm, dtype)
    convert_to_fp8(model, is_online_fp8_module)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill_random(name, param, gen)
    return model.eval()


def fill_random(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
    """Weights of a plausible scale, one expert (or row block) at a time so no big float copy exists."""
    if name.endswith("_scale"):
        param.fill_(0.02 / 64)  # FP8 values spread over +-4 sigma of N(0, 64) -> weights ~ N(0, 0.02)
    elif "norm" in name:
        param.fill_(1.0)
    else:
        for part in param.data.view(-1, param.shape[-1]).split(4096):
            values = torch.randn(part.shape, generator=gen, device=part.device)
            part.copy_(values * 64 if part.dtype == torch.float8_e4m3fn else values * 0.02)


def bytes_per_step(model: Llama4ForCausalLM, shape: RankShape, num_tokens: int, batch: int) -> dict[str, float]:
    """What one step must read from memory: every weight but the routed experts, the experts the
    step's tokens choose (expected distinct count for uniform top-1 routing over the rank's E experts:
    E * (1 - (1 - 1/E)^n); E is 128 slices of 1/8 width, or 16 whole experts), and the sequences' KV cache."""
    expert_bytes, other_bytes = 0, 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            expert_bytes += size
        else:
            other_bytes += size
    num_local = model.config.num_local_experts
    distinct = num_local * (1 - (1 - 1 / num_local) ** num_tokens)
    kv_bytes = (2 * batch * shape.context * (shape.kv_heads // WORLD_SIZE) * shape.head_dim * 2
                * shape.num_layers)
    total = other_bytes + expert_bytes * distinct / num_local + kv_bytes
    return {"moe_parallel": shape.moe_parallel, "dense_weights_gb": other_bytes / 1e9,
            "all_expert_weights_gb": expert_bytes / 1e9, "expected_distinct_experts": distinct,
            "kv_cache_gb": kv_bytes / 1e9, "total_gb": total / 1e9}


@torch.inference_mode()
def run_simulation(shape: RankShape, device: torch.device, repeats: int, batches=(1, 8),
                   query_lens=(1, 4), profile: bool = False) -> dict:
    """Eager and CUDA-graph times of each (batch, query_len) step; profile: also the top kernels of
    one eager decode step at batch 1 (profile_step)."""
    model = build_rank(shape, device)
    config, block_size = model.config, 16
    blocks_per_seq = -(-(shape.context + max(query_lens)) // block_size)
    num_blocks = max(batches) * blocks_per_seq + 1  # the last one: CUDA graph padding
    kv_caches = allocate_kv_cache(config, config.num_key_value_heads, num_blocks, block_size, torch.bfloat16, device)
    model.bind_kv_cache(kv_caches)
    report: dict = {"rows": []}
    if profile:  # before any graph is captured: the profile sees the eager step alone
        step = StepInput.build([SequenceStep([7], shape.context, list(range(blocks_per_seq)), 0)], block_size)
        report["profile"] = profile_step(model, step, device)
    graphs = None
    if device.type == "cuda":
        graphs = CudaGraphRunner(model, CudaGraphConfig(batch_sizes=tuple(batches), query_lens=tuple(query_lens),
                                                        max_model_len=blocks_per_seq * block_size),
                                 pad_block=num_blocks - 1, max_blocks=blocks_per_seq, block_size=block_size,
                                 device=device)
    rows = report["rows"]
    for batch in batches:
        for q in query_lens:
            seqs = [SequenceStep([7 + i] * q, shape.context,
                                 list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 0) for i in range(batch)]
            step = StepInput.build(seqs, block_size)
            row = {"batch": batch, "query_len": q, **bytes_per_step(model, shape, batch * q, batch)}
            row["eager_ms"] = median_ms(lambda s=step: _eager(model, s, device), device, repeats)
            if graphs is not None:
                try:
                    row["graph_ms"] = median_ms(lambda s=step: graphs.run(s), device, repeats)
                except Exception as e:  # a capture failure is a finding to report, not a crash
                    row["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
    return report


def profile_step(model, step: StepInput, device: torch.device, top: int = 15) -> list[dict]:
    """The top kernels of one eager step by total time: on a GPU the CUDA kernels' device time (what
    a CUDA graph replays, without the launch gaps), on a CPU the ops' own CPU time. Each row: name,
    calls, total_ms and its fraction of the step's total over all kernels (or ops)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    on_gpu = device.type == "cuda"
    _eager(model, step, device)  # Triton compiles and caches warm outside the profile
    if on_gpu:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        _eager(model, step, device)
        if on_gpu:
            torch.cuda.synchronize(device)
    if on_gpu:
        totals = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages()
                  if e.device_type == DeviceType.CUDA]
    else:
        totals = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()]
    step_us = sum(t for _, _, t in totals) or 1.0
    totals.sort(key=lambda row: -row[2])
    return [{"name": name, "calls": calls, "total_ms": us / 1e3, "fraction": us / step_us}
            for name, calls, us in totals[:top]]


def _eager(model, step: StepInput, device: torch.device):
    step = step.to(device)
    hidden, _ = model(step.input_ids, step.positions, step)
    return model.compute_logits(hidden[step.logits_indices])


def project(rows: list[dict], copy_gbs: float, num_layers: int, allreduce_us: float,
            acceptance_length: float, host_ms: float = 0.0,
            draft_ms_by_batch: dict[int, float] | None = None) -> list[dict]:
    """Tokens/s per user on 8 GPUs. A step is the measured rank time, 2 all-reduces per layer, the
    engine's host time (scheduling, dispatch, sampling; `warpspec bench dispatch`) and, for a verify
    step of k+1 tokens, the draft's proposal of the next k (maverick_draft.py). A verify step yields
    `acceptance_length` tokens on average, a decode step one."""
    out = []
    for r in rows:
        batch, q = r["batch"], r["query_len"]
        measured = r.get("graph_ms", r["eager_ms"])
        comm_ms = 2 * num_layers * allreduce_us / 1e3
        tokens = acceptance_length if q > 1 else 1.0
        draft_ms = (draft_ms_by_batch or {}).get(batch, 0.0) if q > 1 else 0.0
        step_ms = measured + comm_ms + host_ms + draft_ms
        floor_ms = r["total_gb"] / copy_gbs * 1e3
        out.append({"moe_parallel": r["moe_parallel"], "batch": batch, "query_len": q, "rank_ms": measured,
                    "floor_ms": floor_ms, "fraction_of_floor": floor_ms / measured, "allreduce_ms": comm_ms,
                    "host_ms": host_ms, "draft_ms": draft_ms, "step_ms": step_ms,
                    "tokens_per_step": tokens, "tok_s_per_user": tokens / step_ms * 1e3})
    return out
