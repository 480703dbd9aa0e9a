"""`warpspec bench kv_cache`: a hybrid KV cache (workers/kv_groups.py) against a full one.

  memory     KV bytes one decoding sequence holds at 8k, 32k, 128k and 1M tokens, Llama 4 Maverick's
             and Scout's shapes (computed from their configs), and the same formula against what a
             running engine holds on a scaled-down config (--chunk-size, one chunk of a few blocks)
  capacity   on that config, one KV budget in bytes (--budget-kib) for both caches: the longest
             context one request may ask for, and the most --seq-tokens sequences (prompt and 64
             new tokens) running at once
  steps      decode time per output token at a short context and at --chunks chunks, batch 1 and 8,
             the two caches alternating, median of --repeats
  prefix     a shared-prefix workload with the EAGLE-3 draft (the bundled pair, its target given a
             chunk of --chunk-size): prefix-cache hit rate and acceptance, and the same greedy tokens

Both caches run the same engine and model; only `hybrid_kv_cache` differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from warpspec.benchmarks.report import write_report
from warpspec.entrypoints.llm import LLM
from warpspec.errors import InvalidRequestError
from warpspec.sampling_params import SamplingParams
from warpspec.training.random_checkpoint import create_random_checkpoint
from warpspec.workers.kv_groups import kv_bytes_per_sequence, kv_bytes_per_token_layer
from warpspec.workers.models.registry import model_config_from_dict

# The attention shapes of Llama 4's text configs (Hugging Face config.json): 48 layers, every fourth
# NoPE, 8 KV heads of 128, chunk 8192; Maverick's context is 1M tokens, Scout's 10M.
LLAMA4 = dict(model_type="llama4_text", vocab_size=202048, hidden_size=5120, intermediate_size=8192,
              intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
              head_dim=128, attention_chunk_size=8192)
SHAPES = {"Maverick": dict(LLAMA4, num_local_experts=128, interleave_moe_layer_step=2,
                           max_position_embeddings=1048576),
          "Scout": dict(LLAMA4, num_local_experts=16, interleave_moe_layer_step=1, max_position_embeddings=10485760)}
CONTEXTS = {"8k": 8192, "32k": 32768, "128k": 131072, "1M": 1048576}
BLOCK = 16


def memory_rows() -> list[dict]:
    rows = []
    for name, raw in SHAPES.items():
        config = model_config_from_dict(raw)
        for label, tokens in CONTEXTS.items():
            hybrid, full = (kv_bytes_per_sequence(config, tokens, 2, BLOCK, on) for on in (True, False))
            rows.append({"model": name, "context": label, "hybrid_gib": hybrid / 2**30, "full_gib": full / 2**30,
                         "ratio": hybrid / full})
    return rows


def checkpoint(run_dir: Path, chunk_size: int, max_len: int) -> Path:
    path = run_dir / f"kv-cache-bench-c{chunk_size}-{max_len}"
    if not (path / "config.json").exists():
        create_random_checkpoint(path, "small", attention_chunk_size=chunk_size, max_position_embeddings=max_len)
    return path


ENFORCE_EAGER = {"enforce_eager": False}  # --enforce-eager


def engine(path: Path, hybrid: bool, **options) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BLOCK, hybrid_kv_cache=hybrid, **ENFORCE_EAGER, **options)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def held_check(path: Path, tokens: int) -> dict:
    """Bytes one sequence holds in a running engine after its last step (tokens - 1 of them in the
    cache: the last sampled one is not run), against the formula."""
    with engine(path, True) as llm:
        core, held = llm.engine, 0
        core.add_request(core.new_request("held", list(range(3, 3 + tokens - 16)), greedy(16)))
        while core.has_unfinished():
            held = sum(core.block_manager.blocks_held()) or held
            core.step()
        per_block = BLOCK * core.kv_layout.num_tensors * kv_bytes_per_token_layer(core.model_config, 4)
        return {"tokens": tokens, "measured_bytes": held * per_block,
                "formula_bytes": kv_bytes_per_sequence(core.model_config, tokens - 1, 4, BLOCK)}


def capacity(path: Path, hybrid: bool, budget_bytes: int, seq_tokens: int, num_seqs: int) -> dict:
    """The longest single context, and the most seq_tokens-token sequences running at once, in
    budget_bytes of KV."""
    config = model_config_from_dict(json.loads((path / "config.json").read_text()))
    # num_kv_blocks counts blocks of every layer, the same memory in either layout.
    num_blocks = budget_bytes // (BLOCK * config.num_hidden_layers * kv_bytes_per_token_layer(config, 4))
    with engine(path, hybrid, num_kv_blocks=num_blocks, max_num_seqs=num_seqs,
                max_num_batched_tokens=256) as llm:
        core = llm.engine
        num_blocks = core.block_manager.num_blocks
        longest, low, high = 0, 1, core.max_model_len - 1
        while low <= high:  # what one request may ask for alone, as the engine's boundary answers
            mid = (low + high) // 2
            try:
                core.new_request("probe", [3], greedy(mid))
                longest, low = mid + 1, mid + 1
            except InvalidRequestError:
                high = mid - 1
        # Long enough lives that the batch is bounded by the cache, not by how fast prefills arrive.
        for i in range(num_seqs):
            core.add_request(core.new_request(f"c{i}", [3 + (i + j) % 200 for j in range(seq_tokens - 64)],
                                              greedy(64)))
        most = 0
        while core.has_unfinished():
            core.step()
            most = max(most, len(core.scheduler.running))
        return {"hybrid": hybrid, "num_blocks": num_blocks, "longest_context": longest,
                "concurrent_seqs": most, "preemptions": core.scheduler.num_preemptions}


def step_times(path: Path, contexts: dict[str, int], batches: tuple[int, ...], repeats: int) -> list[dict]:
    engines = {hybrid: engine(path, hybrid) for hybrid in (True, False)}
    rows = []
    try:
        cells = [(label, tokens, batch) for label, tokens in contexts.items() for batch in batches]
        for label, tokens, batch in tqdm(cells, desc="step times", unit="cell"):
            times: dict[bool, list[float]] = {True: [], False: []}
            outputs = {}
            for r in range(repeats):
                for hybrid, llm in engines.items():
                    prompts = [[3 + (r * 7 + i * 13 + j) % 4000 for j in range(tokens)] for i in range(batch)]
                    outs = llm.generate(prompts, greedy(32))
                    times[hybrid].append(statistics.median(o.metrics["time_per_output_token_s"] for o in outs))
                    outputs[hybrid] = [o.token_ids for o in outs]
            hybrid_ms, full_ms = (statistics.median(times[h]) * 1e3 for h in (True, False))
            rows.append({"context": label, "tokens": tokens, "batch": batch, "hybrid_ms": hybrid_ms,
                         "full_ms": full_ms, "ratio": full_ms / hybrid_ms,
                         "hybrid_spread": [min(times[True]) * 1e3, max(times[True]) * 1e3],
                         "full_spread": [min(times[False]) * 1e3, max(times[False]) * 1e3],
                         "same_tokens": outputs[True] == outputs[False]})
    finally:
        for llm in engines.values():
            llm.shutdown()
    return rows


def chunked_pair(run_dir: Path, target: Path, chunk_size: int) -> Path:
    """The bundled target with a chunk of chunk_size (its own is 8,192, longer than its context, so it
    keeps one KV group): the same weights, linked; a different model, the same one on either cache."""
    path = run_dir / f"kv-cache-bench-{target.name}-c{chunk_size}"
    path.mkdir(parents=True, exist_ok=True)
    for file in target.iterdir():
        link = path / file.name
        if file.name != "config.json" and not link.exists():
            link.symlink_to(file.resolve())
    config = json.loads((target / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_chunk_size": chunk_size}, indent=2))
    return path


def prefix_hits(target: Path, draft: Path, chunk_size: int) -> list[dict]:
    """Eight requests sharing a prefix of 2.5 chunks, each with its own ending, one after another,
    with the EAGLE-3 draft: prefix-cache hits and acceptance on either cache."""
    shared = [3 + j % 3000 for j in range(chunk_size * 5 // 2)]
    prompts = [shared + [100 + i, 200 + i, 300 + i] for i in range(8)]
    rows, tokens = [], {}
    for hybrid in (True, False):
        # Fixed k: acceptance compared between the caches, not between draft lengths chosen from timings.
        with engine(target, hybrid, draft=str(draft), compile_draft=not ENFORCE_EAGER["enforce_eager"],
                    speculative_policy="fixed") as llm:
            outs = [llm.generate([prompt], greedy(32))[0] for prompt in prompts]
            tokens[hybrid] = [o.token_ids for o in outs]
            rows.append({"hybrid": hybrid, "hit_rate": llm.engine.block_manager.stats.hit_rate,
                         "hit_tokens": llm.engine.block_manager.stats.hit_tokens,
                         "acceptance_length": llm.engine.spec_stats.acceptance_length})
    for row in rows:
        row["same_tokens"] = tokens[True] == tokens[False]
    return rows


def table(results: dict) -> str:
    lines = ["KV bytes per decoding sequence, bf16, whole model (from the configs):", "",
             "| model | context | hybrid GiB | full GiB | hybrid / full |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['context']} | {r['hybrid_gib']:.2f} | {r['full_gib']:.2f} | {r['ratio']:.3f} |"
              for r in results["memory"]]
    held = results["held"]
    lines += ["", f"Scaled-down check ({results['config']}): one sequence of {held['tokens']} tokens holds "
              f"{held['measured_bytes']} bytes in a running engine; the formula says {held['formula_bytes']}.",
              "", f"Capacity in one KV budget of {results['budget_kib']} KiB ({results['config']}):", "",
              "| cache | blocks | longest context | concurrent {}-token sequences | preemptions |".format(
                  results["seq_tokens"]), "|---|---|---|---|---|"]
    lines += [f"| {'hybrid' if r['hybrid'] else 'full'} | {r['num_blocks']} | {r['longest_context']} | "
              f"{r['concurrent_seqs']} | {r['preemptions']} |" for r in results["capacity"]]
    lines += ["", "Decode, ms per output token (median of the requests' TPOT, median of runs; full / hybrid > 1: "
              "hybrid faster):", "", "| context | batch | hybrid ms | full ms | full / hybrid | spread hybrid | "
              "spread full | same tokens |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} ({r['tokens']}) | {r['batch']} | {r['hybrid_ms']:.3f} | {r['full_ms']:.3f} | "
              f"{r['ratio']:.2f} | {r['hybrid_spread'][0]:.3f}-{r['hybrid_spread'][1]:.3f} | "
              f"{r['full_spread'][0]:.3f}-{r['full_spread'][1]:.3f} | {r['same_tokens']} |" for r in results["steps"]]
    lines += ["", f"Shared-prefix workload with the EAGLE-3 draft ({results['pair']}):", "",
              "| cache | prefix hit rate | hit tokens | acceptance length | same tokens |", "|---|---|---|---|---|"]
    lines += [f"| {'hybrid' if r['hybrid'] else 'full'} | {r['hit_rate']:.3f} | {r['hit_tokens']} | "
              f"{r['acceptance_length']:.2f} | {r['same_tokens']} |" for r in results["prefix"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench kv_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs")
    parser.add_argument("--chunk-size", type=int, default=128, help="the scaled-down config's chunk")
    parser.add_argument("--chunks", type=int, default=8, help="the long context of the step timing, in chunks")
    parser.add_argument("--budget-kib", type=int, default=8192, help="the capacity test's KV budget")
    parser.add_argument("--seq-tokens", type=int, default=512, help="the capacity test's sequence length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--enforce-eager", action="store_true", help="no compiled steps (quicker to start)")
    parser.add_argument("--target", default="assets/tiny-maverick", help="the prefix test's target, rechunked")
    parser.add_argument("--draft", default="assets/tiny-maverick-eagle3", help="the prefix test's EAGLE-3 draft")
    args = parser.parse_args(argv)
    ENFORCE_EAGER["enforce_eager"] = args.enforce_eager
    if args.chunk_size < BLOCK or args.chunks < 1 or args.repeats < 1:
        parser.error(f"--chunk-size must be at least {BLOCK}, --chunks and --repeats at least 1")
    run_dir = Path(args.run_dir)
    max_len = max(32768, args.chunk_size * (args.chunks + 1), args.seq_tokens * 2)
    path = checkpoint(run_dir, args.chunk_size, max_len)
    start = time.perf_counter()
    results = {"config": f"the 'small' preset, 6 layers (1 NoPE), chunk {args.chunk_size}, block {BLOCK}, float32",
               "budget_kib": args.budget_kib, "seq_tokens": args.seq_tokens, "memory": memory_rows(),
               "held": held_check(path, args.chunk_size * 3 + args.chunk_size // 2)}
    results["capacity"] = [capacity(path, hybrid, args.budget_kib * 1024, args.seq_tokens, 32)
                           for hybrid in (True, False)]
    contexts = {"short": args.chunk_size // 2, f"{args.chunks} chunks": args.chunk_size * args.chunks}
    results["steps"] = step_times(path, contexts, tuple(int(b) for b in args.batches.split(",")), args.repeats)
    pair = chunked_pair(run_dir, Path(args.target), args.chunk_size)
    results["pair"] = f"{args.target} with attention_chunk_size {args.chunk_size}, {args.draft}"
    results["prefix"] = prefix_hits(pair, Path(args.draft), args.chunk_size)
    results["seconds"] = time.perf_counter() - start
    text = table(results)
    print(text)
    write_report(run_dir, "kv_cache", results, text)
    return 0
