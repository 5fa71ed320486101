"""The Hopper kernels' tile code and launchers, run on the CPU through a NumPy model of cuTile.

cuTile has no CPU interpreter, and CI has no GPU. The kernels' own Python functions
(``hopper_block_scaled``'s stream kernel, its split-K reduction included, and dequantize kernel,
the ``hopper_gemm`` kernel under ``hopper_fp8``) run on the model in tests/_emulator.py, block by
block over the launch grid that the real launcher computes. This checks the index arithmetic (swapped operands, split-K
ranges, the 32x4x4 scale slices for 16- / 64-row tiles, the nibble order, K padding of the dequantized
copies, persistent tile loops, batch broadcast) against ``tilemm.reference``, and the exactness
argument of ``hopper_block_scaled``'s docstring: every 16-bit operand that reaches ``ct.mma`` must be
exactly representable in its dtype (the model asserts it), and every elementwise product of the
decode is rounded to its dtype, so an inexact step would show.

It does not check cuTile's compiler, register use or the hardware (tests/test_kernels_gpu.py does,
on an H100).
"""

from __future__ import annotations

import pytest
import torch

import swizzle
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Granularity
from tilemm.kernels import hopper_block_scaled as hbs
from tilemm.kernels import hopper_fp8 as hfp8
from tilemm.kernels import hopper_gemm as hgemm
from tilemm.matmul import BlockScaledProblem, FP8Problem
from tilemm.reference import block_scaled_matmul_reference, fp8_matmul_reference

from _emulator import LaunchProxy, TileEmulator, assert_matches

BLOCK_FORMATS = [MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4]
FMT_IDS = [f.name for f in BLOCK_FORMATS]


@pytest.fixture
def emulated(monkeypatch):
    """Route the Hopper launchers' ``ct.launch`` to the emulator, on CPU tensors."""
    emu = TileEmulator()
    for module in (hbs, hgemm, hfp8):
        monkeypatch.setattr(module, "ct", LaunchProxy(emu))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    # 4 "SMs": persistent grids are smaller than the tile count, so blocks loop over several tiles.
    monkeypatch.setattr(hgemm, "num_sms", lambda device: 4)
    monkeypatch.setattr(hbs, "num_sms", lambda device: 4)
    monkeypatch.setattr(hfp8, "num_sms", lambda device: 4)
    return emu


# --------------------------------------------------------------------------------------------------
# Operands
# --------------------------------------------------------------------------------------------------

def _elements(fmt, rows, k, gen):
    if fmt.is_packed:
        return torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen)
    b = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=gen)
    bad = ((0x7F, 0xFF) if fmt.data_dtype == torch.float8_e4m3fn
           else tuple(range(0x7C, 0x80)) + tuple(range(0xFC, 0x100)))  # NaN / Inf codes -> 0
    for code in bad:
        b[b == code] = 0
    return b.view(fmt.data_dtype)


