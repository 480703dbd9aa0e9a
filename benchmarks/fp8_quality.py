"""`warpspec bench fp8`: what FP8 weights cost in quality on the bundled pair, side by side with the
checkpoint's own precision.

- Validation perplexity of the target: the model card's protocol (Debian documentation held out by
  document, joined by EOS, 64 evenly spaced 257-token windows, exp of the mean cross-entropy of the
  last 256 tokens of each), computed through warpspec's engine from prompt log-probabilities. Needs the
  corpus (`apt-get install linux-doc-6.1 python3.11-doc`); without it the held-out prompts' own
  texts are scored instead, and the table says so.
- EAGLE-3 acceptance length: the 16 held-out prompts in one batch, k=3, greedy, 64 new tokens each;
  the draft stays in its own precision (as in the record setup: target FP8, draft bf16).
- Greedy agreement: the share of generated tokens identical to the unquantized target's.

FP8 here is online quantization (`quantization="fp8"`) of every linear and routed expert (not
embeddings, head, norms or router). On a CPU the FP8 linears compute weight-only (dequantize, then
matmul in the activations' dtype); on GPUs with FP8 the dense linears also quantize activations per
token (torch._scaled_mm), which this CPU measurement does not include.
Markdown and JSON under runs/bench/.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts, held_out_texts
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams

WINDOW = 256


def validation_windows(target: Path, num_windows: int) -> tuple[list[list[int]], str]:
    """num_windows token windows of WINDOW + 1 tokens, and where they come from."""
    from tokenizers import Tokenizer

    from warpspec.training.corpus import read_documents, split_documents

    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|end_of_text|>")
    try:
        _, docs = split_documents(read_documents())
        texts, source = [d.text for d in docs], f"validation documents ({len(docs)})"
    except FileNotFoundError:
        texts, source = held_out_texts(), "held-out prompt texts (corpus not installed)"
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        stream.extend(encoding.ids)
        stream.append(eos)
    if len(stream) < WINDOW + 2:
        raise ValueError(f"only {len(stream)} validation tokens; need more than {WINDOW + 1}")
    starts = np.linspace(0, len(stream) - WINDOW - 2, num_windows).astype(np.int64)
    return [stream[s : s + WINDOW + 1] for s in starts], f"{source}, {len(stream):,} tokens"


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    total, count = 0.0, 0
    for out in llm.generate(windows, params):
        for position in range(1, len(out.prompt_token_ids)):
            total -= out.prompt_logprobs[position][out.prompt_token_ids[position]].logprob
            count += 1
    return math.exp(total / count)


def measure(target: str, draft: str, quantization: str | None, dtype: str, windows: list[list[int]],
            new_tokens: int) -> dict:
    start = time.perf_counter()
    with LLM(target, dtype=dtype, quantization=quantization, max_num_batched_tokens=4096) as llm:
        ppl = perplexity(llm, windows)
        report = llm.engine.executor.runner.model.load_report
        param_bytes, num_fp8 = report.param_bytes, len(report.fp8_modules)
    # Fixed k: acceptance compared between the weights' formats, not between lengths chosen from timings.
    with LLM(target, dtype=dtype, quantization=quantization, draft=draft, num_speculative_tokens=3,
             speculative_policy="fixed") as llm:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate(held_out_prompts(), params)
        stats = llm.engine.spec_stats
        accept = stats.acceptance_length
        rates = stats.acceptance_rate_at()
    return {"quantization": quantization or "none", "dtype": dtype, "perplexity": ppl, "acceptance_length": accept,
            "acceptance_rate_at": rates, "param_bytes": param_bytes, "fp8_modules": num_fp8,
            "tokens": [o.token_ids for o in outs], "seconds": time.perf_counter() - start}


def format_table(rows: list[dict], source: str, new_tokens: int) -> str:
    lines = ["| target weights | activations | weight bytes | validation perplexity | acceptance length (k=3) "
             "| draft 1 / 2 / 3 accepted | greedy tokens as unquantized |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rates = " / ".join(f"{x:.1%}" for x in r["acceptance_rate_at"])
        lines.append(f"| {'FP8 e4m3, per-channel' if r['quantization'] == 'fp8' else 'checkpoint (bf16)'} "
                     f"| {r['dtype']} | {r['param_bytes'] / 2**20:.1f} MiB | {r['perplexity']:.2f} "
                     f"| {r['acceptance_length']:.3f} | {rates} | {r['same_tokens']:.1%} |")
    lines.append(f"\nPerplexity over {source}; acceptance over the 16 held-out prompts, {new_tokens} new tokens "
                 "each.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench fp8", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT))
    parser.add_argument("--dtype", default="bfloat16", help="activations' dtype (default: the checkpoint's)")
    parser.add_argument("--windows", type=int, default=64, help="validation windows of 257 tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    windows, source = validation_windows(Path(args.target), args.windows)
    rows = [measure(args.target, args.draft, q, args.dtype, windows, args.new_tokens) for q in (None, "fp8")]
    baseline = [t for out in rows[0]["tokens"] for t in out]
    for r in rows:
        tokens = [t for out in r.pop("tokens") for t in out]
        r["same_tokens"] = float(np.mean([a == b for a, b in zip(tokens, baseline, strict=True)]))
    table = format_table(rows, source, args.new_tokens)
    print(table)
    out = Path(args.run_dir) / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_quality.json").write_text(json.dumps({"source": source, "rows": rows}, indent=2) + "\n")
    (out / "fp8_quality.md").write_text(table + "\n")
    print(f"wrote {out / 'fp8_quality.md'} and fp8_quality.json")
    return 0
