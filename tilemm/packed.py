"""Prepacked weights for the weight-only matmul: ``prepack`` and ``unpack``.

Weights are static in inference, so the weight-only path stores them once in the layout its kernel
decodes cheapest (``tilemm.kernels.weight_only_kernels`` describes the "planes" layout), and keeps the
quantizers' tensors (``MXFP8Tensor``, ``MXFP4Tensor``, ``NVFP4Tensor``) as the interchange format:
``unpack(prepack(w))`` returns exactly the bytes of ``w`` (with logical scales).

A ``PackedWeight`` (its docstring lists the tensors) holds the elements as int32 words permuted within
K tiles, the scale bytes in the orientation the kernels load them, and a power-of-two exponent E: the
kernel's bf16 multipliers ``scale * 2^(offset - E)`` must stay finite, and the epilogue's alpha
carries 2^E (times NVFP4's per-tensor decode scale).

Weights that the kernel cannot reproduce exactly are refused with a ValueError naming the reason: an
e5m2 Inf element, a block whose dequantized values overflow fp32 (the reference gives +-inf there), or
an MX block scale of 2^127 (byte 254: it would need E = offset, outside the multipliers' exact range).

Stacked expert weights (mixture of experts, ``tilemm.moe_linear``): ``prepack`` of a 3-D (E, N, K)
quantized weight, or of a sequence of E quantized (N, K) weights (one per expert: NVFP4 experts with
their own per-tensor scales), gives one PackedWeight whose tensors carry a leading expert dimension
and one shared exponent E, the largest any expert needs. Each expert is prepacked on its own, so the
temporary fp32 copy of the finiteness check never exceeds one expert.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import swizzle as _swizzle

from .formats import Format
from .kernels.weight_only_kernels import E2M1_FIELDS, LAYOUTS, NVFP4_NORMAL, Layout
from .numerics import as_uint8, e2m1_decode, unpack_e2m1, pack_e2m1
from .quantize import MXFP4Tensor, MXFP8Tensor, NVFP4Tensor
from .reference import decode_scales

__all__ = ["PackedWeight", "prepack", "unpack", "layout_of", "expert", "relayout_words", "aligned_scale_t",
           "LAYOUT_VERSION"]

_FP32_MAX_LOG2 = 128.0  # values at or above 2^128 overflow fp32

#: Version of the prepacked layout: 3 since a single NVFP4 weight keeps its scale bytes row-major
#: (``Layout.scale_rows``; before, transposed like the others'), 2 since the e2m1 fields moved to
#: ``E2M1_FIELDS`` (1: magnitudes at lane bits 3p..3p+2, signs at 12 + p). Pickled PackedWeights and
#: ``MoEExperts`` state dicts record it, and an older layout is converted when it is loaded
#: (``relayout_words``; the scales in ``PackedWeight.__setstate__``).
LAYOUT_VERSION = 3


def layout_of(fmt: Format, normal_scales: bool = False) -> Layout:
    """The prepacked layout for a weight format (MXFP4, NVFP4, MXFP8 e4m3 / e5m2); ``normal_scales``:
    NVFP4's layout for a weight whose scale bytes ``prepack`` found all normal (``Layout``)."""
    layout = LAYOUTS.get(getattr(fmt, "name", None))
    if layout is None or layout.format != fmt:
        raise TypeError(f"prepack: weight-only layouts exist for MXFP4, NVFP4 and MXFP8 weights, got {fmt}")
    if not normal_scales:
        return layout
    if layout.format != NVFP4_NORMAL.format:
        raise ValueError(f"PackedWeight: normal_scales is for NVFP4 weights, got {fmt.name}")
    return NVFP4_NORMAL