def _scales(fmt, rows, ks, gen):
    if fmt.is_mx:  # 2^-12 .. 2^12, and the extremes 0 (2^-127 with MXFP4 only) exercised elsewhere
        return torch.randint(115, 140, (rows, ks), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
    b = torch.randint(0, 0x7F, (rows, ks), dtype=torch.uint8, generator=gen)  # every positive e4m3
    return b.view(torch.float8_e4m3fn)


def block_scaled_case(fmt, m, n, k, *, ba=1, bb=1, swizzled=False, out_dtype=torch.float32, alpha=None,
                      bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ks = k // fmt.block
    batch = max(ba, bb)
    a = torch.stack([_elements(fmt, m, k, gen) for _ in range(ba)])
    b = torch.stack([_elements(fmt, n, k, gen) for _ in range(bb)])
    sa = torch.stack([_scales(fmt, m, ks, gen) for _ in range(ba)])
    sb = torch.stack([_scales(fmt, n, ks, gen) for _ in range(bb)])
    alpha_t = None if alpha is None else torch.tensor(alpha, dtype=torch.float32)
    bias_t = torch.randn(n, generator=gen) if bias else None
    ref = block_scaled_matmul_reference(fmt, a, sa, b.transpose(-1, -2), sb.transpose(-1, -2),
                                        out_dtype=torch.float64 if out_dtype == torch.float32 else out_dtype,
                                        alpha=alpha_t, bias=bias_t).expand(batch, m, n)
    if swizzled:
        sa, sb = swizzle.swizzle_32_4_4(sa), swizzle.swizzle_32_4_4(sb)
    problem = BlockScaledProblem(fmt=fmt, a=a, a_scale=sa, b=b, b_scale=sb, swizzled=swizzled,
                                 out=torch.full((batch, m, n), float("nan"), dtype=out_dtype),
                                 bias=bias_t, alpha=alpha_t)
    return problem, ref


# --------------------------------------------------------------------------------------------------
# Block-scaled: stream (small M, split K) and two-pass (large M)
# --------------------------------------------------------------------------------------------------

SMALL = [hbs.StreamConfig(16, 128, 128, 1), hbs.StreamConfig(16, 128, 128, 2),
         hbs.StreamConfig(16, 64, 128, 2, num_worker_warps=4, occupancy=4),
         hbs.StreamConfig(64, 128, 128, 4), hbs.StreamConfig(128, 128, 128, 1),
         hbs.StreamConfig(16, 64, 128, 2, num_worker_warps=4, occupancy=4, x16=True),
         hbs.StreamConfig(128, 128, 128, 2, x16=True)]


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("cfg", SMALL, ids=lambda c: c.name)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_stream_kernel_emulated(emulated, fmt, cfg, swizzled):
    # M = 70: tiles of 16 / 64 rows cut it at 16 / 64 and sit in the 2nd and 3rd 32-row slices of
    # the 32x4x4 layout; N = 130 a partial weight tile; K = 320: 2.5 K tiles of 128 (split 2 and 4
    # leave one split empty or short).
    problem, ref = block_scaled_case(fmt, 70, 130, 320, swizzled=swizzled, bias=True, alpha=0.75, seed=1)
    hbs.launch(problem, cfg)
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("fmt", [MXFP8_E4M3, NVFP4], ids=["mxfp8_e4m3", "nvfp4"])
def test_prepared_launch_reused_emulated(emulated, fmt):
    # A launch prepared for one problem runs a later problem of the same signature (other operands,
    # other alpha and bias) correctly: the plan holds shapes and constants, never the first tensors.
    # M = 1 and N = 300 (M <= 16, few output tiles): x16 for NVFP4 and a K split for both.
    first, _ = block_scaled_case(fmt, 1, 300, 1024, swizzled=True, bias=True, alpha=0.5, seed=2)
    prepared = hbs.Prepared(first)
    assert prepared.direct and prepared.cfg.split_k > 1
    for seed in (3, 4):
        later, ref = block_scaled_case(fmt, 1, 300, 1024, swizzled=True, bias=True, alpha=0.25, seed=seed)
        prepared.run(later, None)
        assert_matches(later.out, ref, torch.float32)


def _rerun(problem, **changes):
    """``problem`` with a fresh NaN-filled output and ``changes``."""
    fields = {f: getattr(problem, f) for f in ("fmt", "a", "a_scale", "b", "b_scale", "swizzled", "bias", "alpha",
                                               "global_scales")}
    fields.update(changes)
    return BlockScaledProblem(out=torch.full_like(problem.out, float("nan")), **fields)


def _nan_scales(problem):
    """A NaN scale byte (e8m0 255 / e4m3 0x7F) in one row of x and one row of the weight."""
    nan = 255 if problem.fmt.is_mx else 0x7F
    problem.a_scale.view(torch.uint8).reshape(-1)[3] = nan
    problem.b_scale.view(torch.uint8).reshape(-1)[5] = nan


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_small_m_decodes_the_activation_in_the_stream_kernel_exactly(emulated, fmt, split):
    # Up to M = 16 the stream kernel decodes the activation itself (one launch); the result is the
    # one the dequantized 16-bit copy (x16) gives, bit for bit, NaN scales included.
    problem, _ = block_scaled_case(fmt, 13, 130, 512, swizzled=True, bias=True, alpha=0.75, seed=6)
    _nan_scales(problem)
    outs = []
    for x16 in (False, True):
        p = _rerun(problem)
        hbs.launch(p, hbs.StreamConfig(16, 64, 128, split, num_worker_warps=4, occupancy=4, x16=x16))
        outs.append(p.out)
    assert outs[0].isnan().any() and torch.equal(_bits(outs[0]), _bits(outs[1]))


@pytest.mark.parametrize("alpha", [None, 0.75])
@pytest.mark.parametrize("split", [1, 2])
def test_nvfp4_decode_scales_in_the_epilogue_exactly(emulated, split, alpha):
    # The kernel multiplies fp32(gx * gy), then alpha, into the product: the same bits as an alpha
    # of fp32(gx * gy) (* alpha) computed beforehand.
    problem, _ = block_scaled_case(NVFP4, 3, 200, 512, bias=True, alpha=alpha, seed=7)
    gx, gy = torch.tensor(0.37), torch.tensor(1.9e-3)
    cfg = hbs.StreamConfig(16, 64, 128, split, num_worker_warps=4, occupancy=4)
    inside = _rerun(problem, global_scales=(gx, gy))
    hbs.launch(inside, cfg)
    before = _rerun(problem, alpha=gx * gy if alpha is None else gx * gy * problem.alpha)
    hbs.launch(before, cfg)
    assert torch.equal(_bits(inside.out), _bits(before.out))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_split_k_adds_the_partials_in_split_order_in_one_launch(emulated, fmt):
    # The last block of each output tile adds the fp32 partial tiles of the stream's workspace in
    # split order, then alpha and bias; every counter is back at zero, and a second call gives the
    # same bits.
    problem, _ = block_scaled_case(fmt, 5, 130, 640, ba=2, bb=1, swizzled=False, bias=True, alpha=0.75, seed=8)
    _nan_scales(problem)
    cfg = hbs.StreamConfig(16, 64, 128, 4, num_worker_warps=4, occupancy=4)
    prepared = hbs.Prepared(problem, cfg)
    outs = []
    for _ in range(2):
        p = _rerun(problem)
        prepared.run(p, None)
        partial, counters = prepared._workspace(p.out, None)
        assert int(counters.count_nonzero()) == 0
        outs.append(p.out)
    batch = problem.out.shape[0]
    parts = partial.view(cfg.split_k, batch, *partial.shape[1:])
    total = torch.zeros(parts.shape[1:], dtype=torch.float32)
    for s in range(cfg.split_k):
        total = total + parts[s]
    expect = total * problem.alpha + problem.bias
    assert outs[0].isnan().any()
    assert torch.equal(_bits(outs[0]), _bits(outs[1])) and torch.equal(_bits(outs[0]), _bits(expect))


@pytest.mark.parametrize("dequant", [(64, 256), (16, 512)], ids=["64x256", "16x512"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_two_pass_emulated(emulated, fmt, swizzled, dequant):
    # K = 160: the dequantized copies are padded to 256 / 512 (a nibble-order half tile is partly
    # empty); 16x512 is the 4-bit formats' planned dequantize tile.
    cfg = hbs.TwoPassConfig(hgemm.GemmConfig(128, 128, 64), *dequant)
    problem, ref = block_scaled_case(fmt, 130, 70, 160, swizzled=swizzled, bias=True, seed=2)
    hbs.launch(problem, cfg)
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4], ids=["mxfp4", "nvfp4"])
def test_batches_emulated(emulated, fmt):
    # x batched (3), y shared (1): the weight broadcasts in both designs.
    for cfg in (hbs.StreamConfig(16, 128, 128, 2),
                hbs.TwoPassConfig(hgemm.GemmConfig(128, 128, 64, persistent=True), 64, 128)):
        problem, ref = block_scaled_case(fmt, 20, 40, 256, ba=3, bb=1, swizzled=True, out_dtype=torch.bfloat16,
                                         seed=3)
        hbs.launch(problem, cfg)
        assert_matches(problem.out, ref, torch.bfloat16)


def test_plan_picks_stream_below_two_pass_min_m():
    assert isinstance(hbs.plan(MXFP4, 1, hbs.TWO_PASS_MIN_M - 1, 4096, 4096), hbs.StreamConfig)
    assert isinstance(hbs.plan(MXFP4, 1, hbs.TWO_PASS_MIN_M, 4096, 4096), hbs.TwoPassConfig)
    # few output tiles and a long K: split K; many tiles: no split
    assert hbs.plan(NVFP4, 1, 16, 4096, 4096, sms=132).split_k > 1
    assert hbs.plan(NVFP4, 1, 16, 65536, 4096, sms=132).split_k == 1


def test_plan_configs_are_aot_variants():
    names = {v.name for v in hbs.aot_variants()}
    for fmt in BLOCK_FORMATS:
        for m in (1, 16, 17, 64, 65, 128, 200, 511):
            for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (256, 96)):
                cfg = hbs.plan(fmt, 1, m, n, k, sms=132)
                assert f"hopper_{fmt.name}_swz_bf16_{cfg.name}" in names


# --------------------------------------------------------------------------------------------------
# FP8 through hopper_gemm
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [hgemm.GemmConfig(128, 128, 128),
                                 hgemm.GemmConfig(128, 256, 64, persistent=True)], ids=lambda c: c.name)
