"""The ``axis`` keyword of the quantizers (CPU, reference path): axis=-2 quantizes x.mT.

A matmul's second operand is (..., K, N) and wants K-major data: ``quantize_*(y, axis=-2)`` gives the
(..., N, K) result of ``quantize_*(y.mT)`` bit for bit, which the GPU kernels compute by reading y's
storage transposed (tests/test_quantize_gpu.py compares them with this reference).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tilemm

QUANTIZERS = {
    "mxfp8": lambda x, **kw: tilemm.quantize_mxfp8(x, **kw),
    "mxfp8_e5m2_floor": lambda x, **kw: tilemm.quantize_mxfp8(x, elem_dtype=torch.float8_e5m2,
                                                              rounding="floor", **kw),
    "mxfp4": lambda x, **kw: tilemm.quantize_mxfp4(x, **kw),
    "nvfp4": lambda x, **kw: tilemm.quantize_nvfp4(x, **kw),
    "nvfp4_given_scale": lambda x, **kw: tilemm.quantize_nvfp4(x, global_scale=0.01, **kw),
    "fp8_tensor": lambda x, **kw: tilemm.quantize_fp8(x, **kw),
    "fp8_row": lambda x, **kw: tilemm.quantize_fp8(x, granularity="row", **kw),
    "fp8_1x128": lambda x, **kw: tilemm.quantize_fp8(x, granularity=(1, 128), **kw),
    "fp8_128x128": lambda x, **kw: tilemm.quantize_fp8(x, granularity=(128, 128), pow2_scale=True, **kw),
}
BLOCK_SCALED = ("mxfp8", "mxfp8_e5m2_floor", "mxfp4", "nvfp4", "nvfp4_given_scale")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def _assert_same(a, b):
    assert type(a) is type(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bits(x), _bits(y))


def _operand(shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    x.view(-1)[::97] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("shape", [(256, 130), (2, 128, 3)], ids=["2d", "batched"])
def test_axis_minus_2_is_quantize_of_the_transpose(name, shape):
    # (..., K, M) with K = 256 or 128 (a multiple of every block) and M odd or tiny.
    y = _operand(shape, torch.bfloat16)
    _assert_same(QUANTIZERS[name](y, axis=-2), QUANTIZERS[name](y.mT.contiguous()))


@pytest.mark.parametrize("name", BLOCK_SCALED)
def test_axis_minus_2_swizzled(name):
    y = _operand((2, 160, 130))  # K = 160: 5 MX / 10 NVFP4 scale columns, M = 130 rows of scales
    got = QUANTIZERS[name](y, axis=-2, swizzle=True)
    _assert_same(got, QUANTIZERS[name](y.mT.contiguous(), swizzle=True))
    assert got.data.shape[:-1] == (2, 130)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_axis_minus_1_is_the_default(name):
    x = _operand((3, 256))
    _assert_same(QUANTIZERS[name](x, axis=-1), QUANTIZERS[name](x))


def test_axis_minus_2_feeds_the_matmul_as_the_k_major_operand():
    """y (K, N) quantized along K is the weight form (N, K): its .mT is mxfp8_matmul's y."""
    x, y = _operand((64, 256)), _operand((256, 48))
    xq, yq = tilemm.quantize_mxfp8(x), tilemm.quantize_mxfp8(y, axis=-2)
    out = tilemm.mxfp8_matmul(xq.data, xq.scale, yq.data.mT, yq.scale.mT, out_dtype=torch.float32)
    ref = xq.dequantize().double() @ yq.dequantize().double().mT
    assert (out.double() - ref).norm() <= 1e-5 * ref.norm()  # docs/numerics.md's fp32 matmul bound


def test_axis_with_numpy():
    y = _operand((128, 33)).numpy()
    got = tilemm.quantize_mxfp4(y, axis=-2)
    ref = tilemm.quantize_mxfp4(np.ascontiguousarray(y.T))
    assert isinstance(got.data, np.ndarray)
    assert np.array_equal(got.data, ref.data) and np.array_equal(got.scale, ref.scale)


@pytest.mark.parametrize("axis", [0, 1, -3, 2])
def test_axis_out_of_range(axis):
    with pytest.raises(ValueError, match=rf"quantize_mxfp8: axis must be -1 .* or -2 .*got {axis}"):
        tilemm.quantize_mxfp8(_operand((4, 64)), axis=axis)


@pytest.mark.parametrize("axis", [-2.0, "k", None, True])
def test_axis_type(axis):
    with pytest.raises(TypeError, match=r"quantize_nvfp4: axis must be -1 or -2 \(an int\)"):
        tilemm.quantize_nvfp4(_operand((4, 64)), axis=axis)


def test_axis_minus_2_needs_two_dimensions():
    with pytest.raises(ValueError, match=r"quantize_fp8: axis=-2 needs x with at least 2 dimensions, "
                                         r"got shape \(64,\)"):
        tilemm.quantize_fp8(_operand((64,)), axis=-2)


def test_axis_minus_2_checks_k_of_the_transpose():
    """The block-size check applies to K = x.shape[-2] and names it as the transpose's last dim."""
    with pytest.raises(ValueError, match=r"multiple of the block size 32, got K=40"):
        tilemm.quantize_mxfp8(_operand((40, 64)), axis=-2)
