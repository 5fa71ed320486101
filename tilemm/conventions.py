"""One layer's quantized tensors as other tools store them: read into tilemm, bit for bit, and back.

A quantized checkpoint stores, per linear layer, the element bytes, the block scales and (NVFP4) a
per-tensor scale. The conventions below agree on the numbers and differ in small ways that are easy to
get wrong and that still give a model that runs: which nibble holds the first element, whether the
NVFP4 per-tensor scale is the *encode* scale (448 * 6 / amax) or its reciprocal, whether e8m0 scales
travel as ``uint8`` or ``float8_e8m0fnu``, whether e4m3 scales travel as ``uint8`` or ``float8_e4m3fn``,
and how the scales are laid out. Each converter here names its convention's choices and turns them
into tilemm's (``docs/numerics.md``): elements in the low nibble first, e8m0 / e4m3 scale bytes,
NVFP4's per-tensor decode scale ``global_scale`` as a 0-d fp32 tensor, scales logical (N, K / block)
or in the 32x4x4 layout. ``docs/checkpoints.md`` lists the layouts and where the writing libraries
compute differently.

* ``"compressed-tensors"`` (llm-compressor, vLLM): ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``,
  ``mxfp8-quantized``, ``float-quantized`` / ``naive-quantized`` (FP8 per channel, per tensor,
  128x128 blocks). Its NVFP4 ``weight_global_scale`` is the **encode** scale.
* ``"modelopt"`` (NVIDIA ModelOpt): NVFP4 and FP8 per tensor. ``weight_scale_2`` is the **decode** scale.
* ``"gpt-oss"``: MXFP4 ``*_blocks`` (..., N, K/32, 16) and ``*_scales`` (..., N, K/32), uint8.
* ``"torchao"``: ``NVFP4Tensor`` (``per_tensor_scale`` is the **decode** scale) and ``MXTensor``;
  logical or 32x4x4 scales; converted as views, no copy.

Data and scale bytes are reinterpreted (``Tensor.view``), never copied, except where tilemm's layout
differs: an NVFP4 encode scale becomes the decode scale ``fp32(1 / encode)`` (what vLLM computes from
the same checkpoint too); a float FP8 scale (bf16 / fp16) becomes fp32 exactly. ``tilemm.checkpoints``
re-exports these functions and adds the whole-model loader and exporter.
"""

from __future__ import annotations

from typing import Mapping

import torch

from swizzle import swizzle_32_4_4, swizzled_shape, unswizzle_32_4_4

from .formats import MXFP4, NVFP4, Granularity
from .numerics import ceil_div
from .quantize import FP8_BLOCK, FP8Tensor, MXFP4Tensor, MXFP8Tensor, NVFP4Tensor

__all__ = [
    "CONVENTIONS",
    "COMPRESSED_TENSORS_FORMATS",
    "MODELOPT_ALGOS",
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
    "scale_for_layout",
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
# ``tilemm.load_quantized`` keeps them as buffers of the module they are stored under, for an
# attention that uses an FP8 cache; tilemm's layers do not read them.
KV_CACHE_SCALE_NAMES = ("k_scale", "v_scale")
# Static activation scales: read by engines that quantize activations with a calibrated scale; tilemm
# quantizes activations per call (``tilemm.checkpoints``), so the converters and
# ``tilemm.load_quantized`` accept and drop them.
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
    channel, blocks = (*lead, n, 1), (*lead, ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK))
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
    elif tuple(q.scale.shape[-2:]) == (ceil_div(n, FP8_BLOCK), k // FP8_BLOCK) and k % FP8_BLOCK == 0:
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
    return scale.contiguous().reshape(swizzled_shape(rows, cols))


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
        return "fp8", {"granularity": Granularity.TENSOR.argument, "elem_dtype": q.data.dtype}
    if tuple(q.scale.shape) == (n, 1):
        return "fp8", {"granularity": Granularity.ROW.argument, "elem_dtype": q.data.dtype}
    if tuple(q.scale.shape) == (ceil_div(n, FP8_BLOCK), k // FP8_BLOCK) and k % FP8_BLOCK == 0:
        return "fp8", {"granularity": Granularity.BLOCK_128X128.argument, "elem_dtype": q.data.dtype}
    raise ValueError(f"{fn}: FP8 weight scale of shape {tuple(q.scale.shape)} for data {(n, k)} is not a "
                     f"tilemm.nn.Linear layout: accepted 0-d (tensor), ({n}, 1) (row) or "
                     f"({ceil_div(n, FP8_BLOCK)}, {k // FP8_BLOCK}) (128x128 blocks)")


def scale_for_layout(q, swizzle: bool) -> torch.Tensor:
    """q's block scale in the layout a Linear stores: swizzled (32x4x4) or logical."""
    if isinstance(q, FP8Tensor) or q.swizzled == swizzle:
        return q.scale
    return swizzle_32_4_4(q.scale) if swizzle else _logical_scale(q)
