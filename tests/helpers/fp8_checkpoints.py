"""FP8 checkpoints in the layout Meta published for Llama 4 (transformers' `fbgemm_fp8`
quantization), made from a full-precision checkpoint folder.

Written from transformers' integrations/fbgemm_fp8.py (FbgemmFp8Linear, FbgemmFp8Llama4TextExperts,
FbgemmFp8Quantize) and fbgemm's `quantize_fp8_per_row`, independently of warpspec's own quantizer:
- config.json gains `quantization_config: {"quant_method": "fbgemm_fp8", "activation_scale_ub": ...,
  "modules_to_not_convert": [...]}`;
- each converted nn.Linear: `weight` float8_e4m3fn [out, in] and `weight_scale` float32 [out, 1];
- routed experts: `gate_up_proj` float8 [E, H, 2I] + `gate_up_proj_scale` [E, 1, 2I], `down_proj`
  float8 [E, I, H] + `down_proj_scale` [E, H, 1] (rows of the transposed [E, out, in] weight quantized).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0


def should_convert(module_name: str, patterns: list[str]) -> bool:
    """transformers' quantizers_utils.should_convert_module: a pattern matches from the start up to a
    module boundary, as a regex with that boundary, or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", module_name) or module_name.endswith(key) for key in patterns)


def fbgemm_quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's quantize_fp8_per_row (no scale bound): x [rows, n] -> (fp8 [rows, n], scale [rows])."""
    x = x.float()
    amax = torch.clamp(x.abs().max(dim=-1).values, min=1e-12)
    a_scale = torch.full_like(amax, FP8_MAX) / amax
    q = torch.clamp(x * a_scale[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, torch.ones_like(a_scale) / a_scale


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] -> (fp8 [E, in, out], scale [E, out]): each output channel over the input dim."""
    transposed = weight.transpose(1, 2)  # [E, out, in]
    q, scale = fbgemm_quantize_per_row(transposed.reshape(-1, transposed.shape[-1]))
    return q.reshape(transposed.shape).transpose(1, 2).contiguous(), scale.reshape(weight.shape[0], -1)


def make_fbgemm_fp8_checkpoint(src: Path, out: Path, modules_to_not_convert: list[str] | None = None,
                               activation_scale_ub: float = 1200.0) -> Path:
    """Quantize src's linears and experts (all but modules_to_not_convert, default lm_head and the
    routers: what warpspec's online quantization leaves alone) into a new folder `out`."""
    patterns = ["lm_head", "feed_forward.router"] if modules_to_not_convert is None else modules_to_not_convert
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": activation_scale_ub,
                                     "modules_to_not_convert": patterns}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in list(f.keys()):
                tensors.update(convert_tensor(name, f.get_tensor(name), patterns))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def convert_tensor(name: str, tensor: torch.Tensor, patterns: list[str]) -> dict[str, torch.Tensor]:
    module, _, leaf = name.rpartition(".")
    if not should_convert(module, patterns):
        return {name: tensor}
    if leaf == "weight" and tensor.ndim == 2 and not module.endswith("embed_tokens"):  # an nn.Linear
        q, scale = fbgemm_quantize_per_row(tensor)
        return {name: q, f"{name}_scale": scale[:, None]}
    if module.endswith(".experts") and leaf == "gate_up_proj":
        q, scale = quantize_experts(tensor)
        return {name: q, f"{name}_scale": scale[:, None, :]}
    if module.endswith(".experts") and leaf == "down_proj":
        q, scale = quantize_experts(tensor)
        return {name: q, f"{name}_scale": scale[:, :, None]}
    return {name: tensor}
