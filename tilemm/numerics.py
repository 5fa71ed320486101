"""Exact element and scale decoders shared by the quantizers, the reference matmul and the tests.

Everything here is pure PyTorch, runs on any device, and is exact: decoded values are fp32 numbers
equal to the encoded ones (docs/numerics.md).
"""

from __future__ import annotations

import torch

from .formats import E2M1_VALUES

__all__ = [
    "ceil_div",
    "e8m0_decode",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "as_uint8",
]


def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative sizes (plain ints or torch's symbolic sizes); tile code has
    ``ct.cdiv``."""
    return -(-a // b)


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a 1-byte tensor (uint8, int8, any float8) as uint8 without copying."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype, got {t.dtype}")
    return t.view(torch.uint8)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 scale bytes to fp32: byte s -> 2^(s-127); s = 0 is 2^-127, s = 255 is NaN.

    Accepts ``torch.float8_e8m0fnu`` or ``torch.uint8`` tensors holding the raw bytes.
    """
    s = as_uint8(scale).to(torch.int32)
    # Normal range: place s in the fp32 exponent field. s = 0 is the fp32 subnormal 2^-127 (mantissa
    # bit 22), s = 255 is NaN (exponent all ones, non-zero mantissa).
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


_E2M1_TABLE = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode e2m1 4-bit codes (one per uint8, values 0..15; bit 3 is the sign) to fp32."""
    table = _E2M1_TABLE.to(codes.device)
    return table[codes.to(torch.int64) & 0xF]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Split packed bytes (..., K/2) into codes (..., K): element 2i is the low nibble of byte i."""
    p = as_uint8(packed)
    lo = p & 0xF
    hi = p >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes (..., K) with K even into bytes (..., K/2), element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)
