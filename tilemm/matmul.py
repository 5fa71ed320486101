"""Public block-scaled matmuls: ``mxfp8_matmul``, ``mxfp4_matmul``, ``nvfp4_matmul``, ``fp8_matmul``
and the nn.Linear-shaped convenience ``linear``.

Semantics (docs/numerics.md): ``out = dequantize(x) @ dequantize(y)`` accumulated in fp32, then
``* alpha + bias``, rounded once to ``out_dtype``. x is (..., M, K) row-major; y is (..., K, N) and
K-major, i.e. ``w.t()`` of an (N, K) quantized weight. For 4-bit formats the stored K is K/2 (two
elements per byte, packed along K).

Scales come in one of two layouts, told apart by their rank:

* logical: x_scale (..., M, K/B), y_scale (..., K/B, N) (usually ``w_scale.t()``);
* swizzled 32x4x4 (``swizzle.swizzle_32_4_4``): x_scale (..., ceil(M/128), ceil(K/B/4), 32, 16) and
  y_scale the same built from the (N, K/B) weight scales: two more dimensions than the operand.

Swapped swizzled scales of one padded shape cannot be detected; :func:`linear`, which takes each
operand with its own scale, cannot swap them: prefer it. CPU tensors run the pure-PyTorch reference
(``tilemm.reference``), CUDA tensors the cuTile kernels of their GPU generation (``tilemm.kernels``).

Path: an eager call on CUDA tensors looks its signature (``launch_key``: the tensors' shapes, strides,
dtypes and devices and the options, one tuple) up in ``tilemm.kernels.PLANS``. A signature seen before
was checked then: the call allocates the output, takes one view per operand and launches (``_Launch``).
A first call checks every argument, plans (``block_scaled_call`` / ``fp8_call``), launches and keeps
the launch. torch.compile and CPU tensors go through the custom operator ``torch.ops.tilemm.<name>``
(registered here; its fake implementation runs the checks), which runs the same planned call. NumPy
and CuPy arrays are accepted and returned in kind (``tilemm._interop``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

import swizzle as _swizzle

from . import _interop, kernels
from ._validate import (as_fp32_scalar, check_bias, check_dtype, check_out_dtype, check_same_device,
                        check_tensor)
from .formats import FP8_BLOCK, MXFP4, NVFP4, Format, Granularity, fp8_format, mxfp8_format
from .kernels import as_view, view_spec
from .kernels._common import Described, ones_scalar, stream_handle, zeros_vector
from .kernels._large import check_matmul_k
from .packed import PackedWeight, prepack
from .quantize import FP8Tensor, MXFP4Tensor, MXFP8Tensor, NVFP4Tensor
from .weight_only import weight_only_linear
from .numerics import ceil_div
from .reference import block_scaled_matmul_reference, fp8_matmul_reference

__all__ = ["mxfp8_matmul", "mxfp4_matmul", "nvfp4_matmul", "fp8_matmul", "linear",
           "BlockScaledProblem", "FP8Problem"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------------------------------
# What the kernels receive: validated, normalised to 3-D, both operands K-contiguous.
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class BlockScaledProblem:
    """A validated MXFP8 / MXFP4 / NVFP4 matmul, normalised for the kernels.

    a: (Ba, M, Kd) data, stride(-1) == 1.        b: (Bb, N, Kd) data (the (N, K) weight form), stride(-1) == 1.
    a_scale / b_scale: logical (Ba, M, Ks) / (Bb, N, Ks), or swizzled (Ba, Mt, Kt, 32, 16) / (Bb, Nt, Kt, 32, 16).
    out: (B, M, N) contiguous, B = max(Ba, Bb); Ba and Bb are B or 1 (broadcast).
    bias: (N,) fp32 or None.   alpha: 0-d fp32 tensor on the device, or None.
    global_scales: NVFP4's decode scales (global_scale_x, global_scale_y), 0-d fp32 tensors on the device,
    or None: the product is then multiplied by ``fp32(global_scale_x * global_scale_y)`` (then by alpha),
    which the kernels do on the GPU.
    """

    fmt: Format
    a: torch.Tensor
    a_scale: torch.Tensor
    b: torch.Tensor
    b_scale: torch.Tensor
    swizzled: bool
    out: torch.Tensor
    bias: torch.Tensor | None
    alpha: torch.Tensor | None
    global_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def m(self) -> int:
        return self.a.shape[1]

    @property
    def n(self) -> int:
        return self.b.shape[1]

    @property
    def k(self) -> int:
        return self.fmt.logical_k(self.a.shape[2])


@dataclasses.dataclass
class FP8Problem:
    """A validated FP8 matmul, normalised for the kernels.

    a: (Ba, M, K), b: (Bb, N, K), both stride(-1) == 1.
    granularity (``tilemm.formats.Granularity``): TENSOR (a_scale, b_scale each (Ba, M) / (Bb, N)
    broadcast views of one value), ROW (a_scale (Ba, M), b_scale (Bb, N): per row, or a per-tensor
    scale on one side), or BLOCK_1X128 (a_scale (Ba, M, K/128) for 1x128 blocks, with b_scale
    (Bb, ceil(N/128), K/128) for 128x128 blocks: the one block pairing). Scales are fp32.
    use_fast_accum: let the kernel skip the extra fp32 accumulation of Hopper's FP8 tensor cores
    (kernels without such a mode ignore it).
    """

    fmt: Format
    a: torch.Tensor
    a_scale: torch.Tensor
    b: torch.Tensor
    b_scale: torch.Tensor
    granularity: Granularity
    out: torch.Tensor
    bias: torch.Tensor | None
    alpha: torch.Tensor | None
    use_fast_accum: bool = False

    @property
    def m(self) -> int:
        return self.a.shape[1]

    @property
    def n(self) -> int:
        return self.b.shape[1]

    @property
    def k(self) -> int:
        return self.a.shape[2]


# --------------------------------------------------------------------------------------------------
# Shape checks shared by all formats.
# --------------------------------------------------------------------------------------------------

def _check_operands(fn: str, x: torch.Tensor, y: torch.Tensor, data_dtypes, k_per_byte: int):
    # x, y and the scales are tensors: the public functions checked (``_check_op_args``), and the
    # operators' schemas take nothing else.
    check_dtype(fn, "x", x, data_dtypes)
    check_dtype(fn, "y", y, data_dtypes)
    if x.dtype != y.dtype:
        raise TypeError(f"{fn}: x and y must have the same dtype, got x {x.dtype} and y {y.dtype}")
    if x.ndim < 2 or y.ndim < 2:
        raise ValueError(f"{fn}: x must be (..., M, K) and y (..., K, N); got x {tuple(x.shape)}, "
                         f"y {tuple(y.shape)}")
    if x.shape[-1] != y.shape[-2]:
        what = "K/2 (packed)" if k_per_byte == 2 else "K"
        raise ValueError(f"{fn}: x is (..., M, K) and y (..., K, N) but their {what} differ: x "
                         f"{tuple(x.shape)}, y {tuple(y.shape)}")
    if x.is_cuda:
        check_matmul_k(fn, "x", x.shape, x.shape[-1] * k_per_byte)
    if y.ndim > 2 and y.shape[:-2] != x.shape[:-2]:
        raise ValueError(f"{fn}: y's batch dims {tuple(y.shape[:-2])} must equal x's "
                         f"{tuple(x.shape[:-2])} (or y must be 2-D and shared across the batch)")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{fn}: x must be row-major (stride 1 along K), got strides {x.stride()}; "
                         f"call x.contiguous()")
    if y.stride(-2) != 1 and y.shape[-2] > 1:
        raise ValueError(f"{fn}: y must be K-major (stride 1 along K), got strides {y.stride()}; pass "
                         f"w.t() of a contiguous (N, K) weight, or use tilemm.linear(x_q, w_q)")


def _scale_layout(fn: str, name: str, scale: torch.Tensor, operand: torch.Tensor) -> bool:
    """True for swizzled (rank = operand rank + 2), False for logical (same rank)."""
    if scale.ndim == operand.ndim:
        return False
    if scale.ndim == operand.ndim + 2:
        return True
    raise ValueError(
        f"{fn}: {name} must be the logical scale ({operand.ndim}-D) or the swizzled 32x4x4 scale "
        f"({operand.ndim + 2}-D), got shape {tuple(scale.shape)} for an operand of shape {tuple(operand.shape)}"
    )


def _block_scaled(fn: str, fmt: Format, x, x_scale, y, y_scale, *, out_dtype, bias, alpha):
    _check_operands(fn, x, y, (fmt.data_dtype,), fmt.elements_per_byte)
    scale_dtypes = (fmt.scale_dtype, torch.uint8) if fmt.is_mx else (fmt.scale_dtype,)
    check_dtype(fn, "x_scale", x_scale, scale_dtypes)
    check_dtype(fn, "y_scale", y_scale, scale_dtypes)
    check_out_dtype(fn, out_dtype)  # the operators' schema takes any dtype: a direct call needs this
    device = check_same_device(fn, x=x, y=y, x_scale=x_scale, y_scale=y_scale)

    k = fmt.logical_k(x.shape[-1])
    if k % fmt.block:
        raise ValueError(f"{fn}: K must be a multiple of the {fmt.name} block size {fmt.block}, got K={k}")
    m, n, ks = x.shape[-2], y.shape[-1], k // fmt.block
    batch = x.shape[:-2]

    x_swz = _scale_layout(fn, "x_scale", x_scale, x)
    y_swz = _scale_layout(fn, "y_scale", y_scale, y)
    if x_swz != y_swz:
        raise ValueError(f"{fn}: x_scale and y_scale must both be logical or both swizzled, got x_scale "
                         f"{tuple(x_scale.shape)} and y_scale {tuple(y_scale.shape)}")
    if x_swz:
        _expect_shape(fn, "x_scale", x_scale, (*batch, *_swizzle.swizzled_shape(m, ks)))
        _expect_shape(fn, "y_scale", y_scale, (*y.shape[:-2], *_swizzle.swizzled_shape(n, ks)),
                      hint="the swizzle of the (N, K/B) weight scale")
    else:
        _expect_shape(fn, "x_scale", x_scale, (*batch, m, ks))
        _expect_shape(fn, "y_scale", y_scale, (*y.shape[:-2], ks, n), hint="usually w_scale.t()")

    bias32 = check_bias(fn, bias, n, device)
    alpha32 = None if alpha is None else as_fp32_scalar(fn, "alpha", alpha, device)
    return m, n, k, x_swz, device, bias32, alpha32


def _expect_shape(fn, name, t, shape, hint=None):
    if tuple(t.shape) != tuple(shape):
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"{fn}: {name} must have shape {tuple(shape)}{extra}, got {tuple(t.shape)}")


def _to3d(t: torch.Tensor, tail: int) -> torch.Tensor:
    """Collapse leading dims so that ``t`` has exactly ``tail`` + 1 dims (a batch dim of 1 if none)."""
    if t.ndim == tail:
        return t.unsqueeze(0)
    lead = t.shape[: t.ndim - tail]
    b = 1
    for d in lead:
        b *= d
    return t.reshape(b, *t.shape[t.ndim - tail:])


def _logical_scales(x_scale, y_scale, m, n, ks):
    rows_x = _swizzle.unswizzle_32_4_4(x_scale, m, ks)
    rows_y = _swizzle.unswizzle_32_4_4(y_scale, n, ks)
    return rows_x, rows_y.transpose(-1, -2)


# --------------------------------------------------------------------------------------------------
# Calls planned once per signature. A signature is everything the checks and the launch plan read:
# shapes, strides, dtypes and devices of the tensors, the output dtype and which optional arguments
# are present. Its first call is checked in full and planned; later calls of the same signature (from
# the public functions, the custom operators or tilemm.nn.Linear) look the call up and launch.
# --------------------------------------------------------------------------------------------------

#: Planned calls by signature, shared by every entry point (``tilemm.kernels.PLANS``).
_CALLS = kernels.PLANS


def _sig(t) -> tuple | None:
    """What the checks and the plan read of a tensor argument (None for an absent one)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


