"""Tests for swizzle: the 32x4x4 block-scale layout (docs/numerics.md, "The 32x4x4 scale layout").

Everything is bit-exact. The oracle is a loop that walks the blocked layout in storage order
(block row-major over (r // 128, c // 4), then 32 lanes, then 4 sub-tiles of 4 columns), written
without the index formula, so it checks both the formula and the array code.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import swizzle
from swizzle import (
    COL_TILE,
    ROW_TILE,
    swizzle_32_4_4,
    swizzle_index,
    swizzled_shape,
    unswizzle_32_4_4,
)

# Rows: 1 (single row), 17 (odd, < 32), 127/128/129 (around one tile), 300 (3 tiles, last partial).
ROWS = [1, 17, 127, 128, 129, 300]
# Cols: 1 and 3 (< one column tile), 4 (exact), 5 (one past), 64 (16 tiles, e.g. K=2048, block 32).
COLS = [1, 3, 4, 5, 64]
SHAPES = [(r, c) for r in ROWS for c in COLS]

TORCH_DTYPES = [torch.uint8, torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.float32]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@functools.lru_cache(maxsize=None)
def _loop_layout(rows: int, cols: int) -> np.ndarray:
    """position[r, c] = flat index of padded scale (r, c), by walking the layout in storage order."""
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    position = np.full((row_tiles * 128, col_tiles * 4), -1, dtype=np.int64)
    flat = 0
    for row_tile in range(row_tiles):
        for col_tile in range(col_tiles):
            for lane in range(32):  # block row
                for sub_tile in range(4):  # which 32-row quarter of the 128-row tile
                    for k in range(4):  # column inside the 4-column tile
                        r = row_tile * 128 + sub_tile * 32 + lane
                        c = col_tile * 4 + k
                        position[r, c] = flat
                        flat += 1
    assert (position >= 0).all()
    return position


def _loop_swizzle(scale: np.ndarray) -> np.ndarray:
    """Reference swizzle of one 2-D numpy matrix, element by element (padding = zero bytes)."""
    rows, cols = scale.shape
    position = _loop_layout(rows, cols)
    out = np.zeros(position.size, dtype=scale.dtype)
    for r in range(rows):
        for c in range(cols):
            out[position[r, c]] = scale[r, c]
    return out.reshape(-(-rows // 128), -(-cols // 4), 32, 16)


def _random(shape, dtype=np.uint8, seed=0) -> np.ndarray:
    """Random data with no zero bytes, so that padding (zero bytes) can be told apart."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.float32:
        return rng.uniform(0.5, 2.0, size=shape).astype(np.float32)
    return rng.integers(1, 256, size=shape, dtype=np.uint8).astype(dtype)


def _torch_input(shape, dtype: torch.dtype, seed=0) -> torch.Tensor:
    if dtype == torch.float32:
        return torch.from_numpy(_random(shape, np.float32, seed))
    return torch.from_numpy(_random(shape, np.uint8, seed)).view(dtype)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """Numpy copy of a tensor's data, one-byte dtypes as raw uint8 (float8 has no numpy dtype)."""
    t = t.cpu()
    return (t.view(torch.uint8) if t.element_size() == 1 else t).numpy()


