"""Cross-check the cuTile kernel against tilemm's independent CuTe-DSL kernel and the reference.

``crosscheck("nvfp4", x_q, w_q)`` multiplies one quantized activation by one quantized (N, K) weight
three ways -- tilemm's public path (``tilemm.linear``: the cuTile ``ct.mma_scaled`` kernel on
Blackwell), the CuTe-DSL tcgen05 kernel (``tilemm.cute``) and the exact pure-PyTorch reference -- and
reports the pairwise differences. The two kernels share nothing but the inputs, so a bug in either
(or in the scale layout) shows up as a disagreement with both others.

It needs a GPU of compute capability 10.x (Blackwell) and nvidia-cutlass-dsl (``tilemm[cute]``).
"""

from __future__ import annotations

import dataclasses

import torch

import swizzle as _swizzle

from . import cute
from ._arch import UnsupportedGPUError
from .cute import SUPPORTED_FORMATS
from .formats import FORMATS, Format
from .matmul import linear
from .quantize import MXFP4Tensor, MXFP8Tensor, NVFP4Tensor

__all__ = ["crosscheck", "CrossCheckReport", "PairError"]

_PAIRS = (("cutile", "reference"), ("cute", "reference"), ("cutile", "cute"))


@dataclasses.dataclass(frozen=True)
class PairError:
    """How far ``actual`` is from ``expected``: max |a - e|, and ||a - e||_F / ||e||_F."""

    max_abs: float
    rel_fro: float


@dataclasses.dataclass(frozen=True)
class CrossCheckReport:
    """Pairwise errors of the cuTile kernel, the CuTe-DSL kernel and the reference on one problem.

    ``errors`` maps ("cutile", "reference"), ("cute", "reference") and ("cutile", "cute") to a
    :class:`PairError`; the outputs are kept in ``outputs`` (fp32 copies on the GPU).
    """

    fmt: str
    m: int
    n: int
    k: int
    out_dtype: torch.dtype
    device: str
    errors: dict
    outputs: dict = dataclasses.field(repr=False)

    def worst_rel(self) -> float:
        return max(e.rel_fro for e in self.errors.values())

    def __str__(self) -> str:
        head = (f"crosscheck {self.fmt} M={self.m} N={self.n} K={self.k} out={self.out_dtype} "
                f"on {self.device}")
        rows = [f"  {a:>6} vs {b:<9}  max|diff| {e.max_abs:.3e}  rel Frobenius {e.rel_fro:.3e}"
                for (a, b), e in self.errors.items()]
        return "\n".join([head, *rows])


def _pair_error(actual: torch.Tensor, expected: torch.Tensor) -> PairError:
    a, e = actual.double(), expected.double()
    diff = a - e
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    norm = e.norm().item()
    rel = diff.norm().item() / norm if norm else diff.norm().item()
    return PairError(max_abs, rel)


def _format(fn: str, fmt_name) -> Format:
    if isinstance(fmt_name, Format):
        fmt_name = fmt_name.name
    if not isinstance(fmt_name, str):
        raise TypeError(f"{fn}: fmt_name must be a format name ({', '.join(SUPPORTED_FORMATS)}), got "
                        f"{type(fmt_name).__name__}")
    if fmt_name not in SUPPORTED_FORMATS:
        hint = " (plain FP8 has no block scales)" if fmt_name in FORMATS else ""
        raise ValueError(f"{fn}: fmt_name must be one of {', '.join(SUPPORTED_FORMATS)}, got "
                         f"{fmt_name!r}{hint}")
    return SUPPORTED_FORMATS[fmt_name]