_remember = kernels.remember
_Tensor = torch.Tensor


def _on_gpu(device: torch.device) -> bool:
    """Whether a checked call on ``device`` runs a kernel (else the reference)."""
    return device.type == "cuda"


def _tsig(t) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


def launch_key(tag: str, x, x_scale, y, y_scale, out_dtype, bias, alpha, extra=()) -> tuple | None:
    """The key of an eager call's prepared launch in ``PLANS``: everything the checks and the plan read
    (shapes, strides, dtypes and devices of the tensors, the options), as one tuple; None for a call
    that has none (an argument that is not a plain torch tensor, or torch.compile tracing).
    ``extra``: further plain tensors (NVFP4's decode scales), then options."""
    if torch.compiler.is_compiling():
        return None
    if (type(x) is not _Tensor or type(x_scale) is not _Tensor or type(y) is not _Tensor
            or type(y_scale) is not _Tensor or not (bias is None or type(bias) is _Tensor)
            or not (alpha is None or type(alpha) is _Tensor)):
        return None
    return (tag, x.shape, x.stride(), x.dtype, x.device, x_scale.shape, x_scale.stride(), x_scale.dtype,
            x_scale.device, y.shape, y.stride(), y.dtype, y.device, y_scale.shape, y_scale.stride(),
            y_scale.dtype, y_scale.device, out_dtype, None if bias is None else _tsig(bias),
            None if alpha is None else _tsig(alpha), *extra)