# ---------------------------------------------------------------------------------------------
# Layout: the index formula and the array code against the loop oracle


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_index_matches_loop(rows, cols):
    position = _loop_layout(rows, cols)
    r, c = np.indices(position.shape)
    np.testing.assert_array_equal(swizzle_index(r, c, cols), position)


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_index_scalar_ints(rows, cols):
    # The last real element and the last padded one, as plain Python ints.
    position = _loop_layout(rows, cols)
    assert swizzle_index(rows - 1, cols - 1, cols) == position[rows - 1, cols - 1]
    r_pad, c_pad = position.shape
    assert swizzle_index(r_pad - 1, c_pad - 1, cols) == position[-1, -1] == r_pad * c_pad - 1


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_numpy_matches_loop_and_round_trips(rows, cols):
    scale = _random((rows, cols))
    blocked = swizzle_32_4_4(scale)
    assert type(blocked) is np.ndarray
    assert blocked.dtype == scale.dtype
    assert blocked.shape == swizzled_shape(rows, cols)
    assert blocked.flags.c_contiguous
    np.testing.assert_array_equal(blocked, _loop_swizzle(scale))
    back = unswizzle_32_4_4(blocked, rows, cols)
    assert back.shape == (rows, cols) and back.flags.c_contiguous
    np.testing.assert_array_equal(back, scale)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_torch_matches_loop_and_round_trips(rows, cols, dtype):
    scale = _torch_input((rows, cols), dtype)
    blocked = swizzle_32_4_4(scale)
    assert isinstance(blocked, torch.Tensor)
    assert blocked.dtype == dtype and blocked.device == scale.device
    assert blocked.shape == swizzled_shape(rows, cols)
    assert blocked.is_contiguous()
    np.testing.assert_array_equal(_bytes(blocked), _loop_swizzle(_bytes(scale)))
    back = unswizzle_32_4_4(blocked, rows, cols)
    assert back.dtype == dtype and back.shape == (rows, cols) and back.is_contiguous()
    np.testing.assert_array_equal(_bytes(back), _bytes(scale))


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_matches_cutile_sample_formula(rows, cols):
    # The cuTile sample's swizzle_32_4_4 (which needs aligned input), applied to the padded matrix.
    scale = _torch_input((rows, cols), torch.float8_e8m0fnu)
    r_pad, c_pad = _round_up(rows, 128), _round_up(cols, 4)
    padded = torch.zeros((r_pad, c_pad), dtype=torch.uint8)
    padded[:rows, :cols] = scale.view(torch.uint8)
    sample = (
        padded.reshape(r_pad // 128, 4, 32, c_pad // 4, 4)
        .permute(0, 3, 2, 1, 4)
        .contiguous()
        .reshape(r_pad // 128, c_pad // 4, 32, 16)
    )
    assert torch.equal(swizzle_32_4_4(scale).view(torch.uint8), sample)


# ---------------------------------------------------------------------------------------------
# Padding, batches, strides, aliasing, empty inputs


@pytest.mark.parametrize("poison", [0x7F, 0xFF], ids=["e8m0_one", "e8m0_nan"])
def test_padding_is_zero_bytes(poison):
    # Real scales all 1.0 (0x7F) or NaN (0xFF): every padded slot must still be the zero byte,
    # which for e8m0 is 2^-127 -- never NaN, which would poison real outputs.
    rows, cols = 129, 5
    scale = torch.full((rows, cols), poison, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    raw = _bytes(swizzle_32_4_4(scale)).reshape(-1)
    r, c = np.indices((_round_up(rows, 128), _round_up(cols, 4)))
    index = swizzle_index(r, c, cols)
    real = (r < rows) & (c < cols)
    assert (raw[index[real]] == poison).all()
    assert (raw[index[~real]] == 0).all()
    padded_value = torch.zeros(1, dtype=torch.uint8).view(torch.float8_e8m0fnu).float()
    assert padded_value.item() == 2.0**-127


def test_numpy_padding_is_zero():
    scale = np.full((17, 3), -1.5, dtype=np.float32)
    blocked = swizzle_32_4_4(scale).reshape(-1)
    r, c = np.indices((128, 4))
    pad = (r >= 17) | (c >= 3)
    assert (blocked[swizzle_index(r[pad], c[pad], 3)] == 0).all()
    assert (blocked[swizzle_index(r[~pad], c[~pad], 3)] == -1.5).all()


@pytest.mark.parametrize("batch", [(2,), (2, 3)], ids=["batch1d", "batch2d"])
@pytest.mark.parametrize("rows,cols", [(17, 5), (129, 64), (128, 4)])
def test_batched_are_consecutive_blocks(batch, rows, cols):
    # Leading dims are kept and each batch entry is one contiguous run of blocks.
    for scale in (_random((*batch, rows, cols)), _torch_input((*batch, rows, cols), torch.float8_e8m0fnu)):
        blocked = swizzle_32_4_4(scale)
        assert tuple(blocked.shape) == (*batch, *swizzled_shape(rows, cols))
        flat_blocked = (blocked if isinstance(blocked, np.ndarray) else _bytes(blocked)).reshape(-1)
        flat_scale = (scale if isinstance(scale, np.ndarray) else _bytes(scale)).reshape(-1, rows, cols)
        per_entry = flat_blocked.size // flat_scale.shape[0]
        for i, entry in enumerate(flat_scale):
            run = flat_blocked[i * per_entry : (i + 1) * per_entry]
            np.testing.assert_array_equal(run, _loop_swizzle(entry).reshape(-1))
        back = unswizzle_32_4_4(blocked, rows, cols)
        assert type(back) is type(scale) and tuple(back.shape) == (*batch, rows, cols)
        if isinstance(scale, np.ndarray):
            np.testing.assert_array_equal(back, scale)
        else:
            assert back.dtype == scale.dtype
            np.testing.assert_array_equal(_bytes(back), _bytes(scale))


def test_transposed_input():
    # y's scales are swizzled from y_scale.T: a non-contiguous view must give the same result.
    y_scale = _torch_input((7, 300), torch.float8_e8m0fnu)  # (K/B, N) storage
    expected = _loop_swizzle(_bytes(y_scale).T.copy())
    np.testing.assert_array_equal(_bytes(swizzle_32_4_4(y_scale.T)), expected)
    np.testing.assert_array_equal(swizzle_32_4_4(_bytes(y_scale).T), expected)
    # And a strided slice of a blocked tensor unswizzles like its contiguous copy.
    blocked = swizzle_32_4_4(_torch_input((2, 129, 5), torch.uint8))
    assert torch.equal(unswizzle_32_4_4(blocked[1], 129, 5), unswizzle_32_4_4(blocked[1].clone(), 129, 5))


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (17, 3)], ids=["one_tile", "aligned", "padded"])
def test_results_are_new_arrays(shape):
    # Aligned shapes need no padding; the result must still be a copy, never a view of the input.
    scale = _random(shape)
    blocked = swizzle_32_4_4(scale)
    back = unswizzle_32_4_4(blocked, *shape)
    assert not np.shares_memory(blocked, scale) and not np.shares_memory(back, blocked)
    tensor = torch.from_numpy(scale.copy())
    tensor_blocked = swizzle_32_4_4(tensor)
    assert tensor_blocked.data_ptr() != tensor.data_ptr()
    tensor.zero_()
    np.testing.assert_array_equal(tensor_blocked.numpy(), blocked)


@pytest.mark.parametrize("rows,cols", [(0, 5), (17, 0), (0, 0)])
def test_empty(rows, cols):
    # An empty operand (M = 0 or K = 0) has an empty blocked layout and round-trips.
    blocked = swizzle_32_4_4(np.zeros((2, rows, cols), dtype=np.uint8))
    assert blocked.shape == (2, *swizzled_shape(rows, cols))
    assert unswizzle_32_4_4(blocked, rows, cols).shape == (2, rows, cols)
    tensor_blocked = swizzle_32_4_4(torch.zeros((rows, cols), dtype=torch.float8_e8m0fnu))
    assert tensor_blocked.dtype == torch.float8_e8m0fnu
    assert unswizzle_32_4_4(tensor_blocked, rows, cols).shape == (rows, cols)


def test_public_api():
    assert (ROW_TILE, COL_TILE) == (128, 4)
    assert swizzle.BLOCK_SHAPE == (32, 16)
    assert swizzled_shape(300, 5) == (3, 2, 32, 16)
    assert swizzled_shape(0, 0) == (0, 0, 32, 16)
    assert swizzled_shape(np.int64(128), 4) == (1, 1, 32, 16)
    assert set(swizzle.__all__) == {
        "BLOCK_SHAPE", "COL_TILE", "ROW_TILE", "swizzle_32_4_4", "swizzle_index", "swizzled_shape", "unswizzle_32_4_4",
    }
    # The docstring carries the formula and the diagram.
    doc = swizzle_32_4_4.__doc__
    assert "(r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)" in doc
    assert "block col ((r % 128) // 32) * 4 + c % 4" in doc


def test_swizzle_index_torch_tensors():
    r, c = torch.meshgrid(torch.arange(256), torch.arange(8), indexing="ij")
    np.testing.assert_array_equal(swizzle_index(r, c, 5).numpy(), _loop_layout(129, 5))


def test_imports_with_numpy_only():
    # torch and CuPy must stay optional: block them and use the numpy path.
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['cupy'] = None\n"
        "import numpy as np, swizzle\n"
        "b = swizzle.swizzle_32_4_4(np.ones((3, 5), np.uint8))\n"
        "assert b.shape == (1, 2, 32, 16) and int(b.sum()) == 15\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# Errors: typed, and naming the argument, the value received and what is accepted


def test_swizzle_rejects_wrong_type():
    accepted = r"a numpy.ndarray, a torch.Tensor or a cupy.ndarray"
    with pytest.raises(TypeError, match=rf"scale must be {accepted}, got builtins.list"):
        swizzle_32_4_4([[1, 2], [3, 4]])


@pytest.mark.parametrize(
    "scale",
    [np.zeros(5, np.uint8), torch.zeros(5), np.array(1.0, np.float32)],
    ids=["np1d", "torch1d", "np0d"],
)
def test_swizzle_rejects_fewer_than_two_dims(scale):
    pattern = r"scale must have at least 2 dimensions \(\.\.\., rows, cols\), got shape \((5,)?\)"
    with pytest.raises(ValueError, match=pattern):
        swizzle_32_4_4(scale)


def test_unswizzle_rejects_wrong_type():
    accepted = r"a numpy.ndarray, a torch.Tensor or a cupy.ndarray"
    with pytest.raises(TypeError, match=rf"blocked must be {accepted}, got builtins.tuple"):
        unswizzle_32_4_4((1, 2), 1, 1)


@pytest.mark.parametrize(
    "shape", [(1, 1, 16, 32), (1, 1, 32, 4, 4), (32, 16)], ids=["swapped", "5d_inner", "2d"]
)
def test_unswizzle_rejects_bad_block_shape(shape):
    pattern = r"blocked must have shape \(\.\.\., row_tiles, col_tiles, 32, 16\), got shape "
    with pytest.raises(ValueError, match=pattern + re.escape(str(shape))):
        unswizzle_32_4_4(np.zeros(shape, np.uint8), 1, 1)


def test_unswizzle_rejects_tile_count_mismatch():
    blocked = swizzle_32_4_4(np.zeros((129, 5), np.uint8))  # (2, 2, 32, 16)
    pattern = r"blocked has shape \(2, 2, 32, 16\), but rows=300, cols=5 need \(\.\.\., 3, 2, 32, 16\)"
    with pytest.raises(ValueError, match=pattern):
        unswizzle_32_4_4(blocked, 300, 5)
    with pytest.raises(ValueError, match=r"rows=129, cols=9 need \(\.\.\., 2, 3, 32, 16\).*ceil\(cols/4\)=3"):
        unswizzle_32_4_4(torch.from_numpy(blocked), 129, 9)


@pytest.mark.parametrize(
    "rows,cols,error,pattern",
    [
        (-1, 4, ValueError, r"rows must be a non-negative int, got -1"),
        (4, -2, ValueError, r"cols must be a non-negative int, got -2"),
        (4.0, 4, TypeError, r"rows must be a non-negative int, got float 4.0"),
        (4, True, TypeError, r"cols must be a non-negative int, got bool True"),
    ],
)
def test_size_arguments_are_validated(rows, cols, error, pattern):
    with pytest.raises(error, match=pattern):
        swizzled_shape(rows, cols)
    with pytest.raises(error, match=pattern):
        unswizzle_32_4_4(np.zeros((1, 1, 32, 16), np.uint8), rows, cols)


def test_swizzle_index_validates():
    with pytest.raises(ValueError, match=r"c must be >= 0 and < 8, got 8"):
        swizzle_index(0, 8, 5)  # cols=5 pads to 8 columns: 0..7 are valid
    with pytest.raises(ValueError, match=r"r must be >= 0, got -1"):
        swizzle_index(-1, 0, 5)
    with pytest.raises(ValueError, match=r"c must be >= 0 and < 4, got values in \[0, 4\]"):
        swizzle_index(np.zeros(5, np.int64), np.arange(5), 3)
    with pytest.raises(TypeError, match=r"r must be an int or an integer array, got ndarray"):
        swizzle_index(np.zeros(3), 0, 4)
    with pytest.raises(TypeError, match=r"c must be an int or an integer array, got float 1.0"):
        swizzle_index(0, 1.0, 4)


# ---------------------------------------------------------------------------------------------
# Properties


@settings(max_examples=150, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    rows=st.integers(0, 300),
    cols=st.integers(0, 40),
    seed=st.integers(0, 2**32 - 1),
    use_torch=st.booleans(),
)
def test_property_round_trip_and_scatter(batch, rows, cols, seed, use_torch):
    scale = _random((*batch, rows, cols), seed=seed)
    blocked = swizzle_32_4_4(torch.from_numpy(scale).view(torch.float8_e8m0fnu) if use_torch else scale)
    raw = _bytes(blocked) if use_torch else blocked
    assert raw.shape == (*batch, *swizzled_shape(rows, cols))
    # Every scale sits where swizzle_index says, in its batch entry's run of blocks.
    r, c = np.indices((rows, cols))
    flat = raw.reshape(*batch, -1)
    np.testing.assert_array_equal(flat[..., swizzle_index(r, c, cols)], scale)
    back = unswizzle_32_4_4(blocked, rows, cols)
    np.testing.assert_array_equal(_bytes(back) if use_torch else back, scale)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 600), cols=st.integers(1, 80))
