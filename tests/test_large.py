"""Launches on tensors of 2^31 elements and more (``tilemm.kernels._large``), checked on the CPU.

Three kinds of check, none of which allocates a big tensor:

* the decision: ``plan_extents`` / ``pieces`` / ``fits`` on shapes and strides (meta tensors);
* the launchers' pieces for the issue's shapes (meta tensors, ``ct.launch`` replaced by a recorder):
  every array of every launch fits 32-bit indexing, cuts fall where the layouts need them, and the
  common case is one launch on the unchanged tensors;
* exactness of the cuts, on small tensors with ``LIMIT`` lowered so that they are cut: quantizers
  with each launch replaced by the reference on the piece's views (so a wrong slice of data or of the
  32x4x4 scales would show), and matmuls through the NumPy model of cuTile (tests/_emulator.py),
  bit-identical to the same launcher with no cuts.
"""

from __future__ import annotations

import math

import pytest
import torch

from tilemm import quantize as tq
from tilemm.formats import FP8_E4M3, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Granularity
from tilemm.kernels import _large
from tilemm.kernels import blackwell_block_scaled as bbs
from tilemm.kernels import blackwell_fp8 as bfp8
from tilemm.kernels import hopper_block_scaled as hbs
from tilemm.kernels import hopper_fp8 as hfp8
from tilemm.kernels import hopper_gemm as hgemm
from tilemm.kernels import quantize_kernels as qk
from tilemm.matmul import FP8Problem

from _emulator import LaunchProxy, TileEmulator
from test_hopper_emulated import block_scaled_case

BIG = 2 ** 31


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


# --------------------------------------------------------------------------------------------------
# The decision, on shapes and strides
# --------------------------------------------------------------------------------------------------

def test_span_and_fits():
    assert _large.span((3, 4), (4, 1)) == 12
    assert _large.span((3, 0), (4, 1)) == 0
    assert _large.span((2, 3), (100, 1)) == 103  # a strided view reaches past its element count
    # 2^31 elements exactly: the largest offset is 2^31 - 1, which int32 holds
    assert _large.fits_shape((65536, 32768), (32768, 1))
    assert not _large.fits_shape((65537, 32768), (32768, 1))
    # the issue's failure: the (1, R, K) view's batch stride is out of range though never used
    assert not _large.fits(meta(65600, 32768).reshape(1, 65600, 32768))
    assert _large.fits(meta(4096, 4096).reshape(1, 4096, 4096))


def test_int32_view_fixes_unused_strides_only():
    v = meta(64, 1024, 32768).reshape(1, 65536, 32768)  # exactly 2^31 elements, stride(0) = 2^31
    assert v.stride(0) == BIG
    w = _large.int32_view(v)
    assert w.shape == v.shape and w.stride()[1:] == v.stride()[1:] and w.stride(0) < BIG
    small = meta(2, 3)
    assert _large.int32_view(small) is small


def test_plan_extents_is_pure_and_minimal():
    # (rows, K) of a 2-D input and its fp8 output, rows cut on 16: the fewest pieces is 2
    x = ((1, 65600, 32768), (65600 * 32768, 32768, 1), 2, ((0, 0, 1), (1, 1, 1), (2, 2, 1)))
    ext = _large.plan_extents((1, 65600, 32768), (1, 16, 512), (x,))
    assert ext == (1, 65536, 32768)
    assert _large.plan_extents((1, 65600, 32768), (1, 16, 512), (x,)) == ext  # same answer, cached
    # K cannot be cut and one row is too long: no plan
    row = ((1, 1, BIG), (BIG, BIG, 1), 2, ((0, 0, 1), (1, 1, 1), (2, 2, 1)))
    assert _large.plan_extents((1, 1, BIG), (1, 1, BIG), (row,)) is None
    # what fits is left whole
    assert _large.plan_extents((1, 128, 128), (1, 16, 128), (((1, 128, 128), (16384, 128, 1), 2,
                                                              ((0, 0, 1), (1, 1, 1), (2, 2, 1))),)) == (1, 128, 128)


def test_cuts_keep_views_16_byte_aligned():
    # logical MX scales are one byte per 32 elements: a K cut must be a multiple of 512 elements so
    # that the scale view starts on 16 bytes (the kernels' specialisations assume it)
    x = ((1, 1, 2 ** 32), (2 ** 32, 2 ** 32, 1), 2, ((0, 0, 1), (1, 1, 1), (2, 2, 1)))
    s = ((1, 1, 2 ** 27), (2 ** 27, 2 ** 27, 1), 1, ((0, 0, 1), (1, 1, 1), (2, 2, 32)))
    ext = _large.plan_extents((1, 1, 2 ** 32), (1, 1, 64), (x, s))
    assert ext[2] % 512 == 0 and ext[2] < BIG


