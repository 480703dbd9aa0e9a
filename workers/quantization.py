"""FP8 weights: which layers hold them, and turning a freshly built (still empty) model's layers into
FP8 layers before the loader fills them.

Two sources, one in-memory layout (weight float8_e4m3fn + float32 scale per output channel):
- online (`quantization="fp8"` on a bf16/fp32 checkpoint): every attention, dense-MLP and
  shared-expert linear and the routed experts are quantized as they are read; embeddings, lm_head,
  norms and the router stay in the model's dtype.
- an FP8 checkpoint in the layout Meta published for Llama 4 (transformers' `fbgemm_fp8`):
  config.json `quantization_config: {"quant_method": "fbgemm_fp8", "activation_scale_ub": ...,
  "modules_to_not_convert": [...]}`; each quantized linear's `weight` is float8_e4m3fn [out, in] beside
  `weight_scale` float32 [out, 1]; routed experts keep their fused [E, in, out] layout as float8 with
  `gate_up_proj_scale` [E, 1, 2I] and `down_proj_scale` [E, H, 1]. Which layers are FP8 is read from
  the safetensors headers (the tensors' dtypes), so the model matches the files whatever rule
  chose them; `modules_to_not_convert` is kept for the record only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from warpspec.kernels.fp8 import FP8_DTYPE
from warpspec.workers.errors import CheckpointError
from warpspec.workers.layers import Linear
from warpspec.workers.models.decoder import DecoderForCausalLM

QUANTIZATION_METHODS = ("fp8",)
CHECKPOINT_METHODS = ("fbgemm_fp8",)
SAFETENSORS_FP8 = "F8_E4M3"


@dataclass
class QuantizationConfig:
    method: str  # "fp8"
    # True: the checkpoint holds FP8 weights and their scales; False: quantize at load time.
    is_checkpoint_quantized: bool = False
    activation_scale_ub: float | None = None  # cap on an activation row's amax (GPU path)
    modules_to_not_convert: tuple[str, ...] = ()


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None "
                         f"(the checkpoint's own precision), got {quantization!r}")


def resolve_quantization(model_dir: str | Path, quantization: str | None) -> QuantizationConfig | None:
    """What the user asked for, combined with what the checkpoint is. An fbgemm_fp8 checkpoint loads
    as FP8 whether or not quantization="fp8" was given."""
    check_quantization(quantization)
    config_path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        raw = {}  # load_model_config reports a missing or broken config.json
    quant = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")
    if not quant:
        return None if quantization is None else QuantizationConfig(quantization)
    method = quant.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise CheckpointError(f"{config_path}: quantization_config.quant_method {method!r} is not supported; "
                              f"warpspec loads {', '.join(CHECKPOINT_METHODS)} checkpoints")
    ub = quant.get("activation_scale_ub")
    return QuantizationConfig("fp8", is_checkpoint_quantized=True,
                              activation_scale_ub=None if ub is None else float(ub),
                              modules_to_not_convert=tuple(quant.get("modules_to_not_convert") or ()))


def checkpoint_dtypes(files: list[Path], prefix: str) -> dict[str, str]:
    """Checkpoint tensor name (prefix stripped) -> safetensors dtype ("BF16", "F8_E4M3", ...), from
    the files' headers only."""
    dtypes = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                for name in names:
                    if name.startswith(prefix):
                        dtypes[name[len(prefix):]] = f.get_slice(name).get_dtype()
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"corrupt or unreadable safetensors file {path}: {e}") from None
    return dtypes


def fp8_module_names(model: DecoderForCausalLM, dtypes: dict[str, str]) -> set[str]:
    """The modules whose checkpoint weights (as model's family names them) are FP8. A module filled
    from several checkpoint tensors (q/k/v into qkv_proj, an expert block's gate_up and down) must
    have them all FP8 or none."""
    chosen = set()
    for module_name, module in model.named_modules():
        weights = quantizable_weights(module)
        names = [hf for w in weights for hf, _ in model.checkpoint_names(f"{module_name}.{w}") if hf in dtypes]
        is_fp8 = {dtypes[n] == SAFETENSORS_FP8 for n in names}
        if is_fp8 == {True, False}:
            raise CheckpointError(f"{', '.join(names)} fill one layer but only some are float8; warpspec needs "
                                  "all of them FP8 or all in full precision")
        if is_fp8 == {True}:
            chosen.add(module_name)
    return chosen


def quantizable_weights(module: nn.Module) -> tuple[str, ...]:
    if isinstance(module, Linear):
        return ("weight",)
    return getattr(module, "quantizable_weights", ())  # a family's own modules (models/llama4.Llama4Experts)


def is_online_fp8_module(module_name: str, module: nn.Module) -> bool:
    """Online quantization's choice: every linear but the router (a few KiB that decides which
    experts run), and the routed experts."""
    return bool(quantizable_weights(module)) and not module_name.endswith(".router")


def convert_to_fp8(model: nn.Module, chosen: Callable[[str, nn.Module], bool],
                   activation_scale_ub: float | None = None) -> list[str]:
    """Swap the chosen layers' (empty) weights for FP8 ones and add their scales, before loading.
    Returns the converted module names."""
    converted = []
    for module_name, module in model.named_modules():
        if not quantizable_weights(module) or not chosen(module_name, module):
            continue
        if isinstance(module, Linear):
            module.weight = fp8_param(module.weight, module.weight_loader)
            module.weight_scale = scale_param(module.weight.shape[:1], module.weight.device, module.scale_loader)
            module.activation_scale_ub = activation_scale_ub
        else:  # routed experts [num_local, in, out]: one scale per expert and output channel
            for weight_name in ("gate_up_proj", "down_proj"):
                weight = fp8_param(getattr(module, weight_name), module.weight_loader)
                setattr(module, weight_name, weight)
                setattr(module, f"{weight_name}_scale",
                        scale_param((weight.shape[0], weight.shape[2]), weight.device, module.scale_loader))
        converted.append(module_name)
    return converted


def fp8_param(like: nn.Parameter, weight_loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(like.shape, dtype=FP8_DTYPE, device=like.device), requires_grad=False)
    param.weight_loader = weight_loader
    return param


def scale_param(shape, device: torch.device, weight_loader) -> nn.Parameter:
    # Ones, not empty: a checkpoint whose scale is never loaded is reported missing by the loader,
    # and an online layer writes every row's scale as it quantizes.
    param = nn.Parameter(torch.ones(tuple(shape), dtype=torch.float32, device=device), requires_grad=False)
    param.weight_loader = weight_loader
    return param


def apply_quantization(model: nn.Module, quant: QuantizationConfig | None, files: list[Path],
                       prefix: str) -> list[str]:
    """Convert the model's layers for `quant` (nothing when None); returns the FP8 module names."""
    if quant is None:
        return []
    if not quant.is_checkpoint_quantized:
        return convert_to_fp8(model, is_online_fp8_module)
    chosen = fp8_module_names(model, checkpoint_dtypes(files, prefix))
    return convert_to_fp8(model, lambda name, _: name in chosen, quant.activation_scale_ub)
