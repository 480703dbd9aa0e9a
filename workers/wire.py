"""Tensors and typed messages across process boundaries, as msgpack (never pickle): each tensor is
(dtype name, shape, raw bytes), so any dtype, bfloat16 included, crosses unchanged."""

from __future__ import annotations

import msgpack
import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                                          torch.int32, torch.bool, torch.uint8)}


def pack_tensor(t: torch.Tensor) -> list:
    t = t.detach().contiguous().cpu()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()]


def unpack_tensor(packed: list) -> torch.Tensor:
    dtype_name, shape, raw = packed
    if not raw:
        return torch.empty(shape, dtype=_DTYPES[dtype_name])
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_DTYPES[dtype_name]).reshape(shape)


def encode(fields: dict) -> bytes:
    """Dict of ints, floats, strings, bytes, None, tensors and lists of tensors -> msgpack bytes."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, torch.Tensor):
            out[key] = {"t": pack_tensor(value)}
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            out[key] = {"ts": [pack_tensor(v) for v in value]}
        else:
            out[key] = value
    return msgpack.packb(out, use_bin_type=True)


def decode(data: bytes) -> dict:
    fields = msgpack.unpackb(data, raw=False)
    for key, value in fields.items():
        if isinstance(value, dict) and "t" in value:
            fields[key] = unpack_tensor(value["t"])
        elif isinstance(value, dict) and "ts" in value:
            fields[key] = [unpack_tensor(v) for v in value["ts"]]
    return fields
