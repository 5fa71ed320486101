"""``tilemm.nn.Linear``: an nn.Linear whose weight is stored quantized, and ``quantize_model``.

``Linear.from_float(linear, format)`` quantizes a ``torch.nn.Linear``'s weight once ("mxfp8", "mxfp4",
"nvfp4" or "fp8"); ``forward`` quantizes the activations on the fly to the same format and runs
``tilemm.linear``: ``y = dequantize(q(x)) @ dequantize(W).T + b``, accumulated in fp32 and returned in
x's dtype (float32, bfloat16 or float16), for x of any leading dimensions. ``weight_only=True`` keeps
x in its own precision: mxfp8, mxfp4 and nvfp4 weights are stored prepacked (``tilemm.prepack``) for
the fused weight-only kernel (``y = x @ dequantize(W).T + b``, fp32 accumulation, one launch per
eager call below the large-M plan's K split and decode designs); fp8 weights are dequantized on every call and multiplied with ``F.linear``.

The quantized weight, its scales, NVFP4's ``global_scale`` and the bias are buffers: ``state_dict`` /
``load_state_dict`` round-trip them bit for bit (a weight-only layer holds only the prepacked form,
unpacked on the way out and prepacked on the way in); ``Module.to(dtype)``, ``.half()`` and
``.bfloat16()`` move them between devices but never cast their encodings (the bias does follow).
Inference only: no gradient flows through the quantized matmul.

On Hopper, a block-scaled layer called eagerly on CUDA, at any number of rows, runs
``weight_only.QuantizedActivationRunner``: one kernel writes ``dequantize(q(x))`` as bf16 (exactly the
activation the matmul reads; NVFP4's decode scale goes to the epilogue), the weight-only path
multiplies it with a prepacked copy of the weight (made on the first such call: twice the layer's
weight memory), with the weight-only plan of that many rows (the small-M kernels, the fused large-M
kernel, or decode + cuBLAS). Hopper has no block-scaled tensor cores, so its block-scaled matmul
decodes both operands in software for every output tile, which this avoids. Same result up to the
order of the fp32 additions; ``torch.compile`` traces the block-scaled path, so compiled and eager
calls agree to docs/numerics.md's matmul tolerance.

``quantize_model(model, format)`` swaps every ``torch.nn.Linear`` of a model for this class in place.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

import swizzle as _swizzle

from . import conventions as _conventions
from . import matmul as _matmul
from ._arch import Family, family
from . import packed as _packed
from . import quantize as _quantize
from . import kernels as _kernels
from . import weight_only as _weight_only
from .kernels import _common as _kernels_common
from .kernels import quantize_kernels as _quantize_kernels
from .kernels._large import LIMIT as _INT32_LIMIT
from .formats import FP8_BLOCK, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Granularity
from .numerics import ceil_div
from .moe import MoEExperts, check_silu_experts, experts_activation

__all__ = ["Linear", "quantize_model", "FORMATS"]

FORMATS = ("mxfp8", "mxfp4", "nvfp4", "fp8")
#: The granularities of an fp8 layer's weight (activations: ``_Options.activation_granularity``).
_WEIGHT_GRANULARITIES = (Granularity.ROW, Granularity.TENSOR, Granularity.BLOCK_128X128)
_BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}  # elements per scale along K (in_features)
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_QUANTIZED_BUFFERS = ("weight", "weight_scale", "weight_global_scale")
# Buffers of a weight-only layer whose encodings a dtype cast must not touch (see Linear._apply).
_ENCODED_BUFFERS = _QUANTIZED_BUFFERS + ("weight_constants",)
# (format, elem_dtype) -> the weight's format descriptor, for the prepacked (weight-only) layouts.
_FORMAT_OF = {("mxfp8", torch.float8_e4m3fn): MXFP8_E4M3, ("mxfp8", torch.float8_e5m2): MXFP8_E5M2,
              ("mxfp4", None): MXFP4, ("nvfp4", None): NVFP4}
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Options:
    """Checked options of one quantized Linear (the keywords of ``Linear.from_float``)."""

    def __init__(self, fn, format, *, swizzle, weight_only, granularity, elem_dtype, rounding):
        if not isinstance(format, str):
            raise TypeError(f"{fn}: format must be a str, one of {', '.join(map(repr, FORMATS))}; "
                            f"got {type(format).__name__}")
        if format not in FORMATS:
            raise ValueError(f"{fn}: format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")
        if not isinstance(weight_only, bool):
            raise TypeError(f"{fn}: weight_only must be True or False, got {weight_only!r}")
        is_fp8, is_mx = format == "fp8", format in ("mxfp8", "mxfp4")
        if swizzle is None:
            swizzle = not is_fp8 and not weight_only  # weight-only keeps logical scales (prepacked)
        elif not isinstance(swizzle, bool):
            raise TypeError(f"{fn}: swizzle must be True, False or None, got {swizzle!r}")
        elif swizzle and is_fp8:
            raise ValueError(f"{fn}: swizzle=True applies to the block-scaled formats (mxfp8, mxfp4, "
                             f"nvfp4); fp8's scales have no swizzled layout")
        fp8_granularity = None
        if granularity is None:
            fp8_granularity = Granularity.ROW if is_fp8 else None
        elif not is_fp8:
            raise ValueError(f"{fn}: granularity applies to format 'fp8' only, got granularity="
                             f"{granularity!r} with format {format!r}")
        else:
            try:
                fp8_granularity = Granularity.parse(granularity, fn)
            except ValueError:
                fp8_granularity = None
            if fp8_granularity not in _WEIGHT_GRANULARITIES:
                raise ValueError(f"{fn}: fp8 weight granularity must be 'row', 'tensor' or (128, 128), "
                                 f"got {granularity!r}")
        if elem_dtype is None:
            elem_dtype = torch.float8_e4m3fn if format in ("mxfp8", "fp8") else None
        elif format not in ("mxfp8", "fp8"):
            raise ValueError(f"{fn}: elem_dtype applies to formats 'mxfp8' and 'fp8' only, got "
                             f"elem_dtype={elem_dtype!r} with format {format!r}")
        elif elem_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"{fn}: elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                            f"got {elem_dtype!r}")
        elif elem_dtype == torch.float8_e5m2 and fp8_granularity is Granularity.BLOCK_128X128:
            raise ValueError(f"{fn}: fp8 (128, 128) blocks are defined for float8_e4m3fn, got "
                             f"elem_dtype=torch.float8_e5m2")
        if rounding is None:
            rounding = "rceil" if is_mx else None
        elif not is_mx:
            raise ValueError(f"{fn}: rounding applies to formats 'mxfp8' and 'mxfp4' only, got "
                             f"rounding={rounding!r} with format {format!r}")
        elif rounding not in _quantize.ROUNDING_MODES:
            raise ValueError(f"{fn}: rounding must be 'rceil' or 'floor', got {rounding!r}")
        self.format, self.swizzle, self.weight_only = format, swizzle, weight_only
        self.elem_dtype, self.rounding = elem_dtype, rounding
        # fp8: the weight's granularity, and the keyword that spells it (messages, as_kwargs)
        self.fp8_granularity = fp8_granularity
        self.granularity = None if fp8_granularity is None else fp8_granularity.argument

    @property
    def packed(self) -> bool:
        """Weight-only with a block-scaled format: the weight is stored prepacked for the fused kernel."""
        return self.weight_only and self.format != "fp8"

    @property
    def k_multiple(self) -> int:
        """in_features must be a multiple of this: the block size along K."""
        if self.format == "fp8":
            return FP8_BLOCK if self.fp8_granularity.is_block else 1
        return _BLOCK[self.format]

    def describe(self) -> str:
        """``format='fp8', granularity='row'``: the options that set the storage, for messages."""
        parts = [f"format={self.format!r}"]
        if self.elem_dtype is not None and self.elem_dtype != torch.float8_e4m3fn:
            parts.append(f"elem_dtype={self.elem_dtype}")
        if self.format == "fp8":
            parts.append(f"granularity={self.granularity!r}")
        if self.rounding not in (None, "rceil"):
            parts.append(f"rounding={self.rounding!r}")
        if self.format != "fp8":
            parts.append(f"swizzle={self.swizzle}")
        return ", ".join(parts)

    def as_kwargs(self) -> dict:
        return dict(swizzle=self.swizzle, weight_only=self.weight_only, granularity=self.granularity,
                    elem_dtype=self.elem_dtype, rounding=self.rounding)

    def quantize_weight(self, w: torch.Tensor):
        return self._quantize(w, weight=True)

    def quantize_activation(self, x: torch.Tensor):
        return self._quantize(x, weight=False)

    def _quantize(self, t, weight):
        if self.format == "mxfp8":
            return _quantize.quantize_mxfp8(t, elem_dtype=self.elem_dtype, rounding=self.rounding,
                                            swizzle=self.swizzle)
        if self.format == "mxfp4":
            return _quantize.quantize_mxfp4(t, rounding=self.rounding, swizzle=self.swizzle)
        if self.format == "nvfp4":
            return _quantize.quantize_nvfp4(t, swizzle=self.swizzle)
        granularity = self.granularity if weight else self.activation_granularity
        return _quantize.quantize_fp8(t, granularity=granularity, elem_dtype=self.elem_dtype)

    @property
    def activation_granularity(self):
        """fp8: how activations are quantized. Per-row weights pair with per-row activations,
        per-tensor with per-tensor, and 128x128 weight blocks with 1x128 activation blocks (DeepSeek
        style)."""
        if self.fp8_granularity is Granularity.BLOCK_128X128:
            return Granularity.BLOCK_1X128.argument
        return self.granularity


_QUANTIZED_KIND = {"mxfp8": _quantize.MXFP8Tensor, "mxfp4": _quantize.MXFP4Tensor, "fp8": _quantize.FP8Tensor}

INFERENCE_ONLY = ("tilemm.nn.Linear is for inference only: its weight is quantized (it has no gradient) "
                  "and its kernels have no backward, so no gradient flows through it to its input. Run "
                  "inference under torch.no_grad() or torch.inference_mode(); to train, use the float "
                  "torch.nn.Linear")


class _InferenceOnly(torch.autograd.Function):
    """Passes a layer's output through; its backward raises :data:`INFERENCE_ONLY`."""

    @staticmethod
    def forward(ctx, x, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(INFERENCE_ONLY)


class Linear(torch.nn.Module):
    """``torch.nn.Linear`` with its weight stored in a tilemm format; see the module docstring.

    Build one with :meth:`from_float`. The constructor makes a module of the same layout with a
    zero weight, to ``load_state_dict`` into: ``Linear(in_features, out_features, bias, format=...)``
    with the same keywords as the saved module.

    Buffers: ``weight`` (out_features, in_features) (or in_features / 2 packed bytes for mxfp4 and
    nvfp4), ``weight_scale`` (logical or 32x4x4 swizzled), ``weight_global_scale`` (nvfp4 only, 0-d
    fp32) and ``bias`` (out_features,) or None.
    """

    #: Set by ``_set_packed`` (``PackedWeight.normal_scales``); a class default for layers pickled before it.
    _normal_scales = False
    #: The prepacked layout's version (``tilemm.packed.LAYOUT_VERSION``) of the packed buffers; a class
    #: default for layers pickled before version 3, whose NVFP4 scales ``packed_weight`` turns row-major.
    _packed_version = 2

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, format: str = "mxfp8",
                 swizzle: bool | None = None, weight_only: bool = False, granularity=None,
                 elem_dtype: torch.dtype | None = None, rounding: str | None = None,
                 device=None, bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        fn = "tilemm.nn.Linear"
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}")
        self._options = _Options(fn, format, swizzle=swizzle, weight_only=weight_only,
                                 granularity=granularity, elem_dtype=elem_dtype, rounding=rounding)
        if in_features % self._options.k_multiple:
            raise ValueError(f"{fn}: in_features must be a multiple of {self._options.k_multiple} for "
                             f"{self._describe_format()}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        # The buffers' shapes and dtypes are those of a quantized (out, in) weight: quantize one on
        # the meta device (the operators' fake implementations) and allocate zeros like it.
        meta = self._options.quantize_weight(torch.empty(out_features, in_features, device="meta"))
        self._runner = None
        self._bias32 = None
        self._exponent = 0
        self._alpha_host = 1.0
        self._normal_scales = False
        self._packed_version = _packed.LAYOUT_VERSION
        if self._options.packed:
            # Weight-only: the weight lives only in the prepacked layout (non-persistent buffers);
            # state_dict shows the interchange form (see _packed_state_dict / _load_from_state_dict).
            layout = _packed.layout_of(_FORMAT_OF[(format, self._options.elem_dtype)])
            words = ceil_div(in_features, layout.tile_k) * layout.words_per_tile
            self.register_buffer("weight_packed", torch.zeros(out_features, words, dtype=torch.int32,
                                                              device=device), persistent=False)
            scale_shape = (out_features, in_features // layout.block)  # PackedWeight.scale_t
            self.register_buffer("weight_scale_packed",
                                 torch.zeros(scale_shape if layout.scale_rows else scale_shape[::-1],
                                             dtype=torch.uint8, device=device), persistent=False)
            self.register_buffer("weight_constants", torch.tensor([1.0, 2.0 ** layout.offset],
                                                                  device=device), persistent=False)
            self.register_buffer("weight_nan_scale", None, persistent=False)
            if format == "nvfp4":
                self.register_buffer("weight_global_scale", torch.ones((), device=device))
            self._register_state_dict_hook(_packed_state_dict)
        else:
            for name, t in zip(_QUANTIZED_BUFFERS, meta):
                zeros = torch.zeros(t.shape, dtype=_SAME_SIZE_INT[t.element_size()], device=device)
                self.register_buffer(name, zeros.view(t.dtype))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device)
                             if bias else None)

    # ---------------------------------------------------------------------------------------------

    @classmethod
    def from_float(cls, linear: torch.nn.Linear, format: str, *, swizzle: bool | None = None,
                   weight_only: bool = False, granularity=None, elem_dtype: torch.dtype | None = None,
                   rounding: str | None = None) -> "Linear":
        """Quantize ``linear``'s weight (on its device) into a new :class:`Linear`.

        Args:
            linear: a ``torch.nn.Linear`` with a float32, bfloat16 or float16 weight (float64 is
                converted to float32 first). Its bias is kept as it is.
            format: ``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"`` or ``"fp8"``.
            swizzle: store the weight scale in the 32x4x4 layout and quantize activations likewise;
                default True for the block-scaled formats (False with ``weight_only``, which only
                stores its weight prepacked). fp8 has no swizzled layout.
            weight_only: keep activations unquantized: the fused weight-only kernel for mxfp8, mxfp4
                and nvfp4 (the weight stored prepacked); fp8 dequantizes its weight on every call.
            granularity: fp8 only: ``"row"`` (default: one scale per output channel, activations per
                row), ``"tensor"`` (activations per tensor) or ``(128, 128)`` blocks (activations in
                1x128 blocks; in_features a multiple of 128).
            elem_dtype: mxfp8 and fp8: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
            rounding: mxfp8 and mxfp4: e8m0 scale rounding, ``"rceil"`` (default) or ``"floor"``.
        """
        fn = "tilemm.nn.Linear.from_float"
        if isinstance(linear, Linear):
            raise TypeError(f"{fn}: linear is already a tilemm.nn.Linear ({linear._describe_format()}); "
                            f"pass the float torch.nn.Linear, or re-quantize a model with "
                            f"tilemm.quantize_model(model, format, requantize=True)")
        if not isinstance(linear, torch.nn.Linear):
            t = type(linear)
            raise TypeError(f"{fn}: linear must be a torch.nn.Linear, got {t.__module__}.{t.__qualname__}")
        options = _Options(fn, format, swizzle=swizzle, weight_only=weight_only, granularity=granularity,
                           elem_dtype=elem_dtype, rounding=rounding)
        if linear.in_features % options.k_multiple:
            raise ValueError(f"{fn}: in_features must be a multiple of {options.k_multiple} for "
                             f"{options.describe()}, got {linear.in_features}")
        weight = linear.weight.detach()
        if weight.dtype not in _ACTIVATION_DTYPES:
            weight = weight.to(torch.float32)
        bias = linear.bias
        module = cls(linear.in_features, linear.out_features, bias is not None, format=format,
                     device=weight.device, bias_dtype=torch.float32 if bias is None else bias.dtype,
                     **options.as_kwargs())
        w_q = options.quantize_weight(weight)
        if options.packed:
            module._set_packed(_packed.prepack(w_q))
        else:
            for name, t in zip(_QUANTIZED_BUFFERS, w_q):
                setattr(module, name, t)
        if bias is not None:
            module.bias = bias.detach().clone()
        return module

    @classmethod
    def from_quantized(cls, weight, *, bias: torch.Tensor | None = None, convention: str | None = None,
                       weight_only: bool = False, swizzle: bool | None = None, rounding: str | None = None,
                       **convention_options) -> "Linear":
        """A :class:`Linear` around an already-quantized weight, without dequantizing it.

        Args:
            weight: a tilemm ``MXFP8Tensor`` / ``MXFP4Tensor`` / ``NVFP4Tensor`` / ``FP8Tensor`` of a 2-D
                (out_features, in_features) weight, or, with ``convention``, one layer of a checkpoint
                written by another tool (see ``tilemm.conventions.to_tilemm``).
            bias: (out_features,) or None; kept as it is.
            convention: ``None`` (a tilemm tensor), ``"compressed-tensors"`` (with ``format=``),
                ``"modelopt"``, ``"gpt-oss"`` or ``"torchao"``; ``convention_options`` go to it.
            weight_only, swizzle, rounding: as for :meth:`from_float` (rounding is the activations'
                e8m0 rounding). The format, FP8 element dtype and granularity are the weight's own.

        The data and scale bytes become the buffers as they are (views of ``weight``'s tensors);
        only a scale whose layout differs from ``swizzle`` is re-laid out.
        """
        fn = "tilemm.nn.Linear.from_quantized"
        q = _conventions.to_tilemm(weight, convention, **convention_options)
        format, storage = _conventions.linear_options(q)
        options = _Options(fn, format, swizzle=swizzle, weight_only=weight_only, rounding=rounding,
                           granularity=storage.get("granularity"), elem_dtype=storage.get("elem_dtype"))
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != q.data.shape[:1]):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"{fn}: bias must be a ({q.data.shape[0]},) tensor or None, got {got}")
        in_features = q.data.shape[1] * (2 if format in ("mxfp4", "nvfp4") else 1)
        module = cls(in_features, q.data.shape[0], bias is not None, format=format, device="meta",
                     bias_dtype=torch.float32 if bias is None else bias.dtype, **options.as_kwargs())
        if options.packed:  # weight-only: the prepacked layout, built from the logical scale
            module._set_packed(_packed.prepack(type(q)(q.data, _conventions.scale_for_layout(q, False), *q[2:])))
            module.bias = None if bias is None else bias.detach()
            return module
        fields = (q.data, _conventions.scale_for_layout(q, options.swizzle), *q[2:])
        for name, t in zip(_QUANTIZED_BUFFERS, fields):
            expected = module._buffers[name]
            if t.dtype != expected.dtype or t.shape != expected.shape:
                raise ValueError(f"{fn}: {name} must be {expected.dtype} of shape {tuple(expected.shape)} "
                                 f"for {options.describe()}, got {t.dtype} of shape {tuple(t.shape)}")
            setattr(module, name, t)
        module.bias = None if bias is None else bias.detach()
        return module

    # ---------------------------------------------------------------------------------------------

    @property
    def format(self) -> str:
        return self._options.format

    @property
    def weight_only(self) -> bool:
        return self._options.weight_only

    def quantized_weight(self):
        """The weight as the quantizer returned it (``MXFP8Tensor``, ..., ``FP8Tensor``)."""
        if self._options.packed:
            w_q = _packed.unpack(self.packed_weight())
            if self._options.swizzle:
                w_q = w_q._replace(scale=_swizzle.swizzle_32_4_4(w_q.scale))
            return w_q
        buffers = self._buffers
        if self._options.format == "nvfp4":
            return _quantize.NVFP4Tensor(buffers["weight"], buffers["weight_scale"], buffers["weight_global_scale"])
        return _QUANTIZED_KIND[self._options.format](buffers["weight"], buffers["weight_scale"])

    def packed_weight(self) -> "_packed.PackedWeight":
        """The weight-only layout (``weight_only=True`` with mxfp8, mxfp4 or nvfp4) as a PackedWeight."""
        if not self._options.packed:
            raise ValueError(f"tilemm.nn.Linear.packed_weight: this layer ({self._describe_format()}, "
                             f"weight_only={self.weight_only}) stores no prepacked weight")
        fmt = _FORMAT_OF[(self.format, self._options.elem_dtype)]
        if self._packed_version < 3 and _packed.layout_of(fmt).scale_rows:  # pickled before row-major scales
            self.weight_scale_packed = _packed.aligned_scale_t(self.weight_scale_packed.t().contiguous())
            self._packed_version = _packed.LAYOUT_VERSION
        return _packed.PackedWeight(fmt=fmt, words=self.weight_packed, scale_t=self.weight_scale_packed,
                                    constants=self.weight_constants, exponent=self._exponent,
                                    in_features=self.in_features,
                                    global_scale=self._buffers.get("weight_global_scale"),
                                    nan_scale=self.weight_nan_scale, alpha_host=self._alpha_host,
                                    normal_scales=self._normal_scales)

    def _set_packed(self, packed: "_packed.PackedWeight") -> None:
        self.weight_packed = packed.words
        self.weight_scale_packed = packed.scale_t
        self.weight_constants = packed.constants
        self.weight_nan_scale = packed.nan_scale
        if packed.global_scale is not None:
            self.weight_global_scale = packed.global_scale
        self._exponent = packed.exponent
        self._alpha_host = packed.alpha_host
        self._normal_scales = packed.normal_scales
        self._packed_version = _packed.LAYOUT_VERSION
        self._runner = None

    def dequantize_weight(self) -> torch.Tensor:
        """The weight as float32 (out_features, in_features), exactly as the matmul reads it."""
        return self.quantized_weight().dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ dequantize(weight).T + bias``. Inference only: where x requires grad (in grad mode) the
        output carries a backward that raises ``RuntimeError`` saying so, so that ``loss.backward()``
        through the layer fails with that message rather than silently skipping it."""
        if getattr(x, "requires_grad", False) and torch.is_grad_enabled():
            with torch.no_grad():
                out = self._forward(x)
            return _InferenceOnly.apply(x, out)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._options.packed:
            return self._forward_weight_only(x)
        small = self._runner
        if type(small) is _PreparedFP8:
            if type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling():
                out = small(self, x)
                if out is not None:
                    return out
        elif (small is not None and type(x) is torch.Tensor and x.ndim == 2 and x.is_cuda
                and x.shape[1] == self.in_features and x.numel() < _INT32_LIMIT
                and x.dtype in _ACTIVATION_DTYPES and small.runner is not None
                and small.source == self._small_batch_key(x.device) and not torch.compiler.is_compiling()):
            # The common eager call, already checked by the conditions above.
            return small.runner(x if x.is_contiguous() else x.contiguous())
        self._check_input(x)
        rows = x if x.ndim == 2 else x.reshape(-1, self.in_features)
        if self.weight_only:
            # fp8 weight-only: no fused kernel; dequantize the weight (exact in fp32), round it once to
            # x's dtype and multiply there.
            bias = None if self.bias is None else self.bias.to(x.dtype)
            out = F.linear(rows, self.dequantize_weight().to(x.dtype), bias)
        else:
            # The runner's fake quant indexes x with int32 offsets: an activation of 2^31 elements or
            # more takes the block-scaled matmul, which launches per piece.
            runner = (self._small_batch_runner(x.device) if x.is_cuda and self.format != "fp8"
                      and rows.numel() < _INT32_LIMIT and not torch.compiler.is_compiling() else None)
            if runner is not None:
                out = runner(rows if rows.is_contiguous() else rows.contiguous())
            else:
                x_q, w_q, bias32 = self._options.quantize_activation(rows), self.quantized_weight(), self._fp32_bias()
                out = _matmul.linear(x_q, w_q, bias=bias32, out_dtype=x.dtype)
                if self.format == "fp8" and type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling():
                    self._prepare_fp8(x, rows, x_q, w_q, bias32)
        return out if x.ndim == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _prepare_fp8(self, x, rows, x_q, w_q, bias32) -> None:
        """After an eager CUDA call of an FP8 layer, checked and run by the full path: keep the two
        launches it made (the activation's quantize and the matmul, prepared in ``tilemm.kernels.PLANS``)
        for x's signature, so that a later call of that signature makes exactly them (``_PreparedFP8``)."""
        source = self._fp8_source()
        prepared = self._runner
        if type(prepared) is not _PreparedFP8 or prepared.source != source:
            prepared = self._runner = _PreparedFP8(source, self._source_tensors())
        quantize = _quantize.prepared_quantize_fp8(rows, self._options.activation_granularity,
                                                   self._options.elem_dtype)
        matmul = _matmul.prepared_linear(x_q, w_q, bias32, x.dtype)
        call = None
        if quantize is not None and matmul is not None:
            call = _FP8Call(quantize, matmul.bound(w_q.data, w_q.scale, bias32),
                            None if x.ndim == 2 else (*x.shape[:-1], self.out_features), self.in_features)
        prepared.remember((x.shape, x.stride(), x.dtype, x.device), call)

    def _fp8_source(self) -> tuple:
        """What an FP8 layer's prepared calls hold: the quantized buffers and the bias, each as its
        identity and version counter (in-place changes, ``load_state_dict``, bump it). Plain integers,
        so that comparing two never compares tensors; ``_PreparedFP8`` keeps the tensors alive, so an
        identity it holds cannot be reused by a new tensor."""
        buffers = self._buffers
        return _identities((buffers["weight"], buffers["weight_scale"], buffers["bias"]))

    def _fp32_bias(self):
        """The bias as the kernels add it, fp32 (the same values: bf16 and fp16 convert exactly),
        converted once per bias version rather than by a kernel on every call; None for none."""
        bias = self.bias
        if bias is None or bias.dtype == torch.float32 or torch.compiler.is_compiling():
            return bias
        cached = getattr(self, "_bias32", None)
        if cached is None or cached[0] is not bias or cached[1] != bias._version:
            cached = self._bias32 = (bias, bias._version, bias.to(torch.float32))
        return cached[2]

    def _small_batch_runner(self, device):
        """The two-launch path of an MXFP8 / MXFP4 / NVFP4 layer on Hopper
        (``weight_only.QuantizedActivationRunner``), built on first use from a prepacked copy of the
        weight and rebuilt when what ``_small_batch_key`` lists changes; None where it does not apply
        (another GPU family, or a weight that ``prepack`` refuses)."""
        key = self._small_batch_key(device)
        bias = self.bias
        runner = self._runner
        if runner is not None and runner.source == key:
            return runner.runner
        built = None
        if family(device) == Family.HOPPER and self.weight.device == device:
            try:
                packed = _packed.prepack(self.quantized_weight())
            except ValueError:  # e.g. an e5m2 weight holding Inf, which the weight-only kernel refuses
                packed = None
            if packed is not None:
                built = _weight_only.QuantizedActivationRunner(packed, bias, self._options.rounding)
        self._runner = _SmallBatch(built, key, self._source_tensors())
        return built

    def _small_batch_key(self, device) -> tuple:
        """What the small-batch runner is built from: the device and the quantized buffers and bias,
        each as its identity and version counter (in-place changes, ``load_state_dict``, bump it);
        integers only, as ``_fp8_source``, and ``_SmallBatch`` keeps the tensors alive."""
        return (device, *_identities(self._source_tensors()))

    def _source_tensors(self) -> tuple:
        """The buffers a prepared path is built from: weight, its scale, NVFP4's global scale (or
        None) and the bias (or None)."""
        buffers = self._buffers
        return buffers["weight"], buffers["weight_scale"], buffers.get("weight_global_scale"), buffers["bias"]

    def _forward_weight_only(self, x: torch.Tensor) -> torch.Tensor:
        """The fused weight-only kernel. Eager CUDA calls go straight to a cached WeightOnlyRunner (one
        or two kernel launches and the output allocation); torch.compile and CPU tensors go through
        ``torch.ops.tilemm.weight_only_linear``."""
        if (type(x) is not torch.Tensor or x.dtype not in _ACTIVATION_DTYPES or x.ndim == 0
                or x.shape[-1] != self.in_features):
            self._check_input(x)
        rows = x if x.ndim == 2 else x.reshape(-1, self.in_features)
        if x.is_cuda and not torch.compiler.is_compiling():
            runner = self._runner
            bias = self.bias
            if (runner is None or runner.packed.words is not self.weight_packed
                    or runner.device != x.device or (bias is not None and runner.bias_source != (
                        bias, bias._version))):
                runner = self._make_runner(x.device)
            out = runner(rows if rows.is_contiguous() else rows.contiguous())
        else:
            out = _weight_only.weight_only_linear(rows, self.packed_weight(), bias=self.bias)
        return out if x.ndim == 2 else out.view(*x.shape[:-1], self.out_features)

    def _make_runner(self, device):
        if self.weight_packed.device != device:
            raise ValueError(f"tilemm.nn.Linear: input is on {device} but the layer is on "
                             f"{self.weight_packed.device}")
        bias = self.bias
        runner = _weight_only.WeightOnlyRunner(self.packed_weight(), bias)
        runner.bias_source = None if bias is None else (bias, bias._version)
        self._runner = runner
        return runner

    def _check_input(self, x) -> None:
        fn = "tilemm.nn.Linear"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{fn}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _ACTIVATION_DTYPES:
            raise TypeError(f"{fn}: input dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                            f"got {x.dtype}")
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"{fn}: input must be (..., in_features) = (..., {self.in_features}), got "
                             f"shape {tuple(x.shape)}")

    # ---------------------------------------------------------------------------------------------

    def _describe_format(self) -> str:
        return self._options.describe()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self._describe_format()}, weight_only={self.weight_only}")

    def _apply(self, fn, recurse=True):
        # Module.to(dtype), .half() and .bfloat16() cast every floating-point tensor, which would turn
        # the FP8 / e8m0 / e4m3 codes and fp32 scales into other numbers. Same-size integer views are
        # only moved between devices, so the quantized buffers travel as those.
        dtypes = {}
        for name in _ENCODED_BUFFERS:
            t = self._buffers.get(name)
            if t is not None and t.is_floating_point():
                dtypes[name] = t.dtype
                self._buffers[name] = t.view(_SAME_SIZE_INT[t.element_size()])
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, dtype in dtypes.items():
                self._buffers[name] = self._buffers[name].view(dtype)
            if self._buffers.get("weight_scale_packed") is not None:  # a move made its rows contiguous
                self._buffers["weight_scale_packed"] = _packed.aligned_scale_t(self._buffers["weight_scale_packed"])
            # The cached runner holds device tensors (for a block-scaled layer, a prepacked copy of the
            # weight): drop it, so that moving the layer frees them; the next call rebuilds it.
            self._runner = None
            self._bias32 = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self._options.packed:
            self._load_packed(state_dict, prefix, strict, missing_keys, error_msgs)
        # load_state_dict copies into the existing buffers, converting dtypes: loading e5m2 codes into
        # an e4m3 module would silently re-encode them. Refuse a dtype that differs instead.
        for name in _QUANTIZED_BUFFERS:
            key, mine = prefix + name, self._buffers.get(name)
            if mine is not None and key in state_dict and state_dict[key].dtype != mine.dtype:
                error_msgs.append(f"{key}: the state dict holds {state_dict[key].dtype} but this "
                                  f"tilemm.nn.Linear ({self._describe_format()}) stores {mine.dtype}; "
                                  f"build it with the options of the saved module")
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


    def _load_packed(self, state_dict, prefix, strict, missing_keys, error_msgs) -> None:
        """Weight-only layers store the prepacked layout: prepack the interchange tensors of the state
        dict (``weight``, ``weight_scale``, ``weight_global_scale``) on this layer's device. The two
        keys are taken out of ``state_dict`` (load_state_dict's own copy) so that the base class does
        not report them as unexpected."""
        keys = (prefix + "weight", prefix + "weight_scale")
        if not all(k in state_dict for k in keys):
            if strict:
                missing_keys.extend(k for k in keys if k not in state_dict)
            return
        data, scale = (state_dict.pop(k) for k in keys)
        fmt = _FORMAT_OF[(self.format, self._options.elem_dtype)]
        if data.dtype != fmt.data_dtype or scale.dtype not in (fmt.scale_dtype, torch.uint8):
            error_msgs.append(f"{keys[0]}: the state dict holds {data.dtype} data with {scale.dtype} "
                              f"scales but this tilemm.nn.Linear ({self._describe_format()}) stores "
                              f"{fmt.data_dtype} with {fmt.scale_dtype}; build it with the options of the "
                              f"saved module")
            return
        device = self.weight_packed.device
        fields = [data.to(device), scale.view(fmt.scale_dtype).to(device)]
        if fmt.has_global_scale:
            fields.append(state_dict.get(prefix + "weight_global_scale", self.weight_global_scale).to(device))
        kind = {MXFP8_E4M3: _quantize.MXFP8Tensor, MXFP8_E5M2: _quantize.MXFP8Tensor,
                MXFP4: _quantize.MXFP4Tensor, NVFP4: _quantize.NVFP4Tensor}[fmt]
        expected = (self.out_features, fmt.data_k(self.in_features))
        if tuple(data.shape) != expected:
            error_msgs.append(f"{keys[0]}: expected shape {expected}, got {tuple(data.shape)}")
            return
        try:
            self._set_packed(_packed.prepack(kind(*fields)))
        except (TypeError, ValueError) as e:
            error_msgs.append(f"{keys[0]}: {e}")


