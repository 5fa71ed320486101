"""Quantized checkpoints written by other tools: read them into tilemm, bit for bit, and write them back.

A quantized checkpoint stores, per linear layer, the element bytes, the block scales and (NVFP4) a
per-tensor scale. The conventions below agree on the numbers and differ in small ways that are easy to
get wrong and that still give a model that runs: which nibble holds the first element, whether the
NVFP4 per-tensor scale is the *encode* scale (448 * 6 / amax) or its reciprocal, whether e8m0 scales
travel as ``uint8`` or ``float8_e8m0fnu``, whether e4m3 scales travel as ``uint8`` or ``float8_e4m3fn``,
and how the scales are laid out. Each converter here names its convention's choices and turns them
into tilemm's (``docs/numerics.md``): elements in the low nibble first, e8m0 / e4m3 scale bytes,
NVFP4's per-tensor *decode* scale as a 0-d fp32 tensor, scales logical (N, K / block) or in the
32x4x4 layout. ``docs/checkpoints.md`` lists where the writing libraries compute differently.

Conventions (layouts in each reader's docstring and in ``docs/checkpoints.md``), all read and written:

* ``"compressed-tensors"`` (llm-compressor, vLLM): ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``,
  ``mxfp8-quantized``, ``float-quantized`` / ``naive-quantized`` (FP8 per channel, per tensor,
  128x128 blocks). Its NVFP4 ``weight_global_scale`` is the **encode** scale.
* ``"modelopt"`` (NVIDIA ModelOpt): NVFP4 and FP8 per tensor. ``weight_scale_2`` is the **decode** scale.
* ``"gpt-oss"``: MXFP4 ``*_blocks`` (..., N, K/32, 16) and ``*_scales`` (..., N, K/32), uint8.
* ``"torchao"``: ``NVFP4Tensor`` (``per_tensor_scale`` is the **decode** scale) and ``MXTensor``;
  logical or 32x4x4 scales; converted as views, no copy.

gpt-oss experts blocks (transformers' ``GptOssExperts``) become ``tilemm.moe.MoEExperts`` when the
checkpoint stores their experts quantized: ``"gpt-oss"``'s MXFP4 blocks; compressed-tensors' (and
ModelOpt's) per-expert ``<experts>.<i>.{gate,up,down}_proj`` layers in NVFP4 / MXFP4 / MXFP8, gate and
up rows interleaved into gpt-oss's gate_up; ModelOpt's fused NVFP4 export (``_load_quantized_experts``).

Every convention packs element 2i in the low nibble of byte i, as tilemm does, so packed bytes are
taken as they are. Data and scale bytes are reinterpreted (``Tensor.view``), never copied, except where
tilemm's layout differs: an NVFP4 encode scale becomes the decode scale ``fp32(1 / encode)`` (what
vLLM computes from the same checkpoint too); a float FP8 scale (bf16 / fp16) becomes fp32 exactly.

Entry points: :func:`to_tilemm` / :func:`from_tilemm` for one layer's tensors,
``tilemm.nn.Linear.from_quantized(tensors, convention=...)`` for one layer, :func:`load_quantized` for a
whole model (swaps ``torch.nn.Linear`` layers for ``tilemm.nn.Linear`` and fills them from the
checkpoint's quantized bytes without ever building the high-precision weights) and
:func:`export_quantized` to write a model of ``tilemm.nn.Linear`` layers in another convention.

What is *not* carried over: static activation scales (``input_scale``, ``input_global_scale``).
``tilemm.nn.Linear`` quantizes activations on every call from their own amax (or, with
``weight_only=True``, leaves them unquantized), so a W4A4 / W8A8 checkpoint runs with dynamic
activation scales.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from typing import Mapping

import torch

from swizzle import swizzle_32_4_4, unswizzle_32_4_4

from .formats import MXFP4, NVFP4
from .quantize import FP8_BLOCK, FP8Tensor, MXFP4Tensor, MXFP8Tensor, NVFP4Tensor

__all__ = [
    "CONVENTIONS",
    "COMPRESSED_TENSORS_FORMATS",
    "to_tilemm",
    "from_tilemm",
    "from_compressed_tensors",
    "to_compressed_tensors",
    "from_modelopt",
    "to_modelopt",
    "from_gpt_oss",
    "to_gpt_oss",
    "from_torchao",
    "to_torchao",
    "linear_options",
    "load_quantized",
    "export_quantized",
]

CONVENTIONS = ("compressed-tensors", "modelopt", "gpt-oss", "torchao")

# compressed-tensors' CompressionFormat values (0.20) that hold a format tilemm has -> tilemm's name.
COMPRESSED_TENSORS_FORMATS = {
    "nvfp4-pack-quantized": "nvfp4",
    "mxfp4-pack-quantized": "mxfp4",
    "mxfp8-quantized": "mxfp8",
    "float-quantized": "fp8",
    "naive-quantized": "fp8",  # the same layout as float-quantized when the weights are 8-bit floats
}
_COMPRESSED_TENSORS_FORMAT_OF = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized",
                                 "mxfp8": "mxfp8-quantized", "fp8": "float-quantized"}
MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8")
# A KV cache in FP8 (ModelOpt's kv_cache_quant_algo "FP8", its examples' default) stores the k / v
# scales beside the k / v projections (``self_attn.k_proj.k_scale``, ``self_attn.v_proj.v_scale``):
# load_quantized keeps them as buffers of the module they are stored under, for an attention that uses
# an FP8 cache; tilemm's layers do not read them.
KV_CACHE_SCALE_NAMES = ("k_scale", "v_scale")
# Static activation scales: read by engines that quantize activations with a calibrated scale; tilemm
# quantizes activations per call (module docstring), so load_quantized accepts and drops them.
ACTIVATION_SCALE_NAMES = ("input_scale", "input_global_scale", "input_zero_point")

_QUANTIZED = (MXFP8Tensor, MXFP4Tensor, NVFP4Tensor, FP8Tensor)
_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# ----------------------------------------------------------------------------------------------
# Checked access to one layer's tensors
# ----------------------------------------------------------------------------------------------


def _names(tensors: Mapping) -> str:
    return ", ".join(sorted(map(str, tensors))) or "none"


def _get(fn: str, tensors: Mapping, key: str, where: str) -> torch.Tensor:
    """``tensors[key]`` as a torch.Tensor, or a ValueError naming what is there instead."""
    if key not in tensors:
        raise ValueError(f"{fn}: {where} needs a tensor named {key!r}; got tensors {_names(tensors)}")
    t = tensors[key]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {key} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _refuse_extra(fn: str, tensors: Mapping, known: tuple[str, ...], where: str) -> None:
    """A tensor this converter does not understand (a zero point, say) would be silently dropped."""
    extra = [k for k in tensors if k not in known and k not in ACTIVATION_SCALE_NAMES]
    if extra:
        raise ValueError(f"{fn}: {where} does not use tensor(s) {', '.join(map(repr, sorted(extra)))}; "
                         f"accepted: {', '.join(known + ACTIVATION_SCALE_NAMES)} (a zero point means "
                         f"asymmetric quantization, which no tilemm format has)")


def _packed_e2m1(fn: str, key: str, t: torch.Tensor, block: int) -> torch.Tensor:
    """Packed e2m1 bytes (..., N, K/2), uint8 (or int8 / float4_e2m1fn_x2 holding the same bytes)."""
    if t.dtype not in (torch.uint8, torch.int8, torch.float4_e2m1fn_x2):
        raise TypeError(f"{fn}: {key} must hold packed e2m1 bytes (torch.uint8), got {t.dtype}")
    if t.ndim < 2 or t.shape[-1] == 0 or (2 * t.shape[-1]) % block:
        raise ValueError(f"{fn}: {key} must be (..., N, K/2) with K a positive multiple of {block}, "
                         f"got shape {tuple(t.shape)}")
    return t.view(torch.uint8)


def _fp8_elements(fn: str, key: str, t: torch.Tensor, block: int = 1) -> torch.Tensor:
    if t.dtype not in _FP8_DTYPES:
        raise TypeError(f"{fn}: {key} must be torch.float8_e4m3fn or torch.float8_e5m2, got {t.dtype}")
    if t.ndim < 2 or t.shape[-1] == 0 or t.shape[-1] % block:
        raise ValueError(f"{fn}: {key} must be (..., N, K) with K a positive multiple of {block}, got "
                         f"shape {tuple(t.shape)}")
    return t


def _e8m0_scale(fn: str, key: str, t: torch.Tensor, expected: tuple) -> torch.Tensor:
    """e8m0 scale bytes: uint8 biased exponents or float8_e8m0fnu, viewed as float8_e8m0fnu."""
    if t.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"{fn}: {key} must hold e8m0 bytes (torch.uint8 biased exponents or "
                        f"torch.float8_e8m0fnu), got {t.dtype}")
    _check_shape(fn, key, t, expected)
    return t.view(torch.float8_e8m0fnu)


def _e4m3_scale(fn: str, key: str, t: torch.Tensor, expected: tuple) -> torch.Tensor:
    """NVFP4 block scales as float8_e4m3fn: fp8 and uint8 bytes are viewed; float values must be e4m3."""
    _check_shape(fn, key, t, expected)
    if t.dtype in (torch.float8_e4m3fn, torch.uint8):
        return t.view(torch.float8_e4m3fn)
    if t.dtype in _FLOAT_SCALE_DTYPES:
        e4m3 = t.to(torch.float8_e4m3fn)
        same = (e4m3.to(t.dtype) == t) | (torch.isnan(t) & torch.isnan(e4m3.to(t.dtype)))
        if not bool(same.all()):
            raise ValueError(f"{fn}: {key} holds {t.dtype} values that are not all float8_e4m3fn numbers "
                             f"(NVFP4 block scales are e4m3); refusing to round them")
        return e4m3
    raise TypeError(f"{fn}: {key} must be torch.float8_e4m3fn (or torch.uint8 holding its bytes, or "
                    f"float values that are e4m3 numbers), got {t.dtype}")


def _fp32_scale(fn: str, key: str, t: torch.Tensor, shapes: tuple) -> torch.Tensor:
    """A float scale converted exactly to fp32 (bf16, fp16 and fp32 all convert without rounding)."""
    if t.dtype not in _FLOAT_SCALE_DTYPES:
        raise TypeError(f"{fn}: {key} must be torch.float32, torch.bfloat16 or torch.float16, got {t.dtype}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{fn}: {key} must have shape {' or '.join(map(str, shapes))}, got "
                         f"{tuple(t.shape)}")
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _scalar_fp32(fn: str, key: str, t: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale stored as () or (1,), as a 0-d fp32 tensor (converted exactly)."""
    return _fp32_scale(fn, key, t, ((), (1,))).reshape(())


