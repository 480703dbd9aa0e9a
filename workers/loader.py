"""Load a Hugging Face checkpoint folder into the causal LM of its model family (workers/models/).

Tensor by tensor from memory-mapped safetensors, through the model file's name-mapping table, into
parameters allocated empty: peak memory stays near the model's own size (plus one tensor).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from warpspec.kernels.fp8 import FP8_DTYPE
from warpspec.workers.distributed.comm import Communicator
from warpspec.workers.errors import CheckpointError
from warpspec.workers.layers import CheckpointTensor
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.models.decoder import DecoderForCausalLM
from warpspec.workers.models.registry import load_model_config, model_class_of
from warpspec.workers.quantization import apply_quantization, resolve_quantization

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 (and 4 KB-page ARM)
READ_AHEAD_BLOCK = 16 << 20

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


def iter_checkpoint_tensors(files: list[Path], after_file: Callable[[], None] | None = None
                            ) -> Iterator[CheckpointTensor]:
    """Yield each tensor as a CheckpointTensor that reads only the slices its layer asks for, and
    call after_file once a file's tensors are all taken.

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
        if after_file is not None:
            after_file()


class ReadAhead:
    """Reads the checkpoint's files into the page cache on a thread of its own, each start to end,
    while the loader copies the tensors already there: the disk reads sequentially at its own speed
    instead of waiting on the loader's page faults. It keeps at most `files_ahead` files beyond the
    one loading, so that a checkpoint larger than memory does not push pages out before they are
    loaded. The pages go to /dev/null with sendfile, which fills the page cache without copying them
    anywhere: 0.05 s of CPU for 3 GB, against 0.45 s for reads into a buffer, a core the loader's copies
    need. A 3 GB checkpoint, page cache dropped, 2 cores: 1.48 s to load with a read-ahead thread, 1.81 s
    without, and 1.82 s with posix_fadvise(WILLNEED) on every file (what this replaced: no faster than
    nothing here); a sequential read of the files alone took 1.38 s.

        with ReadAhead(files) as read_ahead:
            for name, tensor in iter_checkpoint_tensors(files, read_ahead.file_done): ...
    """

    def __init__(self, files: list[Path], files_ahead: int = 1):
        self.files = files
        self.permits = threading.Semaphore(files_ahead + 1)  # files it may read before the loader is done with one
        self.is_stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="warpspec-read-ahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.is_stopped.set()
        self.permits.release()  # wakes the thread where it waits for the loader

    def file_done(self) -> None:
        self.permits.release()

    def run(self) -> None:
        with open(os.devnull, "wb", buffering=0) as sink:
            for path in self.files:
                self.permits.acquire()
                if self.is_stopped.is_set():
                    return
                with contextlib.suppress(OSError), path.open("rb", buffering=0) as f:  # the loader reports it
                    self.read_into_page_cache(f.fileno(), os.fstat(f.fileno()).st_size, sink.fileno())

    def read_into_page_cache(self, fd: int, size: int, sink: int) -> None:
        block = None
        offset = 0
        while offset < size and not self.is_stopped.is_set():
            try:
                sent = os.sendfile(sink, fd, offset, READ_AHEAD_BLOCK)
            except OSError:  # where sendfile wants a socket (macOS): read into a buffer instead
                block = block or memoryview(bytearray(READ_AHEAD_BLOCK))
                sent = os.preadv(fd, [block], offset)
            if sent == 0:
                return
            offset += sent


