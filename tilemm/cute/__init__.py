"""tilemm's independent cross-check path: a CuTe-DSL block-scaled GEMM for Blackwell (sm_100a).

``block_scaled_matmul(fmt, a, a_scale, b, b_scale)`` computes ``alpha * dequantize(a) @
dequantize(b).T`` with tcgen05 block-scaled MMAs written in NVIDIA's CuTe DSL (the kernel is in
:mod:`tilemm.cute.blockscaled_gemm`), from exactly the tensors tilemm's cuTile path takes: A (M, K)
row-major, B the (N, K) weight, and both scales in the swizzled 32x4x4 layout of
``swizzle.swizzle_32_4_4``. ``tilemm.crosscheck`` runs it beside the cuTile kernel and the reference.

Formats: MXFP8 (e4m3 / e5m2 with e8m0 scales per 32), MXFP4 (e2m1 with e8m0 per 32) and NVFP4 (e2m1
with e4m3 per 16 and a per-tensor fp32 decode scale). Outputs: bf16, fp16 or fp32.

It needs the optional ``nvidia-cutlass-dsl`` (``pip install 'tilemm[cute]'``), imported only when a
kernel is compiled, and runs only on GPUs of compute capability 10.x. ``compile_for_sm100`` compiles
the kernels for sm_100a without a GPU, which is what CI does.
"""

from __future__ import annotations

import importlib

import torch

import swizzle as _swizzle

from .._arch import UnsupportedGPUError, capability, gpu_code, is_datacenter_blackwell
from .._validate import as_fp32_scalar, check_out_dtype, check_same_device, check_tensor
from ..formats import FORMATS, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Format

__all__ = ["block_scaled_matmul", "compile_for_sm100", "is_available", "blackwell_device",
           "SUPPORTED_FORMATS", "CuteDSLMissingError", "UnsupportedGPUError"]

#: The formats the CuTe-DSL kernel implements, by ``Format.name``.
SUPPORTED_FORMATS = {f.name: f for f in (MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4)}

#: Every row of A and B must start on a 16-byte boundary for TMA: K a multiple of 32 covers both
#: fp8 (K bytes per row) and packed fp4 (K / 2 bytes per row).
K_MULTIPLE = 32
TMA_ALIGNMENT = 16  # bytes, for the base address of A, B and both scale tensors

_INSTALL_HINT = "install it with `pip install 'tilemm[cute]'` (nvidia-cutlass-dsl)"
NO_BLACKWELL = "needs a compute capability 10.x GPU (Blackwell); none present"


class CuteDSLMissingError(ImportError):
    """nvidia-cutlass-dsl, which the CuTe-DSL kernels need, is not installed."""


def is_available() -> bool:
    """True when nvidia-cutlass-dsl can be imported (the kernels can be compiled)."""
    try:
        importlib.import_module("cutlass.cute")
    except ImportError:
        return False
    return True


def _kernels(fn: str):
    """The kernel module; imports cutlass (slow: a few seconds the first time)."""
    try:
        return importlib.import_module(".blockscaled_gemm", __name__)
    except ImportError as err:
        if not is_available():
            raise CuteDSLMissingError(f"{fn}: the CuTe-DSL kernels need nvidia-cutlass-dsl; "
                                      f"{_INSTALL_HINT}") from err
        raise


def blackwell_device(device: torch.device | None = None) -> torch.device | None:
    """``device`` if it is a CUDA device of compute capability 10.x, else the first such device
    (when ``device`` is None), else None."""
    if not torch.cuda.is_available():
        return None
    if device is not None:
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        return device if is_datacenter_blackwell(capability(index)) else None
    for index in range(torch.cuda.device_count()):
        if is_datacenter_blackwell(capability(index)):
            return torch.device("cuda", index)
    return None