def aligned_scale_t(scale_t: torch.Tensor) -> torch.Tensor:
    """A single weight's ``scale_t`` ((K / B, N), or NVFP4's (N, K / 16)) with every row starting on a
    16-byte boundary: itself where it does, else a view of a copy whose rows are padded to a multiple
    of 16 bytes. The kernels load scale tiles with the tensor memory accelerator, which takes 16-byte
    row strides only; with rows of another length the plain contiguous bytes would put them on a
    slower load path (``benchmarks/results/scale-row-alignment-*.txt``)."""
    if scale_t.ndim != 2 or (scale_t.stride(1) == 1 and scale_t.stride(0) * scale_t.element_size() % 16 == 0
                             and scale_t.data_ptr() % 16 == 0):
        return scale_t
    rows, n = scale_t.shape
    padded = torch.zeros(rows, -(-n // 16) * 16, dtype=scale_t.dtype, device=scale_t.device)
    padded[:, :n] = scale_t
    return padded[:, :n]


def _all_normal(scale: torch.Tensor, codes: torch.Tensor, block: int) -> bool:
    """Whether every e4m3 scale byte of ``scale`` (N, K / B) is normal and positive (exponent field 1..15,
    not the NaN byte 0x7F), or 0 over a block whose e2m1 ``codes`` (N, K) have zero magnitudes: the
    condition of ``Layout.normal_scales``. A byte 0 decodes to a finite multiplier there, which times
    zero elements gives the reference's signed zeros."""
    s = scale.view(torch.uint8)
    normal = (s >= 0x08) & (s < 0x7F)
    if bool(normal.all()):
        return True
    zero_data = (codes & 0x7).reshape(s.shape[0], s.shape[1], block).amax(dim=-1) == 0
    return bool((normal | ((s == 0) & zero_data)).all())


@dataclasses.dataclass(frozen=True, eq=False)
class PackedWeight:
    """A quantized (N, K) weight in the weight-only kernel's layout (see the module docstring).

    * ``words`` (N, k_tiles * words_per_tile) int32: the elements of each row, permuted within K tiles
      of ``layout.tile_k`` elements (K padded with zero elements to a whole tile). e2m1: each 16-bit
      lane holds one element of each of the 4 planes, its 3 magnitude bits and its sign at the bits
      ``E2M1_FIELDS`` names (chosen for the fewest decode instructions); 8-bit elements take a lane's
      low (plane 0) and high (plane 1) byte.
    * ``scale_t`` uint8: the scale bytes (e8m0, or e4m3 for NVFP4) in the orientation the kernels load
      them: transposed, (K / B, N), or for a single NVFP4 weight row-major, (N, K / 16)
      (``scale_rows``: one 16-byte vector per row and K tile). ``prepack`` starts each row of a single
      weight's scales on a 16-byte boundary (``aligned_scale_t``: a view of padded rows where the row
      length is not a multiple of 16 bytes); stacked experts' rows are contiguous, transposed in
      every format. MXFP8 only: a block holding a NaN element gets the NaN scale byte
      255, since a NaN anywhere in weight row n makes output column n NaN either way (the original
      bytes are kept in ``nan_scale`` for ``unpack``).
    * ``exponent`` E and ``constants`` = [2^E * decode scale, 2^(offset - E)] (fp32, on the device):
      the kernel's multipliers are ``scale * 2^(offset - E)`` in bf16, which must stay finite; E = 0
      unless a block scale is large (MX: above 2^1 for MXFP4, 2^7 for e4m3, 2^15 for e5m2; NVFP4:
      E = 7 for the usual block scales up to 448, the decode scale taking the rest).

    Stacked experts (``num_experts`` E): ``words`` (E, N, k_tiles * words_per_tile), ``scale_t``
    (E, K / B, N), ``constants`` (E, 2) (one shared exponent, the largest any expert needs, so
    ``constants[:, 1]`` is one value; ``constants[e, 0]`` carries expert e's decode scale),
    ``global_scale`` (E,) for NVFP4.
    """

    fmt: Format
    words: torch.Tensor
    scale_t: torch.Tensor
    constants: torch.Tensor
    exponent: int
    in_features: int
    global_scale: torch.Tensor | None = None
    nan_scale: torch.Tensor | None = None
    #: constants[0] as a Python float (2^E * decode scale), for host-side GEMM calls without a sync.
    alpha_host: float = 1.0
    #: NVFP4: every scale byte is normal (``Layout.normal_scales``), which ``prepack`` checks; the
    #: kernels then decode scales with fewer instructions. The kernels trust it (set it only as
    #: ``prepack`` does); False is always correct.
    normal_scales: bool = False

    def __post_init__(self):
        if self.normal_scales:
            layout_of(self.fmt, True)  # raises for formats other than NVFP4
        # A shape check: where N = K / B it cannot tell the orientations apart (build weights with prepack).
        n, ks = self.words.shape[-2], self.in_features // self.fmt.block
        expected = (n, ks) if self.scale_rows else (ks, n)
        if self.scale_t.ndim != self.words.ndim or tuple(self.scale_t.shape[-2:]) != expected:
            lead = "" if self.words.ndim == 2 else "E, "
            raise ValueError(f"PackedWeight: scale_t must be ({lead}{'N, K/B' if self.scale_rows else 'K/B, N'}) = "
                             f"({lead}{expected[0]}, {expected[1]}) for this {self.fmt.name} weight (words "
                             f"{tuple(self.words.shape)}), got {tuple(self.scale_t.shape)}")

    @property
    def scale_rows(self) -> bool:
        """Whether ``scale_t`` is row-major, (N, K / B): a single NVFP4 weight (``Layout.scale_rows``)."""
        return self.layout.scale_rows and self.words.ndim == 2

    def logical_scale(self) -> torch.Tensor:
        """The scale bytes as the quantizer lays them out, (N, K / B) (per expert for stacked experts),
        a contiguous copy (MXFP8: the kernels' bytes, NaN blocks marked; ``unpack`` restores the
        quantizer's)."""
        return (self.scale_t if self.scale_rows else self.scale_t.transpose(-1, -2)).contiguous()

    @property
    def layout(self) -> Layout:
        return layout_of(self.fmt, self.normal_scales)

    @property
    def out_features(self) -> int:
        return self.words.shape[-2]

    @property
    def num_experts(self) -> int | None:
        """E for a stacked expert weight (``words`` is 3-D), None for a single (N, K) weight."""
        return self.words.shape[0] if self.words.ndim == 3 else None

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (N, K) shape of the weight, or (E, N, K) for stacked experts."""
        lead = () if self.num_experts is None else (self.num_experts,)
        return (*lead, self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.words.device

    def to(self, device) -> "PackedWeight":
        """The same weight on another device."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return dataclasses.replace(self, words=move(self.words), scale_t=aligned_scale_t(move(self.scale_t)),
                                   constants=move(self.constants), global_scale=move(self.global_scale),
                                   nan_scale=move(self.nan_scale))

    def __getstate__(self) -> dict:
        # Copies and pickles leave out the runners cached for eager calls (``weight_only.runner_for``)
        # and record the word layout's version (see ``__setstate__``).
        state = dict(self.__dict__)
        state.pop("_runners", None)
        state["layout_version"] = LAYOUT_VERSION
        return state

    def __setstate__(self, state: dict) -> None:
        # A PackedWeight pickled under an older layout (no version: 1) is re-laid out: its words, and
        # before version 3 a single NVFP4 weight's transposed scales.
        state = dict(state)
        version = state.pop("layout_version", 1)
        state["words"] = relayout_words(state["words"], state["fmt"], version)
        if version < 3 and state["words"].ndim == 2 and layout_of(state["fmt"]).scale_rows:
            state["scale_t"] = aligned_scale_t(state["scale_t"].t().contiguous())
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"PackedWeight({self.fmt.name}, shape={self.shape}, tile_k={self.layout.tile_k}, "
                f"exponent={self.exponent}, device={self.device})")


