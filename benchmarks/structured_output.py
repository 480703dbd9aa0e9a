"""`warpspec bench structured_output`: what a grammar costs, on the bundled pair in float32.

Three sections, each side by side in one run:
- libraries: llguidance (what warpspec uses) against xgrammar, when xgrammar is installed
  (`pip install xgrammar`): compiling a 30-field schema cold and cached, the per-token mask along a
  valid document, and whether each one refuses, or else enforces, schema keywords a grammar may not
  support (a document breaking the keyword must be refused);
- mask: one step's grammar work at batch 1, 8 and 32 (masks for 1 row per request, or for k + 1
  rows after k = 3 drafts; applying them; advancing the matchers), as the engine core does it;
- serving: tokens/s per user and acceptance on JSON-schema requests against free text, with and
  without the EAGLE-3 draft, at batch 1 and 8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance.numpy
import torch
from tqdm import tqdm

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.benchmarks.report import write_report
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams, StructuredOutputs
from warpspec.structured_output.grammar import GrammarCompiler, masked
from warpspec.tokenizer import Tokenizer

EOS = 2
# Keyword -> (schema, a document that breaks it): enforced means the document is refused.
KEYWORDS = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "not": ({"not": {"type": "string"}}, '"abc"'),
    "if/then": ({"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
                '{"a": 1}'),
    "minProperties": ({"type": "object", "minProperties": 1}, "{}"),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$"}, '"A1"'),
    "maximum": ({"type": "integer", "maximum": 10}, "11"),
}


def schema_of_30_fields() -> dict:
    """Strings, integers, numbers, booleans, arrays and enums, all required."""
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"type": "array", "items": {"type": "string"}, "maxItems": 4}, {"enum": ["red", "green", "blue"]}]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(30)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def document_of_30_fields() -> str:
    values = ["hello world", 3, 1.5, True, ["a", "b"], "green"]
    return json.dumps({f"field_{i}": values[i % len(values)] for i in range(30)})


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_libraries(tokenizer: Tokenizer, vocab_size: int) -> list[dict]:
    schema, doc = json.dumps(schema_of_30_fields()), document_of_30_fields()
    ids = tokenizer.hf.encode(doc, add_special_tokens=False).ids
    rows = []
    compiler = GrammarCompiler(tokenizer.hf.to_str(), vocab_size, [EOS])
    spec = StructuredOutputs(json=schema)
    cold = _timed(lambda: compiler.check(spec))
    cached = _timed(lambda: compiler.check(spec))
    matcher = compiler.matcher(spec)
    bitmask, masks = llguidance.numpy.allocate_token_bitmask(1, vocab_size), []
    for token in ids:  # the bitmask alone, as for xgrammar below
        masks.append(_timed(lambda m=matcher: llguidance.numpy.fill_next_token_bitmask(m, bitmask)))
        matcher.consume_token(token)
    enforced = {}
    for name, (keyword_schema, breaking) in KEYWORDS.items():
        try:
            m = compiler.matcher(StructuredOutputs(json=keyword_schema))
        except Exception as e:  # noqa: BLE001 - refused at compile time, which is what a client needs
            enforced[name] = f"refused ({str(e).split(': ', 1)[-1][:40]})"
            continue
        breaking_ids = tokenizer.hf.encode(breaking, add_special_tokens=False).ids + [EOS]
        enforced[name] = "enforced" if m.try_consume_tokens(breaking_ids) < len(breaking_ids) else "IGNORED"
    rows.append({"library": "llguidance", "compile_cold_ms": cold * 1e3, "compile_cached_ms": cached * 1e3,
                 "mask_median_us": statistics.median(masks) * 1e6, "mask_max_us": max(masks) * 1e6,
                 "keywords": enforced})
    try:
        import xgrammar
    except ImportError:
        return rows
    vocab = [""] * vocab_size
    for text, token in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        vocab[token] = text
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[EOS])
    x_compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    cold = _timed(lambda: x_compiler.compile_json_schema(schema))
    cached = _timed(lambda: x_compiler.compile_json_schema(schema))
    matcher = xgrammar.GrammarMatcher(x_compiler.compile_json_schema(schema))
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    masks = []
    for token in ids:
        masks.append(_timed(lambda m=matcher: m.fill_next_token_bitmask(bitmask)))
        matcher.accept_token(token)
    enforced = {}
    for name, (keyword_schema, breaking) in KEYWORDS.items():
        try:
            m = xgrammar.GrammarMatcher(x_compiler.compile_json_schema(json.dumps(keyword_schema)))
        except Exception as e:  # noqa: BLE001
            enforced[name] = f"refused ({str(e).split(': ', 1)[-1][:40]})"
            continue
        accepted = all(m.accept_token(t) for t in tokenizer.hf.encode(breaking, add_special_tokens=False).ids)
        enforced[name] = "IGNORED" if accepted and m.accept_token(EOS) else "enforced"
    rows.append({"library": "xgrammar", "compile_cold_ms": cold * 1e3, "compile_cached_ms": cached * 1e3,
                 "mask_median_us": statistics.median(masks) * 1e6, "mask_max_us": max(masks) * 1e6,
                 "keywords": enforced})
    return rows


def measure_mask(tokenizer: Tokenizer, vocab_size: int, batches: list[int], k: int, repeats: int) -> list[dict]:
    """Per step, for batch B: masks (1 row each, or k + 1 after k drafts), the masked_fill over the
    step's logits, and consuming one token per request; median over `repeats` steps along a document."""
    compiler = GrammarCompiler(tokenizer.hf.to_str(), vocab_size, [EOS])
    spec = StructuredOutputs(json=schema_of_30_fields())
    ids = tokenizer.hf.encode(document_of_30_fields(), add_special_tokens=False).ids
    rows = []
    for batch in tqdm(batches, desc="mask cost", unit="batch"):
        for drafts in (0, k):
            matchers = [compiler.matcher(spec) for _ in range(batch)]
            logits = torch.randn(batch * (drafts + 1), vocab_size)
            fill, apply, advance = [], [], []
            for step in range(min(repeats, len(ids) - drafts - 1)):
                entries = [(m, i * (drafts + 1), ids[step + 1 : step + 1 + drafts]) for i, m in enumerate(matchers)]
                start = time.perf_counter()
                allowed = compiler.fill_masks(entries, logits.shape[0])
                filled = time.perf_counter()
                masked(logits, allowed)
                applied = time.perf_counter()
                for matcher in matchers:
                    matcher.consume_token(ids[step])
                fill.append(filled - start)
                apply.append(applied - filled)
                advance.append(time.perf_counter() - applied)
            rows.append({"batch": batch, "drafts": drafts, "fill_us": statistics.median(fill) * 1e6,
                         "apply_us": statistics.median(apply) * 1e6, "advance_us": statistics.median(advance) * 1e6})
    return rows


