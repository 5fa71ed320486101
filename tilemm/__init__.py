"""tilemm: block-scaled matrix multiplications (FP8, MXFP8, MXFP4, NVFP4) written in NVIDIA cuTile.

Quantize with ``quantize_*``, lay scales out for the tensor cores with ``swizzle_32_4_4`` (or
``swizzle=True``), multiply with ``*_matmul`` or ``linear``. CPU tensors use the exact pure-PyTorch
reference; CUDA tensors on Hopper (sm_90) and Blackwell (sm_100 / sm_120) use cuTile kernels.

Where each public name's checks, plan and tile code live: README.md, "Where the code is".
GPU generation: ``_arch.py``; planned calls, shared by every entry: ``kernels.PLANS``.
"""

from swizzle import swizzle_32_4_4, unswizzle_32_4_4

from . import formats, numerics, reference
from ._arch import UnsupportedGPUError
from .crosscheck import crosscheck
from .formats import FP8_E4M3, FP8_E5M2, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Format
from .matmul import fp8_matmul, linear, mxfp4_matmul, mxfp8_matmul, nvfp4_matmul
from .quantize import (FP8Tensor, MXFP4Tensor, MXFP8Tensor, NVFP4Tensor, dequantize, dequantize_fp8,
                       dequantize_mxfp4, dequantize_mxfp8, dequantize_nvfp4, quantize_fp8,
                       quantize_mxfp4, quantize_mxfp8, quantize_nvfp4)
from .packed import PackedWeight, prepack, unpack
from . import ops  # registers torch.ops.tilemm.* (the public functions above call them)
from . import nn
from .moe import moe_linear
from .nn import quantize_model
from . import conventions, checkpoints
from .checkpoints import export_quantized, load_quantized

__version__ = "0.1.0"


def __getattr__(name):
    # tilemm.parallel imports torch.distributed.tensor, slow to import and unused by single-GPU code,
    # so it loads on first use.
    if name in ("parallel", "shard_linear"):
        import importlib

        parallel = importlib.import_module(".parallel", __name__)
        return parallel if name == "parallel" else parallel.shard_linear
    raise AttributeError(f"module 'tilemm' has no attribute {name!r}")


__all__ = [
    "Format", "FP8_E4M3", "FP8_E5M2", "MXFP8_E4M3", "MXFP8_E5M2", "MXFP4", "NVFP4",
    "quantize_mxfp8", "quantize_mxfp4", "quantize_nvfp4", "quantize_fp8",
    "dequantize", "dequantize_mxfp8", "dequantize_mxfp4", "dequantize_nvfp4", "dequantize_fp8",
    "MXFP8Tensor", "MXFP4Tensor", "NVFP4Tensor", "FP8Tensor",
    "mxfp8_matmul", "mxfp4_matmul", "nvfp4_matmul", "fp8_matmul", "linear",
    "prepack", "unpack", "PackedWeight", "moe_linear",
    "swizzle_32_4_4", "unswizzle_32_4_4", "UnsupportedGPUError", "crosscheck",
    "nn", "quantize_model", "conventions", "checkpoints", "load_quantized", "export_quantized",
    "parallel", "shard_linear", "ops", "formats", "numerics", "reference",
]