def _fp32_word(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-d or (1,) tensor as the (1,) fp32 tensor on ``device`` that a kernel reads."""
    if t.dtype is torch.float32 and t.device == device:
        return t.reshape(1)
    return t.reshape(1).to(device=device, dtype=torch.float32)


class _Launch:
    """An eager CUDA call of a checked signature whose launch is prepared (a ``direct`` Hopper or
    Blackwell ``Prepared``): per call, the output's allocation, at most one view per operand (``view_spec``,
    worked out on the signature's first call), alpha / bias / decode scales as the kernel takes them,
    and the launch. Nothing is checked: the key (``launch_key``) holds everything the checks read."""

    __slots__ = ("prepared", "specs", "out_shape", "out3", "out_dtype", "device", "ones", "zeros",
                 "bias_fp32", "scaled", "words")

    def __init__(self, prepared, specs, out_shape, out3, out_dtype, device, bias, scaled):
        self.prepared, self.specs, self.scaled = prepared, specs, scaled
        self.out_shape, self.out3, self.out_dtype, self.device = out_shape, out3, out_dtype, device
        self.ones, self.zeros = ones_scalar(device), zeros_vector(device, out3[2])
        if device.type == "cuda":  # fixed tensors, described for cuTile once
            self.ones, self.zeros = Described(self.ones), Described(self.zeros)
        self.bias_fp32 = bias is not None and bias.dtype == torch.float32 and bias.is_contiguous()
        self.words = [(None, None), (None, None)]  # per operand: the last decode scale seen, its word

    def _word(self, i: int, t: torch.Tensor):
        """Decode scale ``t`` (slot 0: x's, 1: y's) as the (1,) fp32 word the kernel reads. A scale that
        is already fp32 on the device is read in place, so the word of the last such tensor seen in this
        slot is kept (described once) and given again while the same tensor object comes back: a
        weight's decode scale, passed on every call, costs no view and no description. (Each slot is
        replaced as one pair, so concurrent callers never see one tensor with another's word.)"""
        kept, word = self.words[i]
        if t is kept:
            return word
        word = _fp32_word(t, self.device)
        if t.dtype is torch.float32 and t.device == self.device:  # a view of t, not a copy
            self.words[i] = (t, Described(word) if self.device.type == "cuda" else word)
        return word

    def __call__(self, x, x_scale, y, y_scale, bias, alpha, global_scale_x=None, global_scale_y=None):
        device = self.device
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=device)
        sa, ssa, sb, ssb = self.specs
        if bias is None:
            bias = self.zeros
        elif not self.bias_fp32:
            bias = bias.to(torch.float32).contiguous()
        alpha = self.ones if alpha is None else alpha.reshape(1).to(device=device, dtype=torch.float32)
        operands = (x if sa is None else as_view(x, sa), x_scale if ssa is None else as_view(x_scale, ssa),
                    y if sb is None else as_view(y, sb), y_scale if ssb is None else as_view(y_scale, ssb))
        if self.scaled:  # block-scaled: NVFP4's decode scales go to the kernel
            if global_scale_x is None:
                global_scale_x = global_scale_y = self.ones
            else:  # (quantize_nvfp4's are fp32 on the device already: a view each)
                global_scale_x, global_scale_y = self._word(0, global_scale_x), self._word(1, global_scale_y)
            self.prepared.launch(stream_handle(device), *operands, out.view(self.out3), alpha, global_scale_x,
                                 global_scale_y, bias)
        else:
            self.prepared.launch(stream_handle(device), *operands, out.view(self.out3), alpha, bias)
        return out

    def bound(self, y, y_scale, bias):
        """This FP8 launch with its y operands and bias fixed, for a caller that holds them (a layer's
        weight): ``(x, x_scale) -> out`` launches what ``self(x, x_scale, y, y_scale, bias, None)``
        launches. ``y``, ``y_scale`` and ``bias`` are tensors of the signature's, whose memory the
        bound launch reads on every call (their views are taken here, once)."""
        if self.scaled:
            raise ValueError("_Launch.bound: block-scaled launches take per-call decode scales")
        _, _, sb, ssb = self.specs
        if bias is None:
            bias = self.zeros
        elif not self.bias_fp32:
            bias = bias.to(torch.float32).contiguous()
        return _BoundLaunch(self, as_view(y, sb), as_view(y_scale, ssb), bias)


class _BoundLaunch:
    """``_Launch.bound``: an FP8 launch whose y operands (as the kernel views them) and bias are fixed."""

    __slots__ = ("launch", "y", "y_scale", "bias")

    def __init__(self, launch, y, y_scale, bias):
        self.launch, self.y, self.y_scale, self.bias = launch, y, y_scale, bias

    def __call__(self, x, x_scale):
        launch = self.launch
        device = launch.device
        out = torch.empty(launch.out_shape, dtype=launch.out_dtype, device=device)
        sa, ssa, _, _ = launch.specs
        launch.prepared.launch(stream_handle(device), x if sa is None else as_view(x, sa),
                               x_scale if ssa is None else as_view(x_scale, ssa), self.y, self.y_scale,
                               out.view(launch.out3), launch.ones, self.bias)
        return out


def _remember_launch(fast_key, prepared, problem, sources, out_shape, out_dtype, device, bias, scaled) -> None:
    """Keep the prepared launch of an eager CUDA call under ``fast_key`` when each kernel operand is one
    view of the caller's tensor (``sources``: x, x_scale and y, y_scale or the weight and its scale;
    an FP8 per-tensor scale is a (1,) view of its 0-d tensor on sm_90, a copied vector on Blackwell,
    which therefore keeps no launch)."""
    if fast_key is None or not getattr(prepared, "direct", False) or not hasattr(prepared, "launch"):
        return
    specs = [view_spec(s, o) for s, o in zip(sources, prepared.operands(problem))]
    if any(spec is False for spec in specs):
        return
    _remember(fast_key, _Launch(prepared, specs, out_shape, tuple(problem.out.shape), out_dtype, device, bias,
                                scaled))


def _prepared(call, problem, prepare, fast_key, sources, bias, scaled):
    """The checked signature ``call``'s prepared launch, planned by ``prepare`` on its first problem,
    and kept under ``fast_key`` for the eager fast path (``_remember_launch``)."""
    prepared = call.prepared
    if prepared is None:
        prepared = call.prepared = prepare(problem)
    _remember_launch(fast_key, prepared, problem, sources, call.out_shape, call.out_dtype, call.device, bias,
                     scaled)
    return prepared


class _BlockScaledCall:
    """A checked block-scaled matmul signature: the output's shape and how the operands are viewed
    for the kernels, and, on a GPU, the launcher's prepared launch (``tilemm.kernels``)."""

    __slots__ = ("fmt", "swizzled", "m", "n", "k", "out_shape", "out_dtype", "tail", "empty", "prepared",
                 "device", "gpu")

    def __init__(self, fmt, x, x_scale, y, y_scale, out_dtype, m, n, k, swizzled, device):
        self.fmt, self.swizzled, self.m, self.n, self.k = fmt, swizzled, m, n, k
        self.out_shape = (*x.shape[:-2], m, n)
        self.out_dtype, self.device = out_dtype, device
        self.tail = 4 if swizzled else 2
        self.empty = x.numel() == 0 or y.numel() == 0 or m == 0 or n == 0
        self.prepared = None
        self.gpu = _on_gpu(device)

    def problem(self, x, x_scale, y, y_scale, out, bias32, alpha32, global_scales=None) -> BlockScaledProblem:
        tail = self.tail
        b_scale = y_scale if self.swizzled else y_scale.transpose(-1, -2)
        return BlockScaledProblem(self.fmt, _to3d(x, 2), _to3d(x_scale, tail), _to3d(y.transpose(-1, -2), 2),
                                  _to3d(b_scale, tail), self.swizzled, out.view(-1, self.m, self.n), bias32,
                                  alpha32, global_scales)


def block_scaled_call(fn, fmt, x, x_scale, y, y_scale, out_dtype, bias, alpha) -> _BlockScaledCall:
    """The planned call for this signature; its first call runs every check (``_block_scaled``)."""
    key = (fmt.name, _sig(x), _sig(x_scale), _sig(y), _sig(y_scale), out_dtype, _sig(bias), _sig(alpha))
    call = _CALLS.get(key)
    if call is None:
        m, n, k, swizzled, device, _, _ = _block_scaled(fn, fmt, x, x_scale, y, y_scale, out_dtype=out_dtype,
                                                        bias=bias, alpha=alpha)
        call = _remember(key, _BlockScaledCall(fmt, x, x_scale, y, y_scale, out_dtype, m, n, k, swizzled, device))
    return call


def _bias32(bias):
    return None if bias is None else bias.to(torch.float32).contiguous()


def _alpha32(alpha, device):
    return None if alpha is None else alpha.reshape(()).to(device=device, dtype=torch.float32)


