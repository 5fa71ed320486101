"""The public matmul API on CPU (the reference path): semantics, scale layouts, batching, errors.

The oracle is an fp64 matmul of operands dequantized by an independent per-element decode written
here, so a bug in tilemm's decoders cannot hide itself.
"""

import math

import pytest
import torch

import swizzle
import tilemm
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------- independent oracle (fp64)

def _decode_e2m1_bytes(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1).tolist()
    vals = []
    for byte in flat:
        for nib in (byte & 0xF, byte >> 4):
            v = E2M1[nib & 7]
            vals.append(-v if nib & 8 else v)
    return torch.tensor(vals, dtype=torch.float64).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _decode_scale(fmt, scale: torch.Tensor) -> torch.Tensor:
    if fmt.scale_dtype == torch.float8_e8m0fnu:
        b = scale.view(torch.uint8).to(torch.float64)
        return torch.where(b == 255, torch.full_like(b, math.nan), torch.exp2(b - 127))
    return scale.to(torch.float64)


def _dequant64(fmt, data, scale):
    """data (..., Kd) with blocks along the last dim; scale logical (..., K/B)."""
    vals = _decode_e2m1_bytes(data) if fmt.is_packed else data.to(torch.float64)
    return vals * _decode_scale(fmt, scale).repeat_interleave(fmt.block, dim=-1)


def oracle(fmt, x, sx, y, sy, alpha=1.0, bias=None):
    xf = _dequant64(fmt, x, sx)
    yf = _dequant64(fmt, y.transpose(-1, -2), sy.transpose(-1, -2)).transpose(-1, -2)
    out = (xf @ yf) * alpha
    return out if bias is None else out + bias.to(torch.float64)


def rel_err(out, ref):
    out, ref = out.to(torch.float64), ref.to(torch.float64)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3 + 1e-5, torch.float16: 1e-3 + 1e-5}


# ---------------------------------------------------------------- random valid operands

def _random_fp8(shape, dtype, gen):
    # Random finite values spread over the format's range, exactly representable.
    v = torch.randn(shape, generator=gen)
    return v.to(dtype)


