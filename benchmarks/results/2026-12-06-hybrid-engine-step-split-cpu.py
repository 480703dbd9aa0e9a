"""A hybrid KV cache against a full one at short context, whole engine steps, both engines in one
process: where a step's time goes. Each round gives both engines `batch` fresh 64-token prompts and
decodes 32 tokens greedily (the prefill step is not counted); per engine, the median over the rounds
of the microseconds a decode step takes (`EngineCore.step`), of them in the executor (`execute`), and
of them building the StepInput (`StepInput.build`, window tables and slots included).

The checkpoint is the one of 2026-12-06-hybrid-short-context-cpu.py (the `small` preset, chunk 128,
block 16, float32; 6 layers, or LAYERS), made on first use. `--cache-windows` runs an experiment:
window tables reused from the step before when every sequence's window is unchanged (slots still
built), patched into this process only.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \
        python benchmarks/results/2026-12-06-hybrid-engine-step-split-cpu.py BATCH ROUNDS [LAYERS] [--cache-windows]
"""

import statistics
import sys
import time
from pathlib import Path

from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.training.random_checkpoint import create_random_checkpoint
from warpspec.workers import step as step_module

CHUNK = 128
TIMED = {"build": 0.0}


def timed_build(build):
    def build_and_time(cls, *args, **kwargs):
        start = time.perf_counter()
        step = build(cls, *args, **kwargs)
        TIMED["build"] += time.perf_counter() - start
        return step
    return classmethod(build_and_time)


def windows_reused(window_inputs):
    """window_inputs keeping the last tables while every sequence's table list, first and last window
    block are the same (the lists only grow past the window's start while a request holds them)."""
    last = {"key": None}

    def reused(seqs, block_size, chunk_size):
        firsts = tuple(seq.num_cached // chunk_size * chunk_size // block_size for seq in seqs)
        ends = tuple(-(-(seq.num_cached + len(seq.token_ids)) // block_size) for seq in seqs)
        key = (tuple(id(seq.window_tables) for seq in seqs), firsts, ends)
        slots = []
        for seq in seqs:
            for p in range(seq.num_cached, seq.num_cached + len(seq.token_ids)):
                block, offset = divmod(p, block_size)
                slots += [table[block] * block_size + offset for table in seq.window_tables]
        if key != last["key"]:
            last.update(window_inputs(seqs, block_size, chunk_size), key=key, held=[seq.window_tables for seq in seqs])
        return {"window_starts": last["window_starts"], "window_tables": last["window_tables"],
                "window_slot_mapping": step_module.int_tensor(slots).view(-1, len(seqs[0].window_tables))}
    return reused


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    batch, rounds = int(args[0]), int(args[1])
    layers = int(args[2]) if len(args) > 2 else 6
    if "--cache-windows" in sys.argv:
        step_module.window_inputs = windows_reused(step_module.window_inputs)
    step_module.StepInput.build = timed_build(step_module.StepInput.build.__func__)
    path = Path("runs/hybrid-short-context-c128" + ("" if layers == 6 else f"-l{layers}"))
    if not (path / "config.json").exists():
        create_random_checkpoint(path, "small", attention_chunk_size=CHUNK, max_position_embeddings=32768,
                                 num_hidden_layers=layers)
    engines = {hybrid: LLM(str(path), dtype="float32", block_size=16, hybrid_kv_cache=hybrid)
               for hybrid in (True, False)}
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    times = {hybrid: {"step": [], "execute": [], "build": []} for hybrid in engines}
    for r in range(rounds):
        for hybrid, llm in engines.items():
            core, executed = llm.engine, [0.0]
            execute = core.executor.execute

            def timed_execute(plan, execute=execute, executed=executed):
                start = time.perf_counter()
                out = execute(plan)
                executed[0] += time.perf_counter() - start
                return out
            core.executor.execute = timed_execute
            for i in range(batch):
                prompt = [3 + (r * 7 + i * 13 + j) % 4000 for j in range(64)]
                core.add_request(core.new_request(f"r{r}-{i}", prompt, params))
            core.step()  # the prefill
            TIMED["build"], executed[0], steps = 0.0, 0.0, 0
            start = time.perf_counter()
            while core.has_unfinished():
                core.step()
                steps += 1
            elapsed = time.perf_counter() - start
            core.executor.execute = execute
            for name, seconds in (("step", elapsed), ("execute", executed[0]), ("build", TIMED["build"])):
                times[hybrid][name].append(seconds / steps * 1e6)
    medians = {hybrid: {name: statistics.median(v) for name, v in t.items()} for hybrid, t in times.items()}
    print(f"batch {batch}, {layers} layers, {rounds} rounds, median us a decode step")
    print("| cache | step | execute | of it StepInput.build | outside execute |")
    print("|---|---|---|---|---|")
    for hybrid, m in medians.items():
        print(f"| {'hybrid' if hybrid else 'full'} | {m['step']:.1f} | {m['execute']:.1f} | {m['build']:.1f} | "
              f"{m['step'] - m['execute']:.1f} |")
    print(f"hybrid / full step time: {medians[True]['step'] / medians[False]['step']:.3f}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
