"""tilemm's quantizers and matmuls as PyTorch custom operators, ``torch.ops.tilemm.*``.

The quantizer operators are registered here, the matmul operators next to their public functions
(``tilemm.matmul``, ``tilemm.weight_only``, ``tilemm.moe``). ``torch.compile`` sees each as one opaque
op (``fullgraph=True`` too); the public functions call them under torch.compile (the matmuls for CPU
tensors too) and run their implementation directly for eager CUDA calls (the quantizers for eager CPU
calls too), after checking once.

Called directly, an operator has no public function before it, so each checks its arguments, and its
fake (meta) implementation runs the same checks, which read only shapes, dtypes and devices, and
returns empty outputs of the exact shapes and dtypes. The operators are ``quantize_mxfp8``,
``quantize_mxfp4``, ``quantize_nvfp4``, ``quantize_fp8``, ``mxfp8_matmul``, ``mxfp4_matmul``,
``nvfp4_matmul``, ``fp8_matmul``, ``weight_only_linear`` and ``moe_linear``; each one's signature is
``torch.ops.tilemm.<name>.default._schema``. Arguments and results mean what they mean for the public
function of the same name (tensors where the function also takes Python numbers; NVFP4's decode scales
are 0-d fp32 tensors; ``weight_only_linear`` and ``moe_linear`` take a ``tilemm.PackedWeight``'s
tensors, its format's name and K). Inference only: no autograd formula is registered, so a backward
pass raises.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import swizzle as _swizzle

from . import quantize as _quantize
from .formats import MXFP4, NVFP4, Granularity
from .numerics import ceil_div

__all__ = ["quantize_mxfp8", "quantize_mxfp4", "quantize_nvfp4", "quantize_fp8",
           "mxfp8_matmul", "mxfp4_matmul", "nvfp4_matmul", "fp8_matmul", "weight_only_linear"]

_E4M3 = torch.float8_e4m3fn


def _block_scale_shape(shape, block: int, swizzle: bool) -> tuple:
    """Scale shape for data of logical ``shape`` (..., K): (..., K/block), or swizzled 32x4x4
    (..., ceil(M/128), ceil(K/block/4), 32, 16). Plain arithmetic, so symbolic sizes work."""
    cols = shape[-1] // block
    if not swizzle:
        return (*shape[:-1], cols)
    return (*shape[:-2], ceil_div(shape[-2], _swizzle.ROW_TILE), ceil_div(cols, _swizzle.COL_TILE),
            *_swizzle.BLOCK_SHAPE)


# --------------------------------------------------------------------------------------------------
# Quantizers
# --------------------------------------------------------------------------------------------------

@torch.library.custom_op("tilemm::quantize_mxfp8", mutates_args=())
def quantize_mxfp8(x: Tensor, elem_dtype: Optional[torch.dtype] = None, rounding: str = "rceil",
                   swizzle: bool = False) -> tuple[Tensor, Tensor]:
    return _quantize.run_quantize_mxfp8(x, elem_dtype or _E4M3, rounding, swizzle)


@quantize_mxfp8.register_fake
def _(x, elem_dtype=None, rounding="rceil", swizzle=False):
    fmt = _quantize.check_quantize_mxfp8(x, elem_dtype or _E4M3, rounding, swizzle)
    return (x.new_empty(x.shape, dtype=fmt.data_dtype),
            x.new_empty(_block_scale_shape(x.shape, fmt.block, swizzle), dtype=fmt.scale_dtype))


@torch.library.custom_op("tilemm::quantize_mxfp4", mutates_args=())
def quantize_mxfp4(x: Tensor, rounding: str = "rceil", swizzle: bool = False) -> tuple[Tensor, Tensor]:
    return _quantize.run_quantize_mxfp4(x, rounding, swizzle)


@quantize_mxfp4.register_fake
def _(x, rounding="rceil", swizzle=False):
    _quantize.check_quantize_mxfp4(x, rounding, swizzle)
    return (x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=MXFP4.data_dtype),
            x.new_empty(_block_scale_shape(x.shape, MXFP4.block, swizzle), dtype=MXFP4.scale_dtype))


@torch.library.custom_op("tilemm::quantize_nvfp4", mutates_args=())
def quantize_nvfp4(x: Tensor, global_scale: Optional[Tensor] = None,
                   swizzle: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return _quantize.run_quantize_nvfp4(x, global_scale, swizzle)


@quantize_nvfp4.register_fake
def _(x, global_scale=None, swizzle=False):
    _quantize.check_quantize_nvfp4(x, global_scale, swizzle, check_value=False)
    return (x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=NVFP4.data_dtype),
            x.new_empty(_block_scale_shape(x.shape, NVFP4.block, swizzle), dtype=NVFP4.scale_dtype),
            x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("tilemm::quantize_fp8", mutates_args=())
def quantize_fp8(x: Tensor, granularity: str = "tensor", elem_dtype: Optional[torch.dtype] = None,
                 pow2_scale: bool = False) -> tuple[Tensor, Tensor]:
    return _quantize.run_quantize_fp8(x, granularity, elem_dtype or _E4M3, pow2_scale)


@quantize_fp8.register_fake
def _(x, granularity="tensor", elem_dtype=None, pow2_scale=False):
    gran = _quantize.fp8_granularity_from_name(granularity)
    fmt, gran = _quantize.check_quantize_fp8(x, gran, elem_dtype or _E4M3, pow2_scale)
    block = _quantize.FP8_BLOCK
    if gran is Granularity.TENSOR:
        scale_shape = ()
    elif gran is Granularity.ROW:
        scale_shape = (*x.shape[:-1], 1)
    elif gran is Granularity.BLOCK_1X128:
        scale_shape = (*x.shape[:-1], x.shape[-1] // block)
    else:
        scale_shape = (*x.shape[:-2], ceil_div(x.shape[-2], block), x.shape[-1] // block)
    return x.new_empty(x.shape, dtype=fmt.data_dtype), x.new_empty(scale_shape, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Matmuls: registered next to their public functions (``tilemm.matmul``, ``tilemm.weight_only``),
# which call them directly; named here as the operators they are.
# --------------------------------------------------------------------------------------------------

from .matmul import (_fp8_matmul_op as fp8_matmul, _mxfp4_matmul_op as mxfp4_matmul,  # noqa: E402
                     _mxfp8_matmul_op as mxfp8_matmul, _nvfp4_matmul_op as nvfp4_matmul)
from .weight_only import _weight_only_linear_op as weight_only_linear  # noqa: E402