def _identities(tensors) -> tuple:
    """Each tensor (or None) as (id, version): a key that compares as integers."""
    out = []
    for t in tensors:
        out += (-1, 0) if t is None else (id(t), t._version)
    return tuple(out)


class _SmallBatch:
    """A block-scaled layer's cached Hopper runner (``QuantizedActivationRunner``, or None) and the
    state it was built from (``source``: identities and versions; ``tensors``: those tensors, held so
    that their identities stay theirs)."""

    __slots__ = ("runner", "source", "tensors")

    def __init__(self, runner, source, tensors):
        self.runner, self.source, self.tensors = runner, source, tensors


class _PreparedFP8:
    """An FP8 layer's (both sides quantized) eager CUDA calls, prepared per signature of x (shape,
    strides, dtype, device), for the buffers and bias listed in ``source`` (``Linear._fp8_source``).
    A call of a signature seen before was checked by the full path then: it runs its ``_FP8Call``
    (None for a signature whose launches could not be kept: the full path serves it)."""

    __slots__ = ("source", "tensors", "calls")

    #: Signatures kept before the table starts over.
    MAX_CALLS = 16

    def __init__(self, source, tensors):
        self.source, self.tensors, self.calls = source, tensors, {}

    def remember(self, key, call) -> None:
        if len(self.calls) >= self.MAX_CALLS:
            self.calls.clear()
        self.calls[key] = call

    def __call__(self, layer, x):
        """The layer's output for x, or None where no prepared call holds (the full path then)."""
        call = self.calls.get((x.shape, x.stride(), x.dtype, x.device))
        if call is None or self.source != layer._fp8_source():
            return None
        return call(x)


