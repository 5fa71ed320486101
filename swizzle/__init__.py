"""Block-scale layouts for tcgen05 / ``ct.mma_scaled``: the 32x4x4 ("swizzled", "blocked") layout.

A scale matrix S of shape (..., R, C) -- R rows of the operand, C = K / block -- is zero-padded to
(round_up(R, 128), round_up(C, 4)) and stored as (..., R/128, C/4, 32, 16) blocks; see
:func:`swizzle_32_4_4` for the index formula and a diagram, and docs/numerics.md, "The 32x4x4 scale layout".

Works on numpy arrays, torch tensors (any device, including float8_e8m0fnu / float8_e4m3fn) and
CuPy arrays, and needs only numpy to import.
"""

from ._layout import (
    BLOCK_SHAPE,
    COL_TILE,
    ROW_TILE,
    swizzle_32_4_4,
    swizzle_index,
    swizzled_shape,
    unswizzle_32_4_4,
)

__all__ = [
    "BLOCK_SHAPE",
    "COL_TILE",
    "ROW_TILE",
    "swizzle_32_4_4",
    "swizzle_index",
    "swizzled_shape",
    "unswizzle_32_4_4",
]