def _format(fn: str, fmt) -> Format:
    accepted = ", ".join(repr(name) for name in SUPPORTED_FORMATS)
    if isinstance(fmt, Format):
        if fmt.name in SUPPORTED_FORMATS:
            return fmt
        raise ValueError(f"{fn}: fmt must be a block-scaled format ({accepted}), got {fmt!r}")
    if isinstance(fmt, str):
        if fmt in SUPPORTED_FORMATS:
            return SUPPORTED_FORMATS[fmt]
        hint = " (plain FP8 has no block scales)" if fmt in FORMATS else ""
        raise ValueError(f"{fn}: fmt must be one of {accepted} or the matching tilemm.formats "
                         f"descriptor, got {fmt!r}{hint}")
    raise TypeError(f"{fn}: fmt must be a format name ({accepted}) or a tilemm.formats.Format, got "
                    f"{type(fmt).__name__}")


def _out_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_operand(fn: str, name: str, t, fmt: Format) -> None:
    check_tensor(fn, name, t)
    if t.dtype != fmt.data_dtype:
        what = "uint8 (two e2m1 per byte, element 2i in the low nibble)" if fmt.is_packed else str(fmt.data_dtype)
        raise TypeError(f"{fn}: {name} must have dtype {what} for {fmt.name}, got {t.dtype}")
    if t.ndim != 2:
        rows = "M" if name == "a" else "N"
        raise ValueError(f"{fn}: {name} must be 2-D ({rows}, K{'/2' if fmt.is_packed else ''}), got shape "
                         f"{tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (row-major, K fastest), got strides "
                         f"{t.stride()}; call .contiguous()")


def _check_scale(fn: str, name: str, t, fmt: Format, rows: int, ks: int, operand: str) -> None:
    check_tensor(fn, name, t)
    accepted = (fmt.scale_dtype, torch.uint8) if fmt.is_mx else (fmt.scale_dtype,)
    if t.dtype not in accepted:
        raise TypeError(f"{fn}: {name} must have dtype {' or '.join(str(d) for d in accepted)} for "
                        f"{fmt.name}, got {t.dtype}")
    expected = _swizzle.swizzled_shape(rows, ks)
    if tuple(t.shape) != expected:
        raise ValueError(f"{fn}: {name} must be the swizzled 32x4x4 scale of {operand}, shape "
                         f"(ceil({rows}/128), ceil({ks}/4), 32, 16) = {expected} "
                         f"(swizzle.swizzle_32_4_4 of the ({rows}, {ks}) scale), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got strides {t.stride()}")


