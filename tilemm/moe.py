"""Mixture-of-experts layers with MXFP4 / NVFP4 / MXFP8 expert weights and bf16 / fp16 activations.

``moe_linear(x, w, topk_ids, bias=None)``: every token's product with each of its top-k experts,
``out[t, j] = x[t] @ dequantize(W[topk_ids[t, j]]).T (+ bias[topk_ids[t, j]])``, accumulated in fp32
and rounded once to x's dtype. ``w`` is a stacked expert weight, ``tilemm.prepack`` of an (E, N, K)
quantized tensor (or of a list of E (N, K) ones). It is the custom operator
``torch.ops.tilemm.moe_linear``, which ``torch.compile(fullgraph=True)`` traces as one op.

* On CUDA (Hopper, Blackwell): for a few tokens (``moe_kernels.plan`` chooses) one launch of the
  per-pair kernel, else one routing step, x's rows gathered into expert order and one grouped launch
  (``run_moe``; ``moe_kernels`` describes both). No host synchronisation and no allocation whose
  size depends on the routing, so a call can be captured in a CUDA graph.
* On the CPU: the same arithmetic in PyTorch (``reference_moe``), expert by expert.

Expert ids outside [0, E) are not checked by default (that would synchronise): their rows come out
NaN on the GPU and the CPU alike, and no weight is read for them; ``check_ids=True`` checks on the
host first and raises ValueError.

``MoEExperts`` is a transformers experts block on two stacked packed weights (gate_up, down) with one
of two gatings (``activation``): gpt-oss's (biases, clamped SwiGLU) or SiLU without bias (Qwen3-MoE,
Qwen2-MoE, Mixtral, which store gate / up as halves). Its gate_up rows are interleaved for both
(gate row j = row 2j, up row j = 2j + 1; ``interleave_gate_up`` permutes halves once), so each N tile
holds matching gate and up rows and either gating runs fused in the gate_up epilogue.
``tilemm.quantize_model(model, fmt, weight_only=True)`` swaps it in; ``tilemm.load_quantized`` fills
it from a checkpoint's quantized experts without building a bf16 expert.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from . import kernels as _kernels
from . import quantize as _quantize
from ._arch import family
from .formats import FORMATS
from .kernels import moe_kernels
from .kernels import _common as _kernels_common  # num_sms looked up per call: host_path.py substitutes it
from .packed import PackedWeight, layout_of, prepack, relayout_words
from .weight_only import reference_weight_only

__all__ = ["moe_linear", "reference_moe", "gpt_oss_glu", "silu_glu", "interleave_gate_up", "MoEExperts",
           "ACTIVATIONS"]

_X_DTYPES = (torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)


def reference_moe(x, words, scale_t, constants, fmt_name: str, in_features: int, topk_ids, bias):
    """The CPU path (and the oracle of the GPU tests): per expert, ``tilemm.weight_only``'s reference
    (fp32 products and sums, one rounding); NaN rows for ids outside [0, E)."""
    tokens, top_k = topk_ids.shape
    num_experts, n = words.shape[0], words.shape[1]
    flat = topk_ids.reshape(-1).to(torch.int64)
    out = torch.full((tokens * top_k, n), float("nan"), dtype=x.dtype, device=x.device)
    rows_x = x.repeat_interleave(top_k, dim=0) if top_k > 1 else x
    # A single weight's scale orientation (stacked experts' are transposed in every format).
    rows_major = layout_of(FORMATS[fmt_name]).scale_rows
    for e in torch.unique(flat).tolist():
        if not 0 <= e < num_experts:
            continue
        rows = (flat == e).nonzero().reshape(-1)
        scale_e = scale_t[e].t() if rows_major else scale_t[e]
        out[rows] = reference_weight_only(rows_x[rows], words[e], scale_e, constants[e], fmt_name,
                                          in_features, None if bias is None else bias[e], None)
    return out.reshape(tokens, top_k, n)


def run_moe(x, words, scale_t, constants, fmt_name: str, in_features: int, topk_ids, bias):
    """What ``torch.ops.tilemm.moe_linear`` runs on checked tensors. On CUDA: one cuTile launch of
    the per-pair kernel, no routing, for a few tokens (one always; ``moe_kernels.plan``). Else: one
    routing step (one small cuTile launch for decode-sized batches, else fixed-size PyTorch operations), x's rows gathered into
    expert order, and one cuTile launch, in which each expert's weight tile is read once per chunk of
    its tokens. Elsewhere ``reference_moe``."""
    if x.device.type != "cuda":
        return reference_moe(x, words, scale_t, constants, fmt_name, in_features, topk_ids, bias)
    family(x.device)  # raises UnsupportedGPUError below sm_90
    return _MoELinearLaunch(x, words, scale_t, fmt_name, topk_ids)(x, words, scale_t, constants, topk_ids, bias)


class _MoELinearLaunch:
    """``run_moe``'s GPU path for one signature, planned once: the ``moe_kernels.plan`` (design and
    its block or tile), the weight layout and the output's shape. ``__call__`` allocates the output and launches; it is
    what a repeated eager ``moe_linear`` call runs (``tilemm.kernels.PLANS``), without the checks and
    the operator's dispatcher."""

    __slots__ = ("plan", "layout", "tokens", "top_k", "n", "dtype", "device")

    def __init__(self, x, words, scale_t, fmt_name: str, topk_ids):
        self.tokens, self.top_k = topk_ids.shape
        num_experts, self.n = words.shape[0], words.shape[1]
        self.dtype, self.device = x.dtype, x.device
        self.layout = layout_of(FORMATS[fmt_name])
        self.plan = moe_kernels.plan(self.tokens, self.top_k, num_experts, self.n, x.shape[1], self.layout,
                                     moe_kernels.expert_bytes(words, scale_t))

    def __call__(self, x, words, scale_t, constants, topk_ids, bias):
        tokens, top_k = self.tokens, self.top_k
        out = torch.empty((tokens * top_k, self.n), dtype=self.dtype, device=self.device)
        if out.numel() and self.plan.design == "pairs":
            moe_kernels.launch_pairs(x.contiguous(), words, scale_t, constants, bias, topk_ids.reshape(-1), out,
                                     self.layout, moe_plan=self.plan)
        elif out.numel():
            routed = moe_kernels.route(topk_ids, words.shape[0])
            moe_kernels.launch(moe_kernels.sort_rows(x.contiguous(), routed, top_k), words, scale_t, constants,
                               bias, routed, tokens, out, self.layout, moe_plan=self.plan)
        return out.reshape(tokens, top_k, self.n)


