"""The 32x4x4 block-scale layout ("swizzled", "blocked") on numpy, torch and CuPy arrays.

See docs/numerics.md, "The 32x4x4 scale layout". Nothing here is GPU-specific: the same code
moves bytes for numpy arrays, torch tensors on any device and CuPy arrays. torch and CuPy are
never imported by this module; an input can only be one of their arrays if its library is
already loaded, so they are looked up in ``sys.modules``.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import numpy as np

#: Rows of the scale matrix covered by one 32x16 block (m0 step: 4 sub-tiles of 32 rows).
ROW_TILE = 128
#: Scale columns covered by one 32x16 block (k1).
COL_TILE = 4

# The block's inner structure, named as in the cuTile sample (m1, m2, k1):
# row r of a 128-row tile goes to block row r % LANES, column group (r // LANES) of width COL_TILE.
_LANES = 32  # m1: rows per sub-tile, one per block row
_SUBTILES = ROW_TILE // _LANES  # m2 = 4: sub-tiles side by side in a block row
_BLOCK_ROWS = _LANES  # 32
_BLOCK_COLS = _SUBTILES * COL_TILE  # 16
_BLOCK_SIZE = _BLOCK_ROWS * _BLOCK_COLS  # 512 elements per (128 x 4) tile
#: Shape of one stored block, (32, 16): the trailing two dimensions of every swizzled scale.
BLOCK_SHAPE = (_BLOCK_ROWS, _BLOCK_COLS)

_ACCEPTED = "a numpy.ndarray, a torch.Tensor or a cupy.ndarray"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _as_size(name: str, value: Any) -> int:
    """A non-negative Python int from ``value``, or a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a non-negative int, got bool {value!r}")
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a non-negative int, got {type(value).__name__} {value!r}"
        ) from None
    if size < 0:
        raise ValueError(f"{name} must be a non-negative int, got {size}")
    return size