def test_property_swizzle_index_is_bijection(rows, cols):
    r_pad, c_pad = _round_up(rows, ROW_TILE), _round_up(cols, COL_TILE)
    r, c = np.indices((r_pad, c_pad))
    index = swizzle_index(r, c, cols)
    assert index.min() == 0 and index.max() == r_pad * c_pad - 1
    np.testing.assert_array_equal(np.sort(index, axis=None), np.arange(r_pad * c_pad))
    assert int(np.prod(swizzled_shape(rows, cols))) == r_pad * c_pad


# ---------------------------------------------------------------------------------------------
# GPU arrays (CuPy, torch CUDA): the same code must run on device memory


def _cupy_or_skip():
    try:
        import cupy
    except ImportError:
        pytest.skip("cupy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("cupy found no CUDA device")
    except Exception as error:  # no driver, no device
        pytest.skip(f"cupy cannot reach a CUDA device: {error}")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint8, np.float32], ids=["uint8", "float32"])
def test_cupy(dtype):
    cupy = _cupy_or_skip()
    scale = _random((2, 129, 5), dtype)
    blocked = swizzle_32_4_4(cupy.asarray(scale))
    assert isinstance(blocked, cupy.ndarray) and blocked.dtype == scale.dtype
    assert blocked.flags.c_contiguous
    host = cupy.asnumpy(blocked)
    for i in range(2):
        np.testing.assert_array_equal(host[i], _loop_swizzle(scale[i]))
    back = unswizzle_32_4_4(blocked, 129, 5)
    assert isinstance(back, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(back), scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch found no CUDA device")
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_cuda(dtype):
    scale = _torch_input((2, 129, 5), dtype).cuda()
    blocked = swizzle_32_4_4(scale)
    assert blocked.device == scale.device and blocked.dtype == dtype
    host = _bytes(blocked)
    for i in range(2):
        np.testing.assert_array_equal(host[i], _loop_swizzle(_bytes(scale[i])))
    np.testing.assert_array_equal(_bytes(unswizzle_32_4_4(blocked, 129, 5)), _bytes(scale))
