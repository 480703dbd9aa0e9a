"""Load a Hugging Face Llama 4 checkpoint folder into Llama4ForCausalLM.

Tensor by tensor from memory-mapped safetensors, through the model file's name-mapping table, into
parameters allocated empty: peak memory stays near the model's own size (plus one tensor).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from warpspec.kernels.fp8 import FP8_DTYPE
from warpspec.workers.comm import Communicator
from warpspec.workers.errors import CheckpointError
from warpspec.workers.layers import CheckpointTensor
from warpspec.workers.llama4 import Llama4Experts, Llama4ForCausalLM, checkpoint_names, map_checkpoint_name
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.quantization import apply_quantization, resolve_quantization

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some exporters write that carry no weights we need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of auto, {', '.join(DTYPES)}")
        return dtype
    if dtype == "auto":
        return DTYPES.get(config.torch_dtype, torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def safetensors_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise CheckpointError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index ({e!r})") from None
    files = sorted({model_dir / f for f in weight_map.values()})
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{index} lists {f.name}, which is missing")
    return files


def iter_checkpoint_tensors(files: list[Path]) -> Iterator[CheckpointTensor]:
    """Yield each tensor as a CheckpointTensor that reads only the slices its layer asks for.

    The file is mapped afresh for each tensor: pages of a mapping held open for the whole file would
    stay in the process's resident set, doubling peak RSS to model + file."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
            for name in names:
                with safe_open(str(path), framework="pt") as f:
                    tensor_slice = f.get_slice(name)
                    yield name, CheckpointTensor(tensor_slice, tuple(tensor_slice.get_shape()))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"corrupt or unreadable safetensors file {path}: {e}") from None


def read_ahead(files: list[Path]) -> threading.Thread:
    """Ask the kernel to read files into the page cache, on a thread of its own, while the loader
    copies the tensors already there: the disk and the copies overlap instead of taking turns (a
    2 GB checkpoint, cache dropped: 0.58x of a sequential read without, `warpspec bench weights
    --cold`). Only for a rank that reads every byte: with several ranks each reads its slices."""
    def advise() -> None:
        for path in files:
            with contextlib.suppress(OSError, AttributeError):  # posix_fadvise: Linux and most Unixes
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    thread = threading.Thread(target=advise, name="warpspec-read-ahead", daemon=True)
    thread.start()
    return thread


@dataclass
class LoadReport:
    bytes_read: int  # checkpoint bytes this rank read (its shard plus the replicated tensors)
    param_bytes: int  # bytes of the parameters it holds
    fp8_modules: list[str] = field(default_factory=list)  # layers holding FP8 weights


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               comm: Communicator | None = None, quantization: str | None = None,
               moe_parallel: str = "tensor") -> Llama4ForCausalLM:
    """quantization: None (the checkpoint's own precision: FP8 for an fbgemm_fp8 checkpoint) or "fp8"
    (quantize a full-precision checkpoint's linears and experts as they load; see quantization.py).
    moe_parallel: how routed experts split over comm's ranks (llama4.Llama4Experts)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    quant = resolve_quantization(model_dir, quantization)
    files = safetensors_files(model_dir)
    prefix = config.tensor_prefix
    with torch.device(device):
        model = Llama4ForCausalLM(config, resolve_dtype(dtype, config), comm, moe_parallel)
    fp8_modules = apply_quantization(model, quant, files, prefix)
    if torch.device(device).type == "cpu":  # GPU kernels read the checkpoint's layouts
        for module in model.modules():
            if isinstance(module, Llama4Experts):
                module.lay_out_inputs_contiguous()
    if comm is None or comm.world_size == 1:
        read_ahead(files)
    params = dict(model.named_parameters())
    pending = {(hf_name, shard): name for name in params for hf_name, shard in checkpoint_names(name)}
    bytes_read = 0
    progress = tqdm(desc="loading weights", unit="tensor", total=len(pending), disable=None, leave=False)
    for raw_name, tensor in iter_checkpoint_tensors(files):
        if prefix and not raw_name.startswith(prefix):
            continue  # vision tower and projector of a multimodal checkpoint: not served
        name = raw_name[len(prefix):]
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        param_name, shard_id = map_checkpoint_name(name)
        if param_name not in params:
            raise CheckpointError(f"unexpected tensor {raw_name!r} in checkpoint {model_dir}")
        param = params[param_name]
        param.weight_loader(param, tensor, raw_name, shard_id)
        bytes_read += tensor.bytes_read
        pending.pop((name, shard_id), None)
        if param.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
            pending.pop((name + "_scale", shard_id), None)  # quantized while loading: scale computed
        progress.update()
    progress.close()
    if pending:
        missing = sorted(prefix + hf_name for hf_name, _ in pending)
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {model_dir} is missing tensor {shown}")
    if torch.device(device).type == "cpu":
        model.store_head_columns_contiguous()
    model.load_report = LoadReport(bytes_read, sum(p.numel() * p.element_size() for p in params.values()),
                                   fp8_modules)
    return model.eval()


def read_checkpoint_tensor(model_dir: str | Path, name: str, config: ModelConfig) -> torch.Tensor:
    """One whole tensor of a text checkpoint by its Llama4ForCausalLM name (prefix added for the
    multimodal layout), e.g. the embedding table a draft model shares."""
    full_name = config.tensor_prefix + name
    for tensor_name, tensor in iter_checkpoint_tensors(safetensors_files(Path(model_dir))):
        if tensor_name == full_name:
            return tensor.read()
    raise CheckpointError(f"checkpoint {model_dir} is missing tensor {full_name}")