def _check_quantized(fn: str, fmt: Format, name: str, t) -> None:
    kinds = (MXFP8Tensor, MXFP4Tensor, NVFP4Tensor)
    if not isinstance(t, kinds):
        raise TypeError(f"{fn}: {name} must be a quantized tensor from tilemm.quantize_mxfp8 / "
                        f"quantize_mxfp4 / quantize_nvfp4, got {type(t).__name__}")
    if t.format.name != fmt.name:
        raise ValueError(f"{fn}: fmt_name is {fmt.name!r} but {name} holds {t.format.name} data")
    if t.data.ndim != 2:
        raise ValueError(f"{fn}: {name} must hold 2-D data ({'M' if name == 'x_q' else 'N'}, K), got "
                         f"shape {tuple(t.data.shape)}")


def _swizzled(scale: torch.Tensor, swizzled: bool) -> torch.Tensor:
    return scale.contiguous() if swizzled else _swizzle.swizzle_32_4_4(scale)


def crosscheck(fmt_name, x_q, w_q, *, out_dtype=torch.bfloat16) -> CrossCheckReport:
    """Run the cuTile kernel, the CuTe-DSL kernel and the reference on ``x_q @ w_q.T``.

    Args:
        fmt_name: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"``.
        x_q: the quantized (M, K) activation (``tilemm.quantize_*``), logical or swizzled scales.
        w_q: the quantized (N, K) weight, same format and scale layout.
        out_dtype: output dtype of both kernels (bf16 default, fp16, fp32). The reference is kept
            in fp32 so its rounding does not hide the kernels'.

    Returns a :class:`CrossCheckReport`. Raises ``UnsupportedGPUError`` when no compute capability
    10.x GPU is present, ``CuteDSLMissingError`` without nvidia-cutlass-dsl.
    """
    fn = "tilemm.crosscheck"
    fmt = _format(fn, fmt_name)
    _check_quantized(fn, fmt, "x_q", x_q)
    _check_quantized(fn, fmt, "w_q", w_q)
    if x_q.swizzled != w_q.swizzled:
        raise ValueError(f"{fn}: x_q and w_q must both have logical or both swizzled scales")
    # The operands' GPU if it is a Blackwell, else the first Blackwell (inputs may live anywhere).
    device = (cute.blackwell_device(x_q.data.device) if x_q.data.is_cuda else None) or cute.blackwell_device()
    if device is None:
        raise UnsupportedGPUError(f"{fn}: {cute.NO_BLACKWELL}")
    if not cute.is_available():
        raise cute.CuteDSLMissingError(f"{fn}: the CuTe-DSL kernel needs nvidia-cutlass-dsl; install "
                                       f"it with `pip install 'tilemm[cute]'`")

    def to(q, dev):
        return type(q)(*(t.to(dev) if isinstance(t, torch.Tensor) else t for t in q))

    x_gpu, w_gpu = to(x_q, device), to(w_q, device)
    x_cpu, w_cpu = to(x_q, "cpu"), to(w_q, "cpu")

    outputs = {
        "cutile": linear(x_gpu, w_gpu, out_dtype=out_dtype),  # CUDA tensors: the cuTile kernel
        "reference": linear(x_cpu, w_cpu, out_dtype=torch.float32).to(device),  # CPU: the reference
    }
    nvfp4 = {}
    if fmt.has_global_scale:
        nvfp4 = dict(global_scale_a=x_gpu.global_scale, global_scale_b=w_gpu.global_scale)
    outputs["cute"] = cute.block_scaled_matmul(
        fmt, x_gpu.data.contiguous(), _swizzled(x_gpu.scale, x_gpu.swizzled), w_gpu.data.contiguous(),
        _swizzled(w_gpu.scale, w_gpu.swizzled), out_dtype=out_dtype, **nvfp4)
    outputs = {name: out.float() for name, out in outputs.items()}
    errors = {(a, b): _pair_error(outputs[a], outputs[b]) for a, b in _PAIRS}
    m, n = x_q.data.shape[0], w_q.data.shape[0]
    return CrossCheckReport(fmt.name, m, n, fmt.logical_k(x_q.data.shape[1]), out_dtype, str(device),
                            errors, outputs)