def run_block_scaled(fn, fmt, x, x_scale, y, y_scale, *, out_dtype, bias, alpha, global_scales=None,
                     fast_key=None, sources=None):
    """What torch.ops.tilemm.{mxfp8,mxfp4,nvfp4}_matmul run: the product for operands whose signature's
    first call was checked (``block_scaled_call``), by the kept prepared launch of the kernel family.

    ``global_scales``: NVFP4's decode scales (global_scale_x, global_scale_y) as 0-d fp32 tensors on the
    device, or None. ``fast_key``: the eager call's ``launch_key``, under which its prepared launch is
    kept (``_remember_launch``); ``sources``: the caller's tensors the operands are views of (x, x_scale,
    y, y_scale by default)."""
    call = block_scaled_call(fn, fmt, x, x_scale, y, y_scale, out_dtype, bias, alpha)
    bias32, alpha32 = _bias32(bias), _alpha32(alpha, call.device)
    if call.empty or not call.gpu:
        if global_scales is not None:  # fp32(global_scale_x * global_scale_y) (* alpha), as the kernels do
            global_scale_x, global_scale_y = global_scales
            scales = global_scale_x * global_scale_y
            alpha32 = scales if alpha32 is None else scales * alpha32
    if call.empty:
        return _empty_result(call.out_shape, call.k, bias32, call.out_dtype, call.device)
    if not call.gpu:
        if call.swizzled:
            x_scale, y_scale = _logical_scales(x_scale, y_scale, call.m, call.n, call.k // call.fmt.block)
        return block_scaled_matmul_reference(call.fmt, x, x_scale, y, y_scale, out_dtype=call.out_dtype,
                                             alpha=alpha32, bias=bias32)
    out = torch.empty(call.out_shape, dtype=call.out_dtype, device=call.device)
    problem = call.problem(x, x_scale, y, y_scale, out, bias32, alpha32, global_scales)
    _prepared(call, problem, kernels.prepare_block_scaled, fast_key, sources or (x, x_scale, y, y_scale), bias,
              True).run(problem, stream_handle(call.device))
    return out


def _empty_result(shape, k, bias32, out_dtype, device):
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    if k == 0 and bias32 is not None:
        out += bias32
    return out.to(out_dtype)


# --------------------------------------------------------------------------------------------------
# What the custom operators torch.ops.tilemm.*_matmul run (registered below): every check on
# the tensors, then the reference (CPU) or a kernel (CUDA). The fake ("meta") versions run the same
# checks, which read only shapes, dtypes and devices, and return an empty output of the right shape.
# --------------------------------------------------------------------------------------------------

def mxfp8_operand_format(fn: str, x) -> Format:
    """The MXFP8 descriptor for the dtype of ``x`` (e4m3 or e5m2), or a TypeError naming ``fn``."""
    if isinstance(x, torch.Tensor) and x.dtype in FP8_DTYPES:
        return mxfp8_format(x.dtype, "x.dtype")
    check_tensor(fn, "x", x)
    raise TypeError(f"{fn}: x must have dtype torch.float8_e4m3fn or torch.float8_e5m2, got {x.dtype}")


def block_scaled_matmul_fake(fn, fmt, x, x_scale, y, y_scale, *, out_dtype, bias, alpha):
    """The output a block-scaled matmul would return, empty, after the same checks."""
    m, n, *_ = _block_scaled(fn, fmt, x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha)
    return x.new_empty((*x.shape[:-2], m, n), dtype=out_dtype)


def nvfp4_alpha(fn, global_scale_x, global_scale_y, alpha, device) -> torch.Tensor:
    """``global_scale_x * global_scale_y (* alpha)`` as a 0-d fp32 tensor on ``device``."""
    total = (as_fp32_scalar(fn, "global_scale_x", global_scale_x, device)
             * as_fp32_scalar(fn, "global_scale_y", global_scale_y, device))
    if alpha is not None:
        total = total * as_fp32_scalar(fn, "alpha", alpha, device)
    return total


def _fp8_granularity(fn: str, x, sx, y, sy):
    """Classify the FP8 scales by shape, as ``torch._scaled_mm`` does: x's and y's ``Granularity``
    (TENSOR, ROW, or BLOCK_1X128 for x with BLOCK_128X128 for y)."""
    m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
    xb, yb = x.shape[:-2], y.shape[:-2]
    for name, s in (("x_scale", sx), ("y_scale", sy)):
        if s.dtype != torch.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {s.dtype}")

    def kind_x():
        if sx.ndim == 0:
            return Granularity.TENSOR
        if tuple(sx.shape) == (*xb, m, 1):
            return Granularity.ROW
        if k % FP8_BLOCK == 0 and tuple(sx.shape) == (*xb, m, k // FP8_BLOCK):
            return Granularity.BLOCK_1X128
        raise ValueError(f"{fn}: x_scale must be 0-d (per tensor), {(*xb, m, 1)} (per row) or "
                         f"{(*xb, m, ceil_div(k, FP8_BLOCK))} (1x128 blocks, K a multiple of 128), got "
                         f"{tuple(sx.shape)}")

    def kind_y():
        if sy.ndim == 0:
            return Granularity.TENSOR
        if tuple(sy.shape) == (*yb, 1, n):
            return Granularity.ROW
        if k % FP8_BLOCK == 0 and tuple(sy.shape) == (*yb, k // FP8_BLOCK, ceil_div(n, FP8_BLOCK)):
            return Granularity.BLOCK_128X128
        raise ValueError(f"{fn}: y_scale must be 0-d (per tensor), {(*yb, 1, n)} (per column) or "
                         f"{(*yb, ceil_div(k, FP8_BLOCK), ceil_div(n, FP8_BLOCK))} (128x128 blocks, the "
                         f"transpose of quantize_fp8's weight scale), got {tuple(sy.shape)}")

    kx, ky = kind_x(), kind_y()
    # With K == 128 an (M, 1) scale is both per-row and 1x128; read it as the partner's granularity.
    if kx is Granularity.ROW and ky is Granularity.BLOCK_128X128 and k == FP8_BLOCK:
        kx = Granularity.BLOCK_1X128
    if ky is Granularity.ROW and kx is Granularity.BLOCK_1X128 and k == FP8_BLOCK and n == 1:
        ky = Granularity.BLOCK_128X128
    if kx.is_block != ky.is_block:
        raise ValueError(f"{fn}: 1x128 x-scales pair only with 128x128 y-scales (DeepSeek-style blocks); "
                         f"got x_scale {tuple(sx.shape)} ({kx.value}) with y_scale {tuple(sy.shape)} "
                         f"({ky.value})")
    return kx, ky


def fp8_matmul_checked(x, x_scale, y, y_scale, *, out_dtype, bias, alpha, use_fast_accum):
    """Every check of :func:`fp8_matmul` on tensors; returns what the computation needs."""
    fn = "fp8_matmul"
    _check_operands(fn, x, y, FP8_DTYPES, 1)
    fmt = fp8_format(x.dtype, "x.dtype")
    check_out_dtype(fn, out_dtype)  # the operators' schema takes any dtype (and makes use_fast_accum a bool)
    kx, ky = _fp8_granularity(fn, x, x_scale, y, y_scale)
    if kx.is_block and fmt.element != "e4m3":
        raise TypeError(f"{fn}: 128-element block scales are defined for float8_e4m3fn, got {x.dtype}")
    device = check_same_device(fn, x=x, y=y, x_scale=x_scale, y_scale=y_scale)
    bias32 = check_bias(fn, bias, y.shape[-1], device)
    alpha32 = None if alpha is None else as_fp32_scalar(fn, "alpha", alpha, device)
    return fmt, kx, ky, device, bias32, alpha32


def fp8_matmul_fake(x, x_scale, y, y_scale, *, out_dtype, bias, alpha, use_fast_accum):
    fp8_matmul_checked(x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                       use_fast_accum=use_fast_accum)
    return x.new_empty((*x.shape[:-2], x.shape[-2], y.shape[-1]), dtype=out_dtype)


class _FP8Call:
    """A checked FP8 matmul signature: the scale granularity, the output's shape and, on a GPU, the
    launcher's prepared launch."""

    __slots__ = ("fmt", "kx", "ky", "m", "n", "k", "out_shape", "out_dtype", "empty", "device",
                 "use_fast_accum", "granularity", "tail", "gpu", "prepared")

    def __init__(self, fmt, kx, ky, x, y, out_dtype, use_fast_accum, device):
        self.fmt, self.kx, self.ky = fmt, kx, ky
        self.m, self.k, self.n = x.shape[-2], x.shape[-1], y.shape[-1]
        self.out_shape = (*x.shape[:-2], self.m, self.n)
        self.out_dtype, self.device, self.use_fast_accum = out_dtype, device, use_fast_accum
        self.empty = x.numel() == 0 or y.numel() == 0 or self.m == 0 or self.n == 0
        self.granularity = kx if kx.is_block else (
            Granularity.TENSOR if kx is ky is Granularity.TENSOR else Granularity.ROW)
        self.tail = 2 if kx.is_block else 1
        self.gpu = _on_gpu(device)
        self.prepared = None


def fp8_call(x, x_scale, y, y_scale, out_dtype, bias, alpha, use_fast_accum) -> _FP8Call:
    """The planned FP8 call for this signature; its first call runs every check."""
    key = ("fp8", _sig(x), _sig(x_scale), _sig(y), _sig(y_scale), out_dtype, _sig(bias), _sig(alpha),
           use_fast_accum)
    call = _CALLS.get(key)
    if call is None:
        fmt, kx, ky, device, _, _ = fp8_matmul_checked(x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias,
                                                       alpha=alpha, use_fast_accum=use_fast_accum)
        call = _remember(key, _FP8Call(fmt, kx, ky, x, y, out_dtype, use_fast_accum, device))
    return call


def run_fp8_matmul(x, x_scale, y, y_scale, *, out_dtype, bias, alpha, use_fast_accum, fast_key=None,
                   sources=None):
    """What torch.ops.tilemm.fp8_matmul runs: as ``run_block_scaled``, without decode scales."""
    call = fp8_call(x, x_scale, y, y_scale, out_dtype, bias, alpha, use_fast_accum)
    bias32, alpha32 = _bias32(bias), _alpha32(alpha, call.device)
    m, n, kx, ky = call.m, call.n, call.kx, call.ky
    if call.empty:
        return _empty_result(call.out_shape, call.k, bias32, call.out_dtype, call.device)
    # Scales as (..., M) rows and (..., N) columns, or block grids.
    if kx.is_block:
        a_scale = x_scale
        b_scale = y_scale.transpose(-1, -2)  # (..., ceil(N/128), K/128)
    else:
        tensor = Granularity.TENSOR
        a_scale = x_scale.reshape(()).expand(*x.shape[:-2], m) if kx is tensor else x_scale[..., 0]
        b_scale = y_scale.reshape(()).expand(*y.shape[:-2], n) if ky is tensor else y_scale[..., 0, :]
    if not call.gpu:
        if kx.is_block:
            xs = a_scale.repeat_interleave(FP8_BLOCK, dim=-1)
            ys = b_scale.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)
            ys = ys.transpose(-1, -2)
        else:
            xs, ys = a_scale[..., :, None], b_scale[..., None, :]
        return fp8_matmul_reference(x, xs, y, ys, out_dtype=call.out_dtype, alpha=alpha32, bias=bias32)
    out = torch.empty(call.out_shape, dtype=call.out_dtype, device=call.device)
    tail = call.tail
    problem = FP8Problem(call.fmt, _to3d(x, 2), _to3d(a_scale, tail), _to3d(y.transpose(-1, -2), 2),
                         _to3d(b_scale, tail), call.granularity, out.view(-1, m, n), bias32, alpha32,
                         call.use_fast_accum)
    _prepared(call, problem, kernels.prepare_fp8, fast_key, sources or (x, x_scale, y, y_scale), bias,
              False).run(problem, stream_handle(call.device))
    return out


# --------------------------------------------------------------------------------------------------
# The custom operators ``torch.ops.tilemm.*_matmul``: one opaque op each for torch.compile, whose
# real implementation is the ``run_*`` function above and whose fake one the ``*_fake`` function.
# --------------------------------------------------------------------------------------------------

@torch.library.custom_op("tilemm::mxfp8_matmul", mutates_args=())
def _mxfp8_matmul_op(x: Tensor, x_scale: Tensor, y: Tensor, y_scale: Tensor,
                 out_dtype: torch.dtype = torch.bfloat16, bias: Optional[Tensor] = None,
                 alpha: Optional[Tensor] = None) -> Tensor:
    fn = "mxfp8_matmul"
    return run_block_scaled(fn, mxfp8_operand_format(fn, x), x, x_scale, y, y_scale,
                                    out_dtype=out_dtype, bias=bias, alpha=alpha)


@_mxfp8_matmul_op.register_fake
def _(x, x_scale, y, y_scale, out_dtype=torch.bfloat16, bias=None, alpha=None):
    fn = "mxfp8_matmul"
    return block_scaled_matmul_fake(fn, mxfp8_operand_format(fn, x), x, x_scale, y,
                                            y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha)


@torch.library.custom_op("tilemm::mxfp4_matmul", mutates_args=())
def _mxfp4_matmul_op(x: Tensor, x_scale: Tensor, y: Tensor, y_scale: Tensor,
                 out_dtype: torch.dtype = torch.bfloat16, bias: Optional[Tensor] = None,
                 alpha: Optional[Tensor] = None) -> Tensor:
    return run_block_scaled("mxfp4_matmul", MXFP4, x, x_scale, y, y_scale, out_dtype=out_dtype,
                                    bias=bias, alpha=alpha)


@_mxfp4_matmul_op.register_fake
def _(x, x_scale, y, y_scale, out_dtype=torch.bfloat16, bias=None, alpha=None):
    return block_scaled_matmul_fake("mxfp4_matmul", MXFP4, x, x_scale, y, y_scale,
                                            out_dtype=out_dtype, bias=bias, alpha=alpha)


@torch.library.custom_op("tilemm::nvfp4_matmul", mutates_args=())
def _nvfp4_matmul_op(x: Tensor, x_scale: Tensor, y: Tensor, y_scale: Tensor, global_scale_x: Tensor,
                 global_scale_y: Tensor, out_dtype: torch.dtype = torch.bfloat16,
                 bias: Optional[Tensor] = None, alpha: Optional[Tensor] = None) -> Tensor:
    fn = "nvfp4_matmul"
    device = x.device
    global_scale_x = as_fp32_scalar(fn, "global_scale_x", global_scale_x, device)
    global_scale_y = as_fp32_scalar(fn, "global_scale_y", global_scale_y, device)
    alpha = _alpha_tensor(fn, alpha, device)
    return run_block_scaled(fn, NVFP4, x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                            global_scales=(global_scale_x, global_scale_y))


@_nvfp4_matmul_op.register_fake
def _(x, x_scale, y, y_scale, global_scale_x, global_scale_y, out_dtype=torch.bfloat16, bias=None,
      alpha=None):
    fn = "nvfp4_matmul"
    total = nvfp4_alpha(fn, global_scale_x, global_scale_y, alpha, x.device)
    return block_scaled_matmul_fake(fn, NVFP4, x, x_scale, y, y_scale, out_dtype=out_dtype,
                                            bias=bias, alpha=total)


@torch.library.custom_op("tilemm::fp8_matmul", mutates_args=())
def _fp8_matmul_op(x: Tensor, x_scale: Tensor, y: Tensor, y_scale: Tensor,
               out_dtype: torch.dtype = torch.bfloat16, bias: Optional[Tensor] = None,
               alpha: Optional[Tensor] = None, use_fast_accum: bool = False) -> Tensor:
    return run_fp8_matmul(x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                                  use_fast_accum=use_fast_accum)


@_fp8_matmul_op.register_fake
def _(x, x_scale, y, y_scale, out_dtype=torch.bfloat16, bias=None, alpha=None, use_fast_accum=False):
    return fp8_matmul_fake(x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                                   use_fast_accum=use_fast_accum)


# --------------------------------------------------------------------------------------------------
# Public functions: Python-level argument handling (non-tensor arguments, FP8 bytes from NumPy or
# CuPy, scalars to 0-d tensors), then the custom operator, which torch.compile sees as one opaque op.
# --------------------------------------------------------------------------------------------------

def _fp8_bytes(fn: str, name: str, t, elem_dtype):
    """FP8 data given as raw uint8 bytes (NumPy / CuPy arrays have no float8) viewed as ``elem_dtype``
    (default e4m3); float8 tensors must agree with an explicit ``elem_dtype``."""
    if elem_dtype is not None and elem_dtype not in FP8_DTYPES:
        raise TypeError(f"{fn}: elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 (the encoding "
                        f"of uint8 FP8 bytes), got {elem_dtype!r}")
    if not isinstance(t, torch.Tensor):
        return t  # check_tensor reports it
    if t.dtype == torch.uint8:
        return t.view(torch.float8_e4m3fn if elem_dtype is None else elem_dtype)
    if elem_dtype is not None and t.dtype in FP8_DTYPES and t.dtype != elem_dtype:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype} but elem_dtype={elem_dtype}; elem_dtype only "
                        f"says how to read uint8 bytes, so leave it out or make it agree")
    return t