def _check_aligned(fn: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % TMA_ALIGNMENT:
            raise ValueError(f"{fn}: {name} must start on a {TMA_ALIGNMENT}-byte boundary for TMA, got "
                             f"address {t.data_ptr():#x} (a view into another tensor?); pass a fresh "
                             f"tensor or .clone() it")


def _alpha(fn: str, fmt: Format, alpha, global_scale_a, global_scale_b, device) -> torch.Tensor:
    """The epilogue's fp32 multiplier: alpha (default 1), times the two NVFP4 decode scales."""
    total = torch.ones((), dtype=torch.float32, device=device)
    if alpha is not None:
        total = total * as_fp32_scalar(fn, "alpha", alpha, device)
    given = (global_scale_a is not None, global_scale_b is not None)
    if fmt.has_global_scale:
        if not all(given):
            missing = [n for n, g in zip(("global_scale_a", "global_scale_b"), given) if not g]
            raise TypeError(f"{fn}: {fmt.name} needs global_scale_a and global_scale_b (the fp32 "
                            f"decode scales from tilemm.quantize_nvfp4; 1.0 if there are none), "
                            f"missing {', '.join(missing)}")
        total = total * as_fp32_scalar(fn, "global_scale_a", global_scale_a, device)
        total = total * as_fp32_scalar(fn, "global_scale_b", global_scale_b, device)
    elif any(given):
        raise TypeError(f"{fn}: global_scale_a / global_scale_b are NVFP4's per-tensor scales; "
                        f"{fmt.name} has none (use alpha for an extra factor)")
    return total.reshape(1)


def block_scaled_matmul(fmt, a, a_scale, b, b_scale, *, alpha=None, global_scale_a=None,
                        global_scale_b=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """``alpha * dequantize(a) @ dequantize(b).T`` with tilemm's CuTe-DSL tcgen05 kernel (sm_100a).

    Args:
        fmt: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"`` (or the
            ``tilemm.formats`` descriptor).
        a: (M, K) row-major data: float8_e4m3fn / float8_e5m2, or uint8 (M, K/2) with two e2m1 per
            byte, element 2i in the low nibble.
        a_scale: A's scales in the 32x4x4 layout, ``swizzle_32_4_4`` of the (M, K/block) scale:
            shape (ceil(M/128), ceil(K/block/4), 32, 16); e8m0 (or its uint8 bytes) or e4m3 (NVFP4).
        b: (N, K) data of the weight (K-major), same dtype as ``a``.
        b_scale: B's scales, ``swizzle_32_4_4`` of the (N, K/block) weight scale.
        alpha: optional float or 0-d tensor multiplying the fp32 accumulator.
        global_scale_a, global_scale_b: NVFP4 only, and required there: the fp32 decode scales
            (``NVFP4Tensor.global_scale``); the epilogue multiplies by their product.
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32; rounded once (RNE).

    K must be a multiple of 32 (TMA needs 16-byte rows), and all tensors on one CUDA device of
    compute capability 10.x. Raises TypeError / ValueError for bad arguments,
    ``UnsupportedGPUError`` off Blackwell and ``CuteDSLMissingError`` without nvidia-cutlass-dsl.
    """
    fn = "tilemm.cute.block_scaled_matmul"
    fmt = _format(fn, fmt)
    _check_operand(fn, "a", a, fmt)
    _check_operand(fn, "b", b, fmt)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{fn}: a is (M, K) and b is (N, K) but their K differ: a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}")
    m, n, k = a.shape[0], b.shape[0], fmt.logical_k(a.shape[1])
    if k % fmt.block:
        raise ValueError(f"{fn}: K must be a multiple of the {fmt.name} block size {fmt.block}, got K={k}")
    if k % K_MULTIPLE:
        raise ValueError(f"{fn}: K must be a multiple of {K_MULTIPLE} (TMA needs every row of a and b "
                         f"to start on a 16-byte boundary), got K={k}")
    ks = k // fmt.block
    _check_scale(fn, "a_scale", a_scale, fmt, m, ks, "a")
    _check_scale(fn, "b_scale", b_scale, fmt, n, ks, "b")
    check_out_dtype(fn, out_dtype)
    device = check_same_device(fn, a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    scale = _alpha(fn, fmt, alpha, global_scale_a, global_scale_b, device)

    if blackwell_device(device) is None:
        where = (f"this GPU ({torch.cuda.get_device_name(device)}) is {gpu_code(capability(device))}"
                 if device.type == "cuda" else f"the tensors are on {device}")
        raise UnsupportedGPUError(f"{fn}: the CuTe-DSL kernel needs tensors on a compute capability "
                                  f"10.x GPU (Blackwell, sm_100a); {where}")
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _check_aligned(fn, a=a, b=b, a_scale=a_scale, b_scale=b_scale)
    kernels = _kernels(fn)
    with torch.cuda.device(device):
        kernels.launch(fmt.name, a, b, a_scale, b_scale, out, scale, m, n, k,
                       arch=_arch_for(device))
    return out


def _arch_for(device: torch.device) -> str:
    return gpu_code(capability(device)) + "a"


def compile_for_sm100(fmt, out_dtype=torch.bfloat16):
    """Compile the CuTe-DSL kernel for ``fmt`` and ``out_dtype`` for sm_100a; no GPU needed.

    Returns a ``CompiledGemm`` (``.ptx``, ``.cubin``, ``.seconds``, ``.function``). Compiled once per
    process and (format, out_dtype); M, N and K are runtime arguments of the compiled kernel.
    """
    fn = "tilemm.cute.compile_for_sm100"
    fmt = _format(fn, fmt)
    check_out_dtype(fn, out_dtype)
    return _kernels(fn).compile_kernel(fmt.name, _out_dtype_name(out_dtype), "sm_100a")