def test_too_large_error_names_the_operand():
    # x.mT of a (64, 2^31) tensor: its storage's row stride is 2^31 whatever the cut
    x = meta(64, BIG)
    with pytest.raises(ValueError, match=r"quantize_mxfp8: x of shape \(1, 64, 2147483648\) and strides "
                                         r"\(137438953472, 2147483648, 1\) cannot be cut .* below 2\^31"):
        qk.quantize_mx(x.mT, MXFP8_E4M3, "rceil", False)


def test_matmul_k_limit_message():
    _large.check_matmul_k("mxfp8_matmul", "x", (4, 2 ** 22), 2 ** 22)  # the limit itself is fine
    with pytest.raises(ValueError, match=r"mxfp8_matmul: x of shape \(4, 4194432\) has K = 4194432; GPU "
                                         r"matmuls take K up to 2\^22 = 4194304"):
        _large.check_matmul_k("mxfp8_matmul", "x", (4, 2 ** 22 + 128), 2 ** 22 + 128)


# --------------------------------------------------------------------------------------------------
# The quantize launchers' pieces for the issue's shapes (meta tensors, launches recorded)
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(qk, "_launch_kernel", lambda device, grid, kernel, args: calls.append((grid, kernel, args)))
    monkeypatch.setattr(qk, "num_sms", lambda device: 132)
    monkeypatch.setattr(qk, "_target", lambda device: "sm_90")
    return calls