def _check_op_args(fn: str, out_dtype, bias, **tensors) -> None:
    for name, t in tensors.items():
        check_tensor(fn, name, t)
    if bias is not None:
        check_tensor(fn, "bias", bias)
    check_out_dtype(fn, out_dtype)


def _alpha_tensor(fn: str, alpha, device):
    return None if alpha is None else as_fp32_scalar(fn, "alpha", alpha, device)


def _eager_gpu(x) -> bool:
    """Whether a checked call on ``x`` may skip the operator dispatcher: an eager call on a plain CUDA
    tensor (torch.compile, tensor subclasses and CPU tensors go through ``torch.ops.tilemm.*``)."""
    return type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling()


@_interop.accepts_arrays
def mxfp8_matmul(x, x_scale, y, y_scale, *, out_dtype=torch.bfloat16, bias=None, alpha=None, elem_dtype=None):
    """MXFP8 matmul: e4m3 or e5m2 elements with one e8m0 scale per 32 elements of K.

    Args:
        x: (..., M, K) float8_e4m3fn or float8_e5m2, row-major (or uint8 bytes, see ``elem_dtype``).
        x_scale: (..., M, K/32) e8m0 (``torch.float8_e8m0fnu`` or its uint8 bytes), or swizzled.
        y: (..., K, N) of x's dtype, K-major (``w.t()`` of an (N, K) weight); 2-D y is shared by a batch.
        y_scale: (..., K/32, N) (``w_scale.t()``), or the swizzle of the (N, K/32) weight scale.
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        bias: optional (N,) float tensor, added after ``alpha``.
        alpha: optional float or 0-d tensor multiplying the fp32 product.
        elem_dtype: the FP8 encoding of x and y when they are uint8 bytes (NumPy and CuPy arrays, which
            have no float8): ``torch.float8_e4m3fn`` (the default for bytes) or ``torch.float8_e5m2``.

    Returns:
        (..., M, N) tensor of ``out_dtype`` (an array of the input's kind for NumPy / CuPy inputs).

    Swizzled x_scale and y_scale of the same padded shape cannot be told apart: swapped, they give a
    silently wrong result. :func:`linear`, which takes each operand with its scale, cannot swap them.
    """
    fn = "mxfp8_matmul"
    key = launch_key(fn, x, x_scale, y, y_scale, out_dtype, bias, alpha) if elem_dtype is None else None
    launch = None if key is None else _CALLS.get(key)
    if launch is not None:  # a signature seen before: checked then, launch prepared
        return launch(x, x_scale, y, y_scale, bias, alpha)
    sources = (x, x_scale, y, y_scale)
    x, y = _fp8_bytes(fn, "x", x, elem_dtype), _fp8_bytes(fn, "y", y, elem_dtype)
    _check_op_args(fn, out_dtype, bias, x=x, x_scale=x_scale, y=y, y_scale=y_scale)
    alpha = _alpha_tensor(fn, alpha, x.device)
    if _eager_gpu(x):  # the operator's own implementation, without the dispatcher's cost
        return run_block_scaled(fn, mxfp8_operand_format(fn, x), x, x_scale, y, y_scale, out_dtype=out_dtype,
                                bias=bias, alpha=alpha, fast_key=key, sources=sources)
    return _mxfp8_matmul_op(x, x_scale, y, y_scale, out_dtype, bias, alpha)


