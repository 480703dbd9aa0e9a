"""vLLM's side of `warpspec bench compare --vllm PYTHON`: run by that Python (a venv with vLLM's CPU
build, `make vllm-peer`), never imported by warpspec. It holds two vLLM engines over the same target,
plain and with the EAGLE-3 draft, and answers one JSON line per request on the pipe it was given, so
that the benchmark interleaves their runs with warpspec's and transformers' as it does for those.

Requests (one JSON object a line on stdin):
    {"cmd": "run", "engine": "plain" | "eagle3", "prompts": [[ids]], "new_tokens": n}
        -> {"tokens": [[ids]], "wall_s": s}   (greedy; the time of generate alone)
    {"cmd": "spec_counts"} -> {"drafts": n, "accepted": n}   (the EAGLE-3 engine's counters so far)
Start-up arguments: one JSON object in argv[1] (target, draft, dtype, max_model_len, hf_overrides,
num_speculative_tokens). It answers {"ready": true, "vllm": version, "start_s": {...}} once both
engines are up. Standard input closed: it exits.

Only stdlib and vLLM here: this file runs in vLLM's venv, and with `python -I` from a folder outside
the repository (see DESIGN.md: the repository's `kernels/` would shadow a package vLLM probes for).
"""

import json
import os
import sys
import time


def spec_counts(llm) -> dict:
    """vLLM's own counters: drafts proposed (one per verifying sequence and step) and draft tokens
    accepted, summed over its engine's metrics."""
    counts = {"drafts": 0, "accepted": 0}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for metric in llm.get_metrics():
        if metric.name in names:
            counts[names[metric.name]] += int(metric.value)
    return counts


def main() -> None:
    # Replies go to the pipe stdout was; everything vLLM or its engine processes print goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    args = json.loads(sys.argv[1])
    import vllm

    common = {"model": args["target"], "dtype": args["dtype"], "max_model_len": args["max_model_len"],
              "hf_overrides": args["hf_overrides"], "enable_prefix_caching": False, "seed": 0,
              "disable_log_stats": False}
    start_s, engines = {}, {}
    for name, extra in (("plain", {}), ("eagle3", {"speculative_config": {
            "method": "eagle3", "model": args["draft"], "num_speculative_tokens": args["num_speculative_tokens"]}})):
        start = time.perf_counter()
        engines[name] = vllm.LLM(**common, **extra)
        start_s[name] = time.perf_counter() - start
    replies.write(json.dumps({"ready": True, "vllm": vllm.__version__, "start_s": start_s}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "spec_counts":
            reply = spec_counts(engines["eagle3"])
        else:
            params = vllm.SamplingParams(temperature=0.0, max_tokens=request["new_tokens"], ignore_eos=True)
            inputs = [{"prompt_token_ids": ids} for ids in request["prompts"]]
            start = time.perf_counter()
            outputs = engines[request["engine"]].generate(inputs, params, use_tqdm=False)
            wall_s = time.perf_counter() - start
            reply = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "wall_s": wall_s}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which imports this file again
    main()