def _sig(t) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _eager_key(tag: str, *tensors, options=()) -> tuple | None:
    """The key of an eager CUDA call's prepared launch in ``tilemm.kernels.PLANS``: the shapes,
    strides, dtypes and devices of ``tensors`` (None for an absent one) and the options; None where
    there is none (torch.compile tracing, a tensor that is not a plain CUDA torch.Tensor: those go
    through the custom operator, and so does a call that autograd would record: the operator, which
    has no backward, then refuses it rather than returning an output without a gradient)."""
    if torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or not t.is_cuda or grad and t.requires_grad):
            return None
    return (tag, *map(_sig, tensors), *options)


@torch.library.custom_op("tilemm::moe_linear", mutates_args=())
def _moe_linear_op(x: Tensor, words: Tensor, scale_t: Tensor, constants: Tensor, format: str,
                   in_features: int, topk_ids: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x (T, K) bf16 / fp16 times the experts ``topk_ids`` (T, k) of a stacked prepacked weight
    (``PackedWeight``'s tensors); bias (E, N) fp32 or None. Returns (T, k, N) in x's dtype."""
    return run_moe(x, words, scale_t, constants, format, in_features, topk_ids, bias)


@_moe_linear_op.register_fake
def _(x, words, scale_t, constants, format, in_features, topk_ids, bias=None):
    return x.new_empty((topk_ids.shape[0], topk_ids.shape[1], words.shape[1]))


def _check(fn: str, x, w, topk_ids, bias, check_ids: bool):
    if not isinstance(w, PackedWeight) or w.num_experts is None:
        got = repr(w) if isinstance(w, PackedWeight) else type(w).__name__
        raise TypeError(f"{fn}: w must be a stacked expert PackedWeight (tilemm.prepack of an (E, N, K) "
                        f"quantized weight), got {got}")
    num_experts, n, k = w.shape
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16 or float16, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"{fn}: x must be (T, K) with K = {k} (the experts' in_features), got shape "
                         f"{tuple(x.shape)}")
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"{fn}: topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"{fn}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] == 0:
        raise ValueError(f"{fn}: topk_ids must be (T, k) with T = {x.shape[0]} (x's rows) and k >= 1, got "
                         f"shape {tuple(topk_ids.shape)}")
    for name, t in (("x", x), ("topk_ids", topk_ids)):
        if t.device != w.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but w is on {w.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{fn}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (num_experts, n):
            raise ValueError(f"{fn}: bias must be (E, N) = ({num_experts}, {n}), got {tuple(bias.shape)}")
        if bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{fn}: bias must be float32, bfloat16 or float16, got {bias.dtype}")
        if bias.device != w.device:
            raise ValueError(f"{fn}: bias is on {bias.device} but w is on {w.device}")
    if check_ids and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{fn}: topk_ids must lie in [0, {num_experts}) (the experts of w), got values "
                             f"in [{lo}, {hi}]")


def moe_linear(x: torch.Tensor, w: PackedWeight, topk_ids: torch.Tensor, bias: torch.Tensor | None = None,
               *, check_ids: bool = False) -> torch.Tensor:
    """Each token's products with its top-k experts: (T, k, N) in x's dtype.

    Args:
        x: (T, K) bfloat16 or float16 tokens.
        w: a stacked expert weight, ``tilemm.prepack`` of an (E, N, K) MXFP4 / NVFP4 / MXFP8 weight
            quantized along K (K a multiple of the format's block, as quantizing requires).
        topk_ids: (T, k) int32 / int64 expert ids on x's device (the router's choice).
        bias: optional (E, N) float bias; expert e's row is added to its outputs (in fp32).
        check_ids: check on the host that every id lies in [0, E) and raise ValueError otherwise
            (a device synchronisation; without it such rows come out NaN, see the module docstring).

    Returns:
        ``out[t, j] = x[t] @ dequantize(W[topk_ids[t, j]]).T + bias[topk_ids[t, j]]``: fp32 products
        and sums (NVFP4: the per-tensor decode scale applied to the fp32 sum), rounded once; equal to
        the reference up to the order of the fp32 additions.
    """
    key = None
    if not check_ids and type(w) is PackedWeight:  # checks that read values run on every call
        key = _eager_key("moe_linear", x, w.words, w.scale_t, w.constants, topk_ids, bias,
                         options=(w.fmt.name, w.in_features))
        launch = _kernels.PLANS.get(key) if key is not None else None
        if launch is not None:  # a signature seen before: checked then, planned
            if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
                bias = bias.to(torch.float32).contiguous()
            return launch(x, w.words, w.scale_t, w.constants, topk_ids, bias)
    fn = "tilemm.moe_linear"
    _check(fn, x, w, topk_ids, bias, check_ids)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    if key is not None:  # an eager CUDA call: the operator's implementation, without the dispatcher
        family(x.device)  # raises UnsupportedGPUError below sm_90
        launch = _kernels.remember(key, _MoELinearLaunch(x, w.words, w.scale_t, w.fmt.name, topk_ids))
        return launch(x, w.words, w.scale_t, w.constants, topk_ids, bias32)
    return _moe_linear_op(x, w.words, w.scale_t, w.constants, w.fmt.name, w.in_features, topk_ids, bias32)


# --------------------------------------------------------------------------------------------------
# gpt-oss's experts block
# --------------------------------------------------------------------------------------------------

def gpt_oss_glu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of interleaved (..., 2I) gate / up values -> (..., I): ``(clamp(up,
    -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = ``min(gate, limit)``, in fp32 from the given
    values, rounded once to their dtype (what the grouped kernel's fused epilogue computes)."""
    g = gate_up[..., ::2].float().clamp(max=limit)
    u = gate_up[..., 1::2].float().clamp(min=-limit, max=limit)
    return ((u + 1) * (g * torch.sigmoid(g * alpha))).to(gate_up.dtype)


def silu_glu(gate_up: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """SiLU gating of (..., 2I) gate / up values -> (..., I): ``silu(gate) * up``, computed as
    ``gate / (exp(-gate) + 1) * up`` in fp32 from the given values, each operation rounded to fp32 in
    that order (exp correctly rounded: evaluated in float64, rounded once to fp32), then rounded once
    to their dtype. The grouped kernel's fused epilogue (ACT = 2) runs the same operations; only its
    hardware exp may differ from it by a few fp32 ulp. Gate and up: the first and last I
    columns (transformers' ``gate, up = gate_up.chunk(2, dim=-1)``), or with ``interleaved`` columns
    0, 2, .. and 1, 3, .. (``MoEExperts``' gate_up layout)."""
    values = gate_up.float()
    gate, up = (values[..., ::2], values[..., 1::2]) if interleaved else values.chunk(2, dim=-1)
    e = torch.exp(-gate.double()).float()
    return (gate / (e + 1) * up).to(gate_up.dtype)


def _interleaved_rows(n: int, device) -> torch.Tensor:
    """The permutation of 2I = ``n`` rows from halves to interleaved: entry 2j is j (gate row j),
    entry 2j + 1 is I + j (up row j)."""
    half = torch.arange(n // 2, device=device)
    return torch.stack((half, half + n // 2), dim=1).reshape(-1)


def interleave_gate_up(w: PackedWeight) -> PackedWeight:
    """A stacked (E, 2I, K) gate_up weight whose rows are gate / up halves (rows 0 .. I-1 the gate,
    I .. 2I-1 the up projection, as transformers' SiLU-gated experts store them) with its rows
    interleaved (row 2j = gate row j, row 2j + 1 = up row j), the layout ``MoEExperts`` takes. A
    permutation of whole rows of the packed tensors (words, scale bytes), no requantization; each
    expert's constants are per expert and stay. Raises TypeError for anything but a stacked
    PackedWeight, ValueError for an odd number of rows."""
    fn = "tilemm.moe.interleave_gate_up"
    if not isinstance(w, PackedWeight) or w.num_experts is None:
        raise TypeError(f"{fn}: w must be a stacked expert PackedWeight (E, 2I, K), got "
                        f"{repr(w) if isinstance(w, PackedWeight) else type(w).__name__}")
    n = w.out_features
    if n % 2:
        raise ValueError(f"{fn}: w must have an even number of rows 2I (gate and up halves), got {w.shape}")
    perm = _interleaved_rows(n, w.device)
    return dataclasses.replace(w, words=w.words[:, perm].contiguous(), scale_t=w.scale_t[:, :, perm].contiguous(),
                               nan_scale=None if w.nan_scale is None else w.nan_scale[:, perm].contiguous())


#: The gatings of ``MoEExperts`` (both on interleaved gate / up rows): "gpt-oss" (gpt-oss's clamped
#: SwiGLU, biases allowed) and "silu" (``silu(gate) * up``, no bias).
ACTIVATIONS = ("gpt-oss", "silu")


def _glu(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    return gpt_oss_glu(gate_up, alpha, limit) if activation == "gpt-oss" else silu_glu(gate_up, interleaved=True)


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j y[t, j] * weights[t, j]: fp32 products and sums, rounded once to y's dtype (one batched
    GEMM on CUDA when the weights have y's dtype, as the router's do)."""
    if y.is_cuda and weights.dtype == y.dtype:
        return torch.bmm(weights.unsqueeze(1), y).squeeze(1)
    return (y.float() * weights.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)


def run_experts(x, ids, weights, gu_words, gu_scale_t, gu_constants, gu_format: str, gu_bias,
                d_words, d_scale_t, d_constants, d_format: str, d_bias, alpha: float, limit: float,
                activation: str = "gpt-oss"):
    """What ``torch.ops.tilemm.gpt_oss_experts`` and ``torch.ops.tilemm.silu_experts`` run on checked
    tensors: gate_up, the gating (``activation``, see ``ACTIVATIONS``), down, the weighted sum over
    the k slots. On CUDA ``_experts_launches``; elsewhere the reference, projection by projection:
    ``reference_moe`` for gate_up, ``gpt_oss_glu`` / ``silu_glu``, ``reference_moe`` for down (one row
    per (token, slot) pair), ``_weighted_sum``."""
    tokens, top_k = ids.shape
    num_experts, inter, hidden = gu_words.shape[0], gu_words.shape[1] // 2, d_words.shape[1]
    if tokens == 0:
        return x.new_empty((0, hidden))
    if x.device.type != "cuda":
        gate_up = reference_moe(x, gu_words, gu_scale_t, gu_constants, gu_format, hidden, ids, gu_bias)
        h = _glu(gate_up, activation, alpha, limit).reshape(tokens * top_k, inter)
        y = reference_moe(h, d_words, d_scale_t, d_constants, d_format, inter, ids.reshape(-1, 1), d_bias)
        return _weighted_sum(y.reshape(tokens, top_k, hidden), weights)
    family(x.device)
    return _experts_launches(x, ids, weights, gu_words, gu_scale_t, gu_constants, gu_format, gu_bias, d_words,
                             d_scale_t, d_constants, d_format, d_bias, alpha, limit, activation=activation)


def _experts_launches(x, ids, weights, gu_words, gu_scale_t, gu_constants, gu_format: str, gu_bias, d_words,
                      d_scale_t, d_constants, d_format: str, d_bias, alpha: float, limit: float,
                      design: str | None = None, activation: str = "gpt-oss", plans: tuple | None = None):
    """The GPU path of ``run_experts``, on ``plans`` (default ``experts_plans``' for ``design``).
    Per pair (the default for a few tokens): no routing, the per-pair kernel for gate_up and for
    down, with the weighted sum in the down launch's epilogue where that pays (two launches), else
    as a batched GEMM. Sorted (the default above): the routing, x's rows sorted by expert once,
    gate_up writing its rows in that order, down reading them and writing (token, slot) rows, the
    weighted sum as a batched GEMM. ``design`` (see ``EXPERTS_DESIGNS``) forces one.

    The gating, on interleaved gate / up rows, is fused into the gate_up launch's epilogue: gpt-oss's
    SwiGLU with gpt-oss's alpha and limit (``act=1``), SiLU (``activation`` "silu", ``act=2``). A
    SwiGLU of another alpha / limit runs gate_up unfused, then ``gpt_oss_glu`` in PyTorch (fp32,
    rounded once: what the CPU path computes from the same rounded gate_up)."""
    tokens, top_k = ids.shape
    num_experts, inter, hidden = gu_words.shape[0], gu_words.shape[1] // 2, d_words.shape[1]
    act = _fused_act(activation, alpha, limit)
    fused = act != moe_kernels.ACT_NONE
    if plans is None:
        plans = experts_plans(tokens, top_k, gu_words, gu_scale_t, gu_format, d_words, d_scale_t, d_format, x.device,
                              design)
    gate_up_plan, down_plan = plans
    gu_layout, d_layout = layout_of(FORMATS[gu_format]), layout_of(FORMATS[d_format])
    if gate_up_plan.design == "pairs":
        flat = ids.reshape(-1)
        h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)  # pair order
        if fused:
            moe_kernels.launch_pairs(x.contiguous(), gu_words, gu_scale_t, gu_constants, gu_bias, flat, h,
                                     gu_layout, act=act, moe_plan=gate_up_plan)
        else:
            gate_up = torch.empty((tokens * top_k, 2 * inter), dtype=x.dtype, device=x.device)
            moe_kernels.launch_pairs(x.contiguous(), gu_words, gu_scale_t, gu_constants, gu_bias, flat,
                                     gate_up, gu_layout, moe_plan=gate_up_plan)
            h = _glu(gate_up, activation, alpha, limit)
        if down_plan.combine:
            out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
            moe_kernels.launch_pairs(h, d_words, d_scale_t, d_constants, d_bias, flat, out, d_layout,
                                     weights=weights.contiguous(), moe_plan=down_plan)
            return out
        y = torch.empty((tokens * top_k, hidden), dtype=x.dtype, device=x.device)  # pair order
        moe_kernels.launch_pairs(h, d_words, d_scale_t, d_constants, d_bias, flat, y, d_layout, moe_plan=down_plan)
        return _weighted_sum(y.reshape(tokens, top_k, hidden), weights)
    routed = moe_kernels.route(ids, num_experts)
    xs = moe_kernels.sort_rows(x.contiguous(), routed, top_k)  # x's rows in expert order
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)  # sorted rows too
    if fused:
        moe_kernels.launch(xs, gu_words, gu_scale_t, gu_constants, gu_bias, routed, tokens, h, gu_layout, act=act,
                           moe_plan=gate_up_plan)
    else:
        gate_up = torch.empty((tokens * top_k, 2 * inter), dtype=x.dtype, device=x.device)
        moe_kernels.launch(xs, gu_words, gu_scale_t, gu_constants, gu_bias, routed, tokens, gate_up, gu_layout,
                           moe_plan=gate_up_plan, sorted_out=1)
        h = _glu(gate_up, activation, alpha, limit)
    y = torch.empty((tokens * top_k, hidden), dtype=x.dtype, device=x.device)  # (token, slot) rows
    moe_kernels.launch(h, d_words, d_scale_t, d_constants, d_bias, routed, tokens, y, d_layout, moe_plan=down_plan)
    return _weighted_sum(y.reshape(tokens, top_k, hidden), weights)


#: The designs ``_experts_launches`` can be forced to (benchmarks, tests): per pair with the weighted
#: sum in the down launch ("pairs_combine") or as a batched GEMM ("pairs_bmm") or either where it pays
#: ("pairs"), or "sorted"; as ``moe_kernels.plan``'s (design, down projection's combine).
EXPERTS_DESIGNS = {"pairs": ("pairs", None), "pairs_combine": ("pairs", True), "pairs_bmm": ("pairs", False),
                   "sorted": ("sorted", False)}


def experts_plans(tokens: int, top_k: int, gu_words, gu_scale_t, gu_format: str, d_words, d_scale_t, d_format: str,
                  device, design: str | None = None) -> tuple:
    """(gate_up's, down's) ``moe_kernels.plan`` for an experts block's call of T = ``tokens`` tokens
    of k = ``top_k`` experts: one design for both projections, chosen on the bytes of one expert of
    both (or ``design``, see ``EXPERTS_DESIGNS``); per pair, down's weighted sum in its epilogue
    where that pays on ``device``'s SMs."""
    forced, combine = EXPERTS_DESIGNS[design] if design is not None else (None, None)
    num_experts, inter, hidden = gu_words.shape[0], gu_words.shape[1] // 2, d_words.shape[1]
    expert_bytes = moe_kernels.expert_bytes(gu_words, gu_scale_t, d_words, d_scale_t)
    gate_up = moe_kernels.plan(tokens, top_k, num_experts, 2 * inter, hidden, layout_of(FORMATS[gu_format]),
                               expert_bytes, design=forced)
    # the SM count only where combine is chosen (a forced design may run on the CPU emulator)
    sms = _kernels_common.num_sms(device) if gate_up.design == "pairs" and combine is None else None
    down = moe_kernels.plan(tokens, top_k, num_experts, hidden, inter, layout_of(FORMATS[d_format]), expert_bytes,
                            sms, design=gate_up.design, combine=combine)
    return gate_up, down


class _MoEExpertsLaunch:
    """A checked ``MoEExperts.forward`` signature on CUDA with its two projections planned
    (``experts_plans``): ``__call__(module, hidden_states, router_indices, routing_weights)`` runs
    ``_experts_launches`` on the module's buffers, without the checks and the operator's dispatcher.

    Kept in the module's own table (``MoEExperts._launches``, keyed by the inputs' signatures and
    the options). It holds the module's buffers of its first call (``held``) and serves only while
    the module still holds those very tensors (else it returns None: the forward empties the table,
    checks and plans again). The per-pair design with
    the gating fused (a decode step's few tokens) is bound to them once (``moe_kernels.PreparedPairs``
    for gate_up and down): the output allocations and the two launches (and, without the combine
    epilogue, the weighted sum); the other designs go through ``_experts_launches``."""

    __slots__ = ("plans", "shape", "tokens", "held", "gate_up", "down")

    #: The buffers a bound call reads, by name in ``MoEExperts._buffers``.
    BUFFERS = ("gate_up_words", "gate_up_scale_t", "gate_up_constants", "gate_up_bias", "down_words",
               "down_scale_t", "down_constants", "down_bias")

    def __init__(self, module, x, ids):
        self.tokens = x.shape[0]
        self.shape = ids.shape
        self.plans = experts_plans(x.shape[0], ids.shape[1], module.gate_up_words, module.gate_up_scale_t,
                                   module.formats[0], module.down_words, module.down_scale_t, module.formats[1],
                                   x.device)
        self.held = held = tuple(module._buffers.get(name) for name in self.BUFFERS)
        self.gate_up = self.down = None
        act = _fused_act(module.activation, module.alpha, module.limit)
        gate_up_plan, down_plan = self.plans
        if gate_up_plan.design == "pairs" and act != moe_kernels.ACT_NONE:
            gu_words, gu_scale_t, gu_constants, gu_bias, d_words, d_scale_t, d_constants, d_bias = held
            pairs = self.tokens * ids.shape[1]
            self.gate_up = moe_kernels.PreparedPairs(module.hidden_size, gu_words, gu_scale_t, gu_constants,
                                                     gu_bias, layout_of(FORMATS[module.formats[0]]), pairs, act,
                                                     gate_up_plan)
            self.down = moe_kernels.PreparedPairs(module.intermediate_size, d_words, d_scale_t, d_constants, d_bias,
                                                  layout_of(FORMATS[module.formats[1]]),
                                                  self.tokens if down_plan.combine else pairs, moe_plan=down_plan)

    def __call__(self, m, hidden_states, router_indices, routing_weights):
        buffers = m._buffers
        if not all(buffers.get(name) is t for name, t in zip(self.BUFFERS, self.held)):
            return None  # a buffer replaced since: the forward checks and plans again
        if self.gate_up is not None:
            return self._bound(m, hidden_states, router_indices, routing_weights)
        out = _experts_launches(hidden_states.reshape(self.tokens, m.hidden_size), router_indices.reshape(self.shape),
                                routing_weights.reshape(self.shape), m.gate_up_words, m.gate_up_scale_t,
                                m.gate_up_constants, m.formats[0], m.gate_up_bias, m.down_words, m.down_scale_t,
                                m.down_constants, m.formats[1], m.down_bias, m.alpha, m.limit,
                                activation=m.activation, plans=self.plans)
        return out.reshape(hidden_states.shape)

    def _bound(self, m, hidden_states, router_indices, routing_weights):
        """``_experts_launches``' per-pair design with the gating fused, on the bound launches."""
        tokens, (_, top_k) = self.tokens, self.shape
        x = hidden_states.reshape(tokens, m.hidden_size)
        x = x if x.is_contiguous() else x.contiguous()
        flat = router_indices.reshape(-1)
        h = torch.empty((tokens * top_k, m.intermediate_size), dtype=x.dtype, device=x.device)  # pair order
        self.gate_up.run(x, flat, h)
        weights = routing_weights.reshape(self.shape)
        if self.plans[1].combine:
            out = torch.empty((tokens, m.hidden_size), dtype=x.dtype, device=x.device)
            self.down.run(h, flat, out, weights if weights.is_contiguous() else weights.contiguous())
        else:
            y = torch.empty((tokens * top_k, m.hidden_size), dtype=x.dtype, device=x.device)
            self.down.run(h, flat, y)
            out = _weighted_sum(y.reshape(tokens, top_k, m.hidden_size), weights)
        return out.reshape(hidden_states.shape)


def _fused_act(activation: str, alpha: float, limit: float) -> int:
    """The gate_up epilogue's gating code (``moe_kernels.ACT_*``): SiLU, gpt-oss's SwiGLU with its own
    alpha and limit, else none (the gating then runs in PyTorch)."""
    if activation == "silu":
        return moe_kernels.ACT_SILU
    if alpha == moe_kernels.SWIGLU_ALPHA and limit == moe_kernels.SWIGLU_LIMIT:
        return moe_kernels.ACT_GPT_OSS
    return moe_kernels.ACT_NONE


@torch.library.custom_op("tilemm::gpt_oss_experts", mutates_args=())
def _gpt_oss_experts_op(x: Tensor, ids: Tensor, weights: Tensor, gu_words: Tensor, gu_scale_t: Tensor,
                        gu_constants: Tensor, gu_format: str, gu_bias: Optional[Tensor], d_words: Tensor,
                        d_scale_t: Tensor, d_constants: Tensor, d_format: str, d_bias: Optional[Tensor],
                        alpha: float, limit: float) -> Tensor:
    """gpt-oss's experts block on stacked packed weights: x (T, H), ids and weights (T, k) -> (T, H)."""
    return run_experts(x, ids, weights, gu_words, gu_scale_t, gu_constants, gu_format, gu_bias,
                       d_words, d_scale_t, d_constants, d_format, d_bias, alpha, limit, "gpt-oss")


@_gpt_oss_experts_op.register_fake
def _(x, ids, weights, gu_words, gu_scale_t, gu_constants, gu_format, gu_bias, d_words, d_scale_t,
      d_constants, d_format, d_bias, alpha, limit):
    return x.new_empty((x.shape[0], d_words.shape[1]))


@torch.library.custom_op("tilemm::silu_experts", mutates_args=())
def _silu_experts_op(x: Tensor, ids: Tensor, weights: Tensor, gu_words: Tensor, gu_scale_t: Tensor,
                     gu_constants: Tensor, gu_format: str, d_words: Tensor, d_scale_t: Tensor, d_constants: Tensor,
                     d_format: str) -> Tensor:
    """A SiLU-gated experts block (gate / up halves, no bias) on stacked packed weights: x (T, H), ids
    and weights (T, k) -> (T, H)."""
    return run_experts(x, ids, weights, gu_words, gu_scale_t, gu_constants, gu_format, None,
                       d_words, d_scale_t, d_constants, d_format, None, 0.0, 0.0, "silu")


@_silu_experts_op.register_fake
def _(x, ids, weights, gu_words, gu_scale_t, gu_constants, gu_format, d_words, d_scale_t, d_constants, d_format):
    return x.new_empty((x.shape[0], d_words.shape[1]))


#: transformers' classes whose modules ``quantize_model`` / ``load_quantized`` replace (matched by
#: name: transformers is not a dependency): gpt-oss's experts, and the SiLU-gated experts whose fused
#: ``gate_up_proj`` (E, 2I, H) holds the gate rows then the up rows and that have no bias.
GPT_OSS_EXPERTS = "GptOssExperts"
SILU_EXPERTS = ("Qwen3MoeExperts", "Qwen2MoeExperts", "MixtralExperts")


def experts_activation(module: torch.nn.Module) -> str | None:
    """The ``MoEExperts`` gating a module is replaced with: "gpt-oss" for transformers'
    ``GptOssExperts``, "silu" for its SiLU-gated experts classes (``SILU_EXPERTS``), a
    ``MoEExperts``'s own; None for any other module."""
    if isinstance(module, MoEExperts):
        return module.activation
    name = type(module).__name__
    return "gpt-oss" if name == GPT_OSS_EXPERTS else "silu" if name in SILU_EXPERTS else None


def experts_dims(module: torch.nn.Module) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a transformers experts block or a ``MoEExperts``
    (transformers names them ``num_experts``, ``hidden_size`` / ``hidden_dim``,
    ``intermediate_size`` / ``intermediate_dim`` depending on the family)."""
    hidden = getattr(module, "hidden_size", None) or getattr(module, "hidden_dim")
    inter = getattr(module, "intermediate_size", None) or getattr(module, "intermediate_dim")
    return int(module.num_experts), int(hidden), int(inter)


def check_silu_experts(fn: str, experts: torch.nn.Module) -> None:
    """Raise ValueError unless ``experts`` computes what ``MoEExperts(activation="silu")`` does: its
    ``act_fn`` is SiLU, it has no bias, ``gate_up_proj`` is (E, 2I, H) and ``down_proj`` (E, H, I)."""
    act = getattr(experts, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"{fn}: experts.act_fn must be SiLU (what activation='silu' computes), got "
                         f"{type(act).__name__}")
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(experts, name, None) is not None:
            raise ValueError(f"{fn}: experts has a {name}; SiLU-gated MoEExperts have no bias")
    e, hidden, inter = experts_dims(experts)
    for name, want in (("gate_up_proj", (e, 2 * inter, hidden)), ("down_proj", (e, hidden, inter))):
        got = tuple(getattr(experts, name).shape)
        if got != want:
            raise ValueError(f"{fn}: experts.{name} must be (E, N, K) = {want} for its {e} experts, hidden "
                             f"{hidden} and intermediate {inter}, got {got}")


class MoEExperts(torch.nn.Module):
    """A mixture-of-experts experts block on stacked packed weights; the forward of transformers'
    ``GptOssExperts`` (``activation="gpt-oss"``) or of its SiLU-gated ``Qwen3MoeExperts``,
    ``Qwen2MoeExperts`` and ``MixtralExperts`` (``activation="silu"``).

    ``forward(hidden_states (T, H), router_indices (T, k), routing_weights (T, k)) -> (T, H)``:

    * ``gate_up = moe_linear(x, W_gate_up, ids, gate_up_bias)`` (T, k, 2I), gate / up interleaved
      in its columns (gate = columns 0, 2, ..., up = 1, 3, ...: gpt-oss's checkpoint layout; the
      SiLU families' halves are interleaved when the module is built or loaded);
    * "gpt-oss": ``h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``,
      g = ``clamp(gate, max=limit)`` (limit 7.0, alpha 1.702 in gpt-oss), in fp32 from the rounded
      gate_up, rounded once (``gpt_oss_glu``; on CUDA fused into the gate_up kernel's epilogue);
    * "silu": no bias; ``h = silu(gate) * up`` in fp32 from the rounded gate_up, rounded once
      (``silu_glu``; on CUDA fused into the gate_up kernel's epilogue);
    * ``y = moe_linear(h, W_down, ids, down_bias)``: one row per (token, slot);
    * the output: sum over the k slots of ``y * routing_weights``, in fp32, rounded once.

    It is one custom op, ``torch.ops.tilemm.gpt_oss_experts`` or ``torch.ops.tilemm.silu_experts``
    (both run ``run_experts``): on CUDA, for a few tokens two launches of the per-pair kernel (the
    weighted sum in the second where that pays, else a batched GEMM); for more, one routing (shared
    by both projections), two grouped launches and a batched GEMM for the weighted sum. transformers
    rounds to bf16 after each of its elementwise operations; the results agree up to those roundings.

    The weights are registered buffers (``{gate_up,down}_{words,scale_t,constants}``, biases in
    fp32), so ``.to(device)`` and state dicts carry them, gate_up's rows interleaved. ``gate_up``
    (E, 2I, H) is given interleaved for either gating (``interleave_gate_up`` converts halves;
    ``from_silu_experts`` and ``tilemm.load_quantized`` do it); down (E, H, I).
    """

    def __init__(self, gate_up: PackedWeight, down: PackedWeight, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, *, alpha: float = 1.702, limit: float = 7.0,
                 activation: str = "gpt-oss"):
        super().__init__()
        self._launches = {}  # eager CUDA signatures -> _MoEExpertsLaunch (holding this module's buffers)
        fn = "tilemm.moe.MoEExperts"
        if activation not in ACTIVATIONS:
            raise ValueError(f"{fn}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got "
                             f"{activation!r}")
        if activation == "silu":
            for name, b in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
                if b is not None:
                    raise ValueError(f"{fn}: {name} must be None with activation='silu' (SiLU-gated experts "
                                     f"have no bias), got a {type(b).__name__}")
        self.activation = activation
        for name, w in (("gate_up", gate_up), ("down", down)):
            if not isinstance(w, PackedWeight) or w.num_experts is None:
                raise TypeError(f"{fn}: {name} must be a stacked expert PackedWeight, got {type(w).__name__}")
        e, two_i, hidden = gate_up.shape
        if two_i % 2 or down.shape != (e, hidden, two_i // 2):
            raise ValueError(f"{fn}: gate_up (E, 2I, H) = {gate_up.shape} and down (E, H, I) = {down.shape} "
                             f"do not fit each other")
        self.num_experts, self.hidden_size, self.intermediate_size = e, hidden, two_i // 2
        self.alpha, self.limit = float(alpha), float(limit)
        self.formats = (gate_up.fmt.name, down.fmt.name)
        self.exponents = (gate_up.exponent, down.exponent)
        for name, w in (("gate_up", gate_up), ("down", down)):
            self.register_buffer(f"{name}_words", w.words)
            self.register_buffer(f"{name}_scale_t", w.scale_t)
            self.register_buffer(f"{name}_constants", w.constants)
        for name, b, n in (("gate_up_bias", gate_up_bias, two_i), ("down_bias", down_bias, hidden)):
            if b is not None and not (isinstance(b, torch.Tensor) and b.is_floating_point()):
                got = b.dtype if isinstance(b, torch.Tensor) else type(b).__name__
                raise TypeError(f"{fn}: {name} must be a float torch.Tensor (E, N) or None, got {got}")
            if b is not None and tuple(b.shape) != (e, n):
                raise ValueError(f"{fn}: {name} must be (E, N) = ({e}, {n}), got {tuple(b.shape)}")
            self.register_buffer(name, None if b is None else b.detach().to(torch.float32).contiguous())

    #: State dicts record the module's version (a state dict without it is version 1). Each version's
    #: prepacked word layout (``tilemm.packed.LAYOUT_VERSION``; words of an older one are re-laid out
    #: on load), and from version 3 on SiLU gate_up rows are interleaved (before: halves, permuted on
    #: load). A new word layout needs a new version here (version 4: layout 3, whose change, single
    #: NVFP4 weights' row-major scales, leaves stacked experts as they were).
    _WORD_LAYOUT = {1: 1, 2: 2, 3: 2, 4: 3}
    #: Eager signatures whose prepared launches the module keeps before its table starts over.
    MAX_LAUNCHES = 16

    def _float_buffer_requires_grad(self) -> bool:
        buffers = self._buffers
        return any(t is not None and t.requires_grad for t in (
            buffers.get("gate_up_constants"), buffers.get("gate_up_bias"), buffers.get("down_constants"),
            buffers.get("down_bias")))

    def _apply(self, fn, recurse=True):
        # The prepared launches hold the buffers: drop them, so that moving or casting the module
        # frees the old tensors; the next call plans again.
        self.__dict__["_launches"] = {}
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_launches"] = {}  # kernels and device tensors: planned again after unpickling
        return state
    _SILU_INTERLEAVED_SINCE = 3
    _version = 4

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self.__dict__["_launches"] = {}  # the prepared launches hold the buffers being replaced
        version = local_metadata.get("version", 1)
        if version not in self._WORD_LAYOUT:
            error_msgs.append(f"MoEExperts {prefix!r}: a state dict of version {version}, which this tilemm does "
                              f"not know (it reads versions {min(self._WORD_LAYOUT)} .. {self._version})")
            return
        for name, fmt in zip(("gate_up", "down"), self.formats):
            key = f"{prefix}{name}_words"
            if key in state_dict:
                state_dict[key] = relayout_words(state_dict[key], FORMATS[fmt], self._WORD_LAYOUT[version])
        if self.activation == "silu" and version < self._SILU_INTERLEAVED_SINCE:
            # gate_up saved as gate / up halves: its rows (words dim 1, scale bytes dim 2) interleaved.
            # Tensors of another shape are left for the shape check to report.
            n = 2 * self.intermediate_size
            for key, dim in ((f"{prefix}gate_up_words", 1), (f"{prefix}gate_up_scale_t", 2)):
                t = state_dict.get(key)
                if isinstance(t, torch.Tensor) and t.ndim == 3 and t.shape[dim] == n:
                    state_dict[key] = t.index_select(dim, _interleaved_rows(n, t.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def packed(self, name: str) -> PackedWeight:
        """The stacked PackedWeight ``"gate_up"`` (rows interleaved, see the class docstring) or
        ``"down"`` (views of the buffers)."""
        i = ("gate_up", "down").index(name)
        constants = getattr(self, f"{name}_constants")
        fmt = FORMATS[self.formats[i]]
        # NVFP4: constants[:, 0] = 2^E * decode scale, so the per-tensor scales come back exactly.
        global_scale = constants[:, 0] / 2.0 ** self.exponents[i] if fmt.has_global_scale else None
        return PackedWeight(fmt=fmt, words=getattr(self, f"{name}_words"),
                            scale_t=getattr(self, f"{name}_scale_t"), constants=constants,
                            exponent=self.exponents[i], global_scale=global_scale,
                            in_features=self.hidden_size if i == 0 else self.intermediate_size)

    @staticmethod
    def _quantizer(fn: str, format: str, quantizer):
        quantizers = {"mxfp4": _quantize.quantize_mxfp4, "nvfp4": _quantize.quantize_nvfp4,
                      "mxfp8": _quantize.quantize_mxfp8}
        if format not in quantizers:
            raise ValueError(f"{fn}: format must be one of {', '.join(map(repr, quantizers))}, got {format!r}")
        return quantizer or quantizers[format]

    @classmethod
    def from_silu_experts(cls, experts: torch.nn.Module, format: str = "mxfp4", *,
                          quantizer=None) -> "MoEExperts":
        """Quantize a transformers SiLU-gated experts block (``Qwen3MoeExperts``, ``Qwen2MoeExperts``,
        ``MixtralExperts``: ``gate_up_proj`` (E, 2I, H) with the gate rows first, ``down_proj``
        (E, H, I), ``act_fn`` SiLU, no bias) along K per expert to ``format`` ("mxfp4", "nvfp4" or
        "mxfp8") and prepack it; ``activation="silu"``. Its weights are already (N, K) per expert (it
        computes ``F.linear(x, gate_up_proj[e])``), so each expert is quantized as stored (NVFP4:
        one per-tensor scale per expert projection, gate and up together), prepacked, and its
        gate_up rows interleaved (``interleave_gate_up``). ``quantizer`` as for ``from_gpt_oss``. Another activation or a bias raises ValueError (the module would compute
        something else)."""
        fn = "tilemm.moe.MoEExperts.from_silu_experts"
        quantizer = cls._quantizer(fn, format, quantizer)
        check_silu_experts(fn, experts)
        e = experts.num_experts
        with torch.no_grad():
            gate_up = interleave_gate_up(prepack([quantizer(experts.gate_up_proj[x].contiguous()) for x in range(e)]))
            down = prepack([quantizer(experts.down_proj[x].contiguous()) for x in range(e)])
        return cls(gate_up, down, activation="silu")

    @classmethod
    def from_gpt_oss(cls, experts: torch.nn.Module, format: str = "mxfp4", *, quantizer=None) -> "MoEExperts":
        """Quantize a transformers ``GptOssExperts`` (bf16 gate_up_proj (E, H, 2I), down_proj (E, I, H),
        biases) along K per expert to ``format`` ("mxfp4", "nvfp4" or "mxfp8") and prepack it.
        ``quantizer`` (an (N, K) tensor -> a quantized weight of ``format``) replaces the default
        ``tilemm.quantize_<format>`` (``quantize_model`` passes its element dtype and rounding)."""
        quantizer = cls._quantizer("tilemm.moe.MoEExperts.from_gpt_oss", format, quantizer)
        with torch.no_grad():
            # transformers stores (E, K, N) (x @ W); tilemm quantizes (E, N, K) rows along K, per expert.
            gate_up = prepack([quantizer(experts.gate_up_proj[e].t().contiguous())
                               for e in range(experts.gate_up_proj.shape[0])])
            down = prepack([quantizer(experts.down_proj[e].t().contiguous())
                            for e in range(experts.down_proj.shape[0])])
        return cls(gate_up, down, getattr(experts, "gate_up_proj_bias", None),
                   getattr(experts, "down_proj_bias", None), alpha=experts.alpha, limit=experts.limit)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        # A repeated eager CUDA call of a signature (the inputs' shapes, strides, dtypes and devices, this
        # module, its formats, alpha, limit and activation) was checked and planned on its first call; the
        # launch serves it while the module holds the buffers it was planned with.
        key = _eager_key("gpt_oss_experts", hidden_states, router_indices, routing_weights,
                         options=(self.formats, self.alpha, self.limit, self.activation))
        if key is not None and torch.is_grad_enabled() and self._float_buffer_requires_grad():
            key = None  # autograd would record the call: the operator (which has no backward) refuses it
        launches = self.__dict__.get("_launches")
        if launches is None:  # (a module unpickled from before the table existed)
            launches = self.__dict__["_launches"] = {}
        launch = launches.get(key) if key is not None else None
        if launch is not None:
            out = launch(self, hidden_states, router_indices, routing_weights)
            if out is not None:
                return out
            launches.clear()  # a buffer was replaced: no launch may keep the old ones alive
        fn = "tilemm.moe.MoEExperts"
        for name, t in (("hidden_states", hidden_states), ("router_indices", router_indices),
                        ("routing_weights", routing_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != self.gate_up_words.device:
                raise ValueError(f"{fn}: {name} is on {t.device} but the experts' weights are on "
                                 f"{self.gate_up_words.device}")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"{fn}: hidden_states must be (..., {self.hidden_size}), got "
                             f"{tuple(hidden_states.shape)}")
        if hidden_states.dtype not in _X_DTYPES:
            raise TypeError(f"{fn}: hidden_states must be bfloat16 or float16, got {hidden_states.dtype}")
        x = hidden_states.reshape(-1, self.hidden_size)
        if router_indices.ndim == 0 or router_indices.numel() % max(x.shape[0], 1) or (
                x.shape[0] and router_indices.numel() == 0):
            raise ValueError(f"{fn}: router_indices must be (T, k) for the T = {x.shape[0]} tokens of "
                             f"hidden_states, k >= 1, got shape {tuple(router_indices.shape)}")
        ids = router_indices.reshape(x.shape[0], -1)
        if ids.dtype not in _ID_DTYPES:
            raise TypeError(f"{fn}: router_indices must be int32 or int64, got {ids.dtype}")
        if routing_weights.numel() != ids.numel():
            raise ValueError(f"{fn}: routing_weights must have router_indices' shape {tuple(router_indices.shape)} "
                             f"(one weight per chosen expert), got {tuple(routing_weights.shape)}")
        if not routing_weights.is_floating_point():
            raise TypeError(f"{fn}: routing_weights must be a float tensor, got {routing_weights.dtype}")
        weights = routing_weights.reshape(ids.shape)
        if key is not None and x.shape[0]:  # an eager CUDA call: the operator's implementation, no dispatcher
            family(x.device)  # raises UnsupportedGPUError below sm_90
            if len(launches) >= self.MAX_LAUNCHES:
                launches.clear()
            launch = launches[key] = _MoEExpertsLaunch(self, x, ids)
            return launch(self, hidden_states, router_indices, routing_weights)
        if self.activation == "silu":
            out = _silu_experts_op(x, ids, weights, self.gate_up_words, self.gate_up_scale_t, self.gate_up_constants,
                                   self.formats[0], self.down_words, self.down_scale_t, self.down_constants,
                                   self.formats[1])
            return out.reshape(hidden_states.shape)
        out = _gpt_oss_experts_op(x, ids, weights, self.gate_up_words, self.gate_up_scale_t,
                                  self.gate_up_constants, self.formats[0], self.gate_up_bias, self.down_words,
                                  self.down_scale_t, self.down_constants, self.formats[1], self.down_bias,
                                  self.alpha, self.limit)
        return out.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, formats={self.formats}, activation={self.activation!r}")