def _random_scale(fmt, shape, gen):
    if fmt.scale_dtype == torch.float8_e8m0fnu:
        return torch.randint(123, 130, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return (torch.rand(shape, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn)


def operands(fmt, m, n, k, batch=(), y_batch=None, seed=0):
    """(x, x_scale, y, y_scale) with y = w.t() of an (N, K) weight and y_scale = w_scale.t()."""
    gen = torch.Generator().manual_seed(seed)
    y_batch = batch if y_batch is None else y_batch
    ks = k // fmt.block
    if fmt.is_packed:
        x = torch.randint(0, 256, (*batch, m, k // 2), generator=gen, dtype=torch.uint8)
        w = torch.randint(0, 256, (*y_batch, n, k // 2), generator=gen, dtype=torch.uint8)
    else:
        x = _random_fp8((*batch, m, k), fmt.data_dtype, gen)
        w = _random_fp8((*y_batch, n, k), fmt.data_dtype, gen)
    sx = _random_scale(fmt, (*batch, m, ks), gen)
    sw = _random_scale(fmt, (*y_batch, n, ks), gen)
    return x, sx, w.transpose(-1, -2), sw.transpose(-1, -2)


def call(fmt, x, sx, y, sy, **kw):
    if fmt.name.startswith("mxfp8"):
        return tilemm.mxfp8_matmul(x, sx, y, sy, **kw)
    if fmt is MXFP4:
        return tilemm.mxfp4_matmul(x, sx, y, sy, **kw)
    kw.setdefault("global_scale_x", 1.0)
    kw.setdefault("global_scale_y", 1.0)
    return tilemm.nvfp4_matmul(x, sx, y, sy, **kw)


BLOCK_FORMATS = [MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4]
FMT_IDS = [f.name for f in BLOCK_FORMATS]


# ---------------------------------------------------------------- semantics

@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 17, 64), (7, 17, 96), (100, 33, 160), (129, 8, 32)],
                         ids=lambda v: str(v))  # M=1/7/100/129 and N=17 are the partial-tile shapes
def test_block_scaled_matches_fp64(fmt, out_dtype, m, n, k):
    x, sx, y, sy = operands(fmt, m, n, k)
    out = call(fmt, x, sx, y, sy, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert rel_err(out, oracle(fmt, x, sx, y, sy)) < TOL[out_dtype]


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_swizzled_scales_give_identical_result(fmt):
    x, sx, y, sy = operands(fmt, 129, 17, 96)  # rows and K-blocks both need padding
    logical = call(fmt, x, sx, y, sy, out_dtype=torch.float32)
    swz = call(fmt, x, swizzle.swizzle_32_4_4(sx), y, swizzle.swizzle_32_4_4(sy.t()),
               out_dtype=torch.float32)
    assert torch.equal(logical, swz)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_poisoned_padding_rows_never_reach_output(fmt):
    x, sx, y, sy = operands(fmt, 7, 17, 64)
    sxs, sys_ = swizzle.swizzle_32_4_4(sx), swizzle.swizzle_32_4_4(sy.t())
    ref = call(fmt, x, sxs, y, sys_, out_dtype=torch.float32)
    # Poison every padded row (rows 7..127 of x, 17..127 of y) with 0xFF (NaN in e8m0, NaN in e4m3).
    for s, rows in ((sxs, 7), (sys_, 17)):
        u = s.view(torch.uint8)
        for r in range(rows, 128):
            u[r // 128, :, r % 32, ((r % 128) // 32) * 4: ((r % 128) // 32) * 4 + 4] = 0xFF
    out = call(fmt, x, sxs, y, sys_, out_dtype=torch.float32)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("shared_y", [False, True], ids=["batched_y", "shared_y"])
def test_batched_equals_per_slice(fmt, shared_y):
    x, sx, y, sy = operands(fmt, 9, 17, 64, batch=(3,), y_batch=() if shared_y else (3,))
    out = call(fmt, x, sx, y, sy, out_dtype=torch.float32)
    for i in range(3):
        yi, syi = (y, sy) if shared_y else (y[i], sy[i])
        # fp32 summation order may differ between batched and 2-D matmuls: compare to fp32 precision.
        assert rel_err(out[i], call(fmt, x[i], sx[i], yi, syi, out_dtype=torch.float32)) < 1e-6


def test_batched_swizzled_scales():
    fmt = MXFP8_E4M3
    x, sx, y, sy = operands(fmt, 9, 17, 64, batch=(2,))
    logical = call(fmt, x, sx, y, sy, out_dtype=torch.float32)
    sxs = swizzle.swizzle_32_4_4(sx)
    sys_ = swizzle.swizzle_32_4_4(sy.transpose(-1, -2))
    assert sxs.shape == (2, 1, 1, 32, 16)
    assert torch.equal(logical, call(fmt, x, sxs, y, sys_, out_dtype=torch.float32))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_alpha_and_bias(fmt):
    x, sx, y, sy = operands(fmt, 5, 17, 64)
    bias = torch.randn(17, dtype=torch.bfloat16)
    out = call(fmt, x, sx, y, sy, out_dtype=torch.float32, alpha=0.375, bias=bias)
    assert rel_err(out, oracle(fmt, x, sx, y, sy, alpha=0.375, bias=bias)) < 1e-5


def test_nvfp4_global_scales_fold_into_alpha():
    x, sx, y, sy = operands(NVFP4, 5, 17, 64)
    ref = oracle(NVFP4, x, sx, y, sy, alpha=0.5 * 0.25 * 3.0)
    out = tilemm.nvfp4_matmul(x, sx, y, sy, global_scale_x=0.5, global_scale_y=0.25, alpha=3.0,
                              out_dtype=torch.float32)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("form", ["float", "fp32", "bf16", "fp16"])
def test_nvfp4_global_scale_forms_agree(form):
    x, sx, y, sy = operands(NVFP4, 5, 17, 64)
    g = 0.3125  # exactly representable in fp16 and bf16
    as_form = {"float": g, "fp32": torch.tensor(g), "bf16": torch.tensor(g, dtype=torch.bfloat16),
               "fp16": torch.tensor(g, dtype=torch.float16)}[form]
    expected = tilemm.nvfp4_matmul(x, sx, y, sy, global_scale_x=torch.tensor(g), global_scale_y=g)
    assert torch.equal(tilemm.nvfp4_matmul(x, sx, y, sy, global_scale_x=as_form, global_scale_y=g),
                       expected)


@pytest.mark.parametrize("fmt", [MXFP8_E4M3, MXFP4], ids=["mxfp8", "mxfp4"])
def test_nan_scale_poisons_exactly_its_row(fmt):
    x, sx, y, sy = operands(fmt, 6, 17, 64)
    sx.view(torch.uint8)[2, 1] = 255  # e8m0 NaN in row 2
    out = call(fmt, x, sx, y, sy, out_dtype=torch.float32)
    nan_rows = out.isnan().all(dim=1)
    assert nan_rows.tolist() == [r == 2 for r in range(6)]
    assert not out[torch.arange(6) != 2].isnan().any()


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_zero_blocks_give_zero(fmt):
    x, sx, y, sy = operands(fmt, 4, 17, 64)
    x.view(torch.uint8).zero_()
    out = call(fmt, x, sx, y, sy, out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros(4, 17))


def test_uint8_scale_bytes_accepted_for_mx():
    x, sx, y, sy = operands(MXFP8_E4M3, 4, 17, 64)
    assert torch.equal(tilemm.mxfp8_matmul(x, sx, y, sy),
                       tilemm.mxfp8_matmul(x, sx.view(torch.uint8), y, sy.view(torch.uint8)))


def test_empty_m():
    x, sx, y, sy = operands(MXFP8_E4M3, 0, 17, 64)
    out = tilemm.mxfp8_matmul(x, sx, y, sy)
    assert out.shape == (0, 17) and out.dtype == torch.bfloat16


# ---------------------------------------------------------------- FP8

def _fp8_operands(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = _random_fp8((m, k), torch.float8_e4m3fn, gen)
    w = _random_fp8((n, k), torch.float8_e4m3fn, gen)
    return x, w


@pytest.mark.parametrize("gran", ["tensor", "row", "block", "tensor_row"])
def test_fp8_granularities_match_fp64(gran):
    m, n, k = 7, 130, 256
    x, w = _fp8_operands(m, n, k)
    gen = torch.Generator().manual_seed(1)
    if gran == "tensor":
        sx, sy = torch.tensor(0.5), torch.tensor(0.25)
        xs, ys = sx.double(), sy.double()
    elif gran in ("row", "tensor_row"):
        sx = torch.rand(m, 1, generator=gen) + 0.5 if gran == "row" else torch.tensor(0.5)
        sy = torch.rand(1, n, generator=gen) + 0.5
        xs, ys = sx.double(), sy.double()
    else:
        sx = torch.rand(m, k // 128, generator=gen) + 0.5
        sw = torch.rand(math.ceil(n / 128), k // 128, generator=gen) + 0.5  # the (N, K) weight's
        sy = sw.t()
        xs = sx.double().repeat_interleave(128, 1)
        ys = sw.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1).t()
    ref = (x.double() * xs) @ (w.t().double() * ys)
    out = tilemm.fp8_matmul(x, sx, w.t(), sy, out_dtype=torch.float32)
    assert rel_err(out, ref) < 1e-5


# ---------------------------------------------------------------- linear()

def test_linear_matches_explicit_calls():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5, 3, 64, generator=gen)
    w = torch.randn(17, 64, generator=gen)
    for quant in (tilemm.quantize_mxfp8, tilemm.quantize_mxfp4, tilemm.quantize_nvfp4):
        for swz in (False, True):
            xq, wq = quant(a, swizzle=swz), quant(w, swizzle=swz)
            out = tilemm.linear(xq, wq, out_dtype=torch.float32)
            ref = tilemm.dequantize(xq).double() @ tilemm.dequantize(wq).double().t()
            assert rel_err(out, ref) < 1e-5, (quant.__name__, swz)
    for gran in ("tensor", "row"):
        xq = tilemm.quantize_fp8(a, granularity=gran)
        wq = tilemm.quantize_fp8(w, granularity=gran)
        out = tilemm.linear(xq, wq, out_dtype=torch.float32)
        ref = tilemm.dequantize(xq).double() @ tilemm.dequantize(wq).double().t()
        assert rel_err(out, ref) < 1e-5, gran


@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
def test_linear_eager_route_is_the_public_functions(monkeypatch, swizzle):
    # An eager CUDA linear() goes straight to the operators' implementations (``_linear_eager``); the
    # implementations run on the CPU too, so forcing that route here must give the public functions'
    # bits, and their errors.
    from tilemm import matmul as mm

    gen = torch.Generator().manual_seed(6)
    a, w = torch.randn(2, 5, 64, generator=gen), torch.randn(17, 64, generator=gen)
    bias = torch.randn(17, generator=gen)
    cases = [(tilemm.quantize_mxfp8(a, swizzle=swizzle), tilemm.quantize_mxfp8(w, swizzle=swizzle)),
             (tilemm.quantize_mxfp4(a, swizzle=swizzle), tilemm.quantize_mxfp4(w, swizzle=swizzle)),
             (tilemm.quantize_nvfp4(a, swizzle=swizzle), tilemm.quantize_nvfp4(w, swizzle=swizzle))]
    if not swizzle:
        cases += [(tilemm.quantize_fp8(a, granularity="row"), tilemm.quantize_fp8(w, granularity="tensor")),
                  (tilemm.quantize_fp8(a[..., :1, :].expand(2, 5, 64).contiguous(), granularity="tensor"),
                   tilemm.quantize_fp8(w, granularity="row"))]
    want = [tilemm.linear(xq, wq, bias=bias, alpha=0.5, out_dtype=torch.float16) for xq, wq in cases]
    monkeypatch.setattr(mm, "_eager_gpu", lambda x: True)
    routed, inner = [], mm._linear_eager
    monkeypatch.setattr(mm, "_linear_eager", lambda fn, *args: routed.append(fn) or inner(fn, *args))
    for (xq, wq), expected in zip(cases, want):
        got = tilemm.linear(xq, wq, bias=bias, alpha=0.5, out_dtype=torch.float16)
        assert got.dtype == torch.float16 and torch.equal(got, expected), type(xq).__name__
        assert routed.pop() == f"{type(xq).__name__[:-6].lower()}_matmul"
        with pytest.raises(TypeError, match=r"_matmul: out_dtype must be one of"):
            tilemm.linear(xq, wq, out_dtype=torch.int8)
        with pytest.raises(ValueError, match=r"_matmul: bias must have shape \(N,\) = \(17,\)"):
            tilemm.linear(xq, wq, bias=torch.zeros(3))


def test_linear_fp8_blocks():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(9, 256, generator=gen)
    w = torch.randn(200, 256, generator=gen)
    xq = tilemm.quantize_fp8(a, granularity=(1, 128))
    wq = tilemm.quantize_fp8(w, granularity=(128, 128))
    out = tilemm.linear(xq, wq, out_dtype=torch.float32)
    ref = tilemm.dequantize(xq).double() @ tilemm.dequantize(wq).double().t()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("quant,matmul", [(tilemm.quantize_mxfp8, tilemm.mxfp8_matmul),
                                          (tilemm.quantize_mxfp4, tilemm.mxfp4_matmul)],
                         ids=["mxfp8", "mxfp4"])
def test_swapped_swizzled_scales_are_silently_wrong_and_linear_cannot_swap(quant, matmul):
    # The limitation the matmul docstrings state: with M and N in the same 128-row tile and one K, the
    # two swizzled scales have the same shape, so nothing can tell them apart.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, 64, generator=gen) * torch.logspace(-3, 3, 20).unsqueeze(1)  # rows of many scales
    w = torch.randn(50, 64, generator=gen)
    xq, wq = quant(x, swizzle=True), quant(w, swizzle=True)
    assert xq.scale.shape == wq.scale.shape
    right = matmul(xq.data, xq.scale, wq.data.t(), wq.scale, out_dtype=torch.float32)
    swapped = matmul(xq.data, wq.scale, wq.data.t(), xq.scale, out_dtype=torch.float32)  # no error
    ref = tilemm.dequantize(xq).double() @ tilemm.dequantize(wq).double().t()
    assert rel_err(right, ref) < 1e-5
    assert rel_err(swapped, ref) > 0.5
    assert torch.equal(tilemm.linear(xq, wq, out_dtype=torch.float32), right)


# ---------------------------------------------------------------- errors

def test_errors_name_argument_value_and_accepted():
    x, sx, y, sy = operands(MXFP8_E4M3, 4, 17, 64)
    with pytest.raises(TypeError, match=r"mxfp8_matmul: x must have dtype .*float8_e4m3fn.*got torch.float32"):
        tilemm.mxfp8_matmul(x.float(), sx, y, sy)
    with pytest.raises(TypeError, match=r"y must have dtype torch.float8_e4m3fn, got torch.float8_e5m2"):
        tilemm.mxfp8_matmul(x, sx, y.to(torch.float32).to(torch.float8_e5m2), sy)
    with pytest.raises(ValueError, match=r"K differ: x \(4, 64\), y \(32, 17\)"):
        tilemm.mxfp8_matmul(x, sx, y[:32], sy)
    with pytest.raises(ValueError, match=r"y must be K-major"):
        tilemm.mxfp8_matmul(x, sx, y.contiguous(), sy)
    with pytest.raises(ValueError, match=r"x must be row-major"):
        tilemm.mxfp8_matmul(x.t().contiguous().t(), sx, y, sy)
    with pytest.raises(ValueError, match=r"x_scale must have shape \(4, 2\), got \(4, 3\)"):
        tilemm.mxfp8_matmul(x, torch.cat([sx, sx[:, :1]], 1), y, sy)
    with pytest.raises(ValueError, match=r"y_scale must have shape \(2, 17\) \(usually w_scale.t\(\)\), got \(17, 2\)"):
        tilemm.mxfp8_matmul(x, sx, y, sy.t())
    with pytest.raises(ValueError, match=r"both be logical or both swizzled"):
        tilemm.mxfp8_matmul(x, swizzle.swizzle_32_4_4(sx), y, sy)
    with pytest.raises(ValueError, match=r"x_scale must be the logical scale \(2-D\) or the swizzled"):
        tilemm.mxfp8_matmul(x, sx[None], y, sy)
    with pytest.raises(TypeError, match=r"x_scale must have dtype .*float8_e8m0fnu.*got torch.float32"):
        tilemm.mxfp8_matmul(x, sx.float(), y, sy)
    with pytest.raises(TypeError, match=r"out_dtype must be one of .*got torch.int32"):
        tilemm.mxfp8_matmul(x, sx, y, sy, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"bias must have shape \(N,\) = \(17,\), got \(16,\)"):
        tilemm.mxfp8_matmul(x, sx, y, sy, bias=torch.zeros(16))
    with pytest.raises(TypeError, match=r"alpha must be a float or a 0-d float tensor, got str"):
        tilemm.mxfp8_matmul(x, sx, y, sy, alpha="2")
    with pytest.raises(TypeError, match=r"y must be a torch.Tensor .*got list"):
        tilemm.mxfp8_matmul(x, sx, [[1]], sy)


def test_block_size_and_global_scale_errors():
    x, sx, y, sy = operands(NVFP4, 4, 17, 32)
    with pytest.raises(ValueError, match=r"global_scale_x must be a scalar .*shape \(2,\)"):
        tilemm.nvfp4_matmul(x, sx, y, sy, global_scale_x=torch.ones(2), global_scale_y=1.0)
    with pytest.raises(TypeError, match=r"global_scale_y must be a float or a 0-d float tensor, got NoneType"):
        tilemm.nvfp4_matmul(x, sx, y, sy, global_scale_x=1.0, global_scale_y=None)
    x8, sx8, y8, sy8 = operands(MXFP8_E4M3, 4, 17, 64)
    with pytest.raises(ValueError, match=r"K must be a multiple of the mxfp8_e4m3 block size 32, got K=48"):
        tilemm.mxfp8_matmul(x8[:, :48], sx8, y8[:48], sy8)
    with pytest.raises(ValueError, match=r"y's batch dims \(3,\) must equal x's \(2,\)"):
        tilemm.mxfp8_matmul(x8.expand(2, 4, 64), sx8.expand(2, 4, 2), y8.expand(3, 64, 17), sy8.expand(3, 2, 17))


def test_fp8_scale_errors():
    x, w = _fp8_operands(4, 17, 256)
    with pytest.raises(ValueError, match=r"x_scale must be 0-d \(per tensor\), \(4, 1\) \(per row\)"):
        tilemm.fp8_matmul(x, torch.ones(4, 3), w.t(), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"1x128 x-scales pair only with 128x128 y-scales"):
        tilemm.fp8_matmul(x, torch.ones(4, 2), w.t(), torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"y_scale must be float32, got torch.bfloat16"):
        tilemm.fp8_matmul(x, torch.tensor(1.0), w.t(), torch.tensor(1.0, dtype=torch.bfloat16))


def test_linear_errors():
    a = tilemm.quantize_mxfp8(torch.randn(4, 64))
    b = tilemm.quantize_mxfp4(torch.randn(8, 64))
    with pytest.raises(TypeError, match=r"linear: x_q and w_q must be of one format, got MXFP8Tensor and MXFP4Tensor"):
        tilemm.linear(a, b)
    with pytest.raises(TypeError, match=r"linear: x_q and w_q must be quantized tensors"):
        tilemm.linear(a, torch.zeros(3))


def test_quantized_tensors_move_between_devices_but_keep_their_encoding():
    q = tilemm.quantize_nvfp4(torch.randn(4, 32))
    moved = q.to("cpu")
    assert type(moved) is tilemm.NVFP4Tensor and moved.device == torch.device("cpu")
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b) for a, b in zip(q, q.cpu()))
    with pytest.raises(TypeError, match=r"NVFP4Tensor.to moves between devices; a dtype would change"):
        q.to(torch.float32)


@pytest.mark.parametrize("gx,gw", [((1, 128), (1, 128)), ((128, 128), (128, 128)), ((1, 128), "row"),
                                   ("row", (128, 128)), ("tensor", (128, 128))])
def test_linear_fp8_block_pairing_error_names_the_users_arguments(gx, gw):
    # FP8 blocks pair (1, 128) activations with (128, 128) weights. A wrong pair used to fail inside
    # fp8_matmul with an error about y_scale, an argument the user of linear never passed.
    x, w = torch.randn(4, 256), torch.randn(128, 256)
    with pytest.raises(ValueError, match=r"granularity=\(1, 128\) \(x_q\).*granularity=\(128, 128\) \(w_q\)") as e:
        tilemm.linear(tilemm.quantize_fp8(x, granularity=gx), tilemm.quantize_fp8(w, granularity=gw))
    assert "y_scale" not in str(e.value)
    good = tilemm.linear(tilemm.quantize_fp8(x, granularity=(1, 128)), tilemm.quantize_fp8(w, granularity=(128, 128)))
    assert good.shape == (4, 128)


def test_checked_once_per_signature(monkeypatch):
    # A signature (shapes, strides, dtypes, devices, options) is checked and planned on its first call
    # only; a call that differs in any of them (here: a transposed x, which must be refused, and an
    # other out_dtype) is checked again.
    from tilemm import matmul as mm

    mm._CALLS.clear()
    checks = []
    real = mm._block_scaled
    monkeypatch.setattr(mm, "_block_scaled", lambda *a, **k: checks.append(a[0]) or real(*a, **k))
    xq = tilemm.quantize_mxfp8(torch.randn(3, 64))
    wq = tilemm.quantize_mxfp8(torch.randn(5, 64))
    first = tilemm.linear(xq, wq)
    for _ in range(3):
        assert torch.equal(tilemm.linear(xq, wq), first)
    assert checks == ["mxfp8_matmul"]
    tilemm.linear(xq, wq, out_dtype=torch.float32)
    assert len(checks) == 2
    column_major = xq.data.t().contiguous().t()  # x's values with stride(-1) != 1
    with pytest.raises(ValueError, match="x must be row-major"):
        tilemm.mxfp8_matmul(column_major, xq.scale, wq.data.t(), wq.scale.t())
    assert len(checks) == 3
