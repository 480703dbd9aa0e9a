"""`warpspec bench weights`: how fast a rank loads its weights, against a plain sequential read of
the same files.

A random Llama 4 checkpoint of about --gigabytes GB (bf16, split into safetensors shards of
--shard-gb) is written once under --run-dir, then, interleaved and repeated:
  sequential read   the files read start to end in 16 MiB blocks into one buffer (`cat` to /dev/null)
  warpspec load     load_model as one rank builds its model: parameters allocated, every tensor
                    read through its layer's weight_loader
By default both run with the files in the page cache (the first, untimed pass warms it): what is
compared is the loader's own cost per byte. --cold drops the page cache before every run (root only,
through /proc/sys/vm/drop_caches): the disk's speed then bounds both. The table gives GB/s of
checkpoint bytes and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from warpspec.benchmarks.report import write_report
from warpspec.training.random_checkpoint import PRESETS
from warpspec.workers.checkpoint_writer import checkpoint_state_dict, hf_config_dict
from warpspec.workers.loader import load_model, safetensors_files
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.models.llama4 import Llama4ForCausalLM
from warpspec.workers.models.registry import model_config_from_dict

BLOCK = 16 << 20
# The "small" preset widened until a checkpoint is about 1 GB per 2.2 experts-per-layer unit: the
# number of experts scales it to the size asked for.
SHAPE = dict(PRESETS["small"], vocab_size=32000, hidden_size=1024, intermediate_size=1024,
             intermediate_size_mlp=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64)


def checkpoint_config(gigabytes: float) -> ModelConfig:
    """A config whose bf16 checkpoint holds about `gigabytes` GB: 4 MoE layers of E experts of
    3 x 1024 x 1024 parameters dominate it."""
    per_expert_gb = 4 * 3 * 1024 * 1024 * 2 / 1e9
    fixed_gb = 0.25  # embeddings, head, attention, dense and shared MLPs
    experts = max(1, round((gigabytes - fixed_gb) / per_expert_gb))
    return model_config_from_dict({**SHAPE, "num_local_experts": experts, "architectures": ["Llama4ForCausalLM"],
                                  "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})


def write_checkpoint(out: Path, gigabytes: float, shard_gb: float) -> Path:
    """A random bf16 checkpoint in shards with its index, reused when already there."""
    if (out / "config.json").is_file():
        return out
    config = checkpoint_config(gigabytes)
    with torch.device("meta"):
        model = Llama4ForCausalLM(config, torch.bfloat16)
    names = checkpoint_state_dict(model)  # names and shapes only: meta tensors
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map, shard_bytes, index = {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, index
        index += 1
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, meta in tqdm(names.items(), desc="writing the checkpoint", unit="tensor"):
        tensor = (torch.randn(meta.shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= shard_gb * 1e9:
            flush()
    if shard:
        flush()
    # Shard names carry the total, as Hugging Face writes them: model-00001-of-00004.safetensors.
    renamed = {}
    for old in sorted(set(weight_map.values())):
        new = old.replace(".safetensors", f"-of-{index:05d}.safetensors")
        (out / old).rename(out / new)
        renamed[old] = new
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config_dict(config, torch.bfloat16), indent=2) + "\n")
    return out


def sequential_read(files: list[Path]) -> int:
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    total = 0
    for path in files:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"--cold: the page cache cannot be dropped here ({e.strerror}); run as root") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench weights", description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=3.0, help="checkpoint size (bf16)")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="safetensors shard size")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each (median kept)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every run (root)")
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    if args.gigabytes <= 0 or args.shard_gb <= 0:
        raise SystemExit("--gigabytes and --shard-gb: positive sizes")
    folder = write_checkpoint(Path(args.run_dir, "bench", f"weights-{args.gigabytes:g}gb"), args.gigabytes,
                              args.shard_gb)
    files = safetensors_files(folder)
    file_bytes = sum(f.stat().st_size for f in files)
    before = drop_page_cache if args.cold else lambda: None
    sequential_read(files)  # warm: the page cache holds the files from here on
    times: dict[str, list[float]] = {"sequential read": [], "warpspec load": []}
    bytes_read = 0
    for _ in tqdm(range(args.repeats), desc="timed runs", unit="round"):
        before()
        start = time.perf_counter()
        sequential_read(files)
        times["sequential read"].append(time.perf_counter() - start)
        before()
        start = time.perf_counter()
        model = load_model(folder, dtype="bfloat16")
        times["warpspec load"].append(time.perf_counter() - start)
        bytes_read = model.load_report.bytes_read
        del model
    rates = {"sequential read": file_bytes, "warpspec load": bytes_read}
    rows = [{"what": what, "gb": rates[what] / 1e9, "median_s": statistics.median(ts), "runs_s": ts,
             "gb_per_s": rates[what] / 1e9 / statistics.median(ts)} for what, ts in times.items()]
    ratio = rows[1]["gb_per_s"] / rows[0]["gb_per_s"]
    cache = "dropped before each run" if args.cold else "warm"
    lines = [f"Checkpoint: {folder} ({file_bytes / 1e9:.2f} GB in {len(files)} files, bf16), page cache {cache}, "
             f"median of {args.repeats}, torch threads {torch.get_num_threads()}", "",
             "| what | GB | median s | runs s | GB/s | vs sequential read |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['gb']:.2f} | {r['median_s']:.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in r['runs_s'])} | {r['gb_per_s']:.2f} | "
                     f"{r['gb_per_s'] / rows[0]['gb_per_s']:.2f}x |")
    table = "\n".join(lines) + "\n"
    print(table)
    write_report(args.run_dir, "weights-cold" if args.cold else "weights",
                 {"rows": rows, "ratio": ratio, "files": len(files), "cold": args.cold}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
