"""Weight-only linear layers: ``x @ dequantize(w).T`` with x in bf16, fp16 or fp32 and w a prepacked
MXFP4, NVFP4 or MXFP8 weight (``tilemm.prepack``).

``weight_only_linear(x, packed, bias=None, alpha=None)`` is what ``tilemm.linear(x, w)`` runs when x is
a plain float tensor; ``WeightOnlyRunner`` is the same call with everything that does not depend on x
worked out once (``tilemm.nn.Linear`` holds one per layer), so an eager call costs one kernel launch
(two where the large-M plan splits K or decodes the weight for cuBLAS) and little else. Both run:

* on CUDA (Hopper and Blackwell): the fused kernels of ``tilemm.kernels.weight_only_kernels`` (bf16
  ``ct.mma`` on the decoded weight, or fp32 FMAs for a single row of x: the same kernels compile for
  sm_90, sm_100 and sm_120; Blackwell's ``ct.mma_scaled`` takes no bf16 operand, and quantizing the
  activation would change the result);
* on the CPU: the same arithmetic in PyTorch: ``(x @ (element * block scale).T) * (decode scale *
  alpha) + bias`` in fp32, rounded once to x's dtype.

``weight_only_linear`` calls the custom operator ``torch.ops.tilemm.weight_only_linear`` (registered
here), which ``torch.compile`` traces as one op with ``fullgraph=True``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ._arch import Family, family
from ._validate import FLOAT_INPUT_DTYPES, as_fp32_scalar, check_bias, check_out_dtype, check_tensor
from .formats import FORMATS
from .kernels import _large
from .kernels._common import num_sms, stream_handle
from .kernels import weight_only_kernels as _kernel
from .kernels import hopper_weight_only_large as _large_kernel
from .kernels.quantize_kernels import FakeQuant
from .packed import PackedWeight, _unpack_words, aligned_scale_t, layout_of
from .reference import decode_elements, decode_scales
from .numerics import pack_e2m1

__all__ = ["weight_only_linear", "WeightOnlyRunner", "QuantizedActivationRunner", "decoded_once"]

#: While ``decoded_once()`` runs (in this thread / context): id(runner) -> (runner, its weight decoded
#: to bf16); else None.
_DECODED: contextvars.ContextVar = contextvars.ContextVar("tilemm_decoded_once", default=None)


@contextlib.contextmanager
def decoded_once():
    """Within the block, a layer whose large-M plan multiplies through the weight decoded to bf16 (the
    decode design, ``hopper_weight_only_large.decode_gemm``) decodes it on its first call only; its
    later calls in the block multiply the same bf16 copy, held until the block ends (one (N, K) bf16
    tensor per such layer). Each call's result is what it would be alone: the copy is the same decode.

    For callers that run a layer on several pieces of one batch, as ``tilemm.parallel.overlapped``
    does: without it, every piece would decode the whole weight again. The layers' weights must not
    change inside the block. A nested block is part of the outer one; the block covers the calls of its
    own thread (a context variable). Captures in a CUDA graph (the copy is then the graph's memory,
    decoded once per replay)."""
    if _DECODED.get() is not None:
        yield
        return
    token = _DECODED.set({})
    try:
        yield
    finally:
        _DECODED.reset(token)


def _check_x(fn: str, x, k: int) -> None:
    check_tensor(fn, "x", x)
    if x.dtype not in FLOAT_INPUT_DTYPES:
        raise TypeError(f"{fn}: x must be a float32, bfloat16 or float16 tensor for a weight-only matmul, "
                        f"got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(f"{fn}: x must be (..., K) with K = {k} (the weight's in_features), got shape "
                         f"{tuple(x.shape)}")


def reference_weight_only(x2d, words, scale_t, constants, fmt_name: str, in_features: int, bias, alpha,
                          out_dtype: torch.dtype | None = None):
    """The CPU path (and the oracle of the GPU tests): fp32 products and sums, one rounding to
    ``out_dtype`` (default: x2d's dtype)."""
    fmt = FORMATS[fmt_name]
    layout = layout_of(fmt)
    codes = _unpack_words(words, layout, in_features)
    data = pack_e2m1(codes) if fmt.is_packed else codes.view(fmt.data_dtype)
    values = decode_elements(fmt, data)
    logical = scale_t if layout.scale_rows else scale_t.t()  # (N, K / B)
    scale = decode_scales(fmt, logical.contiguous().view(fmt.scale_dtype))
    w = values * scale.repeat_interleave(fmt.block, dim=-1)
    # The kernel's accumulator carries 2^-E (constants[1] = 2^(offset - E)); this one does not.
    c = constants.to(torch.float64)
    first = c[0] if alpha is None else alpha.reshape(()).to(torch.float64)
    factor = (first * c[1] * 2.0 ** -layout.offset).to(torch.float32)
    acc = (x2d.to(torch.float32) @ w.T) * factor
    if bias is not None:
        acc = acc + bias
    return acc.to(out_dtype or x2d.dtype)


#: Whether this PyTorch has cuBLAS bf16 x bf16 -> fp32 ``addmm(..., out_dtype=)`` (the large-M path).
_GEMM_FP32_OUT = [True]
#: Errors of the fp32-output GEMM that say nothing about its support, so never turn it off.
_NOT_A_MISSING_GEMM = tuple(e for e in (getattr(torch, "OutOfMemoryError", None),
                                         getattr(torch, "AcceleratorError", None)) if e is not None)


#: Row counts whose prepared launches (and large-M routes) a runner keeps before it starts over: a
#: decode server sees few, prefills of every length could otherwise add one per length for good.
MAX_ROUTES = 64


class WeightOnlyRunner:
    """One weight-only layer on one device, ready to run: ``runner(x2d)`` for x2d (M, K) contiguous.

    Holds the PackedWeight's tensors, the fp32 bias (or a zero vector) and, per (M, x dtype), the
    prepared launch (config, grid, kernel, fixed arguments), so that a call is the output allocation
    and one ``ct.launch``. Nothing a call allocates changes between calls of one shape (PyTorch's
    caching allocator), so calls can be captured in a CUDA graph.
    """

    __slots__ = ("packed", "bias", "bias16", "layout", "n", "k", "device", "_prepared", "_large", "_sms",
                 "bias_source", "keep_workspace", "has_bias")

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None, keep_workspace: bool = True):
        # Scale rows on 16-byte boundaries (``aligned_scale_t``: prepack lays them out so; a weight
        # moved or built elsewhere may not be), copied once here where they are not.
        scale_t = aligned_scale_t(packed.scale_t)
        self.packed = packed if scale_t is packed.scale_t else dataclasses.replace(packed, scale_t=scale_t)
        self.keep_workspace = keep_workspace
        self.layout = packed.layout
        self.n, self.k = packed.shape
        self.device = packed.device
        # No bias: the shared persistent zero vector (a call allocates and fills nothing).
        self.has_bias = bias is not None
        self.bias = (_kernel.zero_bias(self.device, self.n) if bias is None
                     else bias.detach().to(device=self.device, dtype=torch.float32).contiguous())
        # A bf16 bias as it is, for the decode design's cuBLAS epilogue (bf16 values are exact there, so
        # it adds them in fp32 before the one rounding); other dtypes take the fp32-output GEMM.
        self.bias16 = (bias.detach().to(self.device).contiguous()
                       if bias is not None and bias.dtype == torch.bfloat16 else None)
        self._prepared: dict = {}
        self._large: dict = {}
        self._sms = None
        self.bias_source = None  # what the owner built ``bias`` from, to tell when it is stale

    def plan(self, m: int) -> _kernel.WeightOnlyConfig:
        """The config of an (M, K) input: ``weight_only_kernels.plan`` on this layer's device."""
        if self._sms is None:
            self._sms = num_sms(self.device)
        return _kernel.plan(m, self.n, self.k, self.layout, self._sms)

    def _prepare(self, m: int, dtype: torch.dtype, cfg=None) -> _kernel.Prepared:
        p = self.packed
        prepared = _kernel.Prepared(p.words, p.scale_t, p.constants, self.bias, self.layout,
                                    cfg or self.plan(m), m, dtype, keep_workspace=self.keep_workspace)
        if cfg is None:
            if len(self._prepared) >= MAX_ROUTES:
                self._prepared.clear()
            self._prepared[(m, dtype)] = prepared
        return prepared

    def _large_m(self, x2d: torch.Tensor, out_dtype: torch.dtype, alpha: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The large-M plan's decode design with a bias, a non-bf16 output or a device ``alpha``: decode
        the weight once to bf16 (exact, times 2^-E), then cuBLAS's bf16 GEMM with an fp32 output. The
        epilogue is the kernels' (the fp32 sum times alpha, plus the bias, rounded once to
        ``out_dtype``): cuBLAS's own with ``alpha = 2^E * decode scale`` known on the host, or, for a
        (1,) fp32 ``alpha`` on the device (NVFP4 with a quantized activation: its decode scale times the
        weight's factor), a multiply and an add in place over the fp32 output."""
        p = self.packed
        buffer, decoded = self._held()
        w16 = (buffer[:, :self.k] if decoded else
               _kernel.dequantize(p.words, p.scale_t, p.constants, self.layout, self.k, out=buffer))
        if alpha is None:
            acc = torch.addmm(self.bias, x2d, w16.t(), out_dtype=torch.float32, alpha=p.alpha_host)
        else:  # in place: no second (M, N) fp32 temporary
            acc = torch.mm(x2d, w16.t(), out_dtype=torch.float32)
            acc.mul_(alpha).add_(self.bias)
        return acc.to(out_dtype)

    def _held(self) -> tuple[torch.Tensor | None, bool]:
        """Inside ``decoded_once()``: (this layer's (N, Kp) bf16 copy of its decoded weight, whether a
        call of the block has decoded it already); outside: (None, False)."""
        held = _DECODED.get()
        if held is None:
            return None, False
        entry = held.get(id(self))
        if entry is not None:
            return entry[1], True
        kp = self.packed.words.shape[1] // self.layout.words_per_tile * self.layout.tile_k
        buffer = torch.empty((self.n, kp), dtype=torch.bfloat16, device=self.device)
        held[id(self)] = (self, buffer)  # the runner stays referenced, so its id is not reused meanwhile
        return buffer, False

    def _large_route(self, m: int, x_dtype: torch.dtype, out_dtype: torch.dtype, fused_only: bool = False):
        """(large-M config or None, the fused kernel's prepared launch where it serves the call, else None).
        ``fused_only``: for calls with a device alpha (``hopper_weight_only_large.plan``)."""
        if x_dtype != torch.bfloat16 or m < _large_kernel.first_m(self.layout):
            return None, None
        if self._sms is None:
            self._sms = num_sms(self.device)
        large = _large_kernel.plan(m, self.n, self.k, self.layout, sms=self._sms, fused_only=fused_only)
        if large is not None and large.kind == "fused" and (family(self.device) is not Family.HOPPER
                                                             or out_dtype != torch.bfloat16):
            # The fused kernel is built for sm_90 and a bf16 output; otherwise decode + GEMM, or below
            # a few hundred rows the small-M kernels.
            large = _large_kernel.LargeConfig("decode", chunk=0) if _large_kernel.decode_fallback(m) else None
        fits = m * max(self.k, self.n) < _large.LIMIT
        if large is not None and large.kind == "fused" and fused_only and not fits:
            # 2^31 elements or more: no fused launch; the decode design applies the device alpha after.
            return _large_kernel.LargeConfig("decode", chunk=0), None
        if large is not None and large.kind == "fused" and fits:
            p = self.packed
            return large, _large_kernel.Prepared(p.words, p.scale_t, p.constants, self.bias, self.layout, large, m,
                                                 self._sms, x_dtype, keep_workspace=self.keep_workspace)
        return large, None

    def __call__(self, x2d: torch.Tensor, alpha: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (M, N) product in ``out_dtype`` (default: x2d's dtype); ``alpha``, a (1,) fp32 tensor,
        replaces the weight's own epilogue factor."""
        m = x2d.shape[0]
        out_dtype = out_dtype or x2d.dtype
        out = torch.empty((m, self.n), dtype=out_dtype, device=self.device)
        if m == 0:
            return out
        stream = stream_handle(self.device)
        # Many rows of bf16 x: the large-M plan (``hopper_weight_only_large.plan``), where it names a
        # design; worked out once per (M, x dtype, output dtype, device alpha or not), as the small-M
        # launches are. A device alpha (NVFP4's activation decode scale, ``QuantizedActivationRunner``)
        # cannot be cuBLAS's: such calls take the fused kernel, whose epilogue reads it, where the plan
        # would decode for cuBLAS (``hopper_weight_only_large.plan``'s ``fused_only``); the decode
        # design then needs an fp32 output and a pass over it (``_large_m``).
        key = (m, x2d.dtype, out_dtype, alpha is not None)
        route = self._large.get(key)
        if route is None:
            if len(self._large) >= MAX_ROUTES:
                self._large.clear()
            route = self._large[key] = self._large_route(m, x2d.dtype, out_dtype, alpha is not None)
        large, fused = route
        if fused is not None:
            fused.run(x2d, out, stream, alpha)
            return out
        if large is not None and large.kind in ("decode", "overlap"):
            if alpha is None and out_dtype == torch.bfloat16 and (
                    not self.has_bias or (self.bias16 is not None and large.kind == "decode")):
                p = self.packed
                if large.kind == "overlap":
                    return _large_kernel.overlap_gemm(x2d, p.words, p.scale_t, p.constants, p.alpha_host, out,
                                                      self.layout, self.k, large.chunk)
                buffer, decoded = self._held() if large.chunk <= 0 else (None, False)
                return _large_kernel.decode_gemm(x2d, p.words, p.scale_t, p.constants, p.alpha_host, out,
                                                 self.layout, self.k, large.chunk, stream, buffer, decoded,
                                                 self.bias16)
            if _GEMM_FP32_OUT[0]:  # a bias, another output dtype or a device alpha: fp32 GEMM output
                try:
                    return self._large_m(x2d, out_dtype, alpha)
                except _NOT_A_MISSING_GEMM:  # out of memory, a device error: the caller's to see
                    raise
                except (RuntimeError, TypeError):  # a PyTorch without mm / addmm(..., out_dtype): from now
                    _GEMM_FP32_OUT[0] = False  # on, the small-M kernels below
        if m * max(self.k, self.n) < _large.LIMIT:
            prepared = self._prepared.get((m, x2d.dtype)) or self._prepare(m, x2d.dtype)
            prepared.run(x2d, out, stream, alpha)
            return out
        # 2^31 elements or more in x or out: launch per block of rows (each output row depends on its
        # x row only, and the config, chosen for the whole M, is the same in every piece).
        rows = (_large.LIMIT - 1) // max(self.k, self.n) // 128 * 128
        cfg = self.plan(m)
        for r0 in range(0, m, rows):
            piece = x2d[r0:r0 + rows]
            self._prepare(piece.shape[0], x2d.dtype, cfg).run(piece, out[r0:r0 + rows], stream, alpha)
        return out


class QuantizedActivationRunner:
    """A block-scaled layer (activation and weight quantized) on Hopper: ``dequantize(quantize(x))``
    into bf16 (``quantize_kernels.FakeQuant``, exactly the activation the block-scaled matmul reads;
    NVFP4's decode scale goes to the epilogue's alpha), then the weight-only path for that many rows
    (``WeightOnlyRunner``) on that bf16 activation and the prepacked weight.

    The result equals the block-scaled matmul's, ``dequantize(q(x)) @ dequantize(w).T``, up to the
    order of the fp32 additions: every product is exact in fp32 either way (the decoded activation is a
    bf16 number; for MXFP8 with scale bytes below 3 / 10, as in the block-scaled kernels, magnitudes
    under 2^-133 are lost). On Hopper the block-scaled kernels decode both operands in software, the
    weight once for every tile of output rows; here the activation is decoded once, in a pass that
    reads and writes it once, and the weight-only path decodes the weight as its plan does."""

    __slots__ = ("inner", "fake_quant")

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, rounding: str | None):
        """``packed``: the layer's weight, prepacked; the activation is quantized to the same format
        (MX scales rounded by ``rounding``, "rceil" or "floor")."""
        self.inner = WeightOnlyRunner(packed, bias)
        # The activation's decode scale (NVFP4) multiplies the weight's factor on the device.
        self.fake_quant = FakeQuant(packed.fmt, rounding, packed.constants[0:1])

    def __call__(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d (M, K) contiguous float -> (M, N) in x2d's dtype."""
        if x2d.shape[0] == 0:
            return torch.empty((0, self.inner.n), dtype=x2d.dtype, device=x2d.device)
        stream = stream_handle(x2d.device)
        xq, alpha = self.fake_quant.run(x2d, stream)
        return self.inner(xq, alpha, out_dtype=x2d.dtype)


#: Runners kept per weight (and bias) for eager calls.
_RUNNERS_PER_WEIGHT = 4


def runner_for(packed: PackedWeight, bias: torch.Tensor | None, bias32: torch.Tensor | None = None
               ) -> WeightOnlyRunner:
    """The weight's ``WeightOnlyRunner`` with ``bias``, built once and kept on the PackedWeight (the
    launches it prepares per batch size live as long as the weight). ``bias32``: ``bias`` as checked
    fp32, if already made. A bias changed in place is seen: its version counter is part of the key."""
    runners = packed.__dict__.get("_runners")
    if runners is None:
        runners = {}
        object.__setattr__(packed, "_runners", runners)  # a cache, not part of the frozen value
    key = None if bias is None else (id(bias), bias._version, bias.data_ptr())
    runner = runners.get(key)
    if runner is None:
        if len(runners) >= _RUNNERS_PER_WEIGHT:
            runners.clear()
        runner = runners[key] = WeightOnlyRunner(packed, bias if bias32 is None else bias32)
        runner.bias_source = None if bias is None else (bias, bias._version)
    return runner


def run_weight_only(x2d, words, scale_t, constants, fmt_name: str, in_features: int, bias, alpha,
                    alpha_host: float = 1.0, out_dtype: torch.dtype | None = None, normal_scales: bool = False):
    """What ``torch.ops.tilemm.weight_only_linear`` runs on checked tensors."""
    if x2d.device.type != "cuda":
        return reference_weight_only(x2d, words, scale_t, constants, fmt_name, in_features, bias, alpha,
                                     out_dtype)
    family(x2d.device)  # raises UnsupportedGPUError below sm_90
    fmt = FORMATS[fmt_name]
    packed = PackedWeight(fmt=fmt, words=words, scale_t=scale_t, constants=constants, exponent=0,
                          in_features=in_features, alpha_host=alpha_host, normal_scales=normal_scales)
    # A runner per call that keeps nothing of its own: under torch.compile's CUDA graphs
    # (mode="reduce-overhead") the call allocates only its output and launches one kernel (two where
    # the large-M plan splits K in the fused kernel; a missing bias and a K split's workspace are
    # persistent buffers shared per device / stream, ``weight_only_kernels.zero_bias`` / ``workspace``),
    # as long as the scale rows start on 16-byte boundaries, as ``prepack`` lays them out (else each
    # call also copies them to padded rows: ``aligned_scale_t``).
    runner = WeightOnlyRunner(packed, bias, keep_workspace=False)
    return runner(x2d.contiguous(), None if alpha is None else alpha.reshape(1), out_dtype=out_dtype)


@torch.library.custom_op("tilemm::weight_only_linear", mutates_args=())
def _weight_only_linear_op(x: Tensor, words: Tensor, scale_t: Tensor, constants: Tensor, format: str,
                       in_features: int, bias: Optional[Tensor] = None,
                       alpha: Optional[Tensor] = None, alpha_host: float = 1.0,
                       out_dtype: Optional[torch.dtype] = None, normal_scales: bool = False) -> Tensor:
    """x (M, K) float times a prepacked (N, K) weight (``tilemm.packed.PackedWeight``'s tensors);
    ``alpha`` replaces constants[0] (2^E * decode scale) in the epilogue when given; ``alpha_host`` is
    constants[0] as a float (for the large-M GEMM, which takes a host scalar); ``out_dtype`` None is
    x's dtype; ``normal_scales`` is the PackedWeight's (NVFP4 scale bytes all normal, as ``prepack``
    found them; the kernels trust it)."""
    return run_weight_only(x, words, scale_t, constants, format, in_features, bias, alpha,
                           alpha_host, out_dtype, normal_scales)


@_weight_only_linear_op.register_fake
def _(x, words, scale_t, constants, format, in_features, bias=None, alpha=None, alpha_host=1.0,
      out_dtype=None, normal_scales=False):
    return x.new_empty((x.shape[0], words.shape[0]), dtype=out_dtype or x.dtype)


def _eager_gpu(x) -> bool:
    """Whether a checked call may skip the operator dispatcher: an eager call on a plain CUDA tensor."""
    return type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling()


def weight_only_linear(x: torch.Tensor, packed: PackedWeight, *, bias=None, alpha=None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ dequantize(w).T (* alpha) + bias`` for a float x (..., K) and a prepacked (N, K) weight.

    The result has shape (..., N) and ``out_dtype`` (bf16, fp16 or fp32; None, the default: x's
    dtype), rounded once from the fp32 accumulator. It equals an fp32-accumulated product of x with the
    exactly dequantized weight up to the order of the fp32 additions (NVFP4: the decode scale is applied
    to the fp32 sum, as in ``nvfp4_matmul``'s alpha).
    """
    fn = "linear"
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"{fn}: w must be a PackedWeight here, got {type(packed).__name__}")
    n, k = packed.shape
    _check_x(fn, x, k)
    if x.device != packed.device:
        raise ValueError(f"{fn}: x is on {x.device} but the weight is on {packed.device}")
    if out_dtype is not None:
        check_out_dtype(fn, out_dtype)
    bias32 = check_bias(fn, bias, n, x.device)
    alpha32 = None if alpha is None else as_fp32_scalar(fn, "alpha", alpha, x.device) * packed.constants[0]
    rows = x.reshape(-1, k)
    if _eager_gpu(x):
        # An eager call: the weight's cached runner (the operator's work without the dispatcher, the
        # weight's launch plans kept between calls).
        family(x.device)  # raises UnsupportedGPUError below sm_90
        runner = runner_for(packed, bias, bias32)
        out = runner(rows if rows.is_contiguous() else rows.contiguous(),
                     None if alpha32 is None else alpha32.reshape(1), out_dtype=out_dtype)
        return out.reshape(*x.shape[:-1], n)
    out = _weight_only_linear_op(rows, packed.words, packed.scale_t, packed.constants,
                                              packed.fmt.name, k, bias32, alpha32, packed.alpha_host,
                                              out_dtype, packed.normal_scales)
    return out.reshape(*x.shape[:-1], n)