def _check_shape(fn: str, key: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{fn}: {key} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def _logical_scale(q) -> torch.Tensor:
    """The block scale of a tilemm tensor in its logical (..., N, K / block) layout."""
    if not q.swizzled:
        return q.scale
    rows, cols = q.data.shape[-2], q.format.logical_k(q.data.shape[-1]) // q.format.block
    return unswizzle_32_4_4(q.scale, rows, cols)


def _encode_scale(decode: torch.Tensor) -> torch.Tensor:
    """NVFP4 per-tensor encode scale from tilemm's decode scale: fp32(1 / decode), as (1,) fp32."""
    return (torch.ones((), dtype=torch.float32, device=decode.device) / decode.to(torch.float32)).reshape(1)


def _decode_scale(encode: torch.Tensor) -> torch.Tensor:
    """tilemm's 0-d decode scale from an NVFP4 encode scale: fp32(1 / encode)."""
    return torch.ones((), dtype=torch.float32, device=encode.device) / encode


# ----------------------------------------------------------------------------------------------
# compressed-tensors
# ----------------------------------------------------------------------------------------------


def _check_ct_weight_args(fn: str, fmt: str, weights: Mapping | None) -> None:
    """Compare the config's ``weights`` QuantizationArgs (a dict) with what ``fmt`` stores."""
    if weights is None:
        return
    if not isinstance(weights, Mapping):
        raise TypeError(f"{fn}: weights must be the 'weights' entry of a compressed-tensors config "
                        f"group (a dict), got {type(weights).__name__}")
    expected = {"nvfp4": (4, 16), "mxfp4": (4, 32), "mxfp8": (8, 32), "fp8": (8, None)}[fmt]
    got_type = weights.get("type", "float")
    got = (weights.get("num_bits"), weights.get("group_size"))
    if got_type != "float" or got[0] != expected[0] or (expected[1] is not None and got[1] != expected[1]):
        raise ValueError(f"{fn}: weights args type={got_type!r}, num_bits={got[0]!r}, group_size={got[1]!r} "
                         f"do not describe {_COMPRESSED_TENSORS_FORMAT_OF[fmt]} (type 'float', "
                         f"num_bits {expected[0]}" + (f", group_size {expected[1]})" if expected[1] else ")"))
    if weights.get("symmetric", True) is not True:
        raise ValueError(f"{fn}: weights args symmetric={weights.get('symmetric')!r}: asymmetric "
                         f"(zero-point) quantization has no tilemm format")
    if fmt == "fp8":
        strategy = weights.get("strategy")
        block = weights.get("block_structure")
        if strategy not in (None, "tensor", "channel", "block") or (
                strategy == "block" and list(block or []) != [FP8_BLOCK, FP8_BLOCK]):
            raise ValueError(f"{fn}: FP8 weights with strategy={strategy!r}, block_structure={block!r} "
                             f"have no tilemm.nn.Linear layout; accepted: 'tensor', 'channel', 'block' with "
                             f"block_structure [128, 128]")


def from_compressed_tensors(tensors: Mapping[str, torch.Tensor], format: str, *,
                            weights: Mapping | None = None):
    """One layer of a compressed-tensors checkpoint -> the tilemm quantized tensor it holds.

    Args:
        tensors: the layer's tensors under their local names (``weight_packed``, ``weight_scale``,
            ``weight_global_scale``, ``weight``; ``input_scale`` / ``input_global_scale`` are accepted
            and not used).
        format: the compression format, one of :data:`COMPRESSED_TENSORS_FORMATS`.
        weights: optional, the config group's ``weights`` args (a dict); checked against ``format``.

    Layouts (compressed-tensors 0.20, ``compressors/{nvfp4,mxfp4,mxfp8,naive_quantized}``):

    * ``nvfp4-pack-quantized``: ``weight_packed`` uint8 (N, K/2), element 2i in the low nibble;
      ``weight_scale`` float8_e4m3fn (N, K/16); ``weight_global_scale`` fp32 (1,), the *encode*
      scale 448 * 6 / amax, so tilemm's decode scale is ``fp32(1 / weight_global_scale)``.
    * ``mxfp4-pack-quantized``: ``weight_packed`` as above; ``weight_scale`` uint8 (N, K/32) holding
      the biased exponent 127 + log2(scale), which is the e8m0 byte.
    * ``mxfp8-quantized``: ``weight`` float8_e4m3fn (N, K); ``weight_scale`` uint8 (N, K/32) e8m0.
    * ``float-quantized``: ``weight`` float8_e4m3fn (N, K); ``weight_scale`` in the model's float
      dtype, (N, 1) per channel, (1,) per tensor or (ceil(N/128), K/128) for 128x128 blocks;
      converted exactly to fp32.

    Returns an ``NVFP4Tensor``, ``MXFP4Tensor``, ``MXFP8Tensor`` or ``FP8Tensor`` with logical
    scales whose data and scale bytes are views of the given tensors.
    """
    fn = "tilemm.checkpoints.from_compressed_tensors"
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{fn}: tensors must be a mapping of the layer's tensor names to tensors, got "
                        f"{type(tensors).__name__}")
    if format not in COMPRESSED_TENSORS_FORMATS:
        raise ValueError(f"{fn}: format must be one of {', '.join(map(repr, COMPRESSED_TENSORS_FORMATS))}, "
                         f"got {format!r}")
    fmt = COMPRESSED_TENSORS_FORMATS[format]
    _check_ct_weight_args(fn, fmt, weights)
    where = f"format {format!r}"
    if fmt in ("nvfp4", "mxfp4"):
        desc = NVFP4 if fmt == "nvfp4" else MXFP4
        known = ("weight_packed", "weight_scale", "weight_shape") + (("weight_global_scale",)
                                                                     if fmt == "nvfp4" else ())
        _refuse_extra(fn, tensors, known, where)
        data = _packed_e2m1(fn, "weight_packed", _get(fn, tensors, "weight_packed", where), desc.block)
        n, k = data.shape[-2], 2 * data.shape[-1]
        if "weight_shape" in tensors:  # older releases stored the unpacked shape next to the bytes
            shape = [int(v) for v in _get(fn, tensors, "weight_shape", where).reshape(-1).tolist()]
            if shape != [*data.shape[:-1], k]:
                raise ValueError(f"{fn}: weight_shape {shape} does not match weight_packed "
                                 f"{tuple(data.shape)} (two elements per byte)")
        scale_shape = (*data.shape[:-1], k // desc.block)
        if fmt == "mxfp4":
            return MXFP4Tensor(data, _e8m0_scale(fn, "weight_scale", _get(fn, tensors, "weight_scale", where),
                                                 scale_shape))
        scale = _e4m3_scale(fn, "weight_scale", _get(fn, tensors, "weight_scale", where), scale_shape)
        encode = _scalar_fp32(fn, "weight_global_scale", _get(fn, tensors, "weight_global_scale", where))
        return NVFP4Tensor(data, scale, _decode_scale(encode))
    _refuse_extra(fn, tensors, ("weight", "weight_scale"), where)
    data = _fp8_elements(fn, "weight", _get(fn, tensors, "weight", where), 32 if fmt == "mxfp8" else 1)
    scale = _get(fn, tensors, "weight_scale", where)
    if fmt == "mxfp8":
        return MXFP8Tensor(data, _e8m0_scale(fn, "weight_scale", scale, (*data.shape[:-1],
                                                                         data.shape[-1] // 32)))
    n, k = data.shape[-2], data.shape[-1]
    lead = tuple(data.shape[:-2])
    channel, blocks = (*lead, n, 1), (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    per_tensor = ((), (1,))
    strategy = (weights or {}).get("strategy")
    allowed = {"channel": (channel,), "tensor": per_tensor, "block": (blocks,),
               None: (*per_tensor, channel, blocks)}[strategy]
    s = _fp32_scale(fn, "weight_scale", scale, allowed)
    if tuple(s.shape) in per_tensor:
        return FP8Tensor(data, s.reshape(()))
    if tuple(s.shape) != channel and k % FP8_BLOCK:
        # compressed-tensors pads a partial last column block; tilemm's 128x128 blocks need K % 128 == 0.
        raise ValueError(f"{fn}: 128x128-block FP8 weights need K a multiple of 128, got weight shape "
                         f"{tuple(data.shape)}")
    return FP8Tensor(data, s)


def to_compressed_tensors(q) -> tuple[dict[str, torch.Tensor], str, dict]:
    """A tilemm quantized weight -> (the layer's tensors, the compression format, its ``weights`` args).

    The inverse of :func:`from_compressed_tensors`: bytes are views where the layouts agree; scales
    are unswizzled; NVFP4's decode scale becomes the encode scale ``fp32(1 / global_scale)``
    (which dequantizes within 2^-22 relative of tilemm's value; see ``docs/checkpoints.md``).
    Raises ValueError for what compressed-tensors cannot hold: e5m2 elements, FP8 1x128 blocks.
    """
    fn = "tilemm.checkpoints.to_compressed_tensors"
    _check_quantized(fn, q)
    base = {"type": "float", "symmetric": True, "dynamic": False}
    if isinstance(q, NVFP4Tensor):
        tensors = {"weight_packed": q.data, "weight_scale": _logical_scale(q),
                   "weight_global_scale": _encode_scale(q.global_scale)}
        args = dict(base, num_bits=4, group_size=16, strategy="tensor_group",
                    scale_dtype="torch.float8_e4m3fn", zp_dtype="torch.float8_e4m3fn")
        return tensors, "nvfp4-pack-quantized", args
    if isinstance(q, MXFP4Tensor):
        tensors = {"weight_packed": q.data, "weight_scale": _logical_scale(q).view(torch.uint8)}
        args = dict(base, num_bits=4, group_size=32, strategy="group", scale_dtype="torch.uint8",
                    zp_dtype="torch.uint8")
        return tensors, "mxfp4-pack-quantized", args
    if q.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fn}: compressed-tensors stores 8-bit float weights as float8_e4m3fn; got "
                         f"{q.data.dtype} elements")
    if isinstance(q, MXFP8Tensor):
        tensors = {"weight": q.data, "weight_scale": _logical_scale(q).view(torch.uint8)}
        args = dict(base, num_bits=8, group_size=32, strategy="group", scale_dtype="torch.uint8",
                    zp_dtype="torch.uint8")
        return tensors, "mxfp8-quantized", args
    n, k = q.data.shape[-2], q.data.shape[-1]
    if q.scale.ndim == 0:
        tensors, args = {"weight": q.data, "weight_scale": q.scale.reshape(1)}, dict(base, strategy="tensor")
    elif tuple(q.scale.shape[-2:]) == (n, 1):
        tensors, args = {"weight": q.data, "weight_scale": q.scale}, dict(base, strategy="channel")
    elif tuple(q.scale.shape[-2:]) == (-(-n // FP8_BLOCK), k // FP8_BLOCK) and k % FP8_BLOCK == 0:
        tensors = {"weight": q.data, "weight_scale": q.scale}
        args = dict(base, strategy="block", block_structure=[FP8_BLOCK, FP8_BLOCK])
    else:
        raise ValueError(f"{fn}: FP8 scale of shape {tuple(q.scale.shape)} for weight {tuple(q.data.shape)} "
                         f"is not per tensor, per channel or 128x128 blocks")
    return tensors, "float-quantized", dict(args, num_bits=8, group_size=None)


# ----------------------------------------------------------------------------------------------
# NVIDIA ModelOpt
# ----------------------------------------------------------------------------------------------


def from_modelopt(tensors: Mapping[str, torch.Tensor], *, quant_algo: str | None = None):
    """One layer of an NVIDIA ModelOpt (TensorRT Model Optimizer) checkpoint -> a tilemm tensor.

    Layouts (ModelOpt 0.47, ``NVFP4QTensor`` and its Hugging Face export):

    * NVFP4 (``quant_algo="NVFP4"``): ``weight`` uint8 (N, K/2), element 2i in the low nibble;
      ``weight_scale`` float8_e4m3fn (N, K/16); ``weight_scale_2`` fp32 0-d, the *decode* scale
      amax / (448 * 6), taken as it is.
    * ``quant_algo="W4A16_NVFP4"`` (weight-only NVFP4): the same tensors as NVFP4.
    * FP8 per tensor (``quant_algo="FP8"``): ``weight`` float8_e4m3fn (N, K); ``weight_scale`` fp32
      0-d (a decode scale).

    ``quant_algo`` (from ``hf_quant_config.json``) is optional; without it the layout decides.
    ``input_scale`` and the FP8 KV cache's ``k_scale`` / ``v_scale`` are accepted and not used here
    (:func:`load_quantized` keeps the latter as buffers).
    """
    fn = "tilemm.checkpoints.from_modelopt"
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{fn}: tensors must be a mapping of the layer's tensor names to tensors, got "
                        f"{type(tensors).__name__}")
    if quant_algo is not None and quant_algo not in MODELOPT_ALGOS:
        raise ValueError(f"{fn}: quant_algo must be one of {', '.join(map(repr, MODELOPT_ALGOS))}, got "
                         f"{quant_algo!r}")
    weight = _get(fn, tensors, "weight", "a ModelOpt layer")
    algo = quant_algo or ("NVFP4" if weight.dtype == torch.uint8 else "FP8")
    where = f"ModelOpt {algo}"
    tensors = {k: v for k, v in tensors.items() if k not in KV_CACHE_SCALE_NAMES}
    if algo in ("NVFP4", "W4A16_NVFP4"):
        _refuse_extra(fn, tensors, ("weight", "weight_scale", "weight_scale_2"), where)
        data = _packed_e2m1(fn, "weight", weight, NVFP4.block)
        scale = _e4m3_scale(fn, "weight_scale", _get(fn, tensors, "weight_scale", where),
                            (*data.shape[:-1], 2 * data.shape[-1] // NVFP4.block))
        decode = _scalar_fp32(fn, "weight_scale_2", _get(fn, tensors, "weight_scale_2", where))
        return NVFP4Tensor(data, scale, decode)
    _refuse_extra(fn, tensors, ("weight", "weight_scale"), where)
    data = _fp8_elements(fn, "weight", weight)
    return FP8Tensor(data, _scalar_fp32(fn, "weight_scale", _get(fn, tensors, "weight_scale", where)))


def to_modelopt(q) -> dict[str, torch.Tensor]:
    """A tilemm NVFP4 or per-tensor FP8 weight -> the ModelOpt layer tensors (views; scales logical)."""
    fn = "tilemm.checkpoints.to_modelopt"
    _check_quantized(fn, q)
    if isinstance(q, NVFP4Tensor):
        return {"weight": q.data, "weight_scale": _logical_scale(q),
                "weight_scale_2": q.global_scale.to(torch.float32).reshape(())}
    if isinstance(q, FP8Tensor) and q.scale.ndim == 0 and q.data.dtype == torch.float8_e4m3fn:
        return {"weight": q.data, "weight_scale": q.scale}
    raise ValueError(f"{fn}: ModelOpt checkpoints hold NVFP4 or per-tensor float8_e4m3fn FP8 here; got "
                     f"{type(q).__name__} with {q.data.dtype} data and scale shape {tuple(q.scale.shape)}")


# ----------------------------------------------------------------------------------------------
# gpt-oss
# ----------------------------------------------------------------------------------------------


def from_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> MXFP4Tensor:
    """gpt-oss MXFP4 (``*_blocks`` and ``*_scales``) -> an MXFP4Tensor (views, no copy).

    gpt-oss stores each expert projection of logical shape (..., N, K) (N outputs, K inputs; e.g.
    ``gate_up_proj`` (experts, 2 * intermediate, hidden)) as ``blocks`` uint8 (..., N, K/32, 16), 32
    e2m1 elements of one block in 16 bytes with element 2i in the low nibble of byte i, and
    ``scales`` uint8 (..., N, K/32) holding e8m0 bytes (2^(s - 127)); this is the layout that
    transformers' ``convert_moe_packed_tensors`` decodes. The result's data is ``blocks`` viewed as
    (..., N, K/2). transformers multiplies ``x @ W`` with W the transposed (..., K, N) dequantized
    tensor, so one expert's ``MXFP4Tensor[e]`` is a ``tilemm.nn.Linear`` weight as it is.
    """
    fn = "tilemm.checkpoints.from_gpt_oss"
    for name, t in (("blocks", blocks), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if blocks.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"{fn}: blocks must be torch.uint8 (two e2m1 per byte), got {blocks.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != MXFP4.block // 2 or blocks.shape[-2] == 0:
        raise ValueError(f"{fn}: blocks must be (..., N, K/32, 16), got shape {tuple(blocks.shape)}")
    scale = _e8m0_scale(fn, "scales", scales, tuple(blocks.shape[:-1]))
    return MXFP4Tensor(blocks.view(torch.uint8).reshape(*blocks.shape[:-2], -1), scale)


def to_gpt_oss(q: MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4Tensor -> gpt-oss ``(blocks, scales)``: uint8 (..., N, K/32, 16) and uint8 (..., N, K/32)."""
    fn = "tilemm.checkpoints.to_gpt_oss"
    if not isinstance(q, MXFP4Tensor):
        raise TypeError(f"{fn}: q must be an MXFP4Tensor (gpt-oss stores MXFP4 only), got {type(q).__name__}")
    scale = _logical_scale(q)
    return q.data.reshape(*scale.shape, MXFP4.block // 2), scale.view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# torchao
# ----------------------------------------------------------------------------------------------


def _torchao_classes():
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor as AoNVFP4Tensor
    except ImportError as err:
        raise ImportError("the 'torchao' convention needs torchao (pip install torchao, with the PyTorch "
                          f"build it was made for): {err}") from None
    return MXTensor, AoNVFP4Tensor


def _torchao_scale(fn: str, t, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """torchao keeps a swizzled scale as a flat (or 2-D) tensor in the 32x4x4 block order; tilemm's
    swizzled shape (R/128, C/4, 32, 16) is a view of the same bytes."""
    if not t.is_swizzled_scales:
        return scale
    if t.qdata.ndim != 2:
        raise ValueError(f"{fn}: swizzled torchao scales are read for 2-D weights; got qdata shape "
                         f"{tuple(t.qdata.shape)}")
    return scale.contiguous().reshape(-(-rows // 128), -(-cols // 4), 32, 16)


def from_torchao(t):
    """A torchao ``NVFP4Tensor`` or ``MXTensor`` -> the tilemm tensor with the same bytes (views).

    torchao (0.18, ``prototype.mx_formats``) packs e2m1 with element 2i in the low nibble, keeps e8m0
    scales as float8_e8m0fnu and NVFP4 block scales as float8_e4m3fn, and its NVFP4
    ``per_tensor_scale`` is the *decode* scale amax / (448 * 6), as tilemm's ``global_scale``. A
    missing ``per_tensor_scale`` (single-level NVFP4) is a decode scale of 1. Swizzled scales
    (``is_swizzled_scales=True``, 2-D weights) come back in tilemm's swizzled shape. Transposed
    tensors (a ``.t()`` of a quantized weight) are refused: tilemm's weights are (N, K) row-major.
    """
    fn = "tilemm.checkpoints.from_torchao"
    MXTensor, AoNVFP4Tensor = _torchao_classes()
    if isinstance(t, AoNVFP4Tensor):
        if t.block_size != NVFP4.block:
            raise ValueError(f"{fn}: NVFP4Tensor.block_size must be 16, got {t.block_size}")
        if t.qdata.ndim >= 2 and t.qdata.stride(-2) < t.qdata.stride(-1):
            raise ValueError(f"{fn}: a transposed NVFP4Tensor is not a row-major (N, K) weight; pass the "
                             f"untransposed tensor")
        data = _packed_e2m1(fn, "qdata", t.qdata, NVFP4.block)
        rows, cols = data.shape[-2], 2 * data.shape[-1] // NVFP4.block
        scale = _torchao_scale(fn, t, t.scale.view(torch.float8_e4m3fn), rows, cols)
        pts = t.per_tensor_scale
        if pts is None:
            decode = torch.ones((), dtype=torch.float32, device=data.device)
        else:
            if pts.ndim != 0:
                raise ValueError(f"{fn}: per-expert per_tensor_scale of shape {tuple(pts.shape)}: pass one "
                                 f"expert at a time (tilemm's NVFP4Tensor has one decode scale)")
            decode = _scalar_fp32(fn, "per_tensor_scale", pts)
        return NVFP4Tensor(data, scale, decode)
    if isinstance(t, MXTensor):
        if t.block_size != 32:
            raise ValueError(f"{fn}: MXTensor.block_size must be 32, got {t.block_size}")
        if not t.qdata.is_contiguous():
            raise ValueError(f"{fn}: a transposed MXTensor is not a row-major (N, K) weight; pass the "
                             f"untransposed tensor")
        if t.elem_dtype == torch.float4_e2m1fn_x2:
            data = _packed_e2m1(fn, "qdata", t.qdata, MXFP4.block)
            cols = 2 * data.shape[-1] // 32
            return MXFP4Tensor(data, _torchao_scale(fn, t, t.scale.view(torch.float8_e8m0fnu),
                                                    data.shape[-2], cols))
        if t.elem_dtype in _FP8_DTYPES:
            data = _fp8_elements(fn, "qdata", t.qdata, 32)
            return MXFP8Tensor(data, _torchao_scale(fn, t, t.scale.view(torch.float8_e8m0fnu),
                                                    data.shape[-2], data.shape[-1] // 32))
        raise ValueError(f"{fn}: MXTensor elem_dtype {t.elem_dtype} has no tilemm format; accepted: "
                         f"torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2")
    raise TypeError(f"{fn}: expected a torchao NVFP4Tensor or MXTensor, got {type(t).__name__}")


def to_torchao(q, *, orig_dtype: torch.dtype = torch.bfloat16):
    """A tilemm MXFP8 / MXFP4 / NVFP4 tensor -> the torchao tensor with the same bytes (views).

    ``orig_dtype`` is the high-precision dtype torchao reports (and dequantizes to by default).
    Swizzled 2-D scales stay swizzled (``is_swizzled_scales=True``); batched swizzled scales are
    unswizzled, because torchao swizzles the leading dimensions together with the rows.
    """
    fn = "tilemm.checkpoints.to_torchao"
    MXTensor, AoNVFP4Tensor = _torchao_classes()
    _check_quantized(fn, q)
    if isinstance(q, FP8Tensor):
        raise ValueError(f"{fn}: torchao's NVFP4Tensor / MXTensor hold block-scaled formats; got an FP8Tensor")
    swizzled = q.swizzled and q.data.ndim == 2
    scale = q.scale.reshape(-1) if swizzled else _logical_scale(q)
    if swizzled:
        scale = scale.reshape(q.scale.shape[0] * 32, q.scale.shape[1] * 16)
    if isinstance(q, NVFP4Tensor):
        return AoNVFP4Tensor(q.data, scale, NVFP4.block, orig_dtype, q.global_scale.to(torch.float32),
                             None, swizzled)
    elem = torch.float4_e2m1fn_x2 if isinstance(q, MXFP4Tensor) else q.data.dtype
    from torchao.quantization.quantize_.common import KernelPreference

    return MXTensor(q.data, scale, elem, 32, orig_dtype, KernelPreference.EMULATED, None, swizzled)


# ----------------------------------------------------------------------------------------------
# One layer, any convention
# ----------------------------------------------------------------------------------------------


def _check_quantized(fn: str, q) -> None:
    if not isinstance(q, _QUANTIZED):
        raise TypeError(f"{fn}: expected a tilemm MXFP8Tensor, MXFP4Tensor, NVFP4Tensor or FP8Tensor, got "
                        f"{type(q).__name__}")


def _check_convention(fn: str, convention) -> None:
    if not isinstance(convention, str) or convention not in CONVENTIONS:
        raise ValueError(f"{fn}: convention must be one of {', '.join(map(repr, CONVENTIONS))}, got "
                         f"{convention!r}")


def to_tilemm(tensors, convention: str | None, **options):
    """One layer's checkpoint tensors in ``convention`` -> a tilemm quantized tensor.

    ``tensors`` is: a mapping of the layer's tensors (``"compressed-tensors"``, with ``format=`` and
    optionally ``weights=``; ``"modelopt"``, optionally ``quant_algo=``), a ``(blocks, scales)`` pair
    (``"gpt-oss"``) or a torchao tensor (``"torchao"``). ``convention=None`` takes a tilemm tensor as
    it is.
    """
    fn = "tilemm.checkpoints.to_tilemm"
    if convention is None:
        if options:
            raise TypeError(f"{fn}: options {', '.join(sorted(options))} need a convention")
        _check_quantized(fn, tensors)
        return tensors
    _check_convention(fn, convention)
    if convention == "compressed-tensors":
        if "format" not in options:
            raise TypeError(f"{fn}: convention 'compressed-tensors' needs format= (one of "
                            f"{', '.join(map(repr, COMPRESSED_TENSORS_FORMATS))})")
        return from_compressed_tensors(tensors, **options)
    if convention == "modelopt":
        return from_modelopt(tensors, **options)
    if options:
        raise TypeError(f"{fn}: convention {convention!r} takes no options, got "
                        f"{', '.join(sorted(options))}")
    if convention == "gpt-oss":
        if not isinstance(tensors, (tuple, list)) or len(tensors) != 2:
            raise TypeError(f"{fn}: convention 'gpt-oss' takes a (blocks, scales) pair, got "
                            f"{type(tensors).__name__}")
        return from_gpt_oss(*tensors)
    return from_torchao(tensors)


def from_tilemm(q, convention: str, **options):
    """A tilemm quantized tensor -> ``convention``'s form (see the ``to_*`` function of each)."""
    fn = "tilemm.checkpoints.from_tilemm"
    _check_convention(fn, convention)
    if convention == "torchao":
        return to_torchao(q, **options)
    if options:
        raise TypeError(f"{fn}: convention {convention!r} takes no options, got {', '.join(sorted(options))}")
    return {"compressed-tensors": to_compressed_tensors, "modelopt": to_modelopt,
            "gpt-oss": to_gpt_oss}[convention](q)


def linear_options(q) -> tuple[str, dict]:
    """The ``tilemm.nn.Linear`` format and storage keywords that hold ``q`` as it is.

    FP8 granularity is read from the scale: 0-d -> ``"tensor"``, (N, 1) -> ``"row"``,
    (ceil(N/128), K/128) -> ``(128, 128)``.
    """
    fn = "tilemm.nn.Linear.from_quantized"
    _check_quantized(fn, q)
    if q.data.ndim != 2:
        raise ValueError(f"{fn}: a Linear weight is 2-D (out_features, in_features); got data of shape "
                         f"{tuple(q.data.shape)} (index one expert of a batched weight first)")
    if isinstance(q, MXFP8Tensor):
        return "mxfp8", {"elem_dtype": q.data.dtype}
    if isinstance(q, MXFP4Tensor):
        return "mxfp4", {}
    if isinstance(q, NVFP4Tensor):
        return "nvfp4", {}
    n, k = q.data.shape
    if q.scale.ndim == 0:
        return "fp8", {"granularity": "tensor", "elem_dtype": q.data.dtype}
    if tuple(q.scale.shape) == (n, 1):
        return "fp8", {"granularity": "row", "elem_dtype": q.data.dtype}
    if tuple(q.scale.shape) == (-(-n // FP8_BLOCK), k // FP8_BLOCK) and k % FP8_BLOCK == 0:
        return "fp8", {"granularity": (FP8_BLOCK, FP8_BLOCK), "elem_dtype": q.data.dtype}
    raise ValueError(f"{fn}: FP8 weight scale of shape {tuple(q.scale.shape)} for data {(n, k)} is not a "
                     f"tilemm.nn.Linear layout: accepted 0-d (tensor), ({n}, 1) (row) or "
                     f"({-(-n // FP8_BLOCK)}, {k // FP8_BLOCK}) (128x128 blocks)")


def scale_for_layout(q, swizzle: bool) -> torch.Tensor:
    """q's block scale in the layout a Linear stores: swizzled (32x4x4) or logical."""
    if isinstance(q, FP8Tensor) or q.swizzled == swizzle:
        return q.scale
    return swizzle_32_4_4(q.scale) if swizzle else _logical_scale(q)


# ----------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------


def _read_state_dict(fn: str, source) -> tuple[Mapping[str, torch.Tensor], dict | None]:
    """A state dict, a .safetensors file, or a directory of them (with config.json): tensors + config."""
    if isinstance(source, Mapping):
        return source, None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"{fn}: state_dict_or_path must be a mapping of names to tensors, a .safetensors "
                        f"file or a directory holding them, got {type(source).__name__}")
    from safetensors.torch import load_file

    path = os.fspath(source)
    if os.path.isfile(path):
        files, folder = [path], os.path.dirname(path)
    elif os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        folder = path
        if not files:
            raise ValueError(f"{fn}: no .safetensors files in {path!r}")
    else:
        raise ValueError(f"{fn}: {path!r} is neither a file nor a directory")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))  # memory-mapped CPU tensors, in their stored dtypes
    config = None
    for name in ("hf_quant_config.json", "config.json"):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            with open(p) as fh:
                data = json.load(fh)
            config = data.get("quantization", data.get("quantization_config"))
            if config is not None:
                break
    return tensors, config


def _matches_name(name: str, target: str) -> bool:
    """compressed-tensors' name targets: ``re:<regex>`` (``re.match`` on the module name) or the name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _matches_class(module: torch.nn.Module, target: str) -> bool:
    """compressed-tensors' class targets: the name of any torch.nn.Module class in the module's MRO."""
    return any(issubclass(c, torch.nn.Module) and c.__name__ == target for c in type(module).__mro__)


def _matches(name: str, module: torch.nn.Module, target: str) -> bool:
    return _matches_name(name, target) or _matches_class(module, target)


def _ct_scheme(config: Mapping, name: str, module: torch.nn.Module):
    """(format, weights args) of the config group that compressed-tensors gives this module, or None if
    its weight is not quantized.

    compressed-tensors' rules (0.20, ``apply_quantization_config`` / ``match_targets``): every target of
    every group maps to its group, a later group taking a target an earlier one also lists; a module in
    ``ignore`` is left alone; of the targets that match, an exact name comes first, then a regex (each
    kind in sorted order), then a class name; the first one's group is the module's. A group without
    ``weights`` leaves the weight unquantized."""
    if any(_matches(name, module, t) for t in config.get("ignore") or ()):
        return None
    target_group: dict[str, Mapping] = {}
    for group in (config.get("config_groups") or {}).values():
        for target in group.get("targets") or ():
            target_group[target] = group
    ordered = sorted(target_group, key=lambda t: ("re:" in t, t))
    matched = [t for t in ordered if _matches_name(name, t)]
    matched += [t for t in ordered if _matches_class(module, t) and t not in matched]
    if not matched:
        return None
    group = target_group[matched[0]]
    if not group.get("weights"):
        return None
    return group.get("format") or config.get("format"), group["weights"]


def _quantization_section(fn: str, convention: str, config: Mapping | None) -> Mapping | None:
    """The quantization config proper: a whole ``config.json`` (its ``quantization_config``) or
    ``hf_quant_config.json`` (its ``quantization``) is recognized and its section taken."""
    if config is None:
        return None
    for key in ("quantization_config", "quantization"):
        if isinstance(config.get(key), Mapping):
            return config[key]
    if convention == "compressed-tensors" and "config_groups" not in config:
        raise ValueError(f"{fn}: quantization_config has no 'config_groups' (keys: "
                         f"{', '.join(map(repr, sorted(config))) or 'none'}); pass the checkpoint's "
                         f"config['quantization_config'] (config.json's section), or the whole config.json")
    if convention == "modelopt" and "quant_algo" not in config:
        raise ValueError(f"{fn}: quantization_config has no 'quant_algo' (keys: "
                         f"{', '.join(map(repr, sorted(config))) or 'none'}); pass hf_quant_config.json's "
                         f"'quantization' section, or the whole file")
    return config


def _modelopt_algo(fn: str, config: Mapping) -> tuple[str, list]:
    algo = config.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise ValueError(f"{fn}: ModelOpt quant_algo {algo!r} is not one tilemm reads; accepted: "
                         f"{', '.join(map(repr, MODELOPT_ALGOS))}")
    return algo, list(config.get("exclude_modules") or config.get("ignore") or ())


def _keep_kv_cache_scales(model: torch.nn.Module, tensors: Mapping) -> set[str]:
    """Register each ``<module>.k_scale`` / ``<module>.v_scale`` of ``tensors`` as a buffer of that
    module of ``model`` (where it exists); returns the keys taken."""
    taken = set()
    for key, t in tensors.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf not in KV_CACHE_SCALE_NAMES or not prefix:
            continue
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            continue
        module.register_buffer(leaf, t)
        taken.add(key)
    return taken


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of the parameters that share one tensor (tied, e.g. ``lm_head.weight`` and the input
    embedding with ``tie_word_embeddings``), one list per tensor, in ``named_parameters`` order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(fn: str, model: torch.nn.Module, tied: list[list[str]], loaded: Mapping) -> set[str]:
    """Tie again what ``load_state_dict(assign=True)`` untied: every name of a tied group takes the
    parameter of the group's first name that the checkpoint holds (the writers store a tied tensor
    once, as transformers' ``save_pretrained`` does). Returns the names filled that way. A name whose
    own checkpoint tensor differs from that one is an error: the model ties what the checkpoint does
    not."""
    own = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    for group in tied:
        group = [n for n in group if n in own]  # a tied Linear swapped for a tilemm layer is gone
        present = [n for n in group if n in loaded]
        if len(group) < 2 or not present:
            continue
        source = present[0]
        param = own[source]
        for name in group:
            if name == source:
                continue
            if name in loaded and not torch.equal(loaded[name], loaded[source]):
                raise ValueError(f"{fn}: the model ties {name!r} to {source!r}, but the checkpoint holds "
                                 f"different tensors for them; build the model with the checkpoint's "
                                 f"config (e.g. tie_word_embeddings=False)")
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, param)
            filled.add(name)
    return filled


def load_quantized(model: torch.nn.Module, state_dict_or_path, *, convention: str,
                   quantization_config: Mapping | None = None, weight_only: bool | None = None,
                   swizzle: bool | None = None, strict: bool = True) -> torch.nn.Module:
    """Load a quantized checkpoint into ``model``, swapping its quantized ``torch.nn.Linear`` layers for
    ``tilemm.nn.Linear``, in place.

    Args:
        model: the architecture of the checkpoint (e.g. built from its config with random weights);
            layers are matched by name.
        state_dict_or_path: the checkpoint's tensors: a mapping, a ``.safetensors`` file, or a
            directory of them; a directory's ``config.json`` (``quantization_config``) or
            ``hf_quant_config.json`` (``quantization``) is read when ``quantization_config`` is None.
        convention: ``"compressed-tensors"``, ``"modelopt"`` or ``"torchao"`` (tensor-subclass
            weights in the state dict, e.g. ``model.state_dict()`` after ``torchao.quantize_``).
            ``"gpt-oss"``: the MXFP4 experts blocks (``*_blocks`` / ``*_scales``) become
            ``tilemm.moe.MoEExperts`` modules; every other tensor loads as it is.
        quantization_config: compressed-tensors: the ``quantization_config`` dict (config groups
            with targets, ``ignore``, ``format``); ModelOpt: the ``quantization`` dict of
            ``hf_quant_config.json`` (``quant_algo``, ``exclude_modules``). Required for those two.
            The whole ``config.json`` / ``hf_quant_config.json`` dict is recognized too (its
            ``quantization_config`` / ``quantization`` section is taken); a dict that is neither
            raises ValueError.
        weight_only, swizzle: as for ``tilemm.nn.Linear.from_quantized``. ``weight_only=None`` (the
            default) follows the checkpoint: True for ModelOpt ``W4A16_NVFP4`` (16-bit activations),
            False otherwise.
        strict: raise ValueError when a checkpoint tensor is not used or a parameter is missing
            (static activation scales are always accepted and dropped, see the module docstring; an
            FP8 KV cache's ``k_scale`` / ``v_scale`` are always accepted and kept, as buffers of the
            module they are stored under, e.g. ``model.model.layers[0].self_attn.k_proj.k_scale``).

    Every other tensor (embeddings, norms, unquantized layers) is loaded with
    ``load_state_dict(..., assign=True)``, so it keeps the checkpoint's dtype. Parameters the model
    ties (an ``lm_head`` tied to the input embedding, which compressed-tensors and ModelOpt
    checkpoints store once, under the embedding) stay tied: each takes the one stored tensor.

    Returns:
        ``model``.
    """
    fn = "tilemm.load_quantized"
    from .nn import Linear  # tilemm.nn imports this module lazily too

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_convention(fn, convention)
    tensors, found_config = _read_state_dict(fn, state_dict_or_path)
    if convention == "gpt-oss":
        used, new_keys = _load_gpt_oss_experts(fn, model, tensors)
        return _load_rest(fn, model, tensors, used, new_keys, strict)
    config = quantization_config if quantization_config is not None else found_config
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"{fn}: quantization_config must be a dict, got {type(config).__name__}")
    config = _quantization_section(fn, convention, config)
    if convention in ("compressed-tensors", "modelopt") and config is None:
        raise ValueError(f"{fn}: convention {convention!r} needs the checkpoint's quantization config: pass "
                         f"quantization_config= or a directory with config.json / hf_quant_config.json")
    if convention == "compressed-tensors" and config.get("quant_method", "compressed-tensors") != \
            "compressed-tensors":
        raise ValueError(f"{fn}: quantization_config has quant_method {config.get('quant_method')!r}, "
                         f"expected 'compressed-tensors'")
    if convention == "modelopt":
        algo, exclude = _modelopt_algo(fn, config)
    if weight_only is None:
        weight_only = convention == "modelopt" and algo == "W4A16_NVFP4"

    # gpt-oss experts blocks whose experts the checkpoint stores quantized: MoEExperts
    used, new_keys = _load_quantized_experts(fn, model, tensors, convention, config,
                                             algo if convention == "modelopt" else None)
    converted: dict[int, Linear] = {}
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if type(module) is not torch.nn.Linear:
            continue
        prefix = name + "." if name else ""
        local = {k[len(prefix):]: v for k, v in tensors.items()
                 if k.startswith(prefix) and "." not in k[len(prefix):]}
        if convention == "compressed-tensors":
            scheme = _ct_scheme(config, name, module)
            if scheme is None:
                continue
            layer, options = local, dict(format=scheme[0], weights=scheme[1])
        elif convention == "modelopt":
            if any(fnmatch.fnmatchcase(name, p) for p in exclude) or "weight_scale" not in local:
                continue
            layer, options = local, dict(quant_algo=algo)
        else:
            if not isinstance(local.get("weight"), _torchao_classes()):
                continue
            layer, options = local["weight"], {}
        if not name:
            raise ValueError(f"{fn}: model is a bare torch.nn.Linear; use tilemm.nn.Linear.from_quantized")
        bias = local.get("bias")
        if convention != "torchao":
            layer = {k: v for k, v in local.items() if k != "bias" and k not in KV_CACHE_SCALE_NAMES}
        weight_tensors = layer if convention != "torchao" else {"weight": layer}
        try:
            q = to_tilemm(layer, convention, **options)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{fn}: layer {name!r}: {err}") from None
        n = q.data.shape[-2]
        k = q.data.shape[-1] if isinstance(q, FP8Tensor) else q.format.logical_k(q.data.shape[-1])
        if (module.out_features, module.in_features) != (n, k):
            raise ValueError(f"{fn}: layer {name!r} is (out, in) = ({module.out_features}, "
                             f"{module.in_features}) in the model but ({n}, {k}) in the checkpoint")
        if (bias is None) != (module.bias is None):
            raise ValueError(f"{fn}: layer {name!r} has {'a' if module.bias is not None else 'no'} bias "
                             f"in the model but {'one' if bias is not None else 'none'} in the checkpoint")
        if id(module) not in converted:
            converted[id(module)] = Linear.from_quantized(q, bias=bias, weight_only=weight_only,
                                                          swizzle=swizzle)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, converted[id(module)])
        used.update(prefix + key for key in weight_tensors)
        used.update(prefix + key for key in local if key == "bias")
        new_keys.update(prefix + key for key in converted[id(module)].state_dict())
    return _load_rest(fn, model, tensors, used, new_keys, strict)


def _load_rest(fn: str, model, tensors, used: set, new_keys: set, strict: bool):
    """Load the checkpoint tensors the swapped modules did not take (``load_state_dict(assign=True)``),
    and with ``strict`` refuse a missing parameter or an unused tensor. Parameters the model ties stay
    tied (``_retie``)."""
    tied = _tied_groups(model)  # before load_state_dict(assign=True) breaks the ties
    dropped = {k for k in tensors if k.rpartition(".")[2] in ACTIVATION_SCALE_NAMES}
    own = set(model.state_dict())
    kv_scales = _keep_kv_cache_scales(model, {k: v for k, v in tensors.items() if k not in own})
    used |= kv_scales
    new_keys |= kv_scales
    rest = {k: v for k, v in tensors.items() if k not in used and k not in dropped}
    result = model.load_state_dict({k: v for k, v in rest.items() if k in own}, strict=False, assign=True)
    retied = _retie(fn, model, tied, rest)
    if strict:
        missing = sorted(set(result.missing_keys) - new_keys - retied)
        unexpected = sorted(k for k in rest if k not in own)
        if missing or unexpected:
            raise ValueError(f"{fn}: the checkpoint does not fit the model: missing "
                             f"{', '.join(missing) or 'none'}; not used {', '.join(unexpected) or 'none'}")
    return model


def _load_gpt_oss_experts(fn: str, model: torch.nn.Module, tensors: Mapping) -> tuple[set, set]:
    """Replace every gpt-oss experts block of ``model`` (transformers' ``GptOssExperts``, or a
    ``tilemm.moe.MoEExperts``) by a ``MoEExperts`` filled from the checkpoint's ``<name>.gate_up_proj_blocks``
    / ``_scales`` / ``_bias`` and ``<name>.down_proj_*``: the MXFP4 bytes are prepacked expert by expert
    on the module's device (the CPU for a meta module); no bf16 expert is built. Returns (checkpoint
    keys used, the new modules' state-dict keys)."""
    from .moe import GPT_OSS_EXPERTS, MoEExperts

    used: set[str] = set()
    new_keys: set[str] = set()
    found = 0
    for name, module in list(model.named_modules()):
        if not (type(module).__name__ == GPT_OSS_EXPERTS or isinstance(module, MoEExperts)) or not name:
            continue
        found += 1
        prefix = name + "."
        keys = {f"{p}_{s}": prefix + f"{p}_{s}" for p in ("gate_up_proj", "down_proj")
                for s in ("blocks", "scales")}
        missing = [k for k in keys.values() if k not in tensors]
        if missing:
            raise ValueError(f"{fn}: experts {name!r}: the checkpoint has no {', '.join(missing)} (gpt-oss "
                             f"MXFP4 experts are stored as <name>.gate_up_proj_blocks / _scales and "
                             f"<name>.down_proj_blocks / _scales)")
        try:
            gate_up = from_gpt_oss(tensors[keys["gate_up_proj_blocks"]], tensors[keys["gate_up_proj_scales"]])
            down = from_gpt_oss(tensors[keys["down_proj_blocks"]], tensors[keys["down_proj_scales"]])
        except (TypeError, ValueError) as err:
            raise type(err)(f"{fn}: experts {name!r}: {err}") from None
        e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
        for proj, q, want in (("gate_up_proj", gate_up, (e, 2 * i, h)), ("down_proj", down, (e, h, i))):
            got = (*q.data.shape[:-1], 2 * q.data.shape[-1])
            if got != want:
                raise ValueError(f"{fn}: experts {name!r}: {proj} is (E, N, K) = {want} in the model but "
                                 f"{got} in the checkpoint")
        biases = {}
        for proj, n in (("gate_up_proj", 2 * i), ("down_proj", h)):
            b = tensors.get(prefix + proj + "_bias")
            if b is not None and tuple(b.shape) != (e, n):
                raise ValueError(f"{fn}: experts {name!r}: {proj}_bias is {tuple(b.shape)} in the checkpoint, "
                                 f"expected (E, N) = ({e}, {n})")
            biases[proj] = b
            if b is not None:
                used.add(prefix + proj + "_bias")
        device = next((t.device for t in module.buffers() if t.device.type != "meta"),
                      next((t.device for t in module.parameters() if t.device.type != "meta"),
                           torch.device("cpu")))
        from .packed import prepack

        packed = [prepack([MXFP4Tensor(q.data[x].to(device), q.scale[x].to(device)) for x in range(e)])
                  for q in (gate_up, down)]
        new = MoEExperts(*packed, biases["gate_up_proj"], biases["down_proj"],
                         alpha=getattr(module, "alpha", 1.702), limit=getattr(module, "limit", 7.0))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        used.update(keys.values())
        new_keys.update(prefix + k for k in new.state_dict())
    if not found:
        raise ValueError(f"{fn}: convention 'gpt-oss' loads gpt-oss experts blocks (GptOssExperts), and "
                         f"model has none")
    return used, new_keys


def export_quantized(model: torch.nn.Module, convention: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A model's state dict in ``convention`` (``"compressed-tensors"`` or ``"modelopt"``) and the
    quantization config to put next to it (compressed-tensors: ``config.json``'s
    ``quantization_config``; ModelOpt: ``hf_quant_config.json``'s ``quantization``).

    Every ``tilemm.nn.Linear`` becomes that convention's tensors (see :func:`to_compressed_tensors`,
    :func:`to_modelopt`); every other tensor is passed through. Tensors are views where the layouts
    agree, so save them (``safetensors.torch.save_file``) before changing the model.
    """
    fn = "tilemm.export_quantized"
    from .nn import Linear

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    if convention not in ("compressed-tensors", "modelopt"):
        raise ValueError(f"{fn}: convention must be 'compressed-tensors' or 'modelopt', got {convention!r}")
    state = dict(model.state_dict())
    groups: dict[tuple, list[str]] = {}
    algos = set()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    if not layers:
        raise ValueError(f"{fn}: model has no tilemm.nn.Linear layer to export")
    ignore = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, module in layers:
        prefix = name + "." if name else ""
        for key in ("weight", "weight_scale", "weight_global_scale"):
            state.pop(prefix + key, None)
        q = module.quantized_weight()
        if convention == "compressed-tensors":
            tensors, fmt, args = to_compressed_tensors(q)
            groups.setdefault((fmt, json.dumps(args, sort_keys=True)), []).append(name)
        else:
            tensors = to_modelopt(q)
            algos.add("NVFP4" if isinstance(q, NVFP4Tensor) else "FP8")
        state.update({prefix + k: v for k, v in tensors.items()})
    if convention == "modelopt":
        if len(algos) != 1:
            raise ValueError(f"{fn}: a ModelOpt checkpoint has one quant_algo; the model mixes "
                             f"{', '.join(sorted(algos))}")
        algo = algos.pop()
        config = {"quant_algo": algo, "exclude_modules": ignore}
        if algo == "NVFP4":
            config["group_size"] = NVFP4.block
        return state, config
    config_groups = {}
    for i, ((fmt, args), names) in enumerate(sorted(groups.items())):
        config_groups[f"group_{i}"] = {"targets": names, "weights": json.loads(args),
                                       "input_activations": None, "output_activations": None,
                                       "format": fmt}
    formats = {fmt for fmt, _ in groups}
    config = {"quant_method": "compressed-tensors", "quantization_status": "compressed",
              "format": formats.pop() if len(formats) == 1 else "mixed-precision",
              "config_groups": config_groups, "ignore": ignore}
    return state, config


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts blocks from compressed-tensors and ModelOpt checkpoints
# ----------------------------------------------------------------------------------------------

#: The projections of one expert in per-expert checkpoints (``<experts>.<i>.<proj>.<tensor>``).
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def _experts_device(module: torch.nn.Module) -> torch.device:
    return next((t.device for t in list(module.buffers()) + list(module.parameters()) if t.device.type != "meta"),
                torch.device("cpu"))


def _expert_indices(tensors: Mapping, prefix: str) -> list[int]:
    """The expert numbers i of the keys ``<prefix><i>.<proj>.<tensor>``, sorted."""
    found = set()
    for key in tensors:
        if key.startswith(prefix):
            head, _, rest = key[len(prefix):].partition(".")
            if head.isdigit() and rest.partition(".")[0] in _EXPERT_PROJS:
                found.add(int(head))
    return sorted(found)


def _interleave_gate_up(fn: str, where: str, gate, up):
    """gpt-oss's gate_up rows of one expert from separate gate (I, H) and up (I, H) quantized weights:
    row 2j = gate row j, row 2j + 1 = up row j (rows are quantized independently along K, so the
    interleaved tensor holds exactly both weights' values). NVFP4 needs one per-tensor scale for both."""
    if type(gate) is not type(up) or gate.data.shape != up.data.shape:
        raise ValueError(f"{fn}: {where}: gate_proj ({type(gate).__name__} {tuple(gate.data.shape)}) and up_proj "
                         f"({type(up).__name__} {tuple(up.data.shape)}) must have one format and shape")

    def rows(a, b):
        return torch.stack((a, b), dim=-2).reshape(*a.shape[:-2], 2 * a.shape[-2], a.shape[-1])

    data = rows(gate.data, up.data)
    scale = rows(_logical_scale(gate), _logical_scale(up))
    if isinstance(gate, NVFP4Tensor):
        if not bool((gate.global_scale == up.global_scale).all()):
            raise ValueError(f"{fn}: {where}: gate_proj and up_proj have different NVFP4 per-tensor scales "
                             f"({float(gate.global_scale)!r} and {float(up.global_scale)!r}); gpt-oss's fused gate_up "
                             f"projection has one per expert (quantize with shared gate / up global scales)")
        return NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), gate.global_scale)
    return type(gate)(data, scale)


def _refuse_fp8_experts(fn: str, where: str, q) -> None:
    if isinstance(q, FP8Tensor):
        raise ValueError(f"{fn}: {where}: FP8 experts (per tensor, per channel or 128x128 blocks) have no "
                         f"grouped-kernel layout; tilemm.moe takes MXFP4, NVFP4 or MXFP8 experts")


def _per_expert_weights(fn: str, name: str, tensors: Mapping, indices: list[int], convention: str,
                        config: Mapping | None, algo: str | None) -> tuple[list, list, dict, set]:
    """Per-expert checkpoints (compressed-tensors, ModelOpt per-expert export):
    ``<name>.<i>.{gate,up,down}_proj.<tensor>`` -> (gate_up quantized per expert, down per expert,
    biases, keys used)."""
    probe = torch.nn.Linear(1, 1, device="meta")  # compressed-tensors' class targets ("Linear") match it
    gate_up, down, used = [], [], set()
    biases: dict[str, list] = {"gate_up_proj": [], "down_proj": []}
    for i in indices:
        qs = {}
        for proj in _EXPERT_PROJS:
            layer = f"{name}.{i}.{proj}"
            local = {k[len(layer) + 1:]: v for k, v in tensors.items()
                     if k.startswith(layer + ".") and "." not in k[len(layer) + 1:]}
            bias = local.pop("bias", None)
            where = f"experts {name!r}: expert {i} {proj}"
            try:
                if convention == "compressed-tensors":
                    scheme = _ct_scheme(config, layer, probe)
                    if scheme is None:
                        raise ValueError("the quantization config leaves it unquantized (no config group "
                                         "targets it, or it is ignored)")
                    q = from_compressed_tensors(local, scheme[0], weights=scheme[1])
                else:
                    q = from_modelopt(local, quant_algo=algo)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{fn}: {where}: {err}") from None
            _refuse_fp8_experts(fn, where, q)
            qs[proj] = (q, bias)
            used.update(f"{layer}.{k}" for k in local)
            if bias is not None:
                used.add(f"{layer}.bias")
        gate_up.append(_interleave_gate_up(fn, f"experts {name!r}: expert {i}", qs["gate_proj"][0], qs["up_proj"][0]))
        down.append(qs["down_proj"][0])
        gb, ub = qs["gate_proj"][1], qs["up_proj"][1]
        if (gb is None) != (ub is None):
            raise ValueError(f"{fn}: experts {name!r}: expert {i} has a bias on only one of gate_proj and up_proj")
        biases["gate_up_proj"].append(None if gb is None else torch.stack((gb, ub), dim=-1).reshape(-1))
        biases["down_proj"].append(qs["down_proj"][1])
    stacked = {}
    for proj, values in biases.items():
        if all(v is None for v in values):
            stacked[proj] = None
        elif any(v is None for v in values):
            raise ValueError(f"{fn}: experts {name!r}: {proj} has a bias on some experts only")
        else:
            stacked[proj] = torch.stack(values)
    return gate_up, down, stacked, used


def _modelopt_fused_weights(fn: str, name: str, tensors: Mapping, algo: str) -> tuple[list, list, dict, set]:
    """ModelOpt's export of fused (bmm-style) gpt-oss experts, NVFP4 (ModelOpt 0.47,
    ``_export_quantized_weight``): ``<name>.gate_up_proj`` uint8 (E, K/2, N), the packed (E, N, K/2)
    bytes transposed back to transformers' (E, in, out) order; ``<name>.gate_up_proj_weight_scale``
    e4m3 (E, K/16, N) likewise; ``<name>.gate_up_proj_weight_scale_2`` fp32, the decode scale, one
    for all experts (() or (1,)) or one per expert (E,); ``_input_scale`` not used; ``_bias`` (E, N);
    the same for ``down_proj``. Each expert's bytes are transposed back (a byte copy)."""
    if algo not in ("NVFP4", "W4A16_NVFP4"):
        raise ValueError(f"{fn}: experts {name!r}: ModelOpt {algo} fused experts have no grouped-kernel layout; "
                         f"tilemm.moe takes NVFP4 ones from ModelOpt")
    out, used, biases = {}, set(), {}
    for proj in ("gate_up_proj", "down_proj"):
        key = f"{name}.{proj}"
        where = f"experts {name!r}: {proj}"
        data = _packed_e2m1(fn, key, _get(fn, tensors, key, where), 1)
        if data.ndim != 3:
            raise ValueError(f"{fn}: {key} must be (E, K/2, N), got shape {tuple(data.shape)}")
        e, half_k, n = data.shape
        if (2 * half_k) % NVFP4.block:
            raise ValueError(f"{fn}: {key} is (E, K/2, N) = {tuple(data.shape)}: K = {2 * half_k} is not a "
                             f"multiple of NVFP4's block {NVFP4.block}")
        scale = _e4m3_scale(fn, key + "_weight_scale", _get(fn, tensors, key + "_weight_scale", where),
                            (e, 2 * half_k // NVFP4.block, n))
        s2 = _get(fn, tensors, key + "_weight_scale_2", where)
        decode = _fp32_scale(fn, key + "_weight_scale_2", s2, ((), (1,), (e,))).reshape(-1).expand(e)
        data, scale = data.transpose(1, 2), scale.transpose(1, 2)
        out[proj] = [NVFP4Tensor(data[x].contiguous(), scale[x].contiguous(), decode[x].clone()) for x in range(e)]
        used.update(k for k in (key, key + "_weight_scale", key + "_weight_scale_2", key + "_input_scale")
                    if k in tensors)
        biases[proj] = tensors.get(key + "_bias")
        if biases[proj] is not None:
            used.add(key + "_bias")
    return out["gate_up_proj"], out["down_proj"], biases, used


def _load_quantized_experts(fn: str, model: torch.nn.Module, tensors: Mapping, convention: str,
                            config: Mapping | None, algo: str | None) -> tuple[set, set]:
    """Replace every gpt-oss experts block of ``model`` whose quantized experts the checkpoint holds
    by a ``tilemm.moe.MoEExperts`` (compressed-tensors: per-expert ``<name>.<i>.{gate,up,down}_proj``
    layers; ModelOpt: the same per-expert layers, or the fused NVFP4 export). gate_proj and up_proj
    rows are interleaved into gpt-oss's gate_up (``_interleave_gate_up``); bytes are prepacked on the
    module's device, no high-precision expert is built. A block the checkpoint stores unquantized is
    left to the plain state-dict load. Returns (checkpoint keys used, the new modules' keys)."""
    from .moe import GPT_OSS_EXPERTS, MoEExperts
    from .packed import prepack

    used: set[str] = set()
    new_keys: set[str] = set()
    for name, module in list(model.named_modules()):
        if not name or not (type(module).__name__ == GPT_OSS_EXPERTS or isinstance(module, MoEExperts)):
            continue
        indices = _expert_indices(tensors, name + ".")
        if indices:
            gate_up, down, biases, keys = _per_expert_weights(fn, name, tensors, indices, convention, config, algo)
        elif convention == "modelopt" and f"{name}.gate_up_proj_weight_scale" in tensors:
            gate_up, down, biases, keys = _modelopt_fused_weights(fn, name, tensors, algo)
        else:
            continue
        e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
        if indices and indices != list(range(e)):
            raise ValueError(f"{fn}: experts {name!r}: the model has {e} experts, the checkpoint experts "
                             f"{indices[0]} .. {indices[-1]} ({len(indices)} of them)")
        if len(gate_up) != e:
            raise ValueError(f"{fn}: experts {name!r}: the model has {e} experts, the checkpoint {len(gate_up)}")
        for proj, qs, want in (("gate_up_proj", gate_up, (2 * i, h)), ("down_proj", down, (h, i))):
            got = (qs[0].data.shape[-2], qs[0].format.logical_k(qs[0].data.shape[-1]))
            if got != want:
                raise ValueError(f"{fn}: experts {name!r}: {proj} is (N, K) = {want} per expert in the model but "
                                 f"{got} in the checkpoint")
            b = biases[proj]
            if b is not None and tuple(b.shape) != (e, want[0]):
                raise ValueError(f"{fn}: experts {name!r}: {proj}_bias is {tuple(b.shape)} in the checkpoint, "
                                 f"expected (E, N) = ({e}, {want[0]})")
        device = _experts_device(module)
        try:
            packed = [prepack([type(q)(*(t.to(device) for t in q)) for q in qs]) for qs in (gate_up, down)]
        except (TypeError, ValueError) as err:
            raise type(err)(f"{fn}: experts {name!r}: {err}") from None
        new = MoEExperts(*packed, biases["gate_up_proj"], biases["down_proj"],
                         alpha=getattr(module, "alpha", 1.702), limit=getattr(module, "limit", 7.0))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        used |= keys
        new_keys.update(f"{name}.{k}" for k in new.state_dict())
    return used, new_keys
