"""The Blackwell kernels' launch-side logic, and their tile code run on the CPU.

There is no Blackwell GPU to run ``blackwell_block_scaled`` / ``blackwell_fp8`` on, and cuTile has no
CPU interpreter. Two things are checked here without one:

* The host side: config choice, the swizzled scale-load shape for block 16 vs 32, argument checks,
  batch folding, and that every launch specialisation is one that tests/test_aot.py compiles.
* The tile code: the kernels' own Python functions run block by block over the launch grid on the
  NumPy model of cuTile in tests/_emulator.py (tile-indexed ``load`` / ``store`` with zero padding
  and masked edges, ``reshape`` / ``permute`` / ``transpose``, ``bitcast``, ``unpack_from_bytes``,
  ``mma`` and ``mma_scaled`` as their documented contracts), and are compared with
  ``tilemm.reference``. This checks the index arithmetic (tile coordinates, the 32x4x4 unswizzle, the
  transposes of y and y_scale, K padding, batch broadcast and folding, the epilogue); it does not
  check cuTile's compiler or the hardware.
"""

from __future__ import annotations

import types

import pytest
import torch

import cuda.tile as ct
import swizzle
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, FP8_E4M3, FP8_E5M2, Granularity
from tilemm.kernels import blackwell_block_scaled as bbs
from tilemm.kernels import blackwell_fp8 as bfp8
from tilemm.kernels.blackwell_block_scaled import _load_scale_bytes
from tilemm.matmul import BlockScaledProblem, FP8Problem
from tilemm.reference import block_scaled_matmul_reference, fp8_matmul_reference

from _emulator import CT_DTYPE_OF_TORCH, TileEmulator, assert_matches

BLOCK_FORMATS = [MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4]
FMT_IDS = [f.name for f in BLOCK_FORMATS]


def emulate(plan):
    """Run ``plan`` (a ``Prepared``) through the NumPy model of cuTile."""
    TileEmulator().launch(None, plan.grid, plan.kernel, plan.args)


# ==================================================================================================
# Operands
# ==================================================================================================

def _elements(fmt, rows, k, gen):
    """Random stored data (rows, Kd) for ``fmt``."""
    if fmt.is_packed:
        return torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen)
    return (torch.randn(rows, k, generator=gen) * 3).to(fmt.data_dtype)