@_interop.accepts_arrays
def mxfp4_matmul(x, x_scale, y, y_scale, *, out_dtype=torch.bfloat16, bias=None, alpha=None):
    """MXFP4 matmul: e2m1 elements packed two per byte along K, one e8m0 scale per 32 elements.

    x: (..., M, K/2) uint8; y: (..., K/2, N) uint8, K-major (``w.t()`` of an (N, K/2) packed weight);
    scales as for :func:`mxfp8_matmul` with K/32 columns. Other arguments as for :func:`mxfp8_matmul`.

    Swizzled x_scale and y_scale of the same padded shape cannot be told apart: swapped, they give a
    silently wrong result. :func:`linear`, which takes each operand with its scale, cannot swap them.
    """
    fn = "mxfp4_matmul"
    key = launch_key(fn, x, x_scale, y, y_scale, out_dtype, bias, alpha)
    launch = None if key is None else _CALLS.get(key)
    if launch is not None:
        return launch(x, x_scale, y, y_scale, bias, alpha)
    _check_op_args(fn, out_dtype, bias, x=x, x_scale=x_scale, y=y, y_scale=y_scale)
    alpha = _alpha_tensor(fn, alpha, x.device)
    if _eager_gpu(x):
        return run_block_scaled(fn, MXFP4, x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                                fast_key=key)
    return _mxfp4_matmul_op(x, x_scale, y, y_scale, out_dtype, bias, alpha)


@_interop.accepts_arrays
def nvfp4_matmul(x, x_scale, y, y_scale, *, global_scale_x, global_scale_y, out_dtype=torch.bfloat16,
                 bias=None, alpha=None):
    """NVFP4 matmul: e2m1 elements packed two per byte, one e4m3 scale per 16 elements, and one fp32
    decode ("global") scale per tensor.

    x: (..., M, K/2) uint8; y: (..., K/2, N) uint8, K-major; x_scale (..., M, K/16) and y_scale
    (..., K/16, N) float8_e4m3fn (or its uint8 bytes), or swizzled. ``global_scale_x`` /
    ``global_scale_y`` are the decode scales returned by :func:`tilemm.quantize_nvfp4`: Python floats
    or 0-d float tensors (any float dtype, any device; converted exactly to fp32). The product is
    multiplied by ``global_scale_x * global_scale_y`` (then by ``alpha`` if given) before ``bias``.

    Swizzled x_scale and y_scale of the same padded shape cannot be told apart: swapped, they give a
    silently wrong result. :func:`linear`, which takes each operand with its scale, cannot swap them.
    """
    fn = "nvfp4_matmul"
    key = None
    if type(global_scale_x) is _Tensor and type(global_scale_y) is _Tensor:
        key = launch_key(fn, x, x_scale, y, y_scale, out_dtype, bias, alpha,
                         (_tsig(global_scale_x), _tsig(global_scale_y)))
        launch = None if key is None else _CALLS.get(key)
        if launch is not None:
            return launch(x, x_scale, y, y_scale, bias, alpha, global_scale_x, global_scale_y)
    sources = (x, x_scale, y, y_scale)
    _check_op_args(fn, out_dtype, bias, x=x, x_scale=x_scale, y=y, y_scale=y_scale)
    # e4m3 scale bytes (NumPy / CuPy arrays have no float8) are unambiguous: view them as e4m3.
    x_scale, y_scale = (s.view(NVFP4.scale_dtype) if s.dtype == torch.uint8 else s for s in (x_scale, y_scale))
    device = x.device
    global_scale_x = as_fp32_scalar(fn, "global_scale_x", global_scale_x, device)
    global_scale_y = as_fp32_scalar(fn, "global_scale_y", global_scale_y, device)
    alpha = _alpha_tensor(fn, alpha, device)
    if _eager_gpu(x):  # global_scale_x, global_scale_y (and alpha) are 0-d fp32 tensors on the device already;
        # the kernel multiplies fp32(global_scale_x * global_scale_y) (then alpha) into the product
        # (``BlockScaledProblem.global_scales``)
        return run_block_scaled(fn, NVFP4, x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                                global_scales=(global_scale_x, global_scale_y), fast_key=key, sources=sources)
    return _nvfp4_matmul_op(x, x_scale, y, y_scale, global_scale_x, global_scale_y, out_dtype, bias, alpha)