def measure_serving(target: str, draft: str, batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    prompts = held_out_prompts()
    schema = {"type": "object", "additionalProperties": False, "required": ["title", "summary", "tags"],
              "properties": {"title": {"type": "string", "maxLength": 60}, "summary": {"type": "string"},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}}}}
    kinds = {"free text": None, "JSON schema": StructuredOutputs(json=schema)}
    rows = []
    for with_draft in (False, True):
        options = dict(draft=draft, compile_draft=True) if with_draft else {}
        with LLM(target, dtype="float32", **options) as llm:
            for batch in batches:
                for kind, spec in kinds.items():
                    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=spec is None,
                                            structured_output=spec)
                    per_user, acceptance = [], []
                    for _ in range(repeats):
                        before = (llm.engine.spec_stats.num_verify_steps, llm.engine.spec_stats.num_accepted_tokens)
                        start = time.perf_counter()
                        outs = llm.generate(prompts[:batch], params)
                        elapsed = time.perf_counter() - start
                        per_user.append(statistics.mean(len(o.token_ids) for o in outs) / elapsed)
                        steps = llm.engine.spec_stats.num_verify_steps - before[0]
                        accepted = llm.engine.spec_stats.num_accepted_tokens - before[1]
                        acceptance.append(1 + accepted / steps if steps else 0.0)
                    rows.append({"draft": with_draft, "batch": batch, "kind": kind,
                                 "tokens_per_s_per_user": statistics.median(per_user),
                                 "spread": [min(per_user), max(per_user)],
                                 "acceptance_length": statistics.median(acceptance)})
    return rows


def tables(results: dict) -> str:
    lines = []
    if "libraries" in results:
        keywords = list(KEYWORDS)
        lines += ["| library | 30-field schema: compile cold / cached (ms) | mask per token: median / max (us) | "
                  + " | ".join(keywords) + " |", "|---|---|---|" + "---|" * len(keywords)]
        lines += [f"| {r['library']} | {r['compile_cold_ms']:.2f} / {r['compile_cached_ms']:.3f} | "
                  f"{r['mask_median_us']:.0f} / {r['mask_max_us']:.0f} | "
                  + " | ".join(r["keywords"][k] for k in keywords) + " |" for r in results["libraries"]]
        lines.append("")
    if "mask" in results:
        lines += ["| batch | drafts | masks (us) | apply (us) | advance (us) |", "|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['drafts']} | {r['fill_us']:.0f} | {r['apply_us']:.0f} | {r['advance_us']:.0f} |"
                  for r in results["mask"]]
        lines.append("")
    if "serving" in results:
        lines += ["| draft | batch | requests | tok/s per user (spread) | acceptance length |", "|---|---|---|---|---|"]
        lines += [f"| {'EAGLE-3' if r['draft'] else 'none'} | {r['batch']} | {r['kind']} | "
                  f"{r['tokens_per_s_per_user']:.1f} ({r['spread'][0]:.1f}-{r['spread'][1]:.1f}) | "
                  f"{r['acceptance_length']:.2f} |" for r in results["serving"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench structured_output", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT))
    parser.add_argument("--sections", default="libraries,mask,serving")
    parser.add_argument("--mask-batches", default="1,8,32")
    parser.add_argument("--serving-batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    tokenizer = Tokenizer.from_dir(args.target)
    vocab_size = json.loads((Path(args.target) / "config.json").read_text()).get("vocab_size", tokenizer.vocab_size)
    results: dict[str, list[dict]] = {}
    if "libraries" in sections:
        results["libraries"] = measure_libraries(tokenizer, vocab_size)
    if "mask" in sections:
        results["mask"] = measure_mask(tokenizer, vocab_size, [int(b) for b in args.mask_batches.split(",")], 3,
                                       max(args.repeats, 20))
    if "serving" in sections:
        results["serving"] = measure_serving(args.target, args.draft, [int(b) for b in args.serving_batches.split(",")],
                                             args.new_tokens, args.repeats)
    table = tables(results)
    print(f"target {args.target}, draft {args.draft}, float32\n\n{table}")
    write_report(args.run_dir, "structured_output", results, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