class _FP8Call:
    """One signature of an FP8 layer's input, prepared: the activation's quantize launch
    (``tilemm.quantize.prepared_quantize_fp8``) and the matmul launch bound to the layer's weight and
    fp32 bias (``tilemm.matmul`` ``_Launch.bound``): the launches the full path makes for x, with the
    same arguments.

    Where the quantize is one launch (no buffers between launches) and every view of its two outputs
    keeps their dtype, the outputs, which only the matmul reads, are laid out in the shape the
    quantize kernel views them in (``_fuse``), in the stream's activation scratch
    (``quantize_kernels.activation_scratch``: the matmul's read precedes the next call's write in
    stream order), and both kernels' views of them are taken once per scratch buffer; inside a CUDA
    graph capture they are allocated fresh."""

    __slots__ = ("quantize", "matmul", "out_shape", "in_features", "fused", "scratch_elements", "bound")

    def __init__(self, quantize, matmul, out_shape, in_features):
        self.quantize, self.matmul = quantize, matmul
        self.out_shape, self.in_features = out_shape, in_features  # out_shape None: x is 2-D
        self.fused = _fuse(quantize, matmul)
        self.bound = None  # (scratch buffer, quantize arguments, the matmul's views): per scratch buffer
        if self.fused is not None:
            (data_shape, data_dtype), (scale_shape, scale_dtype) = self.fused[4]
            self.scratch_elements = ceil_div(self._scale_offset() + _numel(scale_shape) * scale_dtype.itemsize, 2)

    def _scale_offset(self) -> int:
        """Where the scale starts in the scratch bytes: after the data, 16-byte aligned."""
        data_shape, data_dtype = self.fused[4][0]
        return ceil_div(_numel(data_shape) * data_dtype.itemsize, 16) * 16

    def _carve(self, values: torch.Tensor) -> tuple:
        """(data, scale) as the quantize allocates them, in the scratch ``values`` (bf16, flat)."""
        (data_shape, data_dtype), (scale_shape, scale_dtype) = self.fused[4]
        raw = values.view(torch.uint8)
        start, size = self._scale_offset(), _numel(scale_shape) * scale_dtype.itemsize
        data = raw[:_numel(data_shape) * data_dtype.itemsize].view(data_dtype).view(data_shape)
        return data, raw[start:start + size].view(scale_dtype).view(scale_shape)

    def _bind(self, data: torch.Tensor, scale: torch.Tensor) -> tuple:
        """(the quantize's arguments with data and scale's views in place, the matmul's views of them)."""
        _, _, args, views, _, (a_spec, a_scale_spec) = self.fused
        tensors = (None, data, scale)
        args = args.copy()
        for i, j, spec in views:
            if j != 0:
                args[i] = tensors[j] if spec is None else _kernels.as_view(tensors[j], spec)
        return (args, data if a_spec is None else _kernels.as_view(data, a_spec),
                scale if a_scale_spec is None else _kernels.as_view(scale, a_scale_spec))

    def __call__(self, x):
        out_shape = self.out_shape
        rows = x if out_shape is None else x.reshape(-1, self.in_features)
        fused = self.fused
        if fused is None:
            q = self.quantize(rows)
            if q is None:  # another stream than the quantize launch holds for
                return None
            out = self.matmul(q[0], q[1])
            return out if out_shape is None else out.reshape(out_shape)
        quantize, matmul = self.quantize, self.matmul
        device = quantize.device
        stream = _kernels_common.stream_handle(device)
        if quantize.stream is not None and stream != quantize.stream:
            return None
        if rows.requires_grad:
            rows = rows.detach()
        grid, kernel, _, views, (data_alloc, scale_alloc), _ = fused
        if _quantize_kernels._capturing(device):  # fresh buffers, from the graph's pool
            bound = self._bind(torch.empty(data_alloc[0], dtype=data_alloc[1], device=device),
                               torch.empty(scale_alloc[0], dtype=scale_alloc[1], device=device))
        else:  # the stream's scratch (only the matmul below reads what the quantize writes)
            scratch = _quantize_kernels.activation_scratch(device, stream, self.scratch_elements)
            bound = self.bound
            if bound is None or bound[0] is not scratch.values:
                bound = self.bound = (scratch.values, *self._bind(*self._carve(scratch.values)))
            bound = bound[1:]
        args, a, a_scale = bound
        args = args.copy()
        for i, j, spec in views:
            if j == 0:
                args[i] = rows if spec is None else _kernels.as_view(rows, spec)
        _quantize_kernels.launch_on(stream, grid, kernel, tuple(args))
        launch = matmul.launch
        out = torch.empty(launch.out_shape if out_shape is None else out_shape, dtype=launch.out_dtype,
                          device=device)
        launch.prepared.launch(stream, a, a_scale, matmul.y, matmul.y_scale, out.view(launch.out3), launch.ones,
                               matmul.bias)
        return out


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class _NotFused(Exception):
    """A view ``_fuse`` cannot express on the fused allocation (a dtype change)."""


