"""Quantizers and dequantizers for FP8, MXFP8, MXFP4 and NVFP4, in pure PyTorch.

Each public ``quantize_<fmt>`` validates its input, then runs what the custom operator
``torch.ops.tilemm.quantize_<fmt>`` (``tilemm.ops``) runs: the cuTile kernels of
``tilemm.kernels.quantize_kernels`` for CUDA tensors on sm_90 or newer and
``_quantize_<fmt>_reference`` everywhere else; both give the same bits. An eager call runs them
itself (torch.compile sees the operator); an eager CUDA call keeps its launches per signature
(``_QuantizeLaunch``): a repeated call allocates its outputs and launches. Blocks run along the last dimension K; leading dimensions are batch (and, for 2-D blocks, M).
float32, bfloat16 and float16 inputs are converted to fp32 first (exact), and every step is an fp32
tensor operation in the order that docs/numerics.md gives, so the bits are defined. That page states
every formula and every special case (zero, NaN and Inf blocks, the e2m1 sign of values that round
to zero); the tests in tests/test_quantize.py pin each of them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from swizzle import swizzle_32_4_4, swizzled_shape, unswizzle_32_4_4

from . import _interop
from . import kernels as _kernels
from ._arch import has_kernels
from .kernels import as_view, quantize_kernels, view_spec
from .kernels._common import stream_handle
from .formats import FP8_BLOCK, FP8_E4M3, MXFP4, NVFP4, Format, Granularity, fp8_format, mxfp8_format
from .numerics import as_uint8, ceil_div, pack_e2m1
from .reference import dequantize_blocks

__all__ = [
    "MXFP8Tensor",
    "MXFP4Tensor",
    "NVFP4Tensor",
    "FP8Tensor",
    "quantize_mxfp8",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_fp8",
    "dequantize_mxfp8",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "dequantize_fp8",
    "dequantize",
]

ROUNDING_MODES = ("rceil", "floor")
FP8_BLOCK_AMAX_FLOOR = 1e-4  # s = max(amax, 1e-4) / 448 keeps all-zero blocks finite

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLT_MAX = torch.finfo(torch.float32).max
_NAN_BYTE = 0x7F  # positive NaN in both e4m3fn and e5m2
_E8M0_NAN = 255
_E8M0_MAX_FINITE = 254


# ----------------------------------------------------------------------------------------------
# Quantized tensors
# ----------------------------------------------------------------------------------------------


class MXFP8Tensor(NamedTuple):
    """MXFP8 data (..., K) in e4m3fn or e5m2 and e8m0 scales (..., K/32), or swizzled scales."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def format(self) -> Format:
        return mxfp8_format(self.data.dtype, "data.dtype")

    @property
    def swizzled(self) -> bool:
        """True when ``scale`` is in the 32x4x4 layout (..., ceil(M/128), ceil(K/128), 32, 16)."""
        return self.scale.ndim == self.data.ndim + 2

    def dequantize(self) -> torch.Tensor:
        return dequantize_mxfp8(self.data, self.scale)


class MXFP4Tensor(NamedTuple):
    """MXFP4 packed data (..., K/2) uint8 (element 2i in the low nibble) and e8m0 scales."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def format(self) -> Format:
        return MXFP4

    @property
    def swizzled(self) -> bool:
        return self.scale.ndim == self.data.ndim + 2

    def dequantize(self) -> torch.Tensor:
        return dequantize_mxfp4(self.data, self.scale)


class NVFP4Tensor(NamedTuple):
    """NVFP4 packed data (..., K/2) uint8, e4m3 scales (..., K/16) and a 0-d fp32 decode scale."""

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def format(self) -> Format:
        return NVFP4

    @property
    def swizzled(self) -> bool:
        return self.scale.ndim == self.data.ndim + 2

    def dequantize(self) -> torch.Tensor:
        return dequantize_nvfp4(self.data, self.scale, self.global_scale)


class FP8Tensor(NamedTuple):
    """FP8 data (..., M, K) and fp32 decode scales: 0-d (tensor), (..., M, 1) (row),
    (..., M, K/128) (1x128) or (..., ceil(M/128), K/128) (128x128)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def format(self) -> Format:
        return fp8_format(self.data.dtype, "data.dtype")

    @property
    def swizzled(self) -> bool:
        return self.scale.ndim == self.data.ndim + 2

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.data, self.scale)


def _to(self, *args, **kwargs):
    """The same quantized tensor with every field moved by ``Tensor.to(*args, **kwargs)`` (devices
    only: the encodings are the data, so a dtype argument is refused)."""
    if any(isinstance(a, torch.dtype) for a in (*args, *kwargs.values())):
        raise TypeError(f"{type(self).__name__}.to moves between devices; a dtype would change the "
                        f"encoding (use dequantize() for floats)")
    return type(self)(*(f.to(*args, **kwargs) for f in self))


def _cpu(self):
    """The same quantized tensor on the CPU."""
    return _to(self, "cpu")


def _cuda(self, device=None):
    """The same quantized tensor on a CUDA device."""
    return _to(self, torch.device("cuda") if device is None else device)


def _array_summary(a) -> str:
    """``dtype(shape)`` of a tensor or array, e.g. ``float8_e4m3fn(128, 256)``."""
    return f"{str(a.dtype).removeprefix('torch.')}{tuple(a.shape)}"


def _repr(self) -> str:
    """One line: format, logical shape, each field's dtype and shape, scale layout, device.

    (The NamedTuple default prints every element of every field.)"""
    is_torch = isinstance(self.data, torch.Tensor)
    try:
        fmt = self.format.name
    except TypeError:  # FP8 data held as the uint8 bytes of a NumPy / CuPy array
        fmt = "fp8 bytes" if isinstance(self, FP8Tensor) else "mxfp8 bytes"
    per_byte = 2 if isinstance(self, (MXFP4Tensor, NVFP4Tensor)) else 1
    shape = (*self.data.shape[:-1], self.data.shape[-1] * per_byte) if self.data.ndim else ()
    fields = [f"format={fmt}", f"shape={shape}", f"data={_array_summary(self.data)}",
              f"scale={_array_summary(self.scale)}"]
    if not isinstance(self, FP8Tensor):  # FP8 scales have no swizzled form
        fields.append(f"layout={'swizzled' if self.swizzled else 'logical'}")
    if isinstance(self, NVFP4Tensor):
        global_scale = self.global_scale
        on_host = not is_torch or global_scale.device.type == "cpu"  # reading a GPU value would synchronise
        fields.append(f"global_scale={float(global_scale):.6g}" if on_host else "global_scale=<fp32 on device>")
    device = str(self.data.device) if is_torch else ("cpu (NumPy arrays)" if isinstance(self.data, np.ndarray)
                                                     else "cuda (CuPy arrays)")
    fields.append(f"device={device}")
    return f"{type(self).__name__}({', '.join(fields)})"


for _cls in (MXFP8Tensor, MXFP4Tensor, NVFP4Tensor, FP8Tensor):
    _cls.to, _cls.cpu, _cls.cuda, _cls.__repr__ = _to, _cpu, _cuda, _repr
    _cls.device = property(lambda self: self.data.device, doc="The device of the data.")
del _cls


# ----------------------------------------------------------------------------------------------
# Validation helpers (public boundary)
# ----------------------------------------------------------------------------------------------


