"""NumPy (CPU) and CuPy (GPU) arrays through tilemm's public functions.

The oracle is the same call on torch tensors: an array in must give the very same bytes out, as an
array of the input's kind. NumPy and CuPy have no float8 / e8m0 / bfloat16, so FP8 data and scales come
back as uint8 bytes, ``elem_dtype`` says how to read FP8 bytes, and matmuls default to float32 output.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import swizzle
import tilemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _np(*shape, dtype=np.float32, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(dtype)


def _bytes(t: torch.Tensor) -> np.ndarray:
    t = t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t
    return t.numpy()


def _assert_same(arrays, tensors):
    assert len(arrays) == len(tensors)
    for a, t in zip(arrays, tensors):
        assert isinstance(a, np.ndarray)
        np.testing.assert_array_equal(a, _bytes(t), strict=True)


# --------------------------------------------------------------------------------------------------
# quantizers and dequantizers
# --------------------------------------------------------------------------------------------------

QUANTIZERS = [
    ("mxfp8", tilemm.quantize_mxfp8, {}),
    ("mxfp8-e5m2-swizzled", tilemm.quantize_mxfp8, dict(elem_dtype=E5M2, swizzle=True)),
    ("mxfp4-floor", tilemm.quantize_mxfp4, dict(rounding="floor")),
    ("nvfp4-swizzled", tilemm.quantize_nvfp4, dict(swizzle=True)),
    ("fp8-row", tilemm.quantize_fp8, dict(granularity="row")),
    ("fp8-128x128", tilemm.quantize_fp8, dict(granularity=(128, 128))),
]


@pytest.mark.parametrize("quantize,kw", [q[1:] for q in QUANTIZERS], ids=[q[0] for q in QUANTIZERS])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_numpy_quantizers_give_the_torch_bytes(quantize, kw, dtype):
    x = _np(7, 256, dtype=dtype)  # 7 rows: a partial swizzle tile
    got = quantize(x, **kw)
    ref = quantize(torch.from_numpy(x), **kw)
    assert type(got) is type(ref)  # the same NamedTuple, fields as arrays
    _assert_same(got, ref)
    assert all(a.dtype in (np.uint8, np.float32) for a in got)


@pytest.mark.parametrize("quantize,kw", [q[1:] for q in QUANTIZERS], ids=[q[0] for q in QUANTIZERS])
def test_numpy_dequantize_round_trip(quantize, kw):
    x = _np(7, 256)
    q = quantize(x, **kw)
    ref = tilemm.dequantize(quantize(torch.from_numpy(x), **kw))
    extra = {"elem_dtype": kw["elem_dtype"]} if "elem_dtype" in kw else {}
    if isinstance(q, tilemm.NVFP4Tensor):
        got = tilemm.dequantize_nvfp4(q.data, q.scale, q.global_scale)
    elif isinstance(q, tilemm.MXFP8Tensor):
        got = tilemm.dequantize_mxfp8(q.data, q.scale, **extra)
    elif isinstance(q, tilemm.MXFP4Tensor):
        got = tilemm.dequantize_mxfp4(q.data, q.scale)
    else:
        got = tilemm.dequantize_fp8(q.data, q.scale, **extra)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_array_equal(got, ref.numpy())


def test_fp8_bytes_default_to_e4m3():
    x = _np(4, 64)
    q = tilemm.quantize_mxfp8(x, elem_dtype=E5M2)
    right = tilemm.dequantize_mxfp8(q.data, q.scale, elem_dtype=E5M2)
    wrong = tilemm.dequantize_mxfp8(q.data, q.scale)  # the bytes do not carry their encoding
    np.testing.assert_array_equal(right, tilemm.dequantize(tilemm.quantize_mxfp8(torch.from_numpy(x), elem_dtype=E5M2)).numpy())
    assert not np.array_equal(right, wrong)


def test_read_only_arrays_need_no_copy_and_raise_no_warning():
    x = _np(4, 64)
    x.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = tilemm.quantize_nvfp4(x)
    _assert_same(q, tilemm.quantize_nvfp4(torch.from_numpy(x.copy())))


def test_numpy_swizzle_matches_torch():
    s = tilemm.quantize_mxfp8(_np(130, 160)).scale  # uint8 (130, 5): pads to (256, 8)
    blocked = swizzle.swizzle_32_4_4(s)
    assert isinstance(blocked, np.ndarray) and blocked.shape == (2, 2, 32, 16)
    np.testing.assert_array_equal(blocked, swizzle.swizzle_32_4_4(torch.from_numpy(s)).numpy())
    np.testing.assert_array_equal(swizzle.unswizzle_32_4_4(blocked, 130, 5), s)


# --------------------------------------------------------------------------------------------------
# matmuls
# --------------------------------------------------------------------------------------------------

def _operands(kind, x, w, **kw):
    """(args, kwargs) of kind's matmul for x (M, K) and w (N, K), from the quantizer's outputs."""
    quantize = {"mxfp8": tilemm.quantize_mxfp8, "mxfp4": tilemm.quantize_mxfp4,
                "nvfp4": tilemm.quantize_nvfp4, "fp8": tilemm.quantize_fp8}[kind]
    xq, wq = quantize(x, **kw), quantize(w, **kw)
    if kind == "fp8":
        return (xq.data, xq.scale, wq.data.T, wq.scale.T), {}
    w_scale = wq.scale if wq.scale.ndim == 4 else wq.scale.T
    args = (xq.data, xq.scale, wq.data.T, w_scale)
    if kind == "nvfp4":
        return args, dict(global_scale_x=xq.global_scale, global_scale_y=wq.global_scale)
    return args, {}


MATMULS = [
    ("mxfp8-swizzled", "mxfp8", dict(swizzle=True)),
    ("mxfp8-e5m2", "mxfp8", dict(elem_dtype=E5M2)),
    ("mxfp4", "mxfp4", {}),
    ("nvfp4-swizzled", "nvfp4", dict(swizzle=True)),
    ("fp8-row", "fp8", dict(granularity="row")),
]


@pytest.mark.parametrize("kind,kw", [m[1:] for m in MATMULS], ids=[m[0] for m in MATMULS])
def test_numpy_matmuls_give_the_torch_result(kind, kw):
    x, w, bias = _np(7, 64), _np(17, 64, seed=1), _np(17, seed=2)
    matmul = getattr(tilemm, f"{kind}_matmul")
    extra = {"elem_dtype": kw["elem_dtype"]} if "elem_dtype" in kw else {}
    args, scales = _operands(kind, x, w, **kw)
    got = matmul(*args, **scales, **extra, bias=bias)  # out_dtype defaults to float32 for arrays
    t_args, t_scales = _operands(kind, torch.from_numpy(x), torch.from_numpy(w), **kw)
    ref = matmul(*t_args, **t_scales, bias=torch.from_numpy(bias), out_dtype=torch.float32)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (7, 17)
    np.testing.assert_array_equal(got, ref.numpy())
    half = matmul(*args, **scales, **extra, out_dtype=np.float16)
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, matmul(*t_args, **t_scales, out_dtype=torch.float16).numpy())


def test_numpy_bfloat16_output_is_refused_with_the_fix():
    args, _ = _operands("mxfp4", _np(4, 64), _np(8, 64))
    with pytest.raises(TypeError, match=r"mxfp4_matmul: out_dtype=torch.bfloat16 cannot be returned as a "
                                        r"NumPy or CuPy array .*pass out_dtype=torch.float32 or torch.float16"):
        tilemm.mxfp4_matmul(*args, out_dtype=torch.bfloat16)


def test_a_numpy_argument_makes_the_result_numpy():
    x, w = _np(4, 64), _np(8, 64, seed=1)
    xq, wq = tilemm.quantize_mxfp4(torch.from_numpy(x)), tilemm.quantize_mxfp4(w)  # torch x, numpy w
    out = tilemm.mxfp4_matmul(xq.data, xq.scale, wq.data.T, wq.scale.T)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    # The value is the product of the dequantized operands (exact inputs, fp32 accumulation).
    x_deq = tilemm.dequantize(xq).double()
    w_deq = torch.from_numpy(tilemm.dequantize_mxfp4(wq.data, wq.scale)).double()
    ref = (x_deq @ w_deq.T).numpy()
    assert np.linalg.norm(out - ref) <= 1e-6 * np.linalg.norm(ref)


@pytest.mark.parametrize("quantize", [tilemm.quantize_mxfp8, tilemm.quantize_mxfp4, tilemm.quantize_nvfp4,
                                      tilemm.quantize_fp8], ids=lambda f: f.__name__)
def test_linear_refuses_numpy_operands_with_the_fix(quantize):
    # A quantizer given arrays returns arrays (FP8 as bytes that do not say which encoding they hold),
    # so linear, which works on quantized torch tensors, says what to do instead.
    xq, wq = quantize(_np(4, 64)), quantize(_np(8, 64, seed=1))
    kind = type(xq).__name__
    with pytest.raises(TypeError, match=rf"linear: x_q must hold torch tensors, got a {kind} of "
                                        rf"numpy.ndarray; .*quantize torch.from_numpy\(x\)"):
        tilemm.linear(xq, wq)
    # With torch tensors on either side, it is w_q that is named.
    t_xq = quantize(torch.from_numpy(_np(4, 64)))
    with pytest.raises(TypeError, match=r"linear: w_q must hold torch tensors"):
        tilemm.linear(t_xq, wq)


def test_uint8_fp8_tensors_need_elem_dtype_to_agree():
    xq = tilemm.quantize_mxfp8(torch.randn(4, 64), elem_dtype=E5M2)
    wq = tilemm.quantize_mxfp8(torch.randn(8, 64), elem_dtype=E5M2)
    ref = tilemm.mxfp8_matmul(xq.data, xq.scale, wq.data.t(), wq.scale.t())
    raw = tilemm.mxfp8_matmul(xq.data.view(torch.uint8), xq.scale, wq.data.view(torch.uint8).t(), wq.scale.t(),
                              elem_dtype=E5M2)
    assert torch.equal(raw, ref)
    with pytest.raises(TypeError, match=r"mxfp8_matmul: x has dtype torch.float8_e5m2 but elem_dtype=torch.float8_e4m3fn"):
        tilemm.mxfp8_matmul(xq.data, xq.scale, wq.data.t(), wq.scale.t(), elem_dtype=E4M3)
    with pytest.raises(TypeError, match=r"fp8_matmul: elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 .*got 'e4m3'"):
        tilemm.fp8_matmul(xq.data, torch.tensor(1.0), wq.data.t(), torch.tensor(1.0), elem_dtype="e4m3")


# --------------------------------------------------------------------------------------------------
# CuPy (GPU)
# --------------------------------------------------------------------------------------------------

def _cupy_skip_reason():
    try:
        import cupy  # noqa: F401
    except ImportError as err:
        return f"needs CuPy (pip install tilemm[cupy]): {err}"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if torch.cuda.get_device_capability() < (9, 0):
        return "needs compute capability >= 9.0"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_cupy_skip_reason() is not None, reason=_cupy_skip_reason() or "")
@pytest.mark.parametrize("kind,kw", [m[1:] for m in MATMULS], ids=[m[0] for m in MATMULS])
def test_cupy_quantize_and_matmul_give_the_torch_result(kind, kw):
    import cupy

    x, w = _np(130, 256), _np(17, 256, seed=1)
    cx, cw = cupy.asarray(x), cupy.asarray(w)
    extra = {"elem_dtype": kw["elem_dtype"]} if "elem_dtype" in kw else {}
    args, scales = _operands(kind, cx, cw, **kw)
    assert all(isinstance(a, cupy.ndarray) for a in args)
    got = getattr(tilemm, f"{kind}_matmul")(*args, **scales, **extra)
    assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float32
    t_args, t_scales = _operands(kind, torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda(), **kw)
    ref = getattr(tilemm, f"{kind}_matmul")(*t_args, **t_scales, out_dtype=torch.float32)
    np.testing.assert_array_equal(cupy.asnumpy(got), ref.cpu().numpy())
