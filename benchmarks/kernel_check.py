"""Part 1 and 2 of the GPU check: every Triton kernel against its torch reference (max error,
pass/fail, median time of each; deterministic mode's linear against cuBLAS, and against itself row
by row), and the memory bandwidth that decode attention and the small-batch
MoE path achieve, as a fraction of what a plain copy achieves.

Shapes are one Maverick rank's (of 8): 5 query heads and 1 KV head of 128 dims, hidden 5120, 16 local
experts with intermediate 8192 (the expert layout), or 128 experts at 1/8 of that width (the tensor
layout, which the simulated rank runs). `tiny` shrinks them for a CPU run under the Triton interpreter.
The MoE rows are also timed as CUDA graphs (what decode runs), each replay going through 8 routings
to different experts so that no expert is still in L2 from the replay before: the bandwidth table
uses that time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from warpspec.benchmarks.timing import median_ms
from warpspec.kernels.attention import paged_attention_reference
from warpspec.kernels.attention_metadata import PagedAttentionMetadata
from warpspec.kernels.fp8 import (
    dequantize_fp8,
    fp8_linear,
    fp8_linear_reference,
    quantize_fp8_columns,
    quantize_fp8_reference,
    uses_scaled_mm,
)
from warpspec.kernels.moe import moe_experts_reference, route_topk_sigmoid_reference
from warpspec.kernels.norm import add_rms_norm_reference
from warpspec.kernels.rope import rope_qk_norm_reference


@dataclass
class Shapes:
    hidden: int = 5120
    heads: int = 5
    kv_heads: int = 1
    head_dim: int = 128
    block_size: int = 16
    context: int = 4096  # tokens already cached per sequence in the attention checks
    experts: int = 16
    inter: int = 8192
    rank_experts: int = 128  # moe_parallel="tensor": every expert at 1/8 of its width
    rank_inter: int = 1024

    @classmethod
    def tiny(cls) -> Shapes:
        return cls(hidden=128, heads=5, kv_heads=1, head_dim=32, block_size=16, context=40, experts=4, inter=64,
                   rank_experts=8, rank_inter=32)


@dataclass
class KernelResult:
    name: str
    relative_error: float  # max |triton - reference| / max |reference|
    tolerance: float
    passed: bool
    triton_ms: float
    reference_ms: float
    bytes_moved: int = 0  # the bytes the kernel must read/write, where bandwidth is reported
    error: str = ""  # a kernel that failed to compile or run
    graph_ms: float = float("nan")  # per call, replayed in a CUDA graph (MoE rows on a GPU)

    @property
    def speedup(self) -> float:
        return self.reference_ms / self.triton_ms if self.triton_ms else float("nan")


def _relative_error(a, b) -> float:
    """Largest deviation relative to the reference's largest magnitude (an absolute bound would pass
    a kernel that skipped work whenever outputs are small, as softmax averages over long contexts are)."""
    if isinstance(a, tuple | list):
        return max(_relative_error(x, y) for x, y in zip(a, b, strict=True))
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _fp8_linear_with_fp8_activations(x, weight, weight_scale):
    """What torch._scaled_mm computes: activations quantized per token too, then exact products."""
    x_q = dequantize_fp8(*quantize_fp8_reference(x), dtype=torch.float32)
    return fp8_linear_reference(x_q, weight, weight_scale).to(x.dtype)


def _attention_case(shapes: Shapes, batch: int, query_len: int, dtype, device, gen):
    """batch sequences of context + query_len tokens on shuffled blocks."""
    seq_len = shapes.context + query_len
    blocks_per_seq = -(-seq_len // shapes.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shapes.block_size, shapes.kv_heads, shapes.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq).int()
    query_lens = torch.full((batch,), query_len, device=device)
    meta = PagedAttentionMetadata(torch.cat([torch.zeros(1, device=device, dtype=torch.long), query_lens.cumsum(0)]),
                                  torch.full((batch,), seq_len, device=device), block_tables, shapes.block_size,
                                  query_len, seq_len)
    query = torch.randn(batch * query_len, shapes.heads, shapes.head_dim, generator=gen, device=device).to(dtype)
    kv_bytes = 2 * batch * seq_len * shapes.kv_heads * shapes.head_dim * key_cache.element_size()
    return (query, key_cache, value_cache, meta, 1 / math.sqrt(shapes.head_dim), None), kv_bytes


def _moe_case(hidden: int, experts: int, inter: int, num_tokens: int, fp8: bool, dtype, device, gen):
    """Top-1 routing over experts of [hidden, 2 * inter] and [inter, hidden]; FP8 ones quantized per
    column, one expert at a time (no float32 copy of all of them). Returns the arguments and the
    expert bytes one call must read."""
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(num_tokens, experts, generator=gen, device=device)
    expert_ids, scores = route_topk_sigmoid_reference(logits, 1)
    weight_dtype = torch.float8_e4m3fn if fp8 else dtype
    gate_up = torch.empty(experts, hidden, 2 * inter, device=device, dtype=weight_dtype)
    down = torch.empty(experts, inter, hidden, device=device, dtype=weight_dtype)
    gate_up_scale = torch.empty(experts, 2 * inter, device=device) if fp8 else None
    down_scale = torch.empty(experts, hidden, device=device) if fp8 else None
    for e in range(experts):
        for weight, scale in ((gate_up, gate_up_scale), (down, down_scale)):
            values = torch.randn(weight.shape[1:], generator=gen, device=device) * weight.shape[1] ** -0.5
            if fp8:
                weight[e], scale[e] = quantize_fp8_columns(values)
            else:
                weight[e] = values.to(dtype)
    num_used = int(expert_ids.unique().numel())
    weight_bytes = num_used * (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    return (x, gate_up, down, expert_ids, scores.to(dtype), 0, gate_up_scale, down_scale), weight_bytes


def _rerouted(args: tuple, experts: int, num_routings: int = 8) -> list[tuple]:
    """The same call with every token's expert moved by e * experts // num_routings, e = 0..7: ids
    [3, 9] of 16 -> [3, 9], [5, 11], ..., [1, 7]; each routing reads other experts than the last."""
    x, gate_up, down, expert_ids, *rest = args
    step = max(1, experts // num_routings)
    return [(x, gate_up, down, (expert_ids + e * step) % experts, *rest) for e in range(num_routings)]


def _graph_ms(fn, arg_sets: list[tuple], device: torch.device, repeats: int) -> float:
    """Per call: one CUDA graph of fn over every argument set, replayed; nan off the GPU."""
    if device.type != "cuda":
        return float("nan")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up (Triton compiles) off the capture, as torch asks
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
            fn(*args)
    return median_ms(graph.replay, device, repeats) / len(arg_sets)


def run_kernel_checks(device: torch.device, tiny: bool, repeats: int) -> list[KernelResult]:
    from warpspec.kernels.triton.attention import paged_attention_triton
    from warpspec.kernels.triton.fp8 import quantize_fp8_triton
    from warpspec.kernels.triton.matmul import batch_invariant_linear
    from warpspec.kernels.triton.moe import moe_experts_triton, route_topk_sigmoid_triton
    from warpspec.kernels.triton.norm import add_rms_norm_triton
    from warpspec.kernels.triton.rope import rope_qk_norm_triton

    shapes = Shapes.tiny() if tiny else Shapes()
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = 8
    x = torch.randn(tokens, shapes.hidden, generator=gen, device=device).to(dtype)
    residual = torch.randn(tokens, shapes.hidden, generator=gen, device=device).to(dtype)
    weight = torch.rand(shapes.hidden, generator=gen, device=device).to(dtype)
    q = torch.randn(tokens, shapes.heads, shapes.head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(tokens, shapes.kv_heads, shapes.head_dim, generator=gen, device=device).to(dtype)
    angles = torch.rand(tokens, shapes.head_dim // 2, generator=gen, device=device) * 1000
    freqs = torch.polar(torch.ones_like(angles), angles)
    router_logits = torch.randn(tokens, 128 if not tiny else 16, generator=gen, device=device).to(dtype)
    # name -> (triton fn, reference fn, args, tolerance on the relative error, bytes for bandwidth).
    # bf16 outputs: a few units in the last place (2^-8) of the largest value.
    cases = {
        "add_rms_norm [8 x hidden]": (add_rms_norm_triton, add_rms_norm_reference, (x, residual, weight, 1e-5),
                                      0.02, 0),
        "rope + qk_norm [8 tokens]": (rope_qk_norm_triton, rope_qk_norm_reference, (q, k, freqs, 1e-6), 0.02, 0),
        "route_topk_sigmoid [8 x 128]": (route_topk_sigmoid_triton, route_topk_sigmoid_reference,
                                         (router_logits, 1), 0.02, 0),
        "quantize_fp8 rows [8 x hidden]": (quantize_fp8_triton, quantize_fp8_reference, (x.float(),), 0.0, 0),
    }
    # The FP8 linear: torch._scaled_mm with per-token activation scales on FP8 GPUs (the dequantizing
    # reference elsewhere), against dequantize-then-matmul. [8 x hidden] @ [2 * inter / 8 x hidden]^T.
    dense_out = 2 * shapes.inter // 8
    dense_fp8, dense_scale = quantize_fp8_reference(
        torch.randn(dense_out, shapes.hidden, generator=gen, device=device) * shapes.hidden ** -0.5)
    reference = _fp8_linear_with_fp8_activations if uses_scaled_mm(x, dense_fp8) else fp8_linear_reference
    cases[f"fp8_linear [8 x hidden] -> {dense_out}"] = (fp8_linear, reference, (x, dense_fp8, dense_scale), 0.02, 0)
    # Deterministic mode's linear (kernels/triton/matmul.py) against cuBLAS: the speedup column is
    # what the mode costs (below 1: slower than cuBLAS). Then its promise, to the bit: each row of a
    # batch of 32 equals that row computed alone (tolerance 0).
    dense = torch.randn(dense_out, shapes.hidden, generator=gen, device=device).to(dtype) * shapes.hidden ** -0.5
    for batch in (1, 8, 32):
        xb = torch.randn(batch, shapes.hidden, generator=gen, device=device).to(dtype)
        cases[f"batch_invariant_linear [{batch} x hidden] -> {dense_out}, vs cuBLAS"] = (
            batch_invariant_linear, F.linear, (xb, dense), 0.02, dense.numel() * dense.element_size())
    cases["batch_invariant_linear: 32 rows = each row alone"] = (batch_invariant_linear, _each_row_alone,
                                                                 (xb, dense), 0.0, 0)
    for batch, query_len, label in ((1, 1, "decode b1"), (8, 1, "decode b8"), (8, 4, "verify b8 x 4")):
        args, kv_bytes = _attention_case(shapes, batch, query_len, dtype, device, gen)
        cases[f"paged_attention {label}, ctx {shapes.context}"] = (paged_attention_triton, paged_attention_reference,
                                                                   args, 0.02, kv_bytes)
    # The expert layout's 16 whole experts, then the tensor layout's 128 slices of 1/8 width (the
    # simulated rank's, where one token reads a 1/8 slice of one expert: 15.7 MB in FP8).
    moe_cases = [(shapes.experts, shapes.inter, num_tokens, fp8, "")
                 for num_tokens, fp8 in ((1, True), (8, True), (8, False))]
    moe_cases += [(shapes.rank_experts, shapes.rank_inter, num_tokens, True,
                   f", TP rank [{shapes.rank_experts} x inter {shapes.rank_inter}]") for num_tokens in (1, 8)]
    graph_args = {}
    for experts, inter, num_tokens, fp8, suffix in moe_cases:
        args, weight_bytes = _moe_case(shapes.hidden, experts, inter, num_tokens, fp8, dtype, device, gen)
        label = f"moe_experts {num_tokens} token{'s' if num_tokens > 1 else ''} {'fp8' if fp8 else 'bf16'}{suffix}"
        cases[label] = (moe_experts_triton, moe_experts_reference, args, 0.05, weight_bytes)
        graph_args[label] = _rerouted(args, experts)
    results = []
    for name, (triton_fn, reference_fn, args, tolerance, num_bytes) in cases.items():
        try:
            error = _relative_error(_as_comparable(triton_fn(*args)), _as_comparable(reference_fn(*args)))
            results.append(KernelResult(
                name=name, relative_error=error, tolerance=tolerance, passed=error <= tolerance,
                triton_ms=median_ms(lambda f=triton_fn, a=args: f(*a), device, repeats),
                reference_ms=median_ms(lambda f=reference_fn, a=args: f(*a), device, repeats),
                bytes_moved=num_bytes))
            if name in graph_args:
                results[-1].graph_ms = _graph_ms(triton_fn, graph_args[name], device, repeats)
        except Exception as e:  # one kernel failing to compile must not lose the others' results
            results.append(KernelResult(name, float("nan"), tolerance, False, float("nan"), float("nan"), num_bytes,
                                        f"{type(e).__name__}: {str(e)[:300]}"))
    return results


def _each_row_alone(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from warpspec.kernels.triton.matmul import batch_invariant_linear

    return torch.cat([batch_invariant_linear(x[i : i + 1], weight) for i in range(x.shape[0])])


def _as_comparable(out):
    """FP8 outputs compare as float32; tuples element by element."""
    if isinstance(out, tuple):
        return tuple(_as_comparable(o) for o in out)
    return out.float()


def bandwidth_rows(results: list[KernelResult], copy_gbs: float) -> list[dict]:
    """The CUDA graph's time where there is one (launches overlapped, as in decode), else eager."""
    rows = []
    for r in results:
        if r.bytes_moved and not r.error:
            is_graph = not math.isnan(r.graph_ms)
            ms = r.graph_ms if is_graph else r.triton_ms
            achieved = r.bytes_moved / ms / 1e6
            rows.append({"kernel": r.name, "bytes": r.bytes_moved, "triton_ms": ms, "timed": "graph" if is_graph
                         else "eager", "achieved_gbs": achieved, "fraction_of_copy": achieved / copy_gbs})
    return rows


def as_dicts(results: list[KernelResult]) -> list[dict]:
    return [{**asdict(r), "speedup": r.speedup} for r in results]