def _arrays(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


def _all_fit(calls):
    return all(_large.fits(*_arrays(args)) for _, _, args in calls)


def test_common_case_is_one_launch_on_the_same_tensors(recorded):
    x = meta(4096, 4096)
    data, scale = qk.quantize_mx(x, MXFP8_E4M3, "rceil", True)
    [(grid, _, args)] = recorded
    assert args[0].data_ptr() == x.data_ptr() and args[0].shape == (1, 4096, 4096)
    assert args[1].shape == (1, 4096, 4096) and args[2].shape == (1, 32, 32, 32, 4, 4)
    assert grid == (4096 // 64 * 4096 // 128, 1, 1)


@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("fmt", [MXFP8_E4M3, MXFP4], ids=["mxfp8", "mxfp4"])
def test_mx_rows_cut_on_128_row_blocks(recorded, fmt, swizzle):
    # the issue's activation: (65600, 32768) bf16, 2.15e9 elements
    x = meta(65600, 32768)
    data, scale = qk.quantize_mx(x, fmt, "rceil", swizzle)
    assert len(recorded) == 2 and _all_fit(recorded)
    cfg = qk.plan("mxfp4" if fmt.is_packed else "mxfp8", swizzled=swizzle)
    rows = [args[0].shape[1] for _, _, args in recorded]
    assert sum(rows) == 65600 and rows[0] % (128 if swizzle else cfg.tile_r) == 0
    # the pieces' blocks add up to the one launch's grid: no tile is done twice or left out
    assert sum(g[0] for g, _, _ in recorded) == qk._grid(1, 65600, 32768, cfg, swizzle)[0]
    # the second piece's scales are the slab that follows the first's
    s0, s1 = recorded[0][2][2], recorded[1][2][2]
    assert s1.storage_offset() - s0.storage_offset() == s0.shape[1] * s0.stride(1)
    assert scale.shape == ((1 * 65600 // 128 + 1, 32768 // 128, 32, 16) if swizzle else (65600, 1024))


def test_nvfp4_stacked_weight(recorded):
    # (64, 1024, 32768): exactly 2^31 elements. Logical scales flatten the batch into rows, whose
    # (1, 65536, 32768) view has a batch stride of 2^31: one launch once that stride is fixed.
    w = meta(64, 1024, 32768)
    qk.quantize_nvfp4(w, None, False)
    amax, quant = recorded
    assert _all_fit(recorded) and quant[2][0].shape == (1, 65536, 32768)
    # two more batch entries: the swizzled launch (per batch entry) is cut along the batch
    recorded.clear()
    qk.quantize_nvfp4(meta(66, 1024, 32768), None, True)
    assert _all_fit(recorded)
    amax_calls = [c for c in recorded if c[1] is qk._amax_kernel]
    quant_calls = [c for c in recorded if c[1] is not qk._amax_kernel]
    assert len(amax_calls) == 2 and len(quant_calls) == 2
    assert [a[2][0].shape[0] for a in quant_calls] == [64, 2]
    # every piece of the amax pass writes its own slots, and the quantize launches read all of them
    slots = [(a[2][1].storage_offset(), a[2][1].shape[0]) for a in amax_calls]
    assert slots[0][0] + slots[0][1] == slots[1][0] and sum(n for _, n in slots) <= qk.AMAX_PARTIALS
    assert all(q[2][3].shape[0] == sum(n for _, n in slots) for q in quant_calls)


def test_fp8_granularities_fit(recorded):
    x = meta(65600, 32768)
    for gran in ("row", "tensor", (1, 128), (128, 128)):
        recorded.clear()
        qk.quantize_fp8(x, FP8_E4M3, gran, False)
        assert len(recorded) >= 2 and _all_fit(recorded), gran
    # per row along axis=-2: all the column maxima before any quantize launch
    recorded.clear()
    qk.quantize_fp8(meta(65600, 32768).mT, FP8_E4M3, "row", False)
    kinds = [c[1] for c in recorded]
    first_quant = kinds.index(qk._fp8_columns_kernel)
    assert set(kinds[:first_quant]) == {qk._column_amax_kernel} and qk._column_amax_kernel not in kinds[first_quant:]
    assert _all_fit(recorded)


# --------------------------------------------------------------------------------------------------
# Exactness of the quantizer cuts: each launch replaced by the reference on its views
# --------------------------------------------------------------------------------------------------

def _reference_launch(device, grid, kernel, args):
    """What a quantize kernel computes on its launch's views, by the reference."""
    if kernel is qk._mx_quantize_kernel:
        X, Data, Scale, floor, element, swizzled, transposed, _, _ = args
        x = X.mT if transposed else X
        rounding = "floor" if floor else "rceil"
        if element == qk._E2M1:
            data, scale = tq._quantize_mxfp4_reference(x, rounding, swizzled)
        else:
            fmt = MXFP8_E4M3 if element == qk._E4M3 else MXFP8_E5M2
            data, scale = tq._quantize_mxfp8_reference(x, fmt, rounding, swizzled)
    elif kernel is qk._nvfp4_quantize_kernel:
        X, Data, Scale, Global, GlobalOut, from_amax, grid_amax, swizzled, transposed, _, _ = args
        assert not from_amax and not grid_amax
        x = X.mT if transposed else X
        data, scale, g = tq._quantize_nvfp4_reference(x, Global.reshape(()), swizzled)
        GlobalOut.copy_(g.reshape(1))
    elif kernel is qk._fp8_row_kernel:
        X, Data, Scale = args[:3]
        data, scale = tq._quantize_fp8_reference(X, FP8_E4M3, "row", False)
    elif kernel is qk._fp8_quantize_kernel:
        X, Data, Scale, _, pow2, _, gran, transposed = args[:8]
        granularity = {qk._FP8_1X128: (1, 128), qk._FP8_128X128: (128, 128)}[gran]
        data, scale = tq._quantize_fp8_reference(X.mT if transposed else X, FP8_E4M3, granularity, bool(pow2))
    else:
        raise AssertionError(f"no reference for {kernel}")
    Data.copy_(data.view(Data.dtype))
    Scale.copy_(scale.reshape(Scale.shape).view(Scale.dtype))


@pytest.fixture
def small_limit(monkeypatch):
    """LIMIT lowered to 2^16 elements, so that the small tensors below are cut."""
    monkeypatch.setattr(_large, "LIMIT", 2 ** 16)
    monkeypatch.setattr(qk, "_target", lambda device: "sm_90")
    calls = []

    def launch(device, grid, kernel, args):
        calls.append(args)
        _reference_launch(device, grid, kernel, args)

    monkeypatch.setattr(qk, "_launch_kernel", launch)
    monkeypatch.setattr(qk, "_kernel", lambda kernel, cfg: kernel)
    return calls


def _input(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 8).to(torch.bfloat16)


# Shapes: rows not a multiple of 128 (the last piece writes the swizzle padding), a batch of 3
# (cut along the batch, or along rows of each entry), and x.mT (cut along K and rows at once).
# (x.mT needs a larger limit: its output rows are cut on 128 and K on 512, the 16-byte alignment
# of its logical scales' views.)
SHAPES = [((300, 512), False, 2 ** 16), ((3, 200, 256), False, 2 ** 16), ((4096, 300), True, 2 ** 19)]


@pytest.mark.parametrize("shape,along_k,limit", SHAPES, ids=["2d", "3d", "axis-2"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("fmt", [MXFP8_E4M3, MXFP4, NVFP4], ids=["mxfp8", "mxfp4", "nvfp4"])
def test_quantizer_pieces_are_exact(monkeypatch, small_limit, fmt, swizzle, shape, along_k, limit):
    monkeypatch.setattr(_large, "LIMIT", limit)
    x = _input(*shape)
    x = x.mT if along_k else x
    if fmt is NVFP4:
        g = torch.tensor(0.01, dtype=torch.float32)
        data, scale, _ = qk.quantize_nvfp4(x, g, swizzle)
        ref = tq._quantize_nvfp4_reference(x, g, swizzle)
    else:
        data, scale = qk.quantize_mx(x, fmt, "rceil", swizzle)
        ref = (tq._quantize_mxfp4_reference(x, "rceil", swizzle) if fmt is MXFP4
               else tq._quantize_mxfp8_reference(x, fmt, "rceil", swizzle))
    assert len(small_limit) > 1  # it was cut
    assert all(_large.fits(*_arrays(args)) for args in small_limit)
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8), ref.scale.view(torch.uint8))


@pytest.mark.parametrize("gran", ["row", (1, 128), (128, 128)], ids=["row", "1x128", "128x128"])
def test_fp8_quantizer_pieces_are_exact(small_limit, gran):
    x = _input(300, 512)
    data, scale = qk.quantize_fp8(x, FP8_E4M3, gran, False)
    ref = tq._quantize_fp8_reference(x, FP8_E4M3, gran, False)
    assert len(small_limit) > 1
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scale, ref.scale)


# --------------------------------------------------------------------------------------------------
# Exactness of the matmul cuts, through the NumPy model of cuTile
# --------------------------------------------------------------------------------------------------

class _CountingProxy(LaunchProxy):
    def __init__(self, emu):
        super().__init__(emu)
        self.launches = 0

    def launch(self, stream, grid, kernel, args):
        assert all(_large.fits(a) for a in args if isinstance(a, torch.Tensor))
        self.launches += 1
        super().launch(stream, grid, kernel, args)


@pytest.fixture
def emulated(monkeypatch):
    proxy = _CountingProxy(TileEmulator())
    for module in (hbs, hgemm, hfp8):
        monkeypatch.setattr(module, "ct", proxy)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(hgemm, "num_sms", lambda device: 4)
    monkeypatch.setattr(hbs, "num_sms", lambda device: 4)
    monkeypatch.setattr(hfp8, "num_sms", lambda device: 4)
    return proxy


def _run_cut_and_whole(monkeypatch, proxy, make, run, limit):
    """(outputs, launches) of ``run(make())`` with all of LIMIT, then with ``limit``."""
    results = []
    for lim in (_large.LIMIT, limit):
        monkeypatch.setattr(_large, "LIMIT", lim)
        proxy.launches = 0
        problem = make()
        run(problem)
        results.append((problem.out.clone(), proxy.launches))
    (whole, n_whole), (cut, n_cut) = results
    assert n_cut > n_whole, "the small limit did not cut the launch"
    return whole, cut


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("fmt", [MXFP8_E4M3, NVFP4], ids=["mxfp8", "nvfp4"])
def test_hopper_stream_pieces_are_exact(monkeypatch, emulated, fmt, swizzled):
    # the weight (640 x 256 elements) is cut along N into pieces of 128-row multiples, with a K split of 2
    cfg = hbs.StreamConfig(16, 128, 128, 2)
    whole, cut = _run_cut_and_whole(
        monkeypatch, emulated,
        lambda: block_scaled_case(fmt, 20, 640, 256, swizzled=swizzled, bias=True, alpha=0.5, seed=5)[0],
        lambda p: hbs.launch(p, cfg), 2 ** 16)
    assert torch.equal(whole, cut)


@pytest.mark.parametrize("fmt", [MXFP4, MXFP8_E4M3], ids=["mxfp4", "mxfp8"])
def test_hopper_two_pass_pieces_are_exact(monkeypatch, emulated, fmt):
    # x (600 rows) and its 16-bit copy cut along M (dequantize, then GEMM pieces of 128 rows);
    # swizzled scales, so dequantize cuts fall on 128-row blocks
    cfg = hbs.TwoPassConfig(hgemm.GemmConfig(128, 128, 64, persistent=True), 64, 256)
    whole, cut = _run_cut_and_whole(
        monkeypatch, emulated,
        lambda: block_scaled_case(fmt, 600, 70, 160, swizzled=True, bias=True, seed=6)[0],
        lambda p: hbs.launch(p, cfg), 2 ** 16)
    assert torch.equal(whole, cut)


@pytest.mark.parametrize("granularity", ["row", "block"])
def test_hopper_fp8_pieces_are_exact(monkeypatch, emulated, granularity):
    m, n, k = 130, 300, 256

    def make():
        g = torch.Generator().manual_seed(7)
        a = (torch.randn(2, m, k, generator=g) * 4).to(torch.float8_e4m3fn)
        b = (torch.randn(1, n, k, generator=g) * 4).to(torch.float8_e4m3fn)
        if granularity == "block":
            sa = torch.rand(2, m, k // 128, generator=g) + 0.5
            sb = torch.rand(1, -(-n // 128), k // 128, generator=g) + 0.5
        else:
            sa, sb = torch.rand(2, m, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
        gran = Granularity.BLOCK_1X128 if granularity == "block" else Granularity.ROW
        return FP8Problem(fmt=None, a=a, a_scale=sa, b=b, b_scale=sb, granularity=gran,
                          out=torch.full((2, m, n), float("nan")), bias=torch.randn(n, generator=g), alpha=None)

    cfg = hgemm.GemmConfig(128, 128, 128)
    whole, cut = _run_cut_and_whole(monkeypatch, emulated, make, lambda p: hfp8.launch(p, cfg), 2 ** 16)
    assert torch.equal(whole, cut)


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
def test_blackwell_block_scaled_pieces_are_exact(monkeypatch, swizzled):
    outs = []
    for lim in (_large.LIMIT, 2 ** 16):
        monkeypatch.setattr(_large, "LIMIT", lim)
        problem, _ = block_scaled_case(MXFP8_E4M3, 300, 384, 128, ba=2, bb=1, swizzled=swizzled, bias=True, seed=8)
        plan = bbs.Prepared(problem, table="sm_120")
        emu = TileEmulator()
        for grid, args in plan.launches:
            assert all(_large.fits(a) for a in args if isinstance(a, torch.Tensor))
            emu.launch(None, grid, plan.kernel, args)
        outs.append((problem.out.clone(), len(plan.launches)))
    (whole, n_whole), (cut, n_cut) = outs
    assert n_whole == 1 and n_cut > 1 and torch.equal(whole, cut)


def test_blackwell_fp8_pieces_are_exact(monkeypatch):
    outs = []
    for lim in (_large.LIMIT, 2 ** 16):
        monkeypatch.setattr(_large, "LIMIT", lim)
        g = torch.Generator().manual_seed(9)
        m, n, k = 300, 384, 256
        a = (torch.randn(1, m, k, generator=g) * 4).to(torch.float8_e4m3fn)
        b = (torch.randn(1, n, k, generator=g) * 4).to(torch.float8_e4m3fn)
        problem = FP8Problem(fmt=None, a=a, a_scale=torch.rand(1, m, k // 128, generator=g) + 0.5, b=b,
                             b_scale=torch.rand(1, 3, k // 128, generator=g) + 0.5,
                             granularity=Granularity.BLOCK_1X128,
                             out=torch.full((1, m, n), float("nan")), bias=None, alpha=None)
        plan = bfp8.Prepared(problem, table="sm_100")
        emu = TileEmulator()
        for grid, args in plan.launches:
            emu.launch(None, grid, plan.kernel, args)
        outs.append((problem.out.clone(), len(plan.launches)))
    (whole, n_whole), (cut, n_cut) = outs
    assert n_whole == 1 and n_cut > 1 and torch.equal(whole, cut)


def test_blackwell_plan_of_the_issue_shape_fits():
    # mxfp8_matmul with a (65600, 32768) activation and a (4096, 32768) weight, on meta tensors
    fmt = MXFP8_E4M3
    m, n, k = 65600, 4096, 32768
    from tilemm.matmul import BlockScaledProblem
    problem = BlockScaledProblem(
        fmt=fmt, a=meta(1, m, k, dtype=torch.float8_e4m3fn), a_scale=meta(1, m, k // 32, dtype=torch.uint8),
        b=meta(1, n, k, dtype=torch.float8_e4m3fn), b_scale=meta(1, n, k // 32, dtype=torch.uint8),
        swizzled=False, out=meta(1, m, n), bias=None, alpha=None)
    plan = bbs.Prepared(problem, table="sm_100", sms=148)
    assert len(plan.launches) == 2
    assert all(_large.fits(*[a for a in args if isinstance(a, torch.Tensor)]) for _, args in plan.launches)
    assert sum(args[4].shape[1] for _, args in plan.launches) == m
    assert all(args[4].shape[1] % plan.config.tile_m == 0 for _, args in plan.launches[:-1])
    assert math.prod(plan.launches[0][1][0].shape) <= BIG  # 2^31 elements: offsets to 2^31 - 1