def _array_kind(name: str, x: Any) -> str:
    """'numpy', 'torch' or 'cupy' for a supported array; TypeError naming ``name`` otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    raise TypeError(f"{name} must be {_ACCEPTED}, got {type(x).__module__}.{type(x).__qualname__}")


def _zeros_like_bytes(kind: str, x: Any, shape: tuple[int, ...]) -> Any:
    """A new array of ``shape`` with ``x``'s dtype (and device) whose bytes are all zero.

    "Pad with zeros" means zero bytes: for float8_e8m0fnu, which has no zero, that is 2^-127.
    """
    if kind == "torch":
        import torch  # already loaded: x is a torch.Tensor

        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    xp = np if kind == "numpy" else sys.modules["cupy"]
    if x.dtype.hasobject or x.dtype.itemsize == 0:
        return xp.zeros(shape, dtype=x.dtype)
    # Allocate bytes and reinterpret, so that even dtypes without a zero value start as 0x00.
    raw = xp.zeros(shape[:-1] + (shape[-1] * x.dtype.itemsize,), dtype=np.uint8)
    return raw.view(x.dtype)


def _contiguous(kind: str, x: Any) -> Any:
    if kind == "torch":
        return x.contiguous()
    xp = np if kind == "numpy" else sys.modules["cupy"]
    return xp.ascontiguousarray(x)


def _permute(kind: str, x: Any, axes: list[int]) -> Any:
    return x.permute(*axes) if kind == "torch" else x.transpose(axes)


def _byte_view(kind: str, x: Any) -> tuple[Any, Any]:
    """View one-byte torch dtypes (float8_*, float4_*_x2, bool, int8) as uint8 for data movement.

    torch lacks CPU kernels for some of these dtypes (pad, index_put, copy between layouts), while
    uint8 moves everything; the second item is the dtype to view the result back as (or None).
    """
    if kind != "torch":
        return x, None
    import torch

    if x.dtype == torch.uint8 or x.element_size() != 1:
        return x, None
    return x.view(torch.uint8), x.dtype


def _tile_axes(batch_ndim: int) -> list[int]:
    """(..., m0, m2, m1, k0, k1) <-> (..., m0, k0, m1, m2, k1): swap the 2nd and 4th tile axes.

    The permutation (0, 3, 2, 1, 4) is its own inverse, so swizzle and unswizzle share it.
    """
    b = batch_ndim
    return list(range(b)) + [b + 0, b + 3, b + 2, b + 1, b + 4]


def swizzled_shape(rows: int, cols: int) -> tuple[int, int, int, int]:
    """Shape of one swizzled (rows, cols) scale matrix: (ceil(rows/128), ceil(cols/4), 32, 16)."""
    rows = _as_size("rows", rows)
    cols = _as_size("cols", cols)
    return (_ceil_div(rows, ROW_TILE), _ceil_div(cols, COL_TILE), *BLOCK_SHAPE)


def _is_integer_array(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    kind = getattr(dtype, "kind", None)  # numpy and CuPy dtypes
    if kind is not None:
        return kind in "iu"
    # torch.dtype: integer means neither floating point, complex nor bool.
    return (
        getattr(dtype, "is_floating_point", True) is False
        and getattr(dtype, "is_complex", True) is False
        and str(dtype) != "torch.bool"
    )


def _check_index(name: str, value: Any, upper: int | None) -> Any:
    """Validate an index argument of swizzle_index: an int or an integer array in [0, upper)."""
    bound = "" if upper is None else f" and < {upper}"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = int(value)
        if value < 0 or (upper is not None and value >= upper):
            raise ValueError(f"{name} must be >= 0{bound}, got {value}")
    elif _is_integer_array(value):
        if isinstance(value, np.ndarray) and value.size:
            # Bounds are checked for numpy arrays only: elsewhere a check would synchronise a GPU.
            lo, hi = int(value.min()), int(value.max())
            if lo < 0 or (upper is not None and hi >= upper):
                raise ValueError(f"{name} must be >= 0{bound}, got values in [{lo}, {hi}]")
    else:
        raise TypeError(
            f"{name} must be an int or an integer array, got {type(value).__name__} {value!r}"
        )
    return value


def swizzle_index(r: Any, c: Any, cols: int) -> Any:
    """Flat index of scale (r, c) within one swizzled (rows, cols) scale matrix.

    ``(r // 128) * (C_pad // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
    + (c % 4)`` with ``C_pad = round_up(cols, 4)``. ``r`` and ``c`` may be ints or integer arrays
    (broadcast against each other); ``0 <= r`` and ``0 <= c < C_pad`` (padded positions included).
    Over ``r < round_up(rows, 128)``, ``c < C_pad`` this is a bijection onto
    ``range(round_up(rows, 128) * C_pad)``.
    """
    cols = _as_size("cols", cols)
    col_tiles = _ceil_div(cols, COL_TILE)
    r = _check_index("r", r, None)
    c = _check_index("c", c, col_tiles * COL_TILE)
    return (
        (r // ROW_TILE) * col_tiles * _BLOCK_SIZE
        + (c // COL_TILE) * _BLOCK_SIZE
        + (r % _LANES) * _BLOCK_COLS
        + ((r % ROW_TILE) // _LANES) * COL_TILE
        + (c % COL_TILE)
    )


def swizzle_32_4_4(scale: Any) -> Any:
    """Lay out a block-scale matrix for tcgen05 / ``ct.mma_scaled``: (..., R, C) -> (..., R/128, C/4, 32, 16).

    ``scale`` is (..., R, C): R rows of the operand (M for x, N for y; pass ``y_scale.T``), C = K / block.
    It is padded with zero bytes to (round_up(R, 128), round_up(C, 4)) -- for float8_e8m0fnu a zero
    byte is 2^-127, never NaN -- and element (r, c) of each batch entry is stored at flat index::

        (r // 128) * (C_pad // 4) * 512 + (c // 4) * 512
            + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)

    i.e. ``S.reshape(R/128, 4, 32, C/4, 4).permute(0, 3, 2, 1, 4).reshape(R/128, C/4, 32, 16)``
    (the cuTile sample's ``swizzle_32_4_4``). One 128 x 4 tile of S becomes one 32 x 16 block::

          S tile (128 rows x 4 cols)           block (32 rows x 16 cols, 512 elements)
             c = 0 1 2 3                       cols 0..3  4..7       8..11      12..15
        r   0 +-------+                  row  0  S[0, :]   S[32, :]   S[64, :]   S[96, :]
              |   A   |  rows   0..31    row  1  S[1, :]   S[33, :]   S[65, :]   S[97, :]
           31 +-------+                   ...      A          B          C          D
           32 |   B   |  rows  32..63    row 31  S[31, :]  S[63, :]   S[95, :]   S[127, :]
           63 +-------+
           64 |   C   |  rows  64..95    scale (r, c) -> block row r % 32,
           95 +-------+                                  block col ((r % 128) // 32) * 4 + c % 4
           96 |   D   |  rows 96..127
          127 +-------+

    Blocks follow each other row-major over (r // 128, c // 4); batch entries (leading dims,
    preserved) are consecutive runs of blocks.

    Returns a new contiguous array of the same type (numpy.ndarray, torch.Tensor on the same
    device, or cupy.ndarray) and dtype. numpy subclasses are treated as plain ndarrays.
    """
    kind = _array_kind("scale", scale)
    if scale.ndim < 2:
        raise ValueError(
            f"scale must have at least 2 dimensions (..., rows, cols), got shape {tuple(scale.shape)}"
        )
    if kind == "numpy":
        scale = np.asarray(scale)
    x, view_back = _byte_view(kind, scale)
    *batch, rows, cols = (int(d) for d in x.shape)
    row_tiles, col_tiles, _, _ = swizzled_shape(rows, cols)
    rows_pad, cols_pad = row_tiles * ROW_TILE, col_tiles * COL_TILE

    if (rows_pad, cols_pad) != (rows, cols):
        padded = _zeros_like_bytes(kind, x, (*batch, rows_pad, cols_pad))
        padded[..., :rows, :cols] = x
        x = padded
    tiles = x.reshape(*batch, row_tiles, _SUBTILES, _LANES, col_tiles, COL_TILE)
    blocked = _contiguous(kind, _permute(kind, tiles, _tile_axes(len(batch))))
    blocked = blocked.reshape(*batch, row_tiles, col_tiles, _BLOCK_ROWS, _BLOCK_COLS)
    return blocked if view_back is None else blocked.view(view_back)


def unswizzle_32_4_4(blocked: Any, rows: int, cols: int) -> Any:
    """Inverse of :func:`swizzle_32_4_4`: (..., ceil(rows/128), ceil(cols/4), 32, 16) -> (..., rows, cols).

    Padding is dropped. Returns a new contiguous array of the same type and dtype as ``blocked``.
    Raises ValueError when ``blocked``'s shape does not match ``swizzled_shape(rows, cols)``.
    """
    kind = _array_kind("blocked", blocked)
    rows = _as_size("rows", rows)
    cols = _as_size("cols", cols)
    expected = swizzled_shape(rows, cols)
    shape = tuple(int(d) for d in blocked.shape)
    if len(shape) < 4 or shape[-2:] != expected[-2:]:
        raise ValueError(
            f"blocked must have shape (..., row_tiles, col_tiles, 32, 16), got shape {shape}"
        )
    if shape[-4:-2] != expected[:2]:
        raise ValueError(
            f"blocked has shape {shape}, but rows={rows}, cols={cols} need "
            f"(..., {expected[0]}, {expected[1]}, 32, 16) "
            f"(ceil(rows/128)={expected[0]}, ceil(cols/4)={expected[1]})"
        )
    if kind == "numpy":
        blocked = np.asarray(blocked)
    x, view_back = _byte_view(kind, blocked)
    *batch, row_tiles, col_tiles, _, _ = shape
    tiles = x.reshape(*batch, row_tiles, col_tiles, _LANES, _SUBTILES, COL_TILE)
    logical = _permute(kind, tiles, _tile_axes(len(batch)))
    logical = logical.reshape(*batch, row_tiles * ROW_TILE, col_tiles * COL_TILE)
    out = _contiguous(kind, logical[..., :rows, :cols])
    return out if view_back is None else out.view(view_back)
