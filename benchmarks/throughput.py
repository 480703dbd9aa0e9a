"""`warpspec bench throughput`: a replica under N concurrent requests beside Hugging Face
transformers' batched `generate`, same checkpoint, same prompts, same output lengths, one run.

warpspec serves the N requests through AsyncLLM (continuous batching); transformers gets them as
one batch. Reported: output tokens/s for both and their ratio, and warpspec's TTFT / TPOT
percentiles (for transformers, TTFT is the time of the batch's first token and TPOT the rest of the
batch time per further token). Writes JSON, a Markdown table and a PNG plot under runs/bench/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.sampling_params import SamplingParams
from warpspec.training.random_checkpoint import create_random_checkpoint


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, vocab, (length - 1,), generator=gen).tolist()] for _ in range(num)]


async def run_warpspec(engine: AsyncLLM, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)

    async def one(prompt):
        final = None
        async for out in engine.generate(prompt, params):
            final = out
        return final

    start = time.perf_counter()
    outs = await asyncio.gather(*[one(p) for p in prompts])
    wall = time.perf_counter() - start
    ttft = [o.metrics["time_to_first_token_s"] * 1e3 for o in outs]
    tpot = [o.metrics["time_per_output_token_s"] * 1e3 for o in outs]
    return {"tokens_per_s": len(prompts) * new_tokens / wall, "wall_s": wall,
            "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": _percentile(ttft, 0.99),
            "tpot_ms_p50": statistics.median(tpot), "tpot_ms_p99": _percentile(tpot, 0.99),
            "token_ids": [o.token_ids for o in outs]}


async def _start_engine(model_dir: Path) -> AsyncLLM:
    # Prefix caching off: every repeat sends the same prompts, and transformers caches nothing.
    return AsyncLLM.from_options(str(model_dir), dtype="float32", enable_prefix_caching=False)


def run_transformers(model, prompts: list[list[int]], new_tokens: int) -> dict:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        wall = time.perf_counter() - start
    return {"tokens_per_s": len(prompts) * new_tokens / wall, "wall_s": wall, "ttft_ms": ttft * 1e3,
            "tpot_ms": (wall - ttft) / (new_tokens - 1) * 1e3, "token_ids": out[:, ids.shape[1]:].tolist()}


def format_table(rows: list[dict]) -> str:
    lines = ["| concurrency | warpspec tok/s | transformers tok/s | ratio | warpspec TTFT p50 / p99 (ms) "
             "| warpspec TPOT p50 / p99 (ms) | transformers TTFT / TPOT (ms) | same greedy tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w, h = r["warpspec"], r["transformers"]
        lines.append(f"| {r['concurrency']} | {w['tokens_per_s']:.0f} | {h['tokens_per_s']:.0f} | {r['ratio']:.2f}x "
                     f"| {w['ttft_ms_p50']:.1f} / {w['ttft_ms_p99']:.1f} "
                     f"| {w['tpot_ms_p50']:.2f} / {w['tpot_ms_p99']:.2f} "
                     f"| {h['ttft_ms']:.1f} / {h['tpot_ms']:.2f} | {r['same_tokens']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["warpspec"]["tokens_per_s"] for r in rows], "o-", label="warpspec (continuous batching)")
    ax.plot(x, [r["transformers"]["tokens_per_s"] for r in rows], "s--", label="transformers generate (batched)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(c) for c in x])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput, same checkpoint and prompts (CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a random 'small' checkpoint)")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine and concurrency (median kept)")
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    try:
        from transformers import Llama4ForCausalLM
    except ImportError:
        raise SystemExit("the throughput benchmark compares against transformers: "
                         "pip install 'warpspec[test]'") from None
    out_dir = Path(args.run_dir, "bench")
    model_dir = Path(args.model) if args.model else out_dir / "throughput-model"
    if not (model_dir / "config.json").exists():
        create_random_checkpoint(model_dir, "small")
    reference = Llama4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # run every request to its full length
    vocab = reference.config.vocab_size
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    # Interleave the two engines and repeat, keeping the median: this machine's speed drifts by
    # tens of percent over a minute, and back-to-back blocks would turn drift into a ratio.
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(_start_engine(model_dir))
    loop.run_until_complete(run_warpspec(engine, make_prompts(2, args.prompt_len, vocab, seed=99), 4))  # warm up
    run_transformers(reference, make_prompts(2, args.prompt_len, vocab, seed=99), 4)
    rows = []
    for c in concurrencies:
        prompts = make_prompts(c, args.prompt_len, vocab)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(loop.run_until_complete(run_warpspec(engine, prompts, args.new_tokens)))
            theirs.append(run_transformers(reference, prompts, args.new_tokens))
        w = sorted(ours, key=lambda r: r["tokens_per_s"])[len(ours) // 2]
        h = sorted(theirs, key=lambda r: r["tokens_per_s"])[len(theirs) // 2]
        same = w.pop("token_ids") == h.pop("token_ids")
        rows.append({"concurrency": c, "warpspec": w, "transformers": h, "same_tokens": same,
                     "ratio": w["tokens_per_s"] / h["tokens_per_s"]})
    loop.run_until_complete(engine.shutdown())
    loop.close()
    table = format_table(rows)
    print(f"model {model_dir}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request, "
          f"float32, median of {args.repeats} interleaved runs\n")
    print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "throughput.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out_dir / "throughput.md").write_text(table + "\n")
    plot(rows, out_dir / "throughput.png")
    print(f"\nwrote {out_dir / 'throughput.json'}, throughput.md, throughput.png")
    return 0