def _fuse(quantize, matmul):
    """``_FP8Call``'s one-step form of a quantize launch followed by a bound matmul launch, or None:
    (grid, kernel, args, views of (rows, data, scale), the (shape, dtype) data and scale are allocated
    as, the matmul's views of data and scale). Each view is (dtype None, shape, strides) of the
    allocation, or None for the allocation itself."""
    if len(quantize.launches) != 1 or quantize.buffers or len(quantize.outputs) != 2:
        return None
    grid, kernel, args, views = quantize.launches[0]
    first = {}  # output -> its first view, as (None, shape, strides)
    for _, j, spec in views:
        if j == 0:
            continue
        shape = quantize.outputs[j - 1][0]
        spec = (None, shape, _contiguous_strides(shape)) if spec is None else spec
        if callable(spec) or spec[0] is not None:
            return None
        first.setdefault(j, spec)
    allocs = []
    for j, (shape, dtype) in enumerate(quantize.outputs, start=1):
        view = first.get(j)
        if view is not None and view[2] == _contiguous_strides(view[1]) and _numel(view[1]) == _numel(shape):
            allocs.append((tuple(view[1]), dtype))
        else:
            allocs.append((tuple(shape), dtype))

    def relative(j, spec):
        shape = quantize.outputs[j - 1][0]
        spec = (None, tuple(shape), _contiguous_strides(shape)) if spec is None else spec
        if callable(spec) or spec[0] is not None:
            raise _NotFused
        alloc = allocs[j - 1][0]
        return None if (tuple(spec[1]), tuple(spec[2])) == (alloc, _contiguous_strides(alloc)) else spec

    try:
        fused_views = tuple((i, j, spec if j == 0 else relative(j, spec)) for i, j, spec in views)
        a_spec, a_scale_spec = (relative(j, spec) for j, spec in zip((1, 2), matmul.launch.specs[:2]))
    except _NotFused:
        return None
    return grid, kernel, args, fused_views, tuple(allocs), (a_spec, a_scale_spec)