def advise_huge_pages(model: nn.Module) -> None:
    """Ask Linux to back each CPU parameter's memory with transparent huge pages (2 MB) before the
    weights are written to it (madvise MADV_HUGEPAGE; THP's default mode, "madvise", gives huge pages
    only where asked). The first write to each 4 KB page otherwise costs a page fault: 0.6 of a 3 GB
    checkpoint's 1.8 s load, and the transposing writes of the experts (kernels/transpose.py) miss the
    TLB. That load, in one process, median of 4: 1.43 s with huge pages, 2.11 s without. Where the
    kernel refuses (no THP: EINVAL, or THP "never"), memory stays as it was."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return  # not Linux
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    for param in model.parameters():
        storage = param.untyped_storage()
        if param.device.type != "cpu" or storage.nbytes() < 2 * HUGE_PAGE:
            continue
        # The whole pages inside the storage: its first and last partial pages may hold other data.
        start = -(-storage.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (storage.data_ptr() + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
        if madvise(start, end - start, mmap.MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused: %s", os.strerror(ctypes.get_errno()))
            return


@dataclass
class LoadReport:
    bytes_read: int  # checkpoint bytes this rank read (its shard plus the replicated tensors)
    param_bytes: int  # bytes of the parameters it holds
    fp8_modules: list[str] = field(default_factory=list)  # layers holding FP8 weights


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               comm: Communicator | None = None, quantization: str | None = None,
               moe_parallel: str = "tensor") -> DecoderForCausalLM:
    """quantization: None (the checkpoint's own precision: FP8 for an fbgemm_fp8 checkpoint) or "fp8"
    (quantize a full-precision checkpoint's linears and experts as they load; see quantization.py).
    moe_parallel: how routed experts split over comm's ranks (models/llama4.Llama4Experts)."""
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    quant = resolve_quantization(model_dir, quantization)
    files = safetensors_files(model_dir)
    prefix = config.tensor_prefix
    with torch.device(device):
        model = model_class_of(config)(config, resolve_dtype(dtype, config), comm, moe_parallel)
    fp8_modules = apply_quantization(model, quant, files, prefix)
    if torch.device(device).type == "cpu":  # GPU kernels read the checkpoint's layouts
        for module in model.modules():
            if hasattr(module, "lay_out_inputs_contiguous"):  # experts read by index (models/llama4.py)
                module.lay_out_inputs_contiguous()
        advise_huge_pages(model)
    params = dict(model.named_parameters())
    reads_every_byte = comm is None or comm.world_size == 1  # with several ranks each reads its slices
    with ReadAhead(files) if reads_every_byte else contextlib.nullcontext() as read_ahead:
        bytes_read = load_tensors(model, params, files, model_dir, read_ahead and read_ahead.file_done)
    if torch.device(device).type == "cpu":
        model.store_head_columns_contiguous()
    model.load_report = LoadReport(bytes_read, sum(p.numel() * p.element_size() for p in params.values()),
                                   fp8_modules)
    return model.eval()


def load_tensors(model: DecoderForCausalLM, params: dict[str, nn.Parameter], files: list[Path], model_dir: Path,
                 after_file: Callable[[], None] | None) -> int:
    """Every checkpoint tensor into its parameter of model's (params, by name) through the layer's
    weight_loader, as the model's family names and lays them out; the bytes read."""
    config = model.config
    prefix = config.tensor_prefix
    pending = {(hf_name, shard): name for name in params for hf_name, shard in model.checkpoint_names(name)}
    bytes_read = 0
    progress = tqdm(desc="loading weights", unit="tensor", total=len(pending), disable=None, leave=False)
    for raw_name, tensor in iter_checkpoint_tensors(files, after_file):
        if prefix and not raw_name.startswith(prefix):
            continue  # vision tower and projector of a multimodal checkpoint: not served
        name = raw_name[len(prefix):]
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        param_name, shard_id = model.map_checkpoint_name(name)
        if param_name not in params:
            raise CheckpointError(f"unexpected tensor {raw_name!r} in checkpoint {model_dir}")
        param = params[param_name]
        param.weight_loader(param, model.adapt_checkpoint_tensor(name, tensor), raw_name, shard_id)
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
    return bytes_read


def read_checkpoint_tensor(model_dir: str | Path, name: str, config: ModelConfig) -> torch.Tensor:
    """One whole tensor of a text checkpoint by its name in the text model (prefix added for a
    multimodal layout), e.g. the embedding table a draft model shares."""
    full_name = config.tensor_prefix + name
    for tensor_name, tensor in iter_checkpoint_tensors(safetensors_files(Path(model_dir))):
        if tensor_name == full_name:
            return tensor.read()
    raise CheckpointError(f"checkpoint {model_dir} is missing tensor {full_name}")