@_interop.accepts_arrays
def fp8_matmul(x, x_scale, y, y_scale, *, out_dtype=torch.bfloat16, bias=None, alpha=None,
               use_fast_accum=False, elem_dtype=None):
    """FP8 matmul with fp32 scales whose shapes give the granularity, as in ``torch._scaled_mm``.

    x: (..., M, K) float8_e4m3fn / float8_e5m2; y: (..., K, N) of the same dtype, K-major.
    x_scale: 0-d (per tensor), (..., M, 1) (per row) or (..., M, K/128) (1x128 blocks, e4m3).
    y_scale: 0-d (per tensor), (..., 1, N) (per column) or (..., K/128, ceil(N/128)) (128x128 blocks:
    the transpose of the scale :func:`tilemm.quantize_fp8` returns for an (N, K) weight).
    Per-tensor and per-row scales mix freely; 1x128 pairs with 128x128. Scales are fp32 decode factors.
    use_fast_accum: as in ``torch._scaled_mm``: on Hopper, accumulate in the FP8 tensor cores' own
    (reduced-precision) accumulator only, for speed. Default False: a full fp32 accumulation. The CPU
    reference path and GPUs without such a mode accept it and compute the precise result.
    elem_dtype: the FP8 encoding of x and y when they are uint8 bytes (NumPy / CuPy arrays):
    ``torch.float8_e4m3fn`` (the default for bytes) or ``torch.float8_e5m2``.
    """
    fn = "fp8_matmul"
    key = (launch_key(fn, x, x_scale, y, y_scale, out_dtype, bias, alpha, (use_fast_accum,))
           if elem_dtype is None and type(use_fast_accum) is bool else None)
    launch = None if key is None else _CALLS.get(key)
    if launch is not None:
        return launch(x, x_scale, y, y_scale, bias, alpha)
    sources = (x, x_scale, y, y_scale)
    x, y = _fp8_bytes(fn, "x", x, elem_dtype), _fp8_bytes(fn, "y", y, elem_dtype)
    _check_op_args(fn, out_dtype, bias, x=x, x_scale=x_scale, y=y, y_scale=y_scale)
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"{fn}: use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
    alpha = _alpha_tensor(fn, alpha, x.device)
    if _eager_gpu(x):
        return run_fp8_matmul(x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                              use_fast_accum=use_fast_accum, fast_key=key, sources=sources)
    return _fp8_matmul_op(x, x_scale, y, y_scale, out_dtype, bias, alpha, use_fast_accum)


_QUANTIZED = (MXFP8Tensor, MXFP4Tensor, NVFP4Tensor, FP8Tensor)


def _fp8_granularities_of(t) -> list[Granularity]:
    """The ``quantize_fp8`` granularities an FP8Tensor's scale shape can stand for, the block one first
    (with K <= 128 a row scale and a 1x128 block scale have the same shape)."""
    s, d = t.scale, t.data
    if s.ndim == 0:
        return [Granularity.TENSOR]
    rows, k = d.shape[-2], d.shape[-1]
    kinds = []
    if s.shape[-2:] == (rows, ceil_div(k, FP8_BLOCK)):
        kinds.append(Granularity.BLOCK_1X128)
    if s.shape[-2:] == (ceil_div(rows, FP8_BLOCK), ceil_div(k, FP8_BLOCK)):
        kinds.append(Granularity.BLOCK_128X128)
    if s.shape[-2:] == (rows, 1):
        kinds.append(Granularity.ROW)
    return kinds or [Granularity.BLOCK_128X128]


def _check_fp8_block_pair(fn: str, x_q, w_q) -> None:
    """FP8 blocks pair one way: activations x_q in 1x128 blocks with weights w_q in 128x128 blocks."""
    gran_x, gran_w = _fp8_granularities_of(x_q), _fp8_granularities_of(w_q)
    pair = (Granularity.BLOCK_1X128, Granularity.BLOCK_128X128)
    if any(not (a.is_block or b.is_block) or (a, b) == pair for a in gran_x for b in gran_w):
        return
    raise ValueError(f"{fn}: FP8 blocks pair activations quantized with granularity=(1, 128) (x_q) "
                     f"with weights quantized with granularity=(128, 128) (w_q); got x_q with "
                     f"granularity={gran_x[0].spelling} and w_q with granularity={gran_w[0].spelling}. "
                     f"Quantize x with tilemm.quantize_fp8(x, granularity=(1, 128)) and w with "
                     f"tilemm.quantize_fp8(w, granularity=(128, 128))")