def test_fp8_rowwise_emulated(emulated, cfg):
    gen = torch.Generator().manual_seed(4)
    m, n, k = 130, 300, 200
    a = (torch.randn(2, m, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(1, n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    sa = torch.rand(2, m, generator=gen) + 0.5
    sb = torch.rand(1, n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    ref = fp8_matmul_reference(a, sa[..., None], b.transpose(-1, -2), sb[:, None, :], out_dtype=torch.float64,
                               alpha=None, bias=bias)
    problem = FP8Problem(fmt=None, a=a, a_scale=sa, b=b, b_scale=sb, granularity=Granularity.ROW,
                         out=torch.full((2, m, n), float("nan")), bias=bias, alpha=None)
    hfp8.launch(problem, cfg)
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("scales", ["tensor", "x_row_y_tensor", "x_tensor_y_row"])
def test_fp8_per_tensor_scales_emulated(emulated, scales):
    # A per-tensor scale reaches the kernel as its one value (A_TENSOR / B_TENSOR), not as a vector of
    # copies: the same products, so the same bits as the vectors, and the reference's values.
    gen = torch.Generator().manual_seed(5)
    m, n, k = 130, 300, 200
    a = (torch.randn(2, m, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(1, n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    x_tensor, y_tensor = scales in ("tensor", "x_tensor_y_row"), scales in ("tensor", "x_row_y_tensor")
    sa = (torch.rand((), generator=gen) + 0.5).expand(2, m) if x_tensor else torch.rand(2, m, generator=gen) + 0.5
    sb = (torch.rand((), generator=gen) + 0.5).expand(1, n) if y_tensor else torch.rand(1, n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    alpha = torch.tensor([0.75])
    outs = []
    for x_scale, y_scale in ((sa, sb), (sa.contiguous(), sb.contiguous())):
        problem = FP8Problem(fmt=None, a=a, a_scale=x_scale, b=b, b_scale=y_scale, granularity=Granularity.ROW,
                             out=torch.full((2, m, n), float("nan")), bias=bias, alpha=alpha)
        prepared = hfp8.Prepared(problem)
        one = x_scale.stride() == (0, 0), y_scale.stride() == (0, 0)
        assert (prepared.a_tensor, prepared.b_tensor) == one
        assert [s.shape for s in prepared.operands(problem)[1::2]] == [
            (1,) if one[0] else (2, m), (1,) if one[1] else (1, n)]
        prepared.run(problem, None)
        outs.append(problem.out)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    ref = fp8_matmul_reference(a, sa[..., None], b.transpose(-1, -2), sb[:, None, :], out_dtype=torch.float64,
                               alpha=alpha.reshape(()), bias=bias)
    assert_matches(outs[0], ref, torch.float32)