def _packed_state_dict(module, state_dict, prefix, local_metadata):
    """State-dict hook of weight-only layers: the interchange tensors instead of the packed layout."""
    w_q = module.quantized_weight()
    state_dict[prefix + "weight"] = w_q.data
    state_dict[prefix + "weight_scale"] = w_q.scale


# --------------------------------------------------------------------------------------------------

def quantize_model(model: torch.nn.Module, format: str, *,
                   skip: Iterable[str] | Callable[[str, torch.nn.Module], bool] = (),
                   swizzle: bool | None = None, weight_only: bool = False, granularity=None,
                   elem_dtype: torch.dtype | None = None, rounding: str | None = None,
                   requantize: bool = False) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` in ``model`` with :class:`tilemm.nn.Linear`, in place.

    Args:
        model: any module. Only modules whose type is exactly ``torch.nn.Linear`` are replaced:
            subclasses (such as ``nn.MultiheadAttention``'s ``out_proj``, whose parent reads its
            ``.weight`` directly) are left alone. A Linear registered under several names (tied) is
            replaced everywhere by one quantized module.
        format: ``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"`` or ``"fp8"``.
        skip: module names to leave unquantized (a name also covers everything below it, e.g.
            ``"encoder.layer.0"``), or a predicate ``skip(name, module) -> bool``. Every name must
            exist in ``model``.
        swizzle, weight_only, granularity, elem_dtype, rounding: as for :meth:`Linear.from_float`.
        requantize: what to do with layers that are already :class:`tilemm.nn.Linear`. False (the
            default): raise ``ValueError`` naming them (quantizing a quantized model would otherwise
            keep their old format without a word). True: dequantize each such layer's weight (exact,
            fp32) and quantize it again in ``format`` (the error of both quantizations adds up; the
            bias is kept).

    With ``weight_only=True`` and mxfp4, nvfp4 or mxfp8, transformers' experts blocks are replaced
    too, by :class:`tilemm.moe.MoEExperts` (each expert's projections quantized along K, stacked;
    ``tilemm.moe_linear`` runs them): gpt-oss's (``GptOssExperts``, ``MoEExperts.from_gpt_oss``) and
    the SiLU-gated ones of Qwen3-MoE, Qwen2-MoE and Mixtral (``Qwen3MoeExperts``, ``Qwen2MoeExperts``,
    ``MixtralExperts``; ``MoEExperts.from_silu_experts``, which raises ValueError for another
    ``act_fn``: skip such a block with ``skip=``).

    Layers whose ``in_features`` is not a multiple of the format's block size (32 for mxfp8 / mxfp4,
    16 for nvfp4, 128 for fp8 (128, 128) blocks) stay unquantized; one ``UserWarning`` lists them.
    Every module is converted before any is swapped in, so an error leaves ``model`` unchanged.

    Returns:
        ``model`` (a bare ``torch.nn.Linear`` cannot be swapped in place: the quantized module is
        returned instead).
    """
    fn = "tilemm.quantize_model"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    options = _Options(fn, format, swizzle=swizzle, weight_only=weight_only, granularity=granularity,
                       elem_dtype=elem_dtype, rounding=rounding)
    if not isinstance(requantize, bool):
        raise TypeError(f"{fn}: requantize must be a bool, got {type(requantize).__name__}")
    is_skipped = _skip_predicate(fn, model, skip)
    quantized = [name for name, module in model.named_modules(remove_duplicate=False)
                 if isinstance(module, Linear) and not is_skipped(name, module)]
    if quantized and not requantize:
        raise ValueError(f"{fn}: model already holds {len(quantized)} tilemm.nn.Linear layer(s) "
                         f"({', '.join(repr(n) for n in quantized[:8])}{', ...' if len(quantized) > 8 else ''}"
                         f"); quantize the float model instead, skip them (skip=), or pass requantize=True "
                         f"to dequantize them and quantize again in {format!r}")
    if isinstance(model, Linear) and quantized:
        return Linear.from_float(_dequantized(model), format, **options.as_kwargs())
    if type(model) is torch.nn.Linear:
        if is_skipped("", model):
            return model
        return Linear.from_float(model, format, **options.as_kwargs())

    if options.packed:  # refuse experts blocks MoEExperts cannot compute before changing anything
        for name, module in model.named_modules():
            if name and _experts_to_swap(module) == "silu" and not is_skipped(name, module):
                check_silu_experts(f"{fn}: experts {name!r}", module)

    # Every module is converted first and swapped in only when all have been: an error on the way
    # leaves the model as it was.
    converted: dict[int, Linear] = {}
    misfits, swaps = [], []
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if isinstance(module, Linear) and name in quantized and id(module) not in converted:
            if module.in_features % options.k_multiple:
                misfits.append(f"{name} (in_features={module.in_features})")
                continue
            converted[id(module)] = Linear.from_float(_dequantized(module), format, **options.as_kwargs())
        activation = _experts_to_swap(module)
        if activation and options.packed and name and not is_skipped(name, module):
            # a transformers experts block (not nn.Linear layers): stacked packed experts (tilemm.moe).
            if id(module) not in converted:
                build = MoEExperts.from_gpt_oss if activation == "gpt-oss" else MoEExperts.from_silu_experts
                converted[id(module)] = build(module, format, quantizer=options.quantize_weight)
        if id(module) in converted and (isinstance(module, Linear) or activation):
            swaps.append((name, converted[id(module)]))
            continue
        if type(module) is not torch.nn.Linear or is_skipped(name, module):
            continue
        if module.in_features % options.k_multiple:
            misfits.append(f"{name} (in_features={module.in_features})")
            continue
        if id(module) not in converted:
            converted[id(module)] = Linear.from_float(module, format, **options.as_kwargs())
        swaps.append((name, converted[id(module)]))
    for name, new in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    if misfits:
        warnings.warn(f"{fn}: left {len(misfits)} torch.nn.Linear layer(s) unquantized because their "
                      f"in_features is not a multiple of {options.k_multiple} (the {format} block size): "
                      f"{', '.join(misfits)}", UserWarning, stacklevel=2)
    return model


def _dequantized(layer: Linear) -> torch.nn.Linear:
    """A torch.nn.Linear holding ``layer``'s exactly dequantized (fp32) weight and its bias."""
    w = layer.dequantize_weight()
    out = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
    if layer.bias is not None:
        out.bias = torch.nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
    return out


def _experts_to_swap(module: torch.nn.Module) -> str | None:
    """The gating of the ``MoEExperts`` that replaces a transformers experts block ("gpt-oss" or
    "silu", ``tilemm.moe.experts_activation``); None for any other module, a ``MoEExperts`` included."""
    return None if isinstance(module, MoEExperts) else experts_activation(module)


def _skip_predicate(fn: str, model: torch.nn.Module, skip) -> Callable[[str, torch.nn.Module], bool]:
    if callable(skip):
        return skip
    if isinstance(skip, str):
        skip = (skip,)
    try:
        names = tuple(skip)
    except TypeError:
        raise TypeError(f"{fn}: skip must be module names or a predicate (name, module) -> bool, got "
                        f"{type(skip).__name__}") from None
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{fn}: skip names must be str, got {bad[0]!r}")
    known = {name for name, _ in model.named_modules(remove_duplicate=False)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{fn}: skip names not found in the model: {', '.join(map(repr, unknown))}")
    return lambda name, module: any(name == n or name.startswith(n + ".") for n in names)
