"""Argument checks shared by the public functions. Each raises a typed error whose message names the
function, the argument, the value received and what is accepted."""

from __future__ import annotations

import torch

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLOAT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def check_tensor(fn: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor (or a CuPy array), got {type(t).__name__}")


def check_dtype(fn: str, name: str, t: torch.Tensor, accepted) -> None:
    if t.dtype not in accepted:
        raise TypeError(f"{fn}: {name} must have dtype {_names(accepted)}, got {t.dtype}")


def check_out_dtype(fn: str, out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be one of {_names(OUT_DTYPES)}, got {out_dtype!r}")


def check_same_device(fn: str, **tensors: torch.Tensor | None) -> torch.device:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    device = items[0][1].device
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(
                f"{fn}: all operands must be on one device; {items[0][0]} is on {device} but {name} is "
                f"on {t.device}"
            )
    return device


def as_fp32_scalar(fn: str, name: str, value, device: torch.device) -> torch.Tensor:
    """A Python number or a 0-d / one-element float tensor (any float dtype, any device) as a 0-d fp32
    tensor on ``device``. The conversion is exact for bf16 / fp16 / fp32 inputs."""
    if isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a float or a 0-d float tensor, got a bool")
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=torch.float32, device=device)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.ndim > 1:
            raise ValueError(
                f"{fn}: {name} must be a scalar (a Python float or a 0-d tensor), got a tensor of shape "
                f"{tuple(value.shape)}"
            )
        if not value.is_floating_point() or value.element_size() == 1:
            raise TypeError(f"{fn}: {name} must be a float32, bfloat16 or float16 value, got {value.dtype}")
        return value.reshape(()).to(device=device, dtype=torch.float32)
    raise TypeError(f"{fn}: {name} must be a float or a 0-d float tensor, got {type(value).__name__}")


def check_bias(fn: str, bias, n: int, device: torch.device) -> torch.Tensor | None:
    if bias is None:
        return None
    check_tensor(fn, "bias", bias)
    if bias.shape != (n,):
        raise ValueError(f"{fn}: bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
    check_dtype(fn, "bias", bias, FLOAT_INPUT_DTYPES)
    if bias.device != device:
        raise ValueError(f"{fn}: bias is on {bias.device} but the operands are on {device}")
    return bias.to(torch.float32).contiguous()