# --------------------------------------------------------------------------------------------------

def _to_int32_words(w: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the int32 tensor with the same bits."""
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def _from_int32_words(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.int64) & 0xFFFFFFFF


def _tiles(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(N, K) element codes -> (N, T, planes, group, block / 2, 2), K zero-padded to whole tiles."""
    n, k = t.shape
    pad = -k % layout.tile_k
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(n, -1, layout.planes, layout.group, layout.block // 2, 2)


def _e2m1_fields(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per plane, the lane bit of the magnitude's lowest bit and of the sign (``E2M1_FIELDS``), shaped
    to broadcast over (N, T, planes, group, words, lanes)."""
    fields = torch.tensor(E2M1_FIELDS, dtype=torch.int64, device=device)
    return fields[:, 0].reshape(1, 1, 4, 1, 1, 1), fields[:, 1].reshape(1, 1, 4, 1, 1, 1)


#: The e2m1 lane fields of each word layout version (``E2M1_FIELDS`` is the current one's).
_E2M1_FIELDS_OF = {1: ((0, 12), (3, 13), (6, 14), (9, 15)), 2: E2M1_FIELDS, 3: E2M1_FIELDS}


def relayout_words(words: torch.Tensor, fmt: Format, src: int, dst: int = LAYOUT_VERSION) -> torch.Tensor:
    """Prepacked ``words`` (int32, any leading dimensions) of a ``fmt`` weight in word layout version
    ``src`` as the same elements in version ``dst``: a permutation of each 16-bit lane's bits (e2m1;
    8-bit elements are laid out alike in every version)."""
    for v in (src, dst):
        if v not in _E2M1_FIELDS_OF:
            raise ValueError(f"tilemm.packed.relayout_words: word layout versions are "
                             f"{sorted(_E2M1_FIELDS_OF)}, got {v}")
    if src == dst or not fmt.is_packed:
        return words
    w = _from_int32_words(words)
    out = torch.zeros_like(w)
    for (a, s), (a2, s2) in zip(_E2M1_FIELDS_OF[src], _E2M1_FIELDS_OF[dst]):
        for lane in (0, 16):
            out |= ((w >> (lane + a)) & 0x7) << (lane + a2)
            out |= ((w >> (lane + s)) & 0x1) << (lane + s2)
    return _to_int32_words(out)


def _pack_words(codes: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Element codes (N, K) (e2m1 nibbles, or FP8 bytes) -> words (N, T * words_per_tile) int32."""
    t = _tiles(codes.to(torch.int64), layout)  # (N, T, P, G, W, 2)
    if layout.planes == 4:
        mag_at, sign_at = _e2m1_fields(t.device)
        lane = (((t & 0x7) << mag_at) | (((t >> 3) & 0x1) << sign_at)).sum(dim=2)
    else:
        lane = t[:, :, 0] | (t[:, :, 1] << 8)
    words = lane[..., 0] | (lane[..., 1] << 16)  # (N, T, G, W)
    return _to_int32_words(words.reshape(codes.shape[0], -1))


def _unpack_words(words: torch.Tensor, layout: Layout, k: int) -> torch.Tensor:
    """Inverse of ``_pack_words``: (N, K) element codes as uint8."""
    n = words.shape[0]
    w = _from_int32_words(words).reshape(n, -1, layout.group, layout.block // 2)
    lane = torch.stack((w & 0xFFFF, w >> 16), dim=-1)  # (N, T, G, W, 2)
    if layout.planes == 4:
        mag_at, sign_at = _e2m1_fields(w.device)
        lane = lane.unsqueeze(2)
        codes = ((lane >> mag_at) & 0x7) | (((lane >> sign_at) & 0x1) << 3)
    else:
        codes = torch.stack((lane & 0xFF, lane >> 8), dim=2)
    return codes.reshape(n, -1)[:, :k].to(torch.uint8)


def _logical_scale(fn: str, w_q, n: int, k: int) -> torch.Tensor:
    fmt = w_q.format
    ks = k // fmt.block
    scale = as_uint8(w_q.scale)
    if w_q.swizzled:
        scale = _swizzle.unswizzle_32_4_4(scale, n, ks)
    if tuple(scale.shape) != (n, ks):
        raise ValueError(f"{fn}: the weight's scale must be (N, K/{fmt.block}) = ({n}, {ks}) or its "
                         f"32x4x4 swizzle, got {tuple(w_q.scale.shape)}")
    return scale.contiguous()


def _check_finite_dequant(fn: str, fmt: Format, values: torch.Tensor, scale: torch.Tensor, gs) -> None:
    """Refuse a weight whose dequantized values overflow fp32 (the kernel would stay finite)."""
    amax = values.abs().reshape(values.shape[0], -1, fmt.block).amax(dim=-1).to(torch.float64)
    s = decode_scales(fmt, scale).to(torch.float64)
    big = amax * s * (1.0 if gs is None else float(gs))
    if bool((big >= 2.0 ** _FP32_MAX_LOG2).any()):
        raise ValueError(f"{fn}: the weight holds blocks whose dequantized values overflow float32 (to "
                         f"+-inf); the weight-only kernel reproduces only finite weights exactly. Use "
                         f"tilemm.linear with a quantized activation, or rescale the weight")


def prepack(w_q) -> PackedWeight:
    """Lay out a quantized (N, K) weight, or stacked expert weights, for the weight-only matmul, once.

    Args:
        w_q: an ``MXFP4Tensor``, ``NVFP4Tensor`` or ``MXFP8Tensor`` holding a 2-D (N, K) weight (an
            ``nn.Linear`` weight quantized along K), with logical or swizzled scales, on any device;
            or a 3-D (E, N, K) one (E experts, each quantized along K, logical scales), or a list /
            tuple of E such 2-D weights of one format and shape (stacked; see the module docstring).

    Returns:
        A :class:`PackedWeight` on the same device; ``unpack`` inverts it exactly.
    """
    fn = "tilemm.prepack"
    if type(w_q) in (list, tuple):  # (exactly: the quantized tensors are NamedTuples themselves)
        return _prepack_experts(fn, list(w_q))
    if not isinstance(w_q, (MXFP4Tensor, NVFP4Tensor, MXFP8Tensor)):
        raise TypeError(f"{fn}: w_q must be an MXFP4Tensor, NVFP4Tensor or MXFP8Tensor (from "
                        f"tilemm.quantize_*), or a list of them (stacked experts), got {type(w_q).__name__}")
    if w_q.data.ndim == 3:
        if w_q.swizzled:
            raise ValueError(f"{fn}: a stacked (E, N, K) weight needs logical scales (E, N, K/B), got the "
                             f"swizzled layout {tuple(w_q.scale.shape)}; quantize with swizzle=False")
        cls = type(w_q)
        extra = (w_q.global_scale,) if cls is NVFP4Tensor else ()
        return _prepack_experts(fn, [cls(w_q.data[e], w_q.scale[e], *extra) for e in range(w_q.data.shape[0])])
    if w_q.data.ndim != 2:
        raise ValueError(f"{fn}: w_q must hold a 2-D (N, K) weight or a 3-D (E, N, K) stack of expert "
                         f"weights, got data of shape {tuple(w_q.data.shape)}")
    fmt = w_q.format
    layout = layout_of(fmt)
    n = w_q.data.shape[0]
    k = fmt.logical_k(w_q.data.shape[1])
    if n * (k // layout.elements_per_word) >= 2 ** 31:
        raise ValueError(f"{fn}: a weight of shape ({n}, {k}) has 2^31 or more 32-bit words in the "
                         f"weight-only layout, more than its kernel indexes; split it along N")
    scale = _logical_scale(fn, w_q, n, k)
    gs = None
    if fmt.has_global_scale:
        gs = torch.as_tensor(w_q.global_scale, dtype=torch.float32, device=w_q.data.device).reshape(())

    nan_scale = None
    if fmt.is_packed:
        codes = unpack_e2m1(w_q.data)
        values = e2m1_decode(codes)
    else:
        codes = as_uint8(w_q.data)
        mag = codes & 0x7F
        if fmt.element == "e5m2" and bool((mag == 0x7C).any()):
            raise ValueError(f"{fn}: the e5m2 weight holds Inf elements, which the weight-only kernel "
                             f"cannot reproduce; dequantize it or use a quantized activation")
        nan = (mag == 0x7F) if fmt.element == "e4m3" else (mag > 0x7C)
        nan_block = nan.reshape(n, -1, fmt.block).any(dim=-1)
        if bool(nan_block.any()):
            nan_scale = scale
            scale = torch.where(nan_block, torch.full_like(scale, 255), scale)
        values = torch.where(nan, torch.zeros((), device=codes.device), w_q.data.view(fmt.data_dtype).float())
    finite = ~decode_scales(fmt, scale).isnan()
    _check_finite_dequant(fn, fmt, values, torch.where(finite, scale, torch.zeros_like(scale)), gs)

    # E: the smallest power of two that keeps every multiplier scale * 2^(offset - E) below 2^128.
    s = decode_scales(fmt, scale)[finite]
    top = float(s.max()) if s.numel() else 0.0
    exponent = max(0, math.floor(math.log2(top)) + layout.offset - 127) if top > 0 else 0
    if exponent >= layout.offset:
        raise ValueError(f"{fn}: the weight holds a block scale of 2^127 (e8m0 byte 254); the weight-only "
                         f"kernel's multipliers reach at most 2^126 exactly. Use tilemm.linear with a "
                         f"quantized activation, or rescale the weight")
    alpha = 2.0 ** exponent
    constants = torch.tensor([alpha, 2.0 ** (layout.offset - exponent)], dtype=torch.float32,
                             device=w_q.data.device)
    if gs is not None:
        constants[0] = constants[0] * gs
    normal = fmt.is_packed and not fmt.is_mx and _all_normal(scale, codes, fmt.block)
    scale_t = scale if layout.scale_rows else scale.t()
    return PackedWeight(fmt=fmt, words=_pack_words(codes, layout), scale_t=aligned_scale_t(scale_t.contiguous()),
                        constants=constants, exponent=exponent, in_features=k, global_scale=gs,
                        nan_scale=nan_scale, alpha_host=float(constants[0]), normal_scales=normal)


def _prepack_experts(fn: str, experts: list) -> PackedWeight:
    """Stacked experts: each prepacked on its own, then stacked under the largest exponent."""
    if not experts:
        raise ValueError(f"{fn}: a stacked expert weight needs at least one expert, got none")
    first = experts[0]
    for e, w in enumerate(experts):
        if not isinstance(w, (MXFP4Tensor, NVFP4Tensor, MXFP8Tensor)) or w.data.ndim != 2:
            raise TypeError(f"{fn}: expert {e} must be a 2-D MXFP4Tensor, NVFP4Tensor or MXFP8Tensor, got "
                            f"{type(w).__name__}")
        if w.format is not first.format or w.data.shape != first.data.shape:
            raise ValueError(f"{fn}: every expert must have one format and shape; expert 0 is "
                             f"{first.format.name} {tuple(first.data.shape)}, expert {e} is {w.format.name} "
                             f"{tuple(w.data.shape)}")
    parts = [prepack(w) for w in experts]
    exponent = max(p.exponent for p in parts)
    layout = parts[0].layout
    # Every expert's multipliers move down to 2^(offset - E_max); its alpha carries 2^E_max instead.
    dev = parts[0].words.device
    gs = (torch.stack([p.global_scale for p in parts]) if parts[0].global_scale is not None else None)
    alpha = torch.full((len(parts),), 2.0 ** exponent, dtype=torch.float32, device=dev)
    if gs is not None:
        alpha = alpha * gs
    constants = torch.stack((alpha, torch.full_like(alpha, 2.0 ** (layout.offset - exponent))), dim=1)
    nan_scale = None
    if any(p.nan_scale is not None for p in parts):
        nan_scale = torch.stack([p.nan_scale if p.nan_scale is not None else p.logical_scale() for p in parts])
    # Stacked experts' scales are transposed in every format (the grouped kernels' loads).
    scale_t = torch.stack([p.scale_t.t() if p.scale_rows else p.scale_t for p in parts])
    return PackedWeight(fmt=parts[0].fmt, words=torch.stack([p.words for p in parts]),
                        scale_t=scale_t, constants=constants.contiguous(),
                        exponent=exponent, in_features=parts[0].in_features, global_scale=gs,
                        nan_scale=nan_scale, alpha_host=float(constants[0, 0]),
                        normal_scales=all(p.normal_scales for p in parts))


def unpack(packed: PackedWeight):
    """The quantized weight ``packed`` was built from, with logical scales, bit for bit.

    A stacked expert weight comes back as one 3-D (E, N, K) tensor when its experts share one
    per-tensor scale (always for MX formats), else as a list of E 2-D NVFP4 weights."""
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"tilemm.unpack: packed must be a PackedWeight (from tilemm.prepack), got "
                        f"{type(packed).__name__}")
    if packed.num_experts is not None:
        experts = [unpack(expert(packed, e)) for e in range(packed.num_experts)]
        gs = packed.global_scale
        if gs is not None and not bool((gs == gs[0]).all()):
            return experts
        data = torch.stack([w.data for w in experts])
        scale = torch.stack([w.scale for w in experts])
        if gs is not None:
            return NVFP4Tensor(data, scale, gs[0])
        return type(experts[0])(data, scale)
    fmt, layout = packed.fmt, packed.layout
    codes = _unpack_words(packed.words, layout, packed.in_features)
    scale = packed.nan_scale if packed.nan_scale is not None else packed.logical_scale()
    scale = scale.view(fmt.scale_dtype)
    if fmt.is_packed:
        data = pack_e2m1(codes)
        if fmt.has_global_scale:
            return NVFP4Tensor(data, scale, packed.global_scale)
        return MXFP4Tensor(data, scale)
    return MXFP8Tensor(codes.view(fmt.data_dtype), scale)


def expert(packed: PackedWeight, e: int) -> PackedWeight:
    """Expert ``e`` of a stacked expert weight as a 2-D PackedWeight (views of the stacked tensors, an
    NVFP4 expert's scales transposed to a single weight's row-major orientation, so not contiguous
    then: a runner aligns them once; the shared exponent stays, so its multipliers are those the
    grouped kernel uses)."""
    scale_t = packed.scale_t[e]
    return PackedWeight(fmt=packed.fmt, words=packed.words[e],
                        scale_t=scale_t.t() if packed.layout.scale_rows else scale_t,
                        constants=packed.constants[e], exponent=packed.exponent,
                        in_features=packed.in_features,
                        global_scale=None if packed.global_scale is None else packed.global_scale[e],
                        nan_scale=None if packed.nan_scale is None else packed.nan_scale[e],
                        alpha_host=packed.alpha_host, normal_scales=packed.normal_scales)