def linear(x_q, w_q, *, bias=None, out_dtype=None, alpha=None, use_fast_accum=False):
    """``x @ w.T`` for an nn.Linear-layout (N, K) quantized weight; the recommended entry point.

    Two kinds of call:

    * **block-scaled** (both operands quantized): ``x_q`` and ``w_q`` are what the quantizers return
      (``MXFP8Tensor``, ``MXFP4Tensor``, ``NVFP4Tensor`` or ``FP8Tensor``), both of the same format and
      scale layout; the transposes and scale orientation are handled here. For FP8, ``w_q``'s scale may
      be per tensor, per row (one per output channel) or 128x128 blocks. ``use_fast_accum`` (FP8 only)
      is passed to :func:`fp8_matmul`. The result has ``out_dtype`` (bf16 when None, the default;
      fp16 or fp32).
    * **weight-only**: ``x_q`` is a plain float32 / bfloat16 / float16 tensor (..., K) and ``w_q`` a
      :class:`tilemm.PackedWeight` (``tilemm.prepack`` of an MXFP4, NVFP4 or MXFP8 weight, done once)
      or such a quantized weight (prepacked on every call: slow, for experiments). The result has
      ``out_dtype`` (bf16, fp16 or fp32; None, the default, keeps x's dtype) and equals
      ``x @ dequantize(w).T`` accumulated in fp32, rounded once.

    Why this is the entry point to use: the ``*_matmul`` functions take four loose tensors, and two
    swizzled scales of the same padded shape swapped there give a wrong result that nothing can
    detect; here each scale travels with its operand.
    """
    fn = "linear"
    key = _linear_key(x_q, w_q, bias, out_dtype, alpha, use_fast_accum)
    launch = None if key is None else _CALLS.get(key)
    if launch is not None:  # a signature seen before: checked then, launch prepared
        if key[0] == "linear nvfp4":
            return launch(x_q.data, x_q.scale, w_q.data, w_q.scale, bias, alpha, x_q.global_scale,
                          w_q.global_scale)
        return launch(x_q.data, x_q.scale, w_q.data, w_q.scale, bias, alpha)
    kinds = _QUANTIZED
    if isinstance(x_q, torch.Tensor) and isinstance(w_q, (PackedWeight, MXFP8Tensor, MXFP4Tensor, NVFP4Tensor)):
        if use_fast_accum:
            raise ValueError(f"{fn}: use_fast_accum applies to FP8 operands only, not to a weight-only call")
        packed = w_q if isinstance(w_q, PackedWeight) else prepack(w_q)
        return weight_only_linear(x_q, packed, bias=bias, alpha=alpha, out_dtype=out_dtype)
    if not isinstance(x_q, kinds) or not isinstance(w_q, kinds):
        raise TypeError(f"{fn}: x_q and w_q must be quantized tensors from tilemm.quantize_* "
                        f"({', '.join(k.__name__ for k in kinds)}), or x_q a float tensor and w_q a "
                        f"tilemm.PackedWeight (weight-only); got {type(x_q).__name__} and "
                        f"{type(w_q).__name__}")
    if type(x_q) is not type(w_q):
        raise TypeError(f"{fn}: x_q and w_q must be of one format, got {type(x_q).__name__} and "
                        f"{type(w_q).__name__}")
    for name, t in (("x_q", x_q), ("w_q", w_q)):
        if type(t.data) is torch.Tensor and type(t.scale) is torch.Tensor:
            continue  # the common case, without a generator
        if isinstance(t, tuple) and not all(isinstance(f, torch.Tensor) for f in t):
            arrays = ", ".join(sorted({f"{type(f).__module__}.{type(f).__name__}" for f in t}))
            raise TypeError(f"{fn}: {name} must hold torch tensors, got a {type(t).__name__} of {arrays}; "
                            f"for NumPy / CuPy arrays (FP8 as raw bytes) quantize torch.from_numpy(x) / "
                            f"torch.from_dlpack(x) instead, or call the format's *_matmul with the arrays")
    w, ws = w_q.data, w_q.scale
    if w.ndim != 2:
        raise ValueError(f"{fn}: w_q must hold a 2-D (N, K) weight, got data of shape {tuple(w.shape)}")
    kw = dict(out_dtype=torch.bfloat16 if out_dtype is None else out_dtype, bias=bias, alpha=alpha)
    if use_fast_accum and not isinstance(x_q, FP8Tensor):
        raise ValueError(f"{fn}: use_fast_accum applies to FP8 only, got {type(x_q).__name__} operands")
    if isinstance(x_q, FP8Tensor):
        _check_fp8_block_pair(fn, x_q, w_q)
        kw["use_fast_accum"] = use_fast_accum
        if ws.ndim == 2 and ws.shape[1] == 1 and ws.shape[0] == w.shape[0]:
            ys = ws.t()  # per output channel: (N, 1) -> (1, N)
        else:
            ys = ws.t() if ws.ndim == 2 else ws
        if _eager_gpu(x_q.data) and x_q.data.dtype in FP8_DTYPES:
            return _linear_eager("fp8_matmul", x_q, w.t(), ys, kw, w_q, key)
        return fp8_matmul(x_q.data, x_q.scale, w.t(), ys, **kw)
    ys = ws if ws.ndim == 4 else ws.t()
    if _eager_gpu(x_q.data) and (x_q.data.dtype in FP8_DTYPES or not isinstance(x_q, MXFP8Tensor)):
        name = "mxfp8_matmul" if isinstance(x_q, MXFP8Tensor) else (
            "mxfp4_matmul" if isinstance(x_q, MXFP4Tensor) else "nvfp4_matmul")
        return _linear_eager(name, x_q, w.t(), ys, kw, w_q, key)
    if isinstance(x_q, MXFP8Tensor):
        return mxfp8_matmul(x_q.data, x_q.scale, w.t(), ys, **kw)
    if isinstance(x_q, MXFP4Tensor):
        return mxfp4_matmul(x_q.data, x_q.scale, w.t(), ys, **kw)
    return nvfp4_matmul(x_q.data, x_q.scale, w.t(), ys, global_scale_x=x_q.global_scale,
                        global_scale_y=w_q.global_scale, **kw)


_LINEAR_TAGS = {MXFP8Tensor: "linear mxfp8", MXFP4Tensor: "linear mxfp4", NVFP4Tensor: "linear nvfp4",
                FP8Tensor: "linear fp8"}


def _linear_key(x_q, w_q, bias, out_dtype, alpha, use_fast_accum) -> tuple | None:
    """``launch_key`` of a :func:`linear` of two quantized operands (their data and scales as stored),
    or None."""
    tag = _LINEAR_TAGS.get(type(x_q))
    if tag is None or type(w_q) is not type(x_q) or type(use_fast_accum) is not bool:
        return None
    extra = (use_fast_accum,)
    if tag == "linear nvfp4":
        global_x, global_w = x_q.global_scale, w_q.global_scale
        if type(global_x) is not _Tensor or type(global_w) is not _Tensor:
            return None
        extra = (_tsig(global_x), _tsig(global_w), use_fast_accum)
    return launch_key(tag, x_q.data, x_q.scale, w_q.data, w_q.scale, out_dtype, bias, alpha, extra)


def prepared_linear(x_q, w_q, bias, out_dtype):
    """The prepared launch (``_Launch``) that an eager CUDA ``linear(x_q, w_q, bias=bias,
    out_dtype=out_dtype)`` of two quantized operands (no alpha) kept for their signature, or None.
    For a caller that keeps the launch itself (``tilemm.nn.Linear``; see ``_Launch.bound``)."""
    key = _linear_key(x_q, w_q, bias, out_dtype, None, False)
    return None if key is None else _CALLS.get(key)


def _linear_eager(fn: str, x_q, y, y_scale, kw: dict, w_q=None, key=None):
    """An eager CUDA :func:`linear` of quantized operands, straight to the operator's implementation:
    the checks the public function ``fn`` makes of its remaining arguments, then its planned call,
    without passing through the public function (one layer fewer). Its prepared launch is kept under
    ``key`` (``_linear_key``), with the operands' views taken from x_q's and w_q's own tensors."""
    x, x_scale, out_dtype, bias = x_q.data, x_q.scale, kw["out_dtype"], kw["bias"]
    sources = (x, x_scale, w_q.data, w_q.scale)
    _check_op_args(fn, out_dtype, bias, x_scale=x_scale, y_scale=y_scale)
    alpha = _alpha_tensor(fn, kw["alpha"], x.device)
    if fn == "fp8_matmul":
        if not isinstance(kw["use_fast_accum"], bool):
            raise TypeError(f"{fn}: use_fast_accum must be a bool, got {type(kw['use_fast_accum']).__name__}")
        return run_fp8_matmul(x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                              use_fast_accum=kw["use_fast_accum"], fast_key=key, sources=sources)
    if fn == "mxfp8_matmul":
        return run_block_scaled(fn, mxfp8_operand_format(fn, x), x, x_scale, y, y_scale, out_dtype=out_dtype,
                                bias=bias, alpha=alpha, fast_key=key, sources=sources)
    if fn == "mxfp4_matmul":
        return run_block_scaled(fn, MXFP4, x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                                fast_key=key, sources=sources)
    x_scale, y_scale = (s.view(NVFP4.scale_dtype) if s.dtype == torch.uint8 else s for s in (x_scale, y_scale))
    global_scales = (as_fp32_scalar(fn, "global_scale_x", x_q.global_scale, x.device),
                     as_fp32_scalar(fn, "global_scale_y", w_q.global_scale, x.device))
    return run_block_scaled(fn, NVFP4, x, x_scale, y, y_scale, out_dtype=out_dtype, bias=bias, alpha=alpha,
                            global_scales=global_scales, fast_key=key, sources=sources)