def _check_input(fn: str, x, *, block: int | None, min_ndim: int = 1, why: str = "") -> None:
    """TypeError/ValueError unless x is a float32/bf16/fp16 tensor whose K fits ``block``; ``why``
    names the argument that asks for ``min_ndim`` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{fn}: x.dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                        f"got {x.dtype}")
    if x.ndim < min_ndim:
        dims = "(..., M, K)" if min_ndim >= 2 else "(..., K)"
        raise ValueError(f"{fn}: x must have at least {min_ndim} dimension(s) {dims}{why}, "
                         f"got shape {tuple(x.shape)}")
    k = x.shape[-1]
    if k == 0:
        raise ValueError(f"{fn}: x.shape[-1] (K) must be non-zero (an empty last dimension has "
                         f"no blocks), got shape {tuple(x.shape)}")
    if block is not None and k % block:
        raise ValueError(f"{fn}: x.shape[-1] (K) must be a multiple of the block size {block}, "
                         f"got K={k}")


def _check_bool(fn: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be True or False, got {value!r}")


def _check_rounding(fn: str, rounding) -> None:
    if not isinstance(rounding, str) or rounding not in ROUNDING_MODES:
        raise ValueError(f"{fn}: rounding must be 'rceil' or 'floor', got {rounding!r}")


def _mxfp8_format_or_raise(fn: str, elem_dtype) -> Format:
    try:
        return mxfp8_format(elem_dtype, "elem_dtype")
    except TypeError as err:
        raise TypeError(f"{fn}: {err}") from None


def _fp8_format_or_raise(fn: str, elem_dtype) -> Format:
    try:
        return fp8_format(elem_dtype, "elem_dtype")
    except TypeError as err:
        raise TypeError(f"{fn}: {err}") from None


def _global_decode_scale(fn: str, global_scale, device: torch.device,
                         check_value: bool = True) -> torch.Tensor:
    """The NVFP4 decode scale as a 0-d fp32 tensor on ``device``; must be positive and finite.

    The value is checked when the host already holds it (a Python number or a CPU tensor). A scale
    that lives on the GPU is not read back, since that would synchronise every call and break CUDA
    graph capture. ``check_value=False`` skips the check altogether: for fake tensors, and while
    torch.compile traces (the custom op checks it when it runs).
    """
    if isinstance(global_scale, bool) or not isinstance(global_scale, (int, float, torch.Tensor)):
        raise TypeError(f"{fn}: global_scale must be a Python float or a 0-d floating-point "
                        f"torch.Tensor, got {type(global_scale).__name__}")
    if isinstance(global_scale, torch.Tensor):
        if global_scale.ndim != 0:
            raise ValueError(f"{fn}: global_scale must be a scalar (a 0-d tensor or a Python "
                             f"float), got a tensor of shape {tuple(global_scale.shape)}")
        if not global_scale.is_floating_point():
            raise TypeError(f"{fn}: global_scale must have a floating-point dtype, "
                            f"got {global_scale.dtype}")
        # Every float dtype converts to fp32 exactly except float64, which rounds to nearest.
        global_scale32 = global_scale.detach().to(device=device, dtype=torch.float32)
    else:
        global_scale32 = torch.tensor(float(global_scale), dtype=torch.float32, device=device)
    on_host = not isinstance(global_scale, torch.Tensor) or global_scale.device.type == "cpu"
    if not check_value or not on_host:
        return global_scale32
    host = global_scale if isinstance(global_scale, torch.Tensor) else torch.tensor(float(global_scale))
    value = host.to(torch.float32).item()
    if not (value > 0.0 and value != float("inf")):
        raise ValueError(f"{fn}: global_scale must be a positive finite decode scale, "
                         f"got {value!r}")
    return global_scale32


# ----------------------------------------------------------------------------------------------
# Numerics building blocks (all fp32 / int32 tensor ops, any device)
# ----------------------------------------------------------------------------------------------


def _f32(value: float, device: torch.device) -> torch.Tensor:
    """A 0-d fp32 constant: ``value`` rounded once to the nearest fp32."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _exponent_and_mantissa(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Biased exponent field and mantissa field of non-negative fp32 values."""
    bits = v.contiguous().view(torch.int32)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def _e8m0_rceil(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Scale bytes (int32) = smallest power of two >= amax/Qmax, from the bits of d (docs/numerics.md)."""
    d = amax * _f32(1.0 / qmax, amax.device)
    exponent, mantissa = _exponent_and_mantissa(d)
    # Normal d: round the exponent up unless d is a power of two. Subnormal d (exponent 0):
    # d <= 2^-127 (mantissa <= 0x400000) fits byte 0, anything larger needs byte 1.
    rounded_up = torch.where(exponent == 0, (mantissa > 0x400000).to(torch.int32),
                             exponent + (mantissa != 0).to(torch.int32))
    s = rounded_up.clamp(max=_E8M0_MAX_FINITE)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, _E8M0_NAN))


def _e8m0_floor(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """Scale bytes (int32) = floor(log2(amax)) - emax + 127 clamped to [0, 254], from amax's bits.

    floor(log2(amax)) is exponent_field - 127 for a normal amax; a zero or subnormal amax
    (floor(log2) <= -127) always clamps to 0, which is what exponent_field = 0 gives too.
    """
    exponent, _ = _exponent_and_mantissa(amax)
    s = torch.where(exponent == 0, torch.zeros_like(exponent), exponent - emax)
    s = s.clamp(0, _E8M0_MAX_FINITE)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, _E8M0_NAN))


def _e8m0_reciprocal(s: torch.Tensor) -> torch.Tensor:
    """2^(127 - s) in fp32 for scale bytes 0..254, built from bits (2^-127 is subnormal)."""
    bits = torch.where(s == _E8M0_MAX_FINITE, torch.full_like(s, 0x00400000),
                       (_E8M0_MAX_FINITE - s).clamp(min=0) << 23)
    return bits.view(torch.float32)


def _cast_fp8_rne_satfinite(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fp32 -> fp8 with RNE, finite values saturated to +-Qmax, every NaN stored as 0x7F (uint8)."""
    q = as_uint8(y.clamp(-fmt.qmax, fmt.qmax).to(fmt.data_dtype))
    return torch.where(torch.isnan(y), torch.full_like(q, _NAN_BYTE), q)


# e2m1 magnitudes are {0, .5, 1, 1.5, 2, 3, 4, 6}; a magnitude's code is the number of midpoints it
# passes. At a midpoint, ties go to the even code: strict '>' where the lower code is even,
# '>=' where the upper one is (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                   (3.5, True), (5.0, False))


def _e2m1_encode_rne(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, 0..15), RNE, saturating at 6; sign bit iff y < 0; NaN -> 0."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for midpoint, tie_rounds_up in _E2M1_MIDPOINTS:
        code += (a >= midpoint if tie_rounds_up else a > midpoint).to(torch.uint8)
    return code | ((y < 0).to(torch.uint8) << 3)


def _blocks(xf: torch.Tensor, block: int) -> torch.Tensor:
    """(..., K) -> (..., K/block, block)."""
    return xf.reshape(*xf.shape[:-1], xf.shape[-1] // block, block)


def _swizzle_scale(scale: torch.Tensor) -> torch.Tensor:
    return swizzle_32_4_4(scale)


def _mx_scale_bytes(xb: torch.Tensor, fmt: Format, rounding: str) -> torch.Tensor:
    amax = xb.abs().amax(dim=-1)  # NaN propagates: a NaN block gets byte 255
    if rounding == "rceil":
        return _e8m0_rceil(amax, fmt.qmax)
    return _e8m0_floor(amax, fmt.emax)


def _as_e8m0(s: torch.Tensor) -> torch.Tensor:
    return s.to(torch.uint8).view(torch.float8_e8m0fnu)


# ----------------------------------------------------------------------------------------------
# Reference quantizers
# ----------------------------------------------------------------------------------------------


def _quantize_mxfp8_reference(x: torch.Tensor, fmt: Format, rounding: str,
                              swizzle: bool) -> MXFP8Tensor:
    xb = _blocks(x.detach().to(torch.float32), fmt.block)
    s = _mx_scale_bytes(xb, fmt, rounding)
    y = xb * _e8m0_reciprocal(s).unsqueeze(-1)  # exact: a power of two
    q = _cast_fp8_rne_satfinite(y, fmt)
    s_b = s.unsqueeze(-1)
    q = torch.where(s_b == 0, torch.zeros_like(q), q)
    q = torch.where(s_b == _E8M0_NAN, torch.full_like(q, _NAN_BYTE), q)
    data = q.reshape(x.shape).view(fmt.data_dtype)
    scale = _as_e8m0(s)
    return MXFP8Tensor(data, _swizzle_scale(scale) if swizzle else scale)


def _quantize_mxfp4_reference(x: torch.Tensor, rounding: str, swizzle: bool) -> MXFP4Tensor:
    fmt = MXFP4
    xb = _blocks(x.detach().to(torch.float32), fmt.block)
    s = _mx_scale_bytes(xb, fmt, rounding)
    codes = _e2m1_encode_rne(xb * _e8m0_reciprocal(s).unsqueeze(-1))
    s_b = s.unsqueeze(-1)
    codes = torch.where((s_b == 0) | (s_b == _E8M0_NAN), torch.zeros_like(codes), codes)
    data = pack_e2m1(codes.reshape(x.shape))
    scale = _as_e8m0(s)
    return MXFP4Tensor(data, _swizzle_scale(scale) if swizzle else scale)


def _nvfp4_encode_scale(xf: torch.Tensor, amax_g: torch.Tensor | None = None) -> torch.Tensor:
    """S_enc = 2688 / amax_g, capped at FLT_MAX, 1 when amax_g = 0 or the quotient is 0; amax_g is
    the tensor amax of xf over its finite elements unless given (0-d fp32): NaN and +-Inf count as 0
    (docs/numerics.md, as ``quantize_kernels.tensor_amax`` computes it), so that a non-finite value
    only poisons its own block (whose scale is NaN) and every other block is quantized as if it were
    absent."""
    if amax_g is None:
        a = xf.abs()
        a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
        amax_g = a.amax() if a.numel() else _f32(0.0, xf.device)
    s_enc = (_f32(NVFP4.qmax * FP8_E4M3.qmax, xf.device) / amax_g).clamp(max=_FLT_MAX)
    return torch.where((amax_g == 0) | (s_enc == 0), _f32(1.0, xf.device), s_enc)


def _quantize_nvfp4_reference(x: torch.Tensor, global_scale: torch.Tensor | None,
                              swizzle: bool, amax: torch.Tensor | None = None) -> NVFP4Tensor:
    fmt = NVFP4
    xf = x.detach().to(torch.float32)
    dev = xf.device
    if global_scale is None:
        s_enc = _nvfp4_encode_scale(xf, None if amax is None else amax.view(torch.float32).reshape(()))
        s_dec = _f32(1.0, dev) / s_enc
    else:
        s_dec = global_scale
        s_enc = (_f32(1.0, dev) / s_dec).clamp(max=_FLT_MAX)
    xb = _blocks(xf, fmt.block)
    amax_b = xb.abs().amax(dim=-1)
    s_b = (amax_b * (s_enc * _f32(1.0 / NVFP4.qmax, dev))).clamp(max=FP8_E4M3.qmax)
    # A block holding a NaN or an Inf gets the NaN scale (byte 0x7F); its enc is then NaN and its
    # data code 0, so the whole block decodes to NaN. (A finite amax_b whose product overflows,
    # under a tiny given decode scale, still saturates to 448.)
    s_b = _nonfinite_to_nan(s_b, amax_b)
    s_b_bytes = _cast_fp8_rne_satfinite(s_b, FP8_E4M3)
    s_b_f32 = s_b_bytes.view(torch.float8_e4m3fn).to(torch.float32)
    enc = (_f32(1.0, dev) / (s_b_f32 * s_dec)).clamp(max=_FLT_MAX)
    codes = _e2m1_encode_rne((xb * enc.unsqueeze(-1)).clamp(-NVFP4.qmax, NVFP4.qmax))
    data = pack_e2m1(codes.reshape(x.shape))
    scale = s_b_bytes.view(torch.float8_e4m3fn)
    return NVFP4Tensor(data, _swizzle_scale(scale) if swizzle else scale, s_dec)


def _nonfinite_to_nan(s: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(amax), s, _f32(float("nan"), s.device))


def _round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s, for positive normal fp32 s (NaN kept), from the bits."""
    exponent, mantissa = _exponent_and_mantissa(s)
    up = torch.where(mantissa != 0, exponent + 1, exponent) << 23
    return torch.where(torch.isfinite(s), up.view(torch.float32), s)


def _quantize_fp8_reference(x: torch.Tensor, fmt: Format, granularity,
                            pow2_scale: bool) -> FP8Tensor:
    """``granularity``: a ``Granularity`` or any spelling ``Granularity.parse`` reads."""
    granularity = Granularity.parse(granularity, "_quantize_fp8_reference")
    xf = x.detach().to(torch.float32)
    dev = xf.device
    qmax = _f32(fmt.qmax, dev)
    a = xf.abs()
    if not granularity.is_block:
        if granularity is Granularity.TENSOR:
            amax = a.amax() if a.numel() else _f32(0.0, dev)
        else:
            amax = a.amax(dim=-1, keepdim=True) if a.numel() else a.new_zeros(*a.shape[:-1], 1)
        s = amax / qmax
        s = torch.where(s == 0, _f32(1.0, dev), s)
        s = _nonfinite_to_nan(s, amax)
        return FP8Tensor(_cast_fp8_rne_satfinite(xf / s, fmt).view(fmt.data_dtype), s)

    k_blocks = xf.shape[-1] // FP8_BLOCK
    if granularity is Granularity.BLOCK_1X128:
        amax = _blocks(a, FP8_BLOCK).amax(dim=-1)  # (..., M, K/128)
    else:
        m = xf.shape[-2]
        m_blocks = ceil_div(m, FP8_BLOCK)
        # A partial last row block takes the amax over the rows it has (zero rows change nothing).
        padded = torch.nn.functional.pad(a, (0, 0, 0, m_blocks * FP8_BLOCK - m))
        tiles = padded.reshape(*a.shape[:-2], m_blocks, FP8_BLOCK, k_blocks, FP8_BLOCK)
        amax = tiles.amax(dim=(-3, -1)) if tiles.numel() else tiles.new_zeros(
            *a.shape[:-2], m_blocks, k_blocks)
    s = torch.maximum(amax, _f32(FP8_BLOCK_AMAX_FLOOR, dev)) / qmax
    if pow2_scale:
        s = _round_up_pow2(s)
    s = _nonfinite_to_nan(s, amax)
    s_full = s.repeat_interleave(FP8_BLOCK, dim=-1)
    if granularity is Granularity.BLOCK_128X128:
        s_full = s_full.repeat_interleave(FP8_BLOCK, dim=-2)[..., : xf.shape[-2], :]
    return FP8Tensor(_cast_fp8_rne_satfinite(xf / s_full, fmt).view(fmt.data_dtype), s)


# ----------------------------------------------------------------------------------------------
# Public quantizers
# ----------------------------------------------------------------------------------------------


# What the custom operators torch.ops.tilemm.quantize_* run (registered in tilemm.ops): every check,
# then the quantizer (``_quantize_<fmt>_checked``): the cuTile kernels of tilemm.kernels.quantize_kernels
# for non-empty CUDA tensors on sm_90 or newer (bit-identical to the reference), the reference
# everywhere else. The operators are public too (called directly, eagerly or in a compiled function,
# nothing has checked their arguments), so they and their fakes keep every check. The public functions
# below check once, then run ``_quantize_<fmt>_checked`` themselves for an eager CPU or CUDA tensor, and
# call the operator only under torch.compile (checked at trace time; the fake checks again there) and
# for other tensors.

def check_quantize_mxfp8(x, elem_dtype, rounding, swizzle) -> Format:
    fn = "quantize_mxfp8"
    fmt = _mxfp8_format_or_raise(fn, elem_dtype)
    _check_rounding(fn, rounding)
    _check_bool(fn, "swizzle", swizzle)
    _check_input(fn, x, block=fmt.block, min_ndim=2 if swizzle else 1, why=" with swizzle=True (the 32x4x4 layout tiles rows; swizzle=False takes a 1-D x)" if swizzle else "")
    return fmt


def check_quantize_mxfp4(x, rounding, swizzle) -> Format:
    fn = "quantize_mxfp4"
    _check_rounding(fn, rounding)
    _check_bool(fn, "swizzle", swizzle)
    _check_input(fn, x, block=MXFP4.block, min_ndim=2 if swizzle else 1, why=" with swizzle=True (the 32x4x4 layout tiles rows; swizzle=False takes a 1-D x)" if swizzle else "")
    return MXFP4


def check_quantize_nvfp4(x, global_scale, swizzle, check_value: bool = True):
    """Returns the decode scale as a 0-d fp32 tensor on x's device, or None."""
    fn = "quantize_nvfp4"
    _check_bool(fn, "swizzle", swizzle)
    _check_input(fn, x, block=NVFP4.block, min_ndim=2 if swizzle else 1, why=" with swizzle=True (the 32x4x4 layout tiles rows; swizzle=False takes a 1-D x)" if swizzle else "")
    if global_scale is None:
        return None
    return _global_decode_scale(fn, global_scale, x.device, check_value)


def check_quantize_fp8(x, granularity, elem_dtype, pow2_scale) -> tuple[Format, Granularity]:
    """Returns the format and the granularity (``Granularity.parse``)."""
    fn = "quantize_fp8"
    fmt = _fp8_format_or_raise(fn, elem_dtype)
    gran = Granularity.parse(granularity, fn)
    _check_bool(fn, "pow2_scale", pow2_scale)
    if not gran.is_block:
        if pow2_scale:
            raise ValueError(f"{fn}: pow2_scale=True needs a block granularity (1, 128) or "
                             f"(128, 128), got granularity={granularity!r}")
        _check_input(fn, x, block=None)
    else:
        if fmt is not FP8_E4M3:
            raise ValueError(f"{fn}: granularity {gran.spelling} needs elem_dtype=torch.float8_e4m3fn, "
                             f"got {elem_dtype}")
        _check_input(fn, x, block=FP8_BLOCK, min_ndim=2 if gran is Granularity.BLOCK_128X128 else 1,
                     why=" for granularity=(128, 128) (blocks of 128 rows)")
    return fmt, gran


def _quantize_kernels(x: torch.Tensor):
    """The GPU quantizer module when x is served by it (a non-empty CUDA tensor on sm_90 or newer),
    else None. The kernels read transposed views (the ``axis=-2`` form) as they are stored."""
    if x.numel() == 0 or not has_kernels(x.device):
        return None
    return quantize_kernels


def _eager(x) -> bool:
    """Whether a call the public function has checked runs the operator's implementation itself, without
    the dispatcher and without the operator's checks (which a direct call of the operator needs): an
    eager call on a plain CUDA or CPU tensor. torch.compile (which sees the operator; the public
    function checked at trace time), tensor subclasses and other devices (meta: the operator's fake)
    go through ``torch.ops.tilemm.*``."""
    return (type(x) is torch.Tensor and (x.is_cuda or x.device.type == "cpu")
            and not torch.compiler.is_compiling())


# An eager CUDA quantize is prepared on the first call of its signature (x's shape, strides, dtype and
# device, and the options): the one launch it made, with x and the outputs as views, is kept in
# ``tilemm.kernels.PLANS``; a later call of that signature allocates the outputs and launches.

_Tensor = torch.Tensor
_SCALARS = (int, float, bool)


def _quantize_key(tag: str, x, *options) -> tuple | None:
    """The key of an eager quantize call's prepared launch, or None (not a plain torch tensor, or
    torch.compile tracing). The options' types are part of it: ``swizzle=1`` equals ``swizzle=True``
    but fails the checks."""
    if torch.compiler.is_compiling() or type(x) is not _Tensor:
        return None
    return (tag, x.shape, x.stride(), x.dtype, x.device, options, tuple(map(type, options)))


def _prepared(key):
    """The prepared launch under ``key`` (None for none, or for options that cannot be a key)."""
    if key is None:
        return None
    try:
        return _kernels.PLANS.get(key)
    except TypeError:  # an unhashable option: the checks will name it
        return None


def _repeated(key, x):
    """The outputs of the prepared launch under ``key`` for x, or None (no such launch, or one that
    does not hold for this call: the full path then)."""
    launch = _prepared(key)
    return None if launch is None else launch(x)


class _QuantizeLaunch:
    """A quantizer signature's launches, prepared: ``__call__(x)`` allocates the outputs (as the first
    call returned them) and the buffers between its launches, makes each kernel's arguments from x and
    them (one view each, ``view_spec``) and launches. A launch that passes a per-stream buffer (NVFP4's
    in-launch amax) holds for the stream it was prepared on."""

    __slots__ = ("outputs", "buffers", "launches", "device", "stream")

    def __init__(self, outputs, buffers, launches, device, stream):
        self.outputs, self.buffers, self.launches = outputs, buffers, launches
        self.device, self.stream = device, stream

    @staticmethod
    def build(source, result, launches, buffers):
        """The prepared form of a call that read ``source`` and returned ``result`` through ``launches``
        with ``buffers`` (``quantize_kernels.recording``), or None when it launched nothing (an empty x,
        which the reference serves) or an argument is not one view of them (pieces of a tensor of 2^31
        elements, a copy of x)."""
        if not launches:
            return None
        for out in result:
            if (not out.is_contiguous() or out.storage_offset() != 0
                    or out.untyped_storage().nbytes() != out.numel() * out.element_size()):
                return None
        tensors = (source, *result, *(b for b, _ in buffers))
        prepared, stream = [], None
        for grid, kernel, args in launches:
            views = []
            for i, arg in enumerate(args):
                if isinstance(arg, torch.Tensor):
                    for j, t in enumerate(tensors):
                        spec = view_spec(t, arg)
                        if spec is not False:
                            views.append((i, j, spec))
                            break
                    else:
                        return None
                elif not isinstance(arg, _SCALARS):  # a per-stream buffer
                    stream = stream_handle(source.device)
            prepared.append((grid, kernel, list(args), tuple(views)))
        outputs = tuple((tuple(out.shape), out.dtype) for out in result)
        buffers = tuple((tuple(b.shape), b.dtype, zeroed) for b, zeroed in buffers)
        return _QuantizeLaunch(outputs, buffers, tuple(prepared), source.device, stream)

    def __call__(self, x):
        """The outputs for x (of this signature), or None where the launch does not hold (another stream)."""
        device = self.device
        if self.stream is not None and stream_handle(device) != self.stream:
            return None
        if x.requires_grad:
            x = x.detach()
        tensors = (x, *(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.outputs))
        if self.buffers:
            tensors += tuple((torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
                             for shape, dtype, zeroed in self.buffers)
        for grid, kernel, args, views in self.launches:
            args = args.copy()
            for i, j, spec in views:
                args[i] = tensors[j] if spec is None else as_view(tensors[j], spec)
            quantize_kernels._launch_kernel(device, grid, kernel, tuple(args))
        return tensors[1:1 + len(self.outputs)]


def _run_recorded(key, source, run):
    """``run()``, an eager quantize of ``source``; its launches (a CUDA tensor's) are kept under ``key``
    when ``_QuantizeLaunch.build`` can prepare them."""
    if key is None:
        return run()
    with quantize_kernels.recording() as (launches, buffers):
        result = run()
    launch = _QuantizeLaunch.build(source, result, launches, buffers)
    if launch is not None:
        _kernels.remember(key, launch)
    return result


def run_quantize_mxfp8(x, elem_dtype, rounding, swizzle):
    return _quantize_mxfp8_checked(x, check_quantize_mxfp8(x, elem_dtype, rounding, swizzle), rounding, swizzle)


def _quantize_mxfp8_checked(x, fmt, rounding, swizzle):
    kernels = _quantize_kernels(x)
    if kernels is not None:
        data, scale = kernels.quantize_mx(x, fmt, rounding, swizzle)
        return data, scale.view(fmt.scale_dtype)
    return tuple(_quantize_mxfp8_reference(x.contiguous(), fmt, rounding, swizzle))


def run_quantize_mxfp4(x, rounding, swizzle):
    check_quantize_mxfp4(x, rounding, swizzle)
    return _quantize_mxfp4_checked(x, rounding, swizzle)


def _quantize_mxfp4_checked(x, rounding, swizzle):
    kernels = _quantize_kernels(x)
    if kernels is not None:
        data, scale = kernels.quantize_mx(x, MXFP4, rounding, swizzle)
        return data, scale.view(MXFP4.scale_dtype)
    return tuple(_quantize_mxfp4_reference(x.contiguous(), rounding, swizzle))


# A block's s_b rounds to e4m3 zero at or below 2^-10 (half the smallest subnormal, a tie to even),
# and is clamped to 448 when it would round past it, above 464 (the midpoint to 480, a tie to 448).
_NVFP4_SB_ZERO = 2.0 ** -10
_NVFP4_SB_SATURATED = 464.0


def check_nvfp4_global_scale_fits(x: torch.Tensor, global_scale: torch.Tensor) -> None:
    """ValueError when the given decode scale ``global_scale`` makes every non-zero finite block of x round to
    zero, or saturates every one: the usual sign that the *encode* scale (2688 / amax, what
    compressed-tensors stores) was passed for the decode scale. One extra read of x, plus, on a GPU, one
    host synchronisation: paid only when a global scale is given (not inside CUDA graph capture,
    where the check is skipped)."""
    if x.numel() == 0 or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    # max |x| per block in x's own dtype (exact, and no fp32 copy of x: splitting K is a view).
    blocks = x.detach().unflatten(-1, (-1, NVFP4.block))
    amax_b = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1).to(torch.float32)
    live = torch.isfinite(amax_b) & (amax_b > 0)
    s_enc = (_f32(1.0, x.device) / global_scale).clamp(max=_FLT_MAX)
    t = amax_b * (s_enc * _f32(1.0 / NVFP4.qmax, x.device))
    zero = (t <= _NVFP4_SB_ZERO) | ~live
    saturated = (t > _NVFP4_SB_SATURATED) | ~live
    verdict = torch.stack([live.any(), zero.all(), saturated.all()]).tolist()  # one sync
    if not verdict[0] or not (verdict[1] or verdict[2]):
        return
    g = float(global_scale)
    what = "round to zero (the tensor would dequantize to all zeros)" if verdict[1] else \
        "saturate (their scales clamp at 448)"
    raise ValueError(f"quantize_nvfp4: global_scale={g:.6g} makes every non-zero block {what}. "
                     f"tilemm expects the decode scale, amax / 2688 (dequantized = e2m1 * s_b * "
                     f"global_scale); an encode scale (2688 / amax, as compressed-tensors stores "
                     f"it) converts with global_scale = 1 / encode_scale, here {1.0 / g:.6g}. "
                     f"Or pass global_scale=None to compute it from the tensor")


def run_quantize_nvfp4(x, global_scale, swizzle):
    global_scale = check_quantize_nvfp4(x, global_scale, swizzle)
    if global_scale is not None:
        check_nvfp4_global_scale_fits(x, global_scale)
    return _quantize_nvfp4_checked(x, global_scale, swizzle)


def _quantize_nvfp4_checked(x, global_scale, swizzle):
    kernels = _quantize_kernels(x)
    if kernels is not None:
        data, scale, decode = kernels.quantize_nvfp4(x, global_scale, swizzle)  # decode: a new tensor
        return data, scale.view(NVFP4.scale_dtype), decode
    data, scale, decode = _quantize_nvfp4_reference(x.contiguous(), global_scale, swizzle)
    # A given decode scale comes back out; an operator's outputs must not alias its inputs.
    return data, scale, decode if global_scale is None else decode.clone()


def fp8_granularity_from_name(granularity: str) -> Granularity:
    """The granularity of the operator's name for it (its value): 'tensor', 'row', '1x128' or '128x128'."""
    try:
        return Granularity(granularity)
    except ValueError:
        raise ValueError(f"tilemm::quantize_fp8: granularity must be 'tensor', 'row', '1x128' or "
                         f"'128x128', got {granularity!r}") from None


def run_quantize_fp8(x, granularity, elem_dtype, pow2_scale):
    gran = fp8_granularity_from_name(granularity)
    fmt, gran = check_quantize_fp8(x, gran, elem_dtype, pow2_scale)
    return _quantize_fp8_checked(x, fmt, gran, pow2_scale)


def _quantize_fp8_checked(x, fmt, gran, pow2_scale):
    kernels = _quantize_kernels(x)
    if kernels is not None:
        return kernels.quantize_fp8(x, fmt, gran, pow2_scale)
    return tuple(_quantize_fp8_reference(x.contiguous(), fmt, gran, pow2_scale))


def _along(fn: str, x, axis):
    """x with its blocks' dimension last: x for axis -1, the view x.mT for axis -2 (no copy)."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{fn}: axis must be -1 or -2 (an int), got {type(axis).__name__} {axis!r}")
    if axis not in (-1, -2):
        raise ValueError(f"{fn}: axis must be -1 (blocks along the last dimension) or -2 (along the "
                         f"second to last, for the K-major operand), got {axis}")
    if axis == -1 or not isinstance(x, torch.Tensor):
        return x  # a non-tensor x fails the input checks with its own message
    if x.ndim < 2:
        raise ValueError(f"{fn}: axis=-2 needs x with at least 2 dimensions, got shape {tuple(x.shape)}")
    return x.mT


@_interop.accepts_arrays
def quantize_mxfp8(x: torch.Tensor, *, elem_dtype: torch.dtype = torch.float8_e4m3fn,
                   rounding: str = "rceil", swizzle: bool = False, axis: int = -1) -> MXFP8Tensor:
    """Quantize x (..., K) to MXFP8: 32-element blocks along K with e8m0 scales.

    Args:
        x: float32, bfloat16 or float16 tensor on any device; K a positive multiple of 32.
            NumPy / CuPy arrays give arrays back, data and scale as uint8 bytes.
        elem_dtype: ``torch.float8_e4m3fn`` (Qmax 448) or ``torch.float8_e5m2`` (Qmax 57344).
        rounding: ``"rceil"`` (default; smallest power of two >= amax/Qmax, as TE and cuBLAS) or
            ``"floor"`` (OCP MX spec: floor(log2(amax)) - emax, may clip the block maximum).
        swizzle: return the scale in the 32x4x4 layout (..., ceil(M/128), ceil(K/128), 32, 16),
            M = x.shape[-2]; needs x.ndim >= 2.
        axis: the dimension the blocks run along: -1 (default; x is (..., M, K)) or -2 (x is
            (..., K, M), e.g. the second operand of a matmul, which wants K-major data). axis=-2
            quantizes ``x.mT``: the result is exactly that of ``quantize(x.mT)`` (data (..., M, K)
            and scales along its K), and the GPU kernels read x as it is stored, without a copy.

    Returns:
        ``MXFP8Tensor(data, scale)``: data (..., K) of ``elem_dtype``, scale (..., K/32)
        ``torch.float8_e8m0fnu`` (or swizzled).
    """
    key = _quantize_key("quantize_mxfp8", x, elem_dtype, rounding, swizzle, axis)
    result = _repeated(key, x)  # a signature seen before: checked then, launch prepared
    if result is not None:
        return MXFP8Tensor(*result)
    source = x
    x = _along("quantize_mxfp8", x, axis)
    fmt = check_quantize_mxfp8(x, elem_dtype, rounding, swizzle)
    if _eager(x):  # the operator's own implementation, without the dispatcher's cost
        return MXFP8Tensor(*_run_recorded(key, source, lambda: _quantize_mxfp8_checked(x.detach(), fmt, rounding,
                                                                                      swizzle)))
    return MXFP8Tensor(*torch.ops.tilemm.quantize_mxfp8(x.detach(), fmt.data_dtype, rounding, swizzle))


@_interop.accepts_arrays
def quantize_mxfp4(x: torch.Tensor, *, rounding: str = "rceil",
                   swizzle: bool = False, axis: int = -1) -> MXFP4Tensor:
    """Quantize x (..., K) to MXFP4: e2m1 elements packed two per byte, 32-element e8m0 blocks.

    Args:
        x: float32, bfloat16 or float16 tensor on any device; K a positive multiple of 32.
        rounding: ``"rceil"`` (default) or ``"floor"``, as for :func:`quantize_mxfp8` (Qmax 6).
        swizzle: return the scale in the 32x4x4 layout; needs x.ndim >= 2.
        axis: -1 (default) or -2 (quantize ``x.mT``, read without a copy), as for
            :func:`quantize_mxfp8`.

    Returns:
        ``MXFP4Tensor(data, scale)``: data (..., K/2) uint8, element 2i in the low nibble of byte
        i; scale (..., K/32) ``torch.float8_e8m0fnu`` (or swizzled).
    """
    key = _quantize_key("quantize_mxfp4", x, rounding, swizzle, axis)
    result = _repeated(key, x)  # a signature seen before: checked then, launch prepared
    if result is not None:
        return MXFP4Tensor(*result)
    source = x
    x = _along("quantize_mxfp4", x, axis)
    check_quantize_mxfp4(x, rounding, swizzle)
    if _eager(x):
        return MXFP4Tensor(*_run_recorded(key, source, lambda: _quantize_mxfp4_checked(x.detach(), rounding,
                                                                                      swizzle)))
    return MXFP4Tensor(*torch.ops.tilemm.quantize_mxfp4(x.detach(), rounding, swizzle))


@_interop.accepts_arrays
def quantize_nvfp4(x: torch.Tensor, *, global_scale=None, swizzle: bool = False,
                   axis: int = -1) -> NVFP4Tensor:
    """Quantize x (..., K) to NVFP4: e2m1 pairs, 16-element e4m3 block scales, one fp32 decode scale.

    Args:
        x: float32, bfloat16 or float16 tensor on any device; K a positive multiple of 16.
        global_scale: the fp32 *decode* scale (dequantized value = e2m1 * s_b * global_scale).
            ``None`` (default) computes it from the tensor amax: 1 / (2688 / amax). Otherwise a
            positive finite Python float (rounded to fp32) or a 0-d tensor of any float dtype
            on any device (converted to fp32); every form of the same fp32 value gives
            identical bits. A ``ValueError`` is raised when it makes every non-zero block round to
            zero or saturate (an *encode* scale, 2688 / amax, passed by mistake: convert with
            ``1 / encode_scale``). That check reads x once more and, on a GPU, synchronises the
            host once per call; it costs nothing when ``global_scale`` is None.
        swizzle: return the scale in the 32x4x4 layout; needs x.ndim >= 2.
        axis: -1 (default) or -2 (quantize ``x.mT``, read without a copy), as for
            :func:`quantize_mxfp8`.

    Returns:
        ``NVFP4Tensor(data, scale, global_scale)``: data (..., K/2) uint8, scale (..., K/16)
        ``torch.float8_e4m3fn`` (or swizzled), global_scale a 0-d fp32 tensor on x's device.
    """
    key = _quantize_key("quantize_nvfp4", x, swizzle, axis) if global_scale is None else None
    result = _repeated(key, x)  # a signature seen before: checked then, launch prepared
    if result is not None:
        return NVFP4Tensor(*result)
    source = x
    x = _along("quantize_nvfp4", x, axis)
    if _eager(x) and global_scale is None:
        check_quantize_nvfp4(x, None, swizzle)
        return NVFP4Tensor(*_run_recorded(key, source, lambda: _quantize_nvfp4_checked(x.detach(), None, swizzle)))
    global_scale = check_quantize_nvfp4(x, global_scale, swizzle, check_value=False)
    if _eager(x):  # a given decode scale's value checked as the operator does: where the host holds it
        global_scale = _global_decode_scale("quantize_nvfp4", global_scale, x.device)
        check_nvfp4_global_scale_fits(x, global_scale)
        return NVFP4Tensor(*_quantize_nvfp4_checked(x.detach(), global_scale, swizzle))
    # torch.compile: the operator checks the value when it runs (reading it back at trace time cannot).
    return NVFP4Tensor(*torch.ops.tilemm.quantize_nvfp4(x.detach(), global_scale, swizzle))


@_interop.accepts_arrays
def quantize_fp8(x: torch.Tensor, *, granularity="tensor",
                 elem_dtype: torch.dtype = torch.float8_e4m3fn,
                 pow2_scale: bool = False, axis: int = -1) -> FP8Tensor:
    """Quantize x to FP8 with fp32 decode scales (dequantized value = data * scale).

    Args:
        x: float32, bfloat16 or float16 tensor (..., M, K) on any device ((..., K) is enough
            for ``"tensor"``, ``"row"`` and ``(1, 128)``).
        granularity: ``"tensor"`` (scale 0-d), ``"row"`` (scale (..., M, 1), one per row along
            K), ``(1, 128)`` (scale (..., M, K/128)) or ``(128, 128)`` (scale
            (..., ceil(M/128), K/128); a partial last row block uses the rows it has). The block
            forms need K % 128 == 0 and ``elem_dtype=torch.float8_e4m3fn``.
        elem_dtype: ``torch.float8_e4m3fn`` (Qmax 448) or ``torch.float8_e5m2`` (Qmax 57344).
        pow2_scale: block granularities only: round each block scale up to a power of two.
        axis: -1 (default) or -2 (quantize ``x.mT``, read without a copy), as for
            :func:`quantize_mxfp8`.

    Tensor / row: ``s = amax / Qmax`` (1.0 when that is 0). Blocks: ``s = max(amax, 1e-4) / 448``.
    Then ``data = cast_RNE_satfinite(x / s)``. A NaN or Inf makes its group's scale and data NaN.
    """
    key = _quantize_key("quantize_fp8", x, granularity, elem_dtype, pow2_scale, axis)
    result = _repeated(key, x)  # a signature seen before: checked then, launch prepared
    if result is not None:
        return FP8Tensor(*result)
    source = x
    x = _along("quantize_fp8", x, axis)
    fmt, gran = check_quantize_fp8(x, granularity, elem_dtype, pow2_scale)
    if _eager(x):
        return FP8Tensor(*_run_recorded(key, source, lambda: _quantize_fp8_checked(x.detach(), fmt, gran,
                                                                                  pow2_scale)))
    return FP8Tensor(*torch.ops.tilemm.quantize_fp8(x.detach(), gran.value,
                                                    fmt.data_dtype, pow2_scale))


def prepared_quantize_fp8(x: torch.Tensor, granularity, elem_dtype: torch.dtype):
    """The prepared launch that an eager CUDA ``quantize_fp8(x, granularity=granularity,
    elem_dtype=elem_dtype)`` (``pow2_scale`` and ``axis`` at their defaults) kept for x's signature, or
    None: ``launch(x)`` returns the (data, scale) of any x of that signature, or None on a stream it
    does not hold for. For a caller that keeps the launch itself (``tilemm.nn.Linear``)."""
    return _prepared(_quantize_key("quantize_fp8", x, granularity, elem_dtype, False, -1))



# ----------------------------------------------------------------------------------------------
# Quantizing with the amax given: one tensor spread over several processes
# ----------------------------------------------------------------------------------------------
#
# NVFP4's decode scale and FP8's per-tensor / per-row scales come from an amax over the whole tensor
# (per tensor) or over a whole row of K. When K is split over the ranks of a row-wise tensor-parallel
# layer, each rank sees a slice: it computes ``amax_bits`` of its slice, the ranks take the maximum
# (an integer all-reduce of the bits), and each quantizes its slice with that amax. The result is
# bit for bit the slice of the whole tensor's quantization, because every other step is local to a
# 16-element block (NVFP4) or to one element (FP8).


def amax_bits(x: torch.Tensor, granularity: str, *, propagate_nan: bool) -> torch.Tensor:
    """max |x| as the int32 bit pattern of an fp32: a (1,) tensor for ``"tensor"``, (..., M, 1) for
    ``"row"`` (over the last dimension).

    Non-negative fp32 values order like their bit patterns and NaN's exceed +Inf's, so the integer
    maximum of several of these (``torch.distributed.all_reduce(op=MAX)``, which every backend has
    for int32) is the amax of the union, NaN propagating: the rule of FP8 per tensor / per row.
    ``propagate_nan=False`` is the max over the finite elements only (NaN and +-Inf count as 0):
    NVFP4's tensor amax, whose rule leaves non-finite values to their own 16-block. The maximum is
    taken in x's own dtype (exact; its conversion to fp32 is too), so only the result is converted.
    Plain tensor ops: CUDA-graph safe.
    """
    try:
        gran = Granularity.parse(granularity, "amax_bits")
    except ValueError:
        gran = None
    if gran is None or gran.is_block:
        raise ValueError(f"amax_bits: granularity must be 'tensor' or 'row', got {granularity!r}")
    per_tensor = gran is Granularity.TENSOR
    a = x.detach().abs()
    if not propagate_nan:
        a = a.nan_to_num(nan=0.0, posinf=0.0)  # |x| has no -Inf
    if not a.numel():
        shape = (1,) if per_tensor else (*a.shape[:-1], 1)
        return torch.zeros(shape, dtype=torch.int32, device=a.device)
    m = a.amax().reshape(1) if per_tensor else a.amax(dim=-1, keepdim=True)
    return m.to(torch.float32).view(torch.int32)


def quantize_nvfp4_with_amax(x: torch.Tensor, amax: torch.Tensor, *, swizzle: bool = False) -> NVFP4Tensor:
    """``quantize_nvfp4(x, swizzle=swizzle)`` with the tensor amax ``amax`` (``amax_bits(...,
    "tensor", propagate_nan=False)``, (1,) int32) in place of x's own: S_enc = 2688 / amax exactly
    as from x's amax. (Passing the decode scale 1 / S_enc as ``global_scale`` is not the same: the
    quantizer then takes S_enc = 1 / (1 / S_enc), which differs from S_enc in the last bit for about
    15% of amaxes.) CUDA inputs on sm_90+ run the quantize kernel, others the reference."""
    check_quantize_nvfp4(x, None, swizzle)
    if amax.dtype != torch.int32 or amax.numel() != 1 or amax.device != x.device:
        raise ValueError(f"quantize_nvfp4_with_amax: amax must be a (1,) int32 tensor of fp32 bits on "
                         f"{x.device}, got {amax.dtype} of shape {tuple(amax.shape)} on {amax.device}")
    kernels = _quantize_kernels(x)
    if kernels is not None:
        data, scale, decode = kernels.quantize_nvfp4(x, None, swizzle, amax=amax.reshape(1))
        return NVFP4Tensor(data, scale.view(NVFP4.scale_dtype), decode)
    return _quantize_nvfp4_reference(x.contiguous(), None, swizzle, amax=amax)


def quantize_fp8_with_amax(x: torch.Tensor, amax: torch.Tensor, *, granularity: str,
                           elem_dtype: torch.dtype = torch.float8_e4m3fn) -> FP8Tensor:
    """``quantize_fp8(x, granularity=granularity)`` for ``"tensor"`` or ``"row"`` with the amax
    given as ``amax_bits(..., granularity, propagate_nan=True)``: (1,) or x.shape[:-1] + (1,) int32.
    s = amax / Qmax (1 where 0, NaN where amax is not finite), data = sat_RNE(x / s), with true
    divisions: the same bits as from x's own amax. Per tensor on the GPU runs the quantize kernel;
    per row the reference's tensor ops (CUDA-graph safe: the constants are made by kernels)."""
    fmt, gran = check_quantize_fp8(x, granularity, elem_dtype, False)
    shape = (1,) if gran is Granularity.TENSOR else (*x.shape[:-1], 1)
    if gran.is_block or amax.dtype != torch.int32 or tuple(amax.shape) != shape:
        raise ValueError(f"quantize_fp8_with_amax: needs granularity 'tensor' or 'row' and amax an int32 "
                         f"tensor of shape {shape}, got {granularity!r} and {amax.dtype} {tuple(amax.shape)}")
    kernels = _quantize_kernels(x)
    if kernels is not None and gran is Granularity.TENSOR:
        data, scale = kernels.quantize_fp8(x, fmt, gran, False, amax=amax.view(torch.float32))
        return FP8Tensor(data, scale)
    a = amax.view(torch.float32)
    s = a / torch.full((), fmt.qmax, dtype=torch.float32, device=x.device)  # a true division
    s = torch.where(s == 0, torch.ones_like(s), s)
    s = torch.where(torch.isfinite(a), s, torch.full_like(s, float("nan")))
    data = _cast_fp8_rne_satfinite(x.detach().to(torch.float32) / s, fmt).view(fmt.data_dtype)
    return FP8Tensor(data, s.reshape(()) if gran is Granularity.TENSOR else s)

# ----------------------------------------------------------------------------------------------
# Dequantizers
# ----------------------------------------------------------------------------------------------


def _check_tensor(fn: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_scale_dtype(fn: str, scale: torch.Tensor, fmt: Format) -> None:
    if scale.dtype not in (fmt.scale_dtype, torch.uint8):
        raise TypeError(f"{fn}: scale.dtype must be {fmt.scale_dtype} (or torch.uint8 holding its "
                        f"bytes), got {scale.dtype}")


def _logical_block_scale(fn: str, fmt: Format, data: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
    """Validate ``scale`` against ``data`` and return it in the logical (..., K/block) layout."""
    if data.ndim < 1:
        raise ValueError(f"{fn}: data must have at least 1 dimension (..., K), got a 0-d tensor")
    k = fmt.logical_k(data.shape[-1])
    if k == 0 or k % fmt.block:
        raise ValueError(f"{fn}: data.shape[-1] must hold a positive multiple of the block size "
                         f"{fmt.block} elements, got data shape {tuple(data.shape)} "
                         f"({k} elements)")
    cols = k // fmt.block
    if scale.ndim == data.ndim + 2 and data.ndim >= 2:
        rows = data.shape[-2]
        expected = (*data.shape[:-2], *swizzled_shape(rows, cols))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{fn}: swizzled scale must have shape {expected} for data shape "
                             f"{tuple(data.shape)}, got {tuple(scale.shape)}")
        return unswizzle_32_4_4(scale, rows, cols)
    expected = (*data.shape[:-1], cols)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{fn}: scale must have shape {expected} (logical) for data shape "
                         f"{tuple(data.shape)}, or the swizzled 32x4x4 form; got "
                         f"{tuple(scale.shape)}")
    return scale


def _fp8_data_bytes(fn: str, data, elem_dtype):
    """uint8 FP8 bytes (NumPy / CuPy arrays have no float8) viewed as ``elem_dtype`` (default e4m3)."""
    if elem_dtype is not None:
        _fp8_format_or_raise(fn, elem_dtype)
        if data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and data.dtype != elem_dtype:
            raise TypeError(f"{fn}: data has dtype {data.dtype} but elem_dtype={elem_dtype}; elem_dtype "
                            f"only says how to read uint8 bytes, so leave it out or make it agree")
    if data.dtype == torch.uint8:
        return data.view(torch.float8_e4m3fn if elem_dtype is None else elem_dtype)
    return data


@_interop.accepts_arrays
def dequantize_mxfp8(data: torch.Tensor, scale: torch.Tensor, *, elem_dtype=None) -> torch.Tensor:
    """MXFP8 -> fp32 (..., K). ``scale`` is logical (..., K/32) or swizzled; e8m0 or uint8 bytes.

    ``elem_dtype`` says which FP8 encoding uint8 ``data`` holds (NumPy / CuPy arrays have no float8):
    ``torch.float8_e4m3fn`` (the default for bytes) or ``torch.float8_e5m2``.
    """
    fn = "dequantize_mxfp8"
    _check_tensor(fn, "data", data)
    _check_tensor(fn, "scale", scale)
    data = _fp8_data_bytes(fn, data, elem_dtype)
    try:
        fmt = mxfp8_format(data.dtype, "data.dtype")
    except TypeError as err:
        raise TypeError(f"{fn}: {err}") from None
    _check_scale_dtype(fn, scale, fmt)
    return dequantize_blocks(fmt, data, _logical_block_scale(fn, fmt, data, scale))


@_interop.accepts_arrays
def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 packed uint8 (..., K/2) -> fp32 (..., K). ``scale`` logical (..., K/32) or swizzled."""
    fn = "dequantize_mxfp4"
    _check_tensor(fn, "data", data)
    _check_tensor(fn, "scale", scale)
    if data.dtype != torch.uint8:
        raise TypeError(f"{fn}: data.dtype must be torch.uint8 (two e2m1 per byte), "
                        f"got {data.dtype}")
    _check_scale_dtype(fn, scale, MXFP4)
    return dequantize_blocks(MXFP4, data, _logical_block_scale(fn, MXFP4, data, scale))


@_interop.accepts_arrays
def dequantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, global_scale) -> torch.Tensor:
    """NVFP4 -> fp32 (..., K): ``e2m1 * fp32(s_b) * global_scale``.

    ``scale`` is e4m3 (or its uint8 bytes), logical (..., K/16) or swizzled; ``global_scale`` the
    decode scale as for :func:`quantize_nvfp4`.
    """
    fn = "dequantize_nvfp4"
    _check_tensor(fn, "data", data)
    _check_tensor(fn, "scale", scale)
    if data.dtype != torch.uint8:
        raise TypeError(f"{fn}: data.dtype must be torch.uint8 (two e2m1 per byte), "
                        f"got {data.dtype}")
    _check_scale_dtype(fn, scale, NVFP4)
    global_scale = _global_decode_scale(fn, global_scale, data.device, not torch.compiler.is_compiling())
    return dequantize_blocks(NVFP4, data, _logical_block_scale(fn, NVFP4, data, scale), global_scale)


@_interop.accepts_arrays
def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, *, elem_dtype=None) -> torch.Tensor:
    """FP8 -> fp32: ``data * scale`` with the scale broadcast over its blocks.

    The granularity is read from the shapes: 0-d (tensor); (..., M, C) with K % C == 0 and
    blocks of K/C columns over rows of 1 (C rows = M) or 128 (rows = ceil(M/128)).
    ``elem_dtype`` says which FP8 encoding uint8 ``data`` holds, as for :func:`dequantize_mxfp8`.
    """
    fn = "dequantize_fp8"
    _check_tensor(fn, "data", data)
    _check_tensor(fn, "scale", scale)
    data = _fp8_data_bytes(fn, data, elem_dtype)
    try:
        fp8_format(data.dtype, "data.dtype")
    except TypeError as err:
        raise TypeError(f"{fn}: {err}") from None
    if scale.dtype != torch.float32:
        raise TypeError(f"{fn}: scale.dtype must be torch.float32, got {scale.dtype}")
    values = data.to(torch.float32)
    if scale.ndim == 0:
        return values * scale
    bad_shape = ValueError(
        f"{fn}: scale must be 0-d, (..., M, 1), (..., M, K/128) or (..., ceil(M/128), K/128) "
        f"for data shape {tuple(data.shape)}, got {tuple(scale.shape)}")
    if data.ndim == 0 or scale.ndim != data.ndim:
        raise bad_shape
    k, cols = data.shape[-1], scale.shape[-1]
    if cols == 0 or k % cols or scale.shape[:-2] != data.shape[:-2]:
        raise bad_shape
    s = scale.repeat_interleave(k // cols, dim=-1)
    if data.ndim >= 2:
        m, rows = data.shape[-2], scale.shape[-2]
        if rows != m:
            if rows != ceil_div(m, FP8_BLOCK):
                raise bad_shape
            s = s.repeat_interleave(FP8_BLOCK, dim=-2)[..., :m, :]
    return values * s


def dequantize(q) -> torch.Tensor:
    """Dequantize any of MXFP8Tensor, MXFP4Tensor, NVFP4Tensor, FP8Tensor to fp32."""
    if isinstance(q, (MXFP8Tensor, MXFP4Tensor, NVFP4Tensor, FP8Tensor)):
        return q.dequantize()
    raise TypeError("dequantize: q must be an MXFP8Tensor, MXFP4Tensor, NVFP4Tensor or "
                    f"FP8Tensor, got {type(q).__name__}")
