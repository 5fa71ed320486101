"""The quantized formats tilemm knows, one frozen descriptor each.

Every other module reads element dtype, scale dtype, block size, Qmax and packing from these
descriptors; nothing re-derives them from tensor dtypes. See docs/numerics.md for the contract.

| format        | element          | block (along K) | scale              | extra                     |
|---------------|------------------|-----------------|--------------------|---------------------------|
| FP8_E4M3      | e4m3fn           | tensor/row/1x128/128x128 | fp32      |                           |
| FP8_E5M2      | e5m2             | tensor/row      | fp32               |                           |
| MXFP8_E4M3    | e4m3fn           | 32              | e8m0               |                           |
| MXFP8_E5M2    | e5m2             | 32              | e8m0               |                           |
| MXFP4         | e2m1, 2 per byte | 32              | e8m0               |                           |
| NVFP4         | e2m1, 2 per byte | 16              | e4m3fn             | one fp32 decode scale     |
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = [
    "Format",
    "FP8_E4M3",
    "FP8_E5M2",
    "MXFP8_E4M3",
    "MXFP8_E5M2",
    "MXFP4",
    "NVFP4",
    "FORMATS",
    "E2M1_VALUES",
    "FP8_BLOCK",
    "FP8_GRANULARITIES",
    "Granularity",
    "mxfp8_format",
    "fp8_format",
    "E4M3",
    "E5M2",
    "E2M1",
    "ELEMENT_CODES",
]

#: The edge of DeepSeek-style FP8 blocks: 1x128 for activations, 128x128 for weights (e4m3 only).
FP8_BLOCK = 128


class Granularity(enum.Enum):
    """An FP8 scale granularity, tilemm's one name for it: one scale per tensor, per row (x's rows, the
    weight's output channels), or per 128-element block: 1x128 (x's blocks) or 128x128 (a weight's).

    Each value is the name ``torch.ops.tilemm.quantize_fp8`` takes (``Granularity("1x128")``);
    :meth:`parse` reads the spellings :func:`tilemm.quantize_fp8` takes (``"tensor"``, ``"row"``,
    ``(1, 128)``, ``(128, 128)``). An FP8 matmul pairs 1x128 x-scales with 128x128 weight scales only;
    its ``FP8Problem.granularity`` names the pairing by x's side (``BLOCK_1X128``).
    """

    TENSOR = "tensor"
    ROW = "row"
    BLOCK_1X128 = "1x128"
    BLOCK_128X128 = "128x128"

    @classmethod
    def parse(cls, value, fn: str) -> "Granularity":
        """The granularity that ``value`` spells: a member, ``"tensor"``, ``"row"``, ``(1, 128)`` or
        ``(128, 128)`` (a tuple or a list). ValueError naming ``fn`` for anything else."""
        if isinstance(value, cls):
            return value
        key = value if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else None
        try:
            gran = _SPELLINGS.get(key)
        except TypeError:  # an unhashable entry in a list
            gran = None
        if gran is None:
            raise ValueError(f"{fn}: granularity must be 'tensor', 'row', (1, 128) or (128, 128), "
                             f"got {value!r}")
        return gran

    @property
    def block_shape(self) -> tuple[int, int] | None:
        """(rows, columns) of one scale's block, or None for per tensor and per row."""
        return _BLOCK_SHAPES.get(self)

    @property
    def is_block(self) -> bool:
        return self in _BLOCK_SHAPES

    @property
    def argument(self):
        """The ``granularity`` argument of :func:`tilemm.quantize_fp8` for it: ``"tensor"``, ``"row"``,
        ``(1, 128)`` or ``(128, 128)``."""
        return self.block_shape or self.value

    @property
    def spelling(self) -> str:
        """``argument`` as messages write it: ``'tensor'``, ``'row'``, ``(1, 128)``, ``(128, 128)``."""
        return repr(self.argument)

    @property
    def code(self) -> int:
        """Its code in tile code: the ``GRANULARITY`` constant of the FP8 quantize kernel (per row has a
        kernel of its own and never reaches it)."""
        return _CODES[self]

    @property
    def quantize_kernel(self) -> str:
        """The FP8 quantize kernel's name in ``quantize_kernels.plan`` and the AOT variants:
        ``"fp8_tensor"``, ``"fp8_row"``, ``"fp8_1x128"`` or ``"fp8_128x128"``."""
        return f"fp8_{self.value}"

    @property
    def matmul_kernel(self) -> str:
        """The FP8 matmul kernel that serves it: ``"scaled"`` (per tensor or per row: one kernel, the
        scales in the epilogue) or ``"blockwise"`` (128-element blocks, scaled per K step)."""
        return "blockwise" if self.is_block else "scaled"


_BLOCK_SHAPES = {Granularity.BLOCK_1X128: (1, FP8_BLOCK), Granularity.BLOCK_128X128: (FP8_BLOCK, FP8_BLOCK)}
_SPELLINGS = {"tensor": Granularity.TENSOR, "row": Granularity.ROW,
              **{shape: gran for gran, shape in _BLOCK_SHAPES.items()}}
_CODES = {Granularity.TENSOR: 0, Granularity.BLOCK_1X128: 1, Granularity.BLOCK_128X128: 2, Granularity.ROW: 3}

#: Every FP8 granularity (``tuple(Granularity)``).
FP8_GRANULARITIES = tuple(Granularity)

#: Element codes, as every tile kernel receives them (its ``ELEMENT`` constant); ``Format.element_code``.
E4M3, E5M2, E2M1 = 0, 1, 2
ELEMENT_CODES = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}