def _scales(fmt, rows, ks, gen):
    """Random logical scales (rows, Ks): e8m0 bytes 2^-4..2^3, or positive e4m3 values."""
    if fmt.is_mx:
        return torch.randint(123, 131, (rows, ks), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
    return (torch.rand(rows, ks, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn)


def _swizzled(scale, poison_rows=False):
    """32x4x4 layout of a logical (..., R, Ks) scale; padded rows 0xFF when ``poison_rows``."""
    r, ks = scale.shape[-2:]
    if not poison_rows:
        return swizzle.swizzle_32_4_4(scale)
    rp = -(-r // 128) * 128
    raw = torch.full((*scale.shape[:-2], rp, ks), 0xFF, dtype=torch.uint8)
    raw[..., :r, :] = scale.view(torch.uint8)
    blocked = swizzle.swizzle_32_4_4(raw.view(scale.dtype))
    assert blocked.shape[-4:] == swizzle.swizzled_shape(r, ks)
    return blocked


def block_scaled_case(fmt, m, n, k, *, ba=1, bb=1, swizzled=False, poison=False, out_dtype=torch.float32,
                      alpha=None, bias=False, seed=0):
    """A BlockScaledProblem on the CPU and its reference result."""
    gen = torch.Generator().manual_seed(seed)
    ks = k // fmt.block
    batch = max(ba, bb)
    a = torch.stack([_elements(fmt, m, k, gen) for _ in range(ba)])
    b = torch.stack([_elements(fmt, n, k, gen) for _ in range(bb)])              # (Bb, N, Kd)
    sa = torch.stack([_scales(fmt, m, ks, gen) for _ in range(ba)])              # (Ba, M, Ks)
    sb = torch.stack([_scales(fmt, n, ks, gen) for _ in range(bb)])              # (Bb, N, Ks)
    alpha_t = None if alpha is None else torch.tensor(alpha, dtype=torch.float32)
    bias_t = torch.randn(n, generator=gen) if bias else None
    ref = block_scaled_matmul_reference(fmt, a, sa, b.transpose(-1, -2), sb.transpose(-1, -2),
                                        out_dtype=torch.float32, alpha=alpha_t, bias=bias_t)
    ref = ref.expand(batch, m, n)
    if swizzled:
        sa, sb = _swizzled(sa, poison), _swizzled(sb, poison)
    problem = BlockScaledProblem(fmt=fmt, a=a, a_scale=sa, b=b, b_scale=sb, swizzled=swizzled,
                                 out=torch.full((batch, m, n), float("nan"), dtype=out_dtype),
                                 bias=bias_t, alpha=alpha_t)
    return problem, ref


# ==================================================================================================
# Host side: configs, scale-load shapes, checks
# ==================================================================================================

def test_table_for_capability():
    assert bbs.table_for_capability((10, 0)) == "sm_100"
    assert bbs.table_for_capability((10, 3)) == "sm_100"
    assert bbs.table_for_capability((12, 0)) == "sm_120"
    assert bbs.table_for_capability((12, 1)) == "sm_120"


@pytest.mark.parametrize("batch,m,n,expect", [
    (1, 128, 128, "128x128x128B"),          # one tile: the large tile would leave 147 SMs idle
    (1, 4096, 4096, "256x256x128B_2cta"),   # 256 tiles x 2 CTAs >= 148 SMs (the upstream B200 shape)
    (1, 2048, 2048, "128x128x128B"),        # 64 large tiles x 2 = 128 CTAs < 148: stay small
    (2, 2048, 2048, "256x256x128B_2cta"),   # the batch counts too
])
def test_block_scaled_config_choice_sm100(batch, m, n, expect):
    assert bbs.plan("sm_100", batch, m, n, sms=148).name == expect


def test_block_scaled_sm120_has_no_two_cta_config():
    for shape in [(1, 128, 128), (1, 8192, 8192)]:
        cfg = bbs.plan("sm_120", *shape, sms=188)
        assert cfg.num_ctas == 1 and cfg.tile_m == 128 and "sm_120" in cfg.targets


@pytest.mark.parametrize("fmt,cfg,expect", [
    # TK covers 128 bytes: 128 e4m3/e5m2 elements = 4 scale columns = one 4-column block ...
    (MXFP8_E4M3, bbs.BlockScaledConfig(128, 128), (1, 1)),
    # ... 256 e2m1 elements: 8 e8m0 columns (block 32) = two blocks, 16 e4m3 columns (block 16) = four.
    (MXFP4, bbs.BlockScaledConfig(128, 128), (1, 2)),
    (NVFP4, bbs.BlockScaledConfig(128, 128), (1, 4)),
    # A 256-row tile loads two 128-row blocks per operand.
    (NVFP4, bbs.BlockScaledConfig(256, 256, num_ctas=2), (2, 4)),
    # TK = 128 e2m1 elements: 8 NVFP4 scale columns = two blocks, but 4 MXFP4 columns = one.
    (NVFP4, bbs.BlockScaledConfig(128, 128, k_bytes=64), (1, 2)),
    (MXFP4, bbs.BlockScaledConfig(128, 128, k_bytes=64), (1, 1)),
], ids=["mxfp8", "mxfp4", "nvfp4", "nvfp4-256", "nvfp4-tk128", "mxfp4-tk128"])
def test_swizzled_scale_load_shape(fmt, cfg, expect):
    assert bbs.scale_tile_blocks(fmt, cfg) == expect
    rb, cb = expect
    # The unswizzled tile is exactly (TM, TK / B).
    assert (rb * 128, cb * 4) == (cfg.tile_m, cfg.tile_k(fmt) // fmt.block)


@pytest.mark.parametrize("fmt,cfg,match", [
    (MXFP8_E4M3, bbs.BlockScaledConfig(64, 128), "multiples of 128"),
    (MXFP8_E4M3, bbs.BlockScaledConfig(128, 128, k_bytes=64), "multiple of 4 scale blocks \\(128 for mxfp8_e4m3\\)"),
    (NVFP4, bbs.BlockScaledConfig(128, 128, k_bytes=16), "multiple of 4 scale blocks \\(64 for nvfp4\\)"),
    (MXFP4, bbs.BlockScaledConfig(128, 128, num_ctas=2), "num_ctas must be 1, or 2 with tile_m = 256"),
    (MXFP4, bbs.BlockScaledConfig(128, 96), "tile_n must be a power of two"),
    (FP8_E4M3, bbs.BlockScaledConfig(128, 128), "format must be one of"),
])
def test_block_scaled_config_errors(fmt, cfg, match):
    with pytest.raises(ValueError, match=match):
        bbs.check_config(fmt, cfg)


def test_fp8_config_choice_and_errors():
    row, block = Granularity.ROW, Granularity.BLOCK_1X128
    assert bfp8.plan("sm_100", row, 1, 4096, 4096, 148).num_ctas == 2
    assert bfp8.plan("sm_100", Granularity.TENSOR, 1, 256, 256, 148).num_ctas == 1
    assert bfp8.plan("sm_100", block, 1, 8192, 8192, 148).tile_n == 128
    assert bfp8.plan("sm_120", row, 1, 8192, 8192, 188).num_ctas == 1
    with pytest.raises(TypeError, match="granularity must be a tilemm.formats.Granularity, got 'row'"):
        bfp8.plan("sm_100", "row", 1, 1, 1)
    with pytest.raises(ValueError, match="blockwise configs need tile_n = tile_k = 128"):
        bfp8.check_config(block, bfp8.FP8Config(128, 256))
    with pytest.raises(ValueError, match="num_ctas must be 1, or 2 with tile_m = 256"):
        bfp8.check_config(row, bfp8.FP8Config(128, 256, num_ctas=2))


def test_plan_rejects_inconsistent_problems():
    problem, _ = block_scaled_case(MXFP8_E4M3, 7, 17, 64, ba=2, bb=2)
    problem.out = problem.out[:1].expand(3, 7, 17)
    with pytest.raises(ValueError, match="batch sizes must be 1 or 3, got 2 and 2"):
        bbs.Prepared(problem, table="sm_100")
    problem, _ = block_scaled_case(MXFP8_E4M3, 7, 17, 64, swizzled=True)
    problem.swizzled = False
    with pytest.raises(ValueError, match="swizzled=False needs 3-D scales"):
        bbs.Prepared(problem, table="sm_100")
    fp8, _ = fp8_case("block", 7, 17, 128)
    fp8.a = fp8.a[:, :, :100]
    with pytest.raises(ValueError, match="K to be a multiple of 128, got K=100"):
        bfp8.Prepared(fp8, table="sm_100")


@pytest.mark.parametrize("swizzled,m,folds", [
    (False, 100, True),    # logical scales fold for any M
    (True, 128, True),     # swizzled: the batched layout equals the folded one when M % 128 == 0
    (True, 100, False),    # ... and not otherwise (each batch entry pads its rows to 128)
])
def test_shared_weight_folds_batch_into_m(swizzled, m, folds):
    problem, _ = block_scaled_case(MXFP8_E4M3, m, 17, 64, ba=3, bb=1, swizzled=swizzled)
    plan = bbs.Prepared(problem, table="sm_100")
    assert plan.folded == folds
    a, out = plan.args[0], plan.args[4]
    if folds:
        assert a.shape == (1, 3 * m, 64) and out.shape == (1, 3 * m, 17)
        assert out.data_ptr() == problem.out.data_ptr()
        assert plan.grid == (-(-3 * m // 128), 1, 1)
    else:
        assert a.shape == (3, m, 64) and plan.grid == (3, 1, 1)


@pytest.mark.parametrize("swizzled, m", [(False, 100), (True, 128), (True, 100)])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_prepared_launch_is_the_plan(monkeypatch, fmt, swizzled, m):
    # The launch that Prepared.run makes for a later problem of the signature is the one Prepared
    # makes for it: same kernel, grid and arguments (tensors by address, shape and strides).
    problem, _ = block_scaled_case(fmt, m, 17, 128, ba=3, bb=1, swizzled=swizzled, bias=True, alpha=0.5)
    monkeypatch.setattr(bbs, "capability", lambda device: (10, 0))
    monkeypatch.setattr(bbs, "num_sms", lambda device: 148)
    prepared = bbs.Prepared(problem)
    later, _ = block_scaled_case(fmt, m, 17, 128, ba=3, bb=1, swizzled=swizzled, bias=True, alpha=0.5, seed=1)
    plan = bbs.Prepared(later, table="sm_100", sms=148)
    launches = []
    monkeypatch.setattr(bbs, "ct", types.SimpleNamespace(launch=lambda *call: launches.append(call)))
    prepared.run(later, "stream")
    ((stream, grid, kernel, args),) = launches
    assert (stream, grid, kernel) == ("stream", plan.grid, plan.kernel)
    assert len(args) == len(plan.args)
    for got, want in zip(args, plan.args):
        if isinstance(want, torch.Tensor):
            assert (got.data_ptr(), got.shape, got.stride(), got.dtype) == (want.data_ptr(), want.shape,
                                                                            want.stride(), want.dtype)
        else:
            assert got == want


def test_scales_and_epilogue_arguments():
    """Scales travel as bytes; an absent alpha / bias becomes 1.0 / zeros; NVFP4 sets the e4m3 flag."""
    problem, _ = block_scaled_case(NVFP4, 7, 17, 64)
    plan = bbs.Prepared(problem, table="sm_120")
    a, sa, b, sb, out, alpha, bias, tm, tn, tk, block, packed, e4m3, group = plan.args
    assert sa.dtype == sb.dtype == torch.uint8
    assert alpha.tolist() == [1.0] and bias.shape == (17,) and not bias.any()
    assert (tm, tn, tk, block, packed, e4m3) == (128, 128, 256, 16, True, True)


# --------------------------------------------------------------------------------------------------
# Every specialisation a launch can produce is one that test_aot.py compiles.
# --------------------------------------------------------------------------------------------------

def _signature(args):
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((CT_DTYPE_OF_TORCH[a.dtype], a.ndim))
        else:
            sig.append(a)
    return tuple(sig)


def _variant_signatures(variants):
    out = {}
    for v in variants:
        sig = tuple((p.dtype, p.ndim) if hasattr(p, "ndim") else p for p in v.params)
        for t in v.targets:
            out[(sig, t)] = v
    return out


@pytest.mark.parametrize("table", ["sm_100", "sm_120"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_block_scaled_launches_are_aot_variants(fmt, swizzled, table):
    known = _variant_signatures(bbs.aot_variants())
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        problem, _ = block_scaled_case(fmt, 7, 17, 64, swizzled=swizzled, out_dtype=out_dtype)
        for sms in (1, 10_000):  # forces the large config where the table has one, then the small
            plan = bbs.Prepared(problem, table=table, sms=sms)
            assert (_signature(plan.args), table) in known, f"{plan.config} is not in aot_variants()"


@pytest.mark.parametrize("table", ["sm_100", "sm_120"])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_fp8_launches_are_aot_variants(granularity, table):
    known = _variant_signatures(bfp8.aot_variants())
    dtypes = (torch.float8_e4m3fn,) if granularity == "block" else (torch.float8_e4m3fn, torch.float8_e5m2)
    for dt in dtypes:
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            problem, _ = fp8_case(granularity, 7, 17, 128, dtype=dt, out_dtype=out_dtype)
            for sms in (1, 10_000):
                plan = bfp8.Prepared(problem, table=table, sms=sms)
                assert (_signature(plan.args), table) in known, f"{plan.config} is not in aot_variants()"


def test_aot_arrays_declare_launch_alignment():
    """AOT compiles the kernel the JIT builds for 16-byte-aligned tensors (TMA), not a byte-load one."""
    p = bbs.launch_array(ct.float8_e4m3fn, 3)
    assert p.stride_constant == (None, None, 1)
    assert p.stride_divisible_by == (16, 16, 1) and p.base_addr_divisible_by == 16
    assert bbs.launch_array(ct.float32, 2).stride_divisible_by == (4, 1)


# ==================================================================================================
# The tile code, emulated
# ==================================================================================================

# The output dtype is fp32 unless a case is about the cast. Shapes: M = 1, 7, 100, 129 (a second
# partial M tile), N = 17 (partial N tile); K a multiple of the block but not of TK (128 for MXFP8,
# 256 for FP4), so the last K step is padded, and K > TK so that more than one step runs.
EDGE_SHAPES = [(1, 17, 160), (7, 17, 96), (100, 17, 288), (129, 17, 416)]


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("m,n,k", EDGE_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in EDGE_SHAPES])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=FMT_IDS)
def test_block_scaled_kernel_emulated(fmt, m, n, k, swizzled):
    problem, ref = block_scaled_case(fmt, m, n, k, swizzled=swizzled, poison=swizzled)
    emulate(bbs.Prepared(problem, table="sm_100"))
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("fmt", [MXFP8_E4M3, NVFP4], ids=["mxfp8", "nvfp4"])
def test_block_scaled_two_cta_tile_emulated(fmt, swizzled):
    """The 256x256 config: two 128-row scale blocks per load, partial tiles in both directions."""
    problem, ref = block_scaled_case(fmt, 300, 260, 160, swizzled=swizzled, poison=swizzled)
    plan = bbs.Prepared(problem, table="sm_100", sms=1)
    assert plan.config.num_ctas == 2
    emulate(plan)
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("ba,bb", [(2, 2), (3, 1), (1, 2)], ids=["batched", "shared_b", "shared_a"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("fmt", [MXFP8_E5M2, MXFP4], ids=["mxfp8_e5m2", "mxfp4"])
def test_block_scaled_batches_emulated(fmt, swizzled, ba, bb):
    problem, ref = block_scaled_case(fmt, 100, 17, 96, ba=ba, bb=bb, swizzled=swizzled, poison=swizzled)
    emulate(bbs.Prepared(problem, table="sm_100"))
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", [MXFP8_E4M3, NVFP4], ids=["mxfp8", "nvfp4"])
def test_block_scaled_epilogue_emulated(fmt, out_dtype):
    """alpha (NVFP4's folded global scales) and bias, then one cast."""
    problem, ref = block_scaled_case(fmt, 7, 17, 64, out_dtype=out_dtype, alpha=0.375, bias=True)
    emulate(bbs.Prepared(problem, table="sm_120"))
    assert_matches(problem.out, ref.to(out_dtype), out_dtype)


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
def test_nan_scale_poisons_exactly_its_row_and_column_emulated(swizzled):
    problem, _ = block_scaled_case(MXFP8_E4M3, 7, 17, 64, swizzled=False)
    sa, sb = problem.a_scale.view(torch.uint8).clone(), problem.b_scale.view(torch.uint8).clone()
    sa[0, 3, 1] = 255
    sb[0, 5, 0] = 255
    if swizzled:
        sa, sb = swizzle.swizzle_32_4_4(sa), swizzle.swizzle_32_4_4(sb)
    problem.a_scale, problem.b_scale, problem.swizzled = sa, sb, swizzled
    emulate(bbs.Prepared(problem, table="sm_100"))
    nan = problem.out[0].isnan()
    expect = torch.zeros(7, 17, dtype=torch.bool)
    expect[3, :] = True
    expect[:, 5] = True
    assert torch.equal(nan, expect)


def test_plain_sample_sizing_would_miss_nvfp4_scales():
    """Sizing the swizzled row extent as TM // B // 4 (right only for B = 32) reads two 128-row blocks
    for NVFP4 (B = 16) at TM = 128: the derivation from the 128-row block is what the kernel uses."""
    cfg = bbs.BlockScaledConfig(128, 128)
    assert cfg.tile_m // NVFP4.block // 4 == 2
    assert bbs.scale_tile_blocks(NVFP4, cfg)[0] == 1


# --------------------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------------------

def fp8_case(granularity, m, n, k, *, ba=1, bb=1, dtype=torch.float8_e4m3fn, out_dtype=torch.float32,
             bias=False, alpha=None, seed=0):
    """An FP8Problem on the CPU (scales in FP8Problem's forms) and its reference result."""
    gen = torch.Generator().manual_seed(seed)
    batch = max(ba, bb)
    a = (torch.randn(ba, m, k, generator=gen) * 3).to(dtype)
    b = (torch.randn(bb, n, k, generator=gen) * 3).to(dtype)
    if granularity == "block":
        sa = torch.rand(ba, m, k // 128, generator=gen) + 0.5
        sb = torch.rand(bb, -(-n // 128), k // 128, generator=gen) + 0.5
        xs = sa.repeat_interleave(128, dim=-1)
        ys = sb.repeat_interleave(128, dim=-2)[:, :n].repeat_interleave(128, dim=-1)  # (Bb, N, K)
    elif granularity == "tensor":
        sa = torch.tensor(0.75).expand(ba, m)          # stride-0 views, as fp8_matmul passes them
        sb = torch.tensor(1.25).expand(bb, n)
        xs, ys = sa[..., None], sb[..., None]
    else:
        sa = torch.rand(ba, m, generator=gen) + 0.5
        sb = torch.rand(bb, n, generator=gen) + 0.5
        xs, ys = sa[..., None], sb[..., None]
    alpha_t = None if alpha is None else torch.tensor(alpha, dtype=torch.float32)
    bias_t = torch.randn(n, generator=gen) if bias else None
    ref = fp8_matmul_reference(a, xs.expand(ba, m, k), b.transpose(-1, -2), ys.expand(bb, n, k).transpose(-1, -2),
                               out_dtype=torch.float32, alpha=alpha_t, bias=bias_t).expand(batch, m, n)
    fmt = FP8_E4M3 if dtype == torch.float8_e4m3fn else FP8_E5M2
    gran = {"tensor": Granularity.TENSOR, "row": Granularity.ROW, "block": Granularity.BLOCK_1X128}[granularity]
    problem = FP8Problem(fmt=fmt, a=a, a_scale=sa, b=b, b_scale=sb, granularity=gran,
                         out=torch.full((batch, m, n), float("nan"), dtype=out_dtype), bias=bias_t,
                         alpha=alpha_t)
    return problem, ref


@pytest.mark.parametrize("m,n,k", [(1, 17, 128), (100, 17, 384), (129, 17, 256)], ids=str)
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_fp8_kernel_emulated(granularity, m, n, k):
    problem, ref = fp8_case(granularity, m, n, k)
    emulate(bfp8.Prepared(problem, table="sm_100"))
    assert_matches(problem.out, ref, torch.float32)


@pytest.mark.parametrize("granularity", ["row", "block"])
def test_fp8_batches_and_epilogue_emulated(granularity):
    problem, ref = fp8_case(granularity, 100, 130, 256, ba=2, bb=1, out_dtype=torch.bfloat16, bias=True,
                            alpha=1.5)
    emulate(bfp8.Prepared(problem, table="sm_120"))
    assert_matches(problem.out, ref.to(torch.bfloat16), torch.bfloat16)


def test_fp8_two_cta_tile_and_k_not_multiple_of_tile_emulated():
    problem, ref = fp8_case("row", 300, 260, 200, dtype=torch.float8_e5m2)
    plan = bfp8.Prepared(problem, table="sm_100", sms=1)
    assert plan.config.num_ctas == 2
    emulate(plan)
    assert_matches(problem.out, ref, torch.float32)


# ==================================================================================================
# On a GPU: the architecture-neutral parts, on whatever GPU is there (Hopper included)
# ==================================================================================================
# ct.mma_scaled, float8_e8m0fnu and float4_e2m1fn need sm_100, but the scale-tile loads (uint8) and the
# whole FP8 module (ct.mma on e4m3 / e5m2) compile for sm_90 too, so an H100 checks them against
# cuTile's real semantics rather than the NumPy model.

def _fp8_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 ct.mma needs compute capability >= 9.0")
    return torch.device("cuda")


@ct.kernel
def _scale_bytes_probe(S, Out, ROWS: ct.Constant[int], TKS: ct.Constant[int]):
    """Out[b] (B, R, Ks) <- the (ROWS, TKS) tiles ``_load_scale_bytes`` returns, one per block."""
    tiles_k = ct.cdiv(Out.shape[2], TKS)
    tiles_r = ct.cdiv(Out.shape[1], ROWS)
    bid = ct.bid(0)
    b = bid // (tiles_r * tiles_k)
    i = (bid // tiles_k) % tiles_r
    kt = bid % tiles_k
    raw = _load_scale_bytes(S, b, i, kt, ROWS, TKS)
    ct.store(Out, (b, i, kt), raw.reshape((1, ROWS, TKS)))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,ks", [(100, 5), (129, 12), (300, 33)], ids=str)
@pytest.mark.parametrize("tile_rows,tks", [(128, 4), (128, 8), (128, 16), (256, 16)],
                         ids=["mxfp8", "mxfp4", "nvfp4", "nvfp4-256"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
def test_scale_tile_loads_on_gpu(swizzled, tile_rows, tks, rows, ks):
    device = _fp8_gpu()
    gen = torch.Generator().manual_seed(rows * ks)
    logical = torch.randint(0, 255, (2, rows, ks), dtype=torch.uint8, generator=gen)
    src = _swizzled(logical.view(torch.float8_e8m0fnu), poison_rows=True).view(torch.uint8) if swizzled else logical
    out = torch.zeros_like(logical, device=device)
    grid = (2 * -(-rows // tile_rows) * -(-ks // tks), 1, 1)
    ct.launch(torch.cuda.current_stream(), grid, _scale_bytes_probe, (src.to(device), out, tile_rows, tks))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), logical)


@pytest.mark.gpu
@pytest.mark.parametrize("table,sms", [("sm_100", 10_000), ("sm_100", 1), ("sm_120", 1)],
                         ids=["128x128", "256x256-2cta", "sm120"])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_blackwell_fp8_kernels_on_gpu(granularity, table, sms):
    device = _fp8_gpu()
    for (m, n, k, ba, bb) in [(129, 17, 256, 1, 1), (100, 130, 384, 2, 1), (7, 300, 128, 1, 2)]:
        problem, ref = fp8_case(granularity, m, n, k, ba=ba, bb=bb, bias=True, alpha=0.5,
                                out_dtype=torch.bfloat16)
        for field in ("a", "a_scale", "b", "b_scale", "out", "bias", "alpha"):
            setattr(problem, field, getattr(problem, field).to(device))
        plan = bfp8.Prepared(problem, table=table, sms=sms)
        ct.launch(torch.cuda.current_stream(), plan.grid, plan.kernel, plan.args)
        torch.cuda.synchronize()
        assert_matches(problem.out.cpu(), ref.to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_fp8_prepared_launch_is_the_plan(monkeypatch, granularity):
    # As for the block-scaled kernel: Prepared.run launches a later problem of the signature exactly
    # as Prepared plans it.
    problem, _ = fp8_case(granularity, 100, 200, 256, ba=2, bias=True, alpha=0.5)
    monkeypatch.setattr(bfp8, "capability", lambda device: (10, 0))
    monkeypatch.setattr(bfp8, "num_sms", lambda device: 148)
    prepared = bfp8.Prepared(problem)
    later, _ = fp8_case(granularity, 100, 200, 256, ba=2, bias=True, alpha=0.5, seed=1)
    plan = bfp8.Prepared(later, table="sm_100", sms=148)
    launches = []
    monkeypatch.setattr(bfp8, "ct", types.SimpleNamespace(launch=lambda *call: launches.append(call)))
    prepared.run(later, "stream")
    ((stream, grid, kernel, args),) = launches
    assert (stream, grid, kernel) == ("stream", plan.grid, plan.kernel)
    for got, want in zip(args, plan.args, strict=True):
        if isinstance(want, torch.Tensor):
            # the same memory, or (scales made contiguous per call) the same values
            same = got.data_ptr() == want.data_ptr() or torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert same and (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        else:
            assert got == want
