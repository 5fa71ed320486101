"""The pure-PyTorch reference path: exact dequantization and an fp32-accumulated matmul.

CPU tensors run this path, and the GPU tests compare every kernel against it on the same quantized
inputs. It follows docs/numerics.md: ``out = dequantize(x) @ dequantize(y)`` accumulated in fp32, then
``* alpha + bias``, rounded once to ``out_dtype``.
"""

from __future__ import annotations

import torch

from .formats import Format
from .numerics import as_uint8, e2m1_decode, e8m0_decode, unpack_e2m1

__all__ = ["decode_elements", "decode_scales", "dequantize_blocks", "matmul_fp32",
           "block_scaled_matmul_reference", "fp8_matmul_reference"]


def decode_elements(fmt: Format, data: torch.Tensor) -> torch.Tensor:
    """Stored elements (..., K / elements_per_byte) -> exact fp32 values (..., K) along the last dim."""
    if fmt.is_packed:
        return e2m1_decode(unpack_e2m1(data))
    return data.view(fmt.data_dtype).to(torch.float32)


def decode_scales(fmt: Format, scale: torch.Tensor) -> torch.Tensor:
    """Stored scales -> exact fp32 values (e8m0 bytes, e4m3 values, or fp32 as they are)."""
    if fmt.scale_dtype == torch.float8_e8m0fnu:
        return e8m0_decode(scale)
    if fmt.scale_dtype == torch.float8_e4m3fn:
        return as_uint8(scale).view(torch.float8_e4m3fn).to(torch.float32)
    return scale.to(torch.float32)


def dequantize_blocks(fmt: Format, data: torch.Tensor, scale: torch.Tensor,
                      global_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """Dequantize block-scaled data whose blocks run along the last dimension.

    ``data`` is (..., K / elements_per_byte); ``scale`` is the logical (..., K / fmt.block) scale.
    Returns fp32 (..., K): element * scale (* global_scale for NVFP4), each product exact in fp32
    except where the true value is below fp32's range.
    """
    values = decode_elements(fmt, data)
    s = decode_scales(fmt, scale).repeat_interleave(fmt.block, dim=-1)
    out = values * s
    if global_scale is not None:
        out = out * torch.as_tensor(global_scale, dtype=torch.float32, device=out.device)
    return out


def _epilogue(acc: torch.Tensor, alpha, bias, out_dtype: torch.dtype) -> torch.Tensor:
    if alpha is not None:
        acc = acc * torch.as_tensor(alpha, dtype=torch.float32, device=acc.device)
    if bias is not None:
        acc = acc + bias.to(device=acc.device, dtype=torch.float32)
    return acc.to(out_dtype)


def block_scaled_matmul_reference(fmt: Format, x: torch.Tensor, x_scale: torch.Tensor,
                                  y: torch.Tensor, y_scale: torch.Tensor, *, out_dtype: torch.dtype,
                                  alpha=None, bias=None) -> torch.Tensor:
    """Reference for MXFP8 / MXFP4 / NVFP4 with logical (unswizzled) scales.

    x (..., M, Kd), x_scale (..., M, Ks); y (..., Kd, N), y_scale (..., Ks, N); Kd = K / elements per
    byte. ``alpha`` already includes NVFP4's product of global decode scales.
    """
    xf = dequantize_blocks(fmt, x, x_scale)
    yf = dequantize_blocks(fmt, y.transpose(-1, -2), y_scale.transpose(-1, -2)).transpose(-1, -2)
    return _epilogue(matmul_fp32(xf, yf), alpha, bias, out_dtype)


def fp8_matmul_reference(x: torch.Tensor, x_scale_full: torch.Tensor, y: torch.Tensor,
                         y_scale_full: torch.Tensor, *, out_dtype: torch.dtype, alpha=None,
                         bias=None) -> torch.Tensor:
    """Reference for FP8 with scales already broadcast to the element shapes of x and y."""
    xf = x.to(torch.float32) * x_scale_full
    yf = y.to(torch.float32) * y_scale_full
    return _epilogue(matmul_fp32(xf, yf), alpha, bias, out_dtype)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32 with fp32 accumulation (TF32 off on GPUs): the reference path's product, and
    the benchmarks' oracle."""
    if a.is_cuda:
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return torch.matmul(a, b)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return torch.matmul(a, b)