# The 8 non-negative e2m1 magnitudes, indexed by the low 3 bits of a nibble; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclasses.dataclass(frozen=True)
class Format:
    """Facts about one quantized format.

    Attributes:
        name: short name, e.g. ``"mxfp8_e4m3"``.
        element: element encoding: ``"e4m3"``, ``"e5m2"`` or ``"e2m1"``.
        data_dtype: torch dtype of the stored data tensor (``uint8`` for packed e2m1).
        scale_dtype: torch dtype of the stored scale tensor.
        block: elements per scale along K, or ``None`` when the granularity is chosen per call (FP8).
        qmax: largest finite element magnitude.
        emax: exponent of the largest element binade (``floor(log2(qmax))``), used by FLOOR scaling.
        elements_per_byte: 1, or 2 for packed e2m1 (element 2i in the low nibble of byte i).
        has_global_scale: True for NVFP4's per-tensor fp32 decode scale.
    """

    name: str
    element: str
    data_dtype: torch.dtype
    scale_dtype: torch.dtype
    block: int | None
    qmax: float
    emax: int
    elements_per_byte: int = 1
    has_global_scale: bool = False

    @property
    def is_packed(self) -> bool:
        return self.elements_per_byte == 2

    @property
    def element_code(self) -> int:
        """The element's code in tile code (``ELEMENT_CODES``)."""
        return ELEMENT_CODES[self.element]

    @property
    def is_mx(self) -> bool:
        """Block-scaled with e8m0 scales (OCP MX)."""
        return self.scale_dtype == torch.float8_e8m0fnu

    @property
    def element_torch_dtype(self) -> torch.dtype:
        """Torch dtype of one unpacked element (``float4_e2m1fn_x2`` stands for e2m1)."""
        return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
                "e2m1": torch.float4_e2m1fn_x2}[self.element]

    def data_k(self, k: int) -> int:
        """Size of the stored K dimension for ``k`` logical elements."""
        return k // self.elements_per_byte

    def logical_k(self, data_k: int) -> int:
        """Logical K for a stored K dimension of ``data_k`` entries."""
        return data_k * self.elements_per_byte

    def __repr__(self) -> str:  # short, for error messages and test ids
        return f"Format({self.name})"


FP8_E4M3 = Format("fp8_e4m3", "e4m3", torch.float8_e4m3fn, torch.float32, None, 448.0, 8)
FP8_E5M2 = Format("fp8_e5m2", "e5m2", torch.float8_e5m2, torch.float32, None, 57344.0, 15)
MXFP8_E4M3 = Format("mxfp8_e4m3", "e4m3", torch.float8_e4m3fn, torch.float8_e8m0fnu, 32, 448.0, 8)
MXFP8_E5M2 = Format("mxfp8_e5m2", "e5m2", torch.float8_e5m2, torch.float8_e8m0fnu, 32, 57344.0, 15)
MXFP4 = Format("mxfp4", "e2m1", torch.uint8, torch.float8_e8m0fnu, 32, 6.0, 2, elements_per_byte=2)
NVFP4 = Format("nvfp4", "e2m1", torch.uint8, torch.float8_e4m3fn, 16, 6.0, 2, elements_per_byte=2,
               has_global_scale=True)

FORMATS = {f.name: f for f in (FP8_E4M3, FP8_E5M2, MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4)}

_FP8_BY_DTYPE = {torch.float8_e4m3fn: (FP8_E4M3, MXFP8_E4M3), torch.float8_e5m2: (FP8_E5M2, MXFP8_E5M2)}


def _fp8_pair(elem_dtype, argname: str):
    try:
        return _FP8_BY_DTYPE[elem_dtype]
    except (KeyError, TypeError):
        raise TypeError(
            f"{argname} must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype!r}"
        ) from None


def mxfp8_format(elem_dtype, argname: str = "elem_dtype") -> Format:
    """The MXFP8 descriptor for an element dtype (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``)."""
    return _fp8_pair(elem_dtype, argname)[1]


def fp8_format(elem_dtype, argname: str = "elem_dtype") -> Format:
    """The plain FP8 descriptor for an element dtype."""
    return _fp8_pair(elem_dtype, argname)[0]
