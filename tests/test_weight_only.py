"""The weight-only path: ``tilemm.prepack`` / ``unpack`` and the weight-only kernel's tile code.

The kernel runs on the CPU through the NumPy model of cuTile (tests/_emulator.py), which asserts that
every bf16 operand reaching ``ct.mma`` holds its value exactly and that every bf16 product of the
decode is exact; its result is compared with the reference ``x @ dequantize(w).T`` in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import swizzle
import tilemm
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4
from tilemm.kernels import weight_only_kernels as wo
from tilemm.numerics import unpack_e2m1
from tilemm.packed import layout_of, prepack, unpack

from _emulator import LaunchProxy, TileEmulator, assert_matches

FORMATS = [MXFP4, NVFP4, MXFP8_E4M3, MXFP8_E5M2]
IDS = [f.name for f in FORMATS]


def quantized_weight(fmt, n, k, *, seed=0, swizzle_scale=False, scale_bytes=None):
    """A random quantized (N, K) weight: every element code, scales from ``scale_bytes`` (a range)."""
    gen = torch.Generator().manual_seed(seed)
    ks = k // fmt.block
    if fmt.is_packed:
        data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    else:
        raw = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
        nonfinite = (raw & 0x7F) == 0x7F if fmt.element == "e4m3" else (raw & 0x7F) >= 0x7C
        data = torch.where(nonfinite, raw & 0x80, raw).view(fmt.data_dtype)
    lo, hi = scale_bytes or ((118, 136) if fmt.is_mx else (1, 0x7F))
    scale = torch.randint(lo, hi, (n, ks), dtype=torch.uint8, generator=gen).view(fmt.scale_dtype)
    if swizzle_scale:
        scale = swizzle.swizzle_32_4_4(scale)
    if fmt is NVFP4:
        return tilemm.NVFP4Tensor(data, scale, torch.tensor(0.0123, dtype=torch.float32))
    return (tilemm.MXFP4Tensor if fmt is MXFP4 else tilemm.MXFP8Tensor)(data, scale)


def _logical(w_q):
    n = w_q.data.shape[0]
    k = w_q.format.logical_k(w_q.data.shape[1])
    if w_q.swizzled:
        return swizzle.unswizzle_32_4_4(w_q.scale, n, k // w_q.format.block)
    return w_q.scale


def _bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
# K = 96 / 160: not a multiple of any tile_k (the words are zero-padded); N = 17: not a tile multiple.
@pytest.mark.parametrize("n,k", [(17, 96), (130, 512), (8, 160)])
def test_unpack_returns_the_exact_bytes(fmt, swizzled, n, k):
    if k % fmt.block:
        pytest.skip("K must be a multiple of the block")
    w_q = quantized_weight(fmt, n, k, swizzle_scale=swizzled)
    packed = prepack(w_q)
    assert packed.shape == (n, k)
    assert packed.words.shape == (n, -(-k // layout_of(fmt).tile_k) * layout_of(fmt).words_per_tile)
    back = unpack(packed)
    assert type(back) is type(w_q)
    assert torch.equal(_bytes(back.data), _bytes(w_q.data))
    assert torch.equal(_bytes(back.scale), _bytes(_logical(w_q)))
    if fmt is NVFP4:
        assert torch.equal(back.global_scale, w_q.global_scale)


def test_prepack_errors_name_the_argument():
    with pytest.raises(TypeError, match="w_q must be an MXFP4Tensor"):
        prepack(torch.zeros(4, 4))
    w = tilemm.quantize_fp8(torch.randn(4, 32), granularity="row")
    with pytest.raises(TypeError, match="w_q must be"):
        prepack(w)
    w = tilemm.quantize_mxfp4(torch.randn(2, 2, 4, 32))  # 3-D is a stack of experts (tests/test_moe.py)
    with pytest.raises(ValueError, match="2-D"):
        prepack(w)


def test_e5m2_inf_and_fp32_overflow_are_refused():
    w_q = quantized_weight(MXFP8_E5M2, 4, 64)
    data = _bytes(w_q.data).clone()
    data[1, 3] = 0x7C  # +inf
    with pytest.raises(ValueError, match="Inf elements"):
        prepack(tilemm.MXFP8Tensor(data.view(torch.float8_e5m2), w_q.scale))
    w_q = quantized_weight(MXFP4, 4, 64)
    data = w_q.data.clone()
    data[0, 0] = 0x07  # element 0 = 6.0
    scale = _bytes(w_q.scale).clone()
    scale[0, 0] = 254  # 6 * 2^127 overflows fp32
    with pytest.raises(ValueError, match="overflow float32"):
        prepack(tilemm.MXFP4Tensor(data, scale.view(torch.float8_e8m0fnu)))


def test_pickled_packed_weight_keeps_its_layout_version():
    import copy
    import pickle

    from tilemm.packed import LAYOUT_VERSION, relayout_words

    packed = prepack(quantized_weight(MXFP4, 4, 64))
    back = pickle.loads(pickle.dumps(packed))
    assert torch.equal(back.words, packed.words) and copy.deepcopy(packed).exponent == packed.exponent
    state = packed.__getstate__()
    assert state.pop("layout_version") == LAYOUT_VERSION  # as pickled before versions existed: layout 1
    state["words"] = relayout_words(packed.words, MXFP4, LAYOUT_VERSION, 1)
    old = object.__new__(type(packed))
    old.__setstate__(state)
    assert torch.equal(old.words, packed.words)
    assert torch.equal(unpack(old).data, unpack(packed).data)


def test_relayout_from_word_layout_1():
    """Layout 1 held plane p's magnitude at lane bits 3p..3p+2 and its sign at 12 + p; relayout_words
    turns such words into the current layout's words of the same weight, and back."""
    from tilemm.packed import LAYOUT_VERSION, relayout_words

    w_q = quantized_weight(MXFP4, 3, 512)
    packed = prepack(w_q)
    codes = unpack_e2m1(w_q.data).to(torch.int64).reshape(3, -1, 4, 2, 16, 2)  # (N, T, P, G, W, lane)
    p = torch.arange(4).reshape(1, 1, 4, 1, 1, 1)
    lane = (((codes & 7) << (3 * p)) | (((codes >> 3) & 1) << (12 + p))).sum(dim=2)
    old = lane[..., 0] | (lane[..., 1] << 16)
    old = torch.where(old >= 2 ** 31, old - 2 ** 32, old).to(torch.int32).reshape(3, -1)
    assert torch.equal(relayout_words(old, MXFP4, 1), packed.words)
    assert torch.equal(relayout_words(packed.words, MXFP4, LAYOUT_VERSION, 1), old)
    mx8 = prepack(quantized_weight(MXFP8_E4M3, 2, 128)).words
    assert relayout_words(mx8, MXFP8_E4M3, 1) is mx8
    with pytest.raises(ValueError, match="versions are"):
        relayout_words(packed.words, MXFP4, 0)


def test_scale_2_to_127_is_refused():
    """A block scale of 2^127 (byte 254) would need E = offset, where the kernel's multiplier of byte 0
    (2^-127) and of the NaN byte would not be exact; prepack refuses it by name."""
    w_q = quantized_weight(MXFP4, 4, 64)
    data = torch.zeros_like(w_q.data)
    data[0, 0] = 0x02  # element 0 = 1.0: 2^127 is finite
    scale = _bytes(w_q.scale).clone()
    scale[0, 0] = 254
    with pytest.raises(ValueError, match="2\\^127"):
        prepack(tilemm.MXFP4Tensor(data, scale.view(torch.float8_e8m0fnu)))
    scale[0, 0] = 253
    assert prepack(tilemm.MXFP4Tensor(data, scale.view(torch.float8_e8m0fnu))).exponent == 125


def test_exponent_offset():
    """E = 0 for ordinary MX scales; large block scales move the multipliers down by 2^E."""
    assert prepack(quantized_weight(MXFP4, 4, 64, scale_bytes=(100, 129))).exponent == 0
    assert prepack(quantized_weight(MXFP4, 4, 64, scale_bytes=(135, 136))).exponent == 7
    assert prepack(quantized_weight(MXFP8_E4M3, 4, 64, scale_bytes=(100, 135))).exponent == 0
    nv = prepack(tilemm.quantize_nvfp4(torch.randn(8, 64)))
    assert nv.exponent == 7  # the largest block scale is 448 = 1.75 * 2^8


# --------------------------------------------------------------------------------------------------
# The kernel's tile code on the CPU
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def emulated(monkeypatch):
    emu = TileEmulator()
    monkeypatch.setattr(wo, "ct", LaunchProxy(emu))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    return emu


def _reference(x, w_q, bias=None, out_dtype=torch.float32):
    w = w_q.dequantize().to(torch.float64)
    out = x.to(torch.float64) @ w.T
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(out_dtype)


def _gemv(tile_m, split, unroll):
    """The FMA kernel's config (its block shape as ``plan`` picks it) with ``tile_m`` rows of x per
    block, a K split and K tiles per load."""
    tile_n, warps, occupancy = wo._GEMV_SHAPE
    return wo.WeightOnlyConfig(tile_m, tile_n, split, warps, occupancy, unroll=unroll, gemv=1)


def _run(x, packed, cfg, bias=None):
    n = packed.out_features
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    b = torch.zeros(n, dtype=torch.float32) if bias is None else bias.float()
    wo.launch(x, packed.words, packed.scale_t, packed.constants, b, out, packed.layout, cfg)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_kernel_matches_reference(emulated, fmt, x_dtype):
    # M = 3 (a partial 16-row tile), N = 20 (a partial weight tile), K = 320: not a multiple of
    # tile_k, so the last K tile reads zero words and zero-padded activations; split 2 over 2 tiles.
    m, n, k = 3, 20, 320
    # scales small enough that fp16 outputs stay finite
    w_q = quantized_weight(fmt, n, k, seed=1, scale_bytes=(105, 122) if fmt.is_mx else (1, 0x50))
    packed = prepack(w_q)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * 3).to(x_dtype)
    bias = torch.randn(n)
    for cfg in (wo.WeightOnlyConfig(16, 16, 1), wo.WeightOnlyConfig(16, 16, 2), wo.WeightOnlyConfig(16, 16, 4),
                _gemv(1, 1, 2), _gemv(2, 1, 1), _gemv(2, 2, 2)):
        out = _run(x, packed, cfg, bias)
        assert_matches(out.float(), _reference(x, w_q, bias), torch.float32 if x_dtype == torch.float32
                       else x_dtype)


@pytest.mark.parametrize("fmt", [MXFP4, MXFP8_E4M3], ids=["mxfp4", "mxfp8_e4m3"])
def test_kernel_with_large_scales(emulated, fmt):
    """E > 0: the MMA operand is the weight times 2^-E, the epilogue multiplies 2^E back."""
    w_q = quantized_weight(fmt, 16, 128, scale_bytes=(125, 150))
    packed = prepack(w_q)
    assert packed.exponent > 0
    x = torch.randn(2, 128)
    out = _run(x, packed, wo.WeightOnlyConfig(16, 16, 1))
    assert_matches(out, _reference(x, w_q), torch.float32)


def test_kernels_with_scale_bytes_0_and_large(emulated):
    """The multiplier of scale byte s is built as the bf16 exponent field s + offset - E: with E = 2,
    bytes 0 to 3 (2^-127 ..) sit next to 2^3 in one weight, every product still a bf16 number; both
    kernels. (With larger E, or 8-bit elements, products of bytes near 0 fall below bf16's range:
    the documented lower limit.)"""
    fmt = MXFP4
    w_q = quantized_weight(fmt, 16, 256, scale_bytes=(0, 4))
    scale = _bytes(w_q.scale).clone()
    scale[::3] = 130
    w_q = type(w_q)(w_q.data, scale.view(torch.float8_e8m0fnu))
    packed = prepack(w_q)
    assert packed.exponent == 2 and int((scale == 0).sum()) > 0
    x = torch.randn(1, 256)
    for cfg in (wo.WeightOnlyConfig(16, 16, 1), _gemv(1, 1, 2)):
        assert_matches(_run(x, packed, cfg), _reference(x, w_q), torch.float32)


def test_split_k_counters_return_to_zero(emulated):
    """The last block of each output tile resets its counter, so the next launch starts from zero."""
    packed = prepack(quantized_weight(MXFP4, 40, 1024))
    x = torch.randn(5, 1024)
    prepared = wo.Prepared(packed.words, packed.scale_t, packed.constants, torch.zeros(40), packed.layout,
                           wo.WeightOnlyConfig(16, 16, 4), 5, x.dtype)  # keeps its workspace
    outs = []
    for _ in range(2):
        outs.append(torch.full((5, 40), float("nan")))
        prepared.run(x, outs[-1], None)
        partial, counter = prepared._work[None]
        assert counter.numel() >= 3 and int(counter.count_nonzero()) == 0
    assert torch.equal(outs[0], outs[1])
    assert_matches(outs[0], _reference(x, unpack(packed)), torch.float32)


def test_nan_scales_and_elements_reach_their_columns(emulated):
    """A NaN scale (MX byte 255) or a NaN element makes exactly its weight row's output column NaN."""
    w_q = quantized_weight(MXFP8_E4M3, 16, 64)
    data, scale = _bytes(w_q.data).clone(), _bytes(w_q.scale).clone()
    scale[3, 1] = 255
    data[9, 40] = 0x7F  # e4m3 NaN
    w_q = tilemm.MXFP8Tensor(data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu))
    packed = prepack(w_q)
    x = torch.randn(2, 64)
    out = _run(x, packed, wo.WeightOnlyConfig(16, 16, 1))
    ref = _reference(x, w_q)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out.isnan()[:, [3, 9]].all() and out.isnan().sum() == 4
    assert torch.equal(_bytes(unpack(packed).scale), scale)  # the original bytes come back


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantize_kernel_is_the_weight_times_2_to_minus_e(emulated, fmt):
    """The large-M path's decode: the prepacked weight as bf16, exactly dequantize(w) * 2^-E (NVFP4:
    without its decode scale), K padding cut off."""
    w_q = quantized_weight(fmt, 70, 160)
    packed = prepack(w_q)
    w16 = wo.dequantize(packed.words, packed.scale_t, packed.constants, packed.layout, 160)
    assert w16.shape == (70, 160) and w16.dtype == torch.bfloat16
    expected = w_q.dequantize() * 2.0 ** -packed.exponent
    if fmt is NVFP4:
        expected = expected / w_q.global_scale
    torch.testing.assert_close(w16.double(), expected.double(), rtol=2 ** -20, atol=0)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4, MXFP8_E4M3], ids=["mxfp4", "nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("scheme", [dict(unroll=2), dict(cat=1), dict(unroll=2, cat=1)],
                         ids=["unroll2", "cat", "unroll2_cat"])
def test_load_schemes_match_reference(emulated, fmt, scheme):
    # K = 1344: 5.25 4-bit K tiles / 10.5 8-bit ones, so splits of 1, 2 and 4 end in odd remainders,
    # empty splits and partial tiles; unroll 2 rounds each split's range to an even number of tiles.
    m, n, k = 3, 20, 1344
    w_q = quantized_weight(fmt, n, k, seed=1, scale_bytes=(105, 122) if fmt.is_mx else (1, 0x50))
    packed = prepack(w_q)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    bias = torch.randn(n)
    for split in (1, 2, 4):
        out = _run(x, packed, wo.WeightOnlyConfig(16, 16, split, 8, None, **scheme), bias)
        assert_matches(out.float(), _reference(x, w_q, bias), torch.bfloat16)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4, MXFP8_E4M3], ids=["mxfp4", "nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("stack", [2, 4])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stacked_k_tiles_match_reference(emulated, fmt, stack, x_dtype):
    # Stacks of 2 / 4 K tiles over K = 1344 (5.25 4-bit K tiles, 10.5 8-bit ones): the last stack is
    # partial and reads zero words, zero scale bytes and zero activations; splits of 2 and 4 leave
    # empty splits. M = 3 of a tile_m 8 block, N = 20 over blocks of 16 rows (a partial block).
    m, n, k = 3, 20, 1344
    w_q = quantized_weight(fmt, n, k, seed=5, scale_bytes=(105, 122) if fmt.is_mx else (1, 0x50))
    packed = prepack(w_q)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(6)) * 3).to(x_dtype)
    bias = torch.randn(n)
    for split, cat in ((1, 1), (1, 0), (2, 1), (4, 0)):
        out = _run(x, packed, wo.WeightOnlyConfig(8, 16, split, 4, 3, cat=cat, stack=stack), bias)
        assert_matches(out.float(), _reference(x, w_q, bias), x_dtype)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4, MXFP8_E4M3], ids=["mxfp4", "nvfp4", "mxfp8_e4m3"])
def test_one_row_on_the_mma_kernel_matches_reference(emulated, fmt):
    # M = 1 on the MMA kernel (``plan``'s m1_kernel "mma"): an 8-column x tile of which 7 columns are
    # padding, the configs ``_one_row_mma`` picks (wide and narrow stacks, K splits leaving empty
    # splits) over K = 1344 (a partial last stack) and N = 40 (a partial block).
    m, n, k = 1, 40, 1344
    w_q = quantized_weight(fmt, n, k, seed=7, scale_bytes=(105, 122) if fmt.is_mx else (1, 0x50))
    packed = prepack(w_q)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(8)) * 3).to(torch.bfloat16)
    bias = torch.randn(n)
    for (tile_n, stack, warps, occupancy), split in zip(wo._STACKED[8][:2] * 2, (1, 2, 4, 1)):
        cfg = wo.WeightOnlyConfig(8, tile_n, split, warps, occupancy, cat=1, stack=stack)
        out = _run(x, packed, cfg, bias)
        assert_matches(out.float(), _reference(x, w_q, bias), torch.bfloat16)


def test_layouts_read_their_format():
    # The element code, scale block and scale encoding of each layout are its Format's; the decode's
    # offset is bf16's exponent bias less the element's (e2m1 1, e4m3 7, e5m2 15).
    fmts = (MXFP4, NVFP4, MXFP8_E4M3, MXFP8_E5M2)
    assert list(wo.LAYOUTS) == [f.name for f in fmts]
    for fmt, layout in zip(fmts, wo.LAYOUTS.values()):
        assert layout.format is fmt and layout_of(fmt) is layout
        assert (layout.element, layout.block, layout.scale_e8m0) == (fmt.element_code, fmt.block, int(fmt.is_mx))
    assert [layout.offset for layout in wo.LAYOUTS.values()] == [126, 126, 120, 112]
    with pytest.raises(TypeError, match="weight-only layouts exist for MXFP4, NVFP4 and MXFP8"):
        layout_of(tilemm.formats.FP8_E4M3)


def test_plan_one_row_mma():
    """m1_kernel "mma": one row of x on the MMA kernel, tile_m 8, 32-row blocks (stacks of 2) while
    they give a block per SM, else 16-row blocks (stacks of 4), a K split below one block per SM; the
    default stays the FMA kernel, and more rows ignore the choice."""
    mx4 = wo.LAYOUTS["mxfp4"]
    assert wo.M1_KERNEL == "fma" and wo.plan(1, 14336, 4096, mx4).gemv
    cfg = wo.plan(1, 14336, 4096, mx4, m1_kernel="mma")
    assert (cfg.gemv, cfg.tile_m, cfg.tile_n, cfg.stack, cfg.split_k, cfg.cat) == (0, 8, 32, 2, 1, 1)
    cfg = wo.plan(1, 4096, 14336, mx4, m1_kernel="mma")
    assert (cfg.tile_m, cfg.tile_n, cfg.stack, cfg.split_k) == (8, 16, 4, 1)
    cfg = wo.plan(1, 1024, 4096, mx4, m1_kernel="mma")  # 64 blocks of 16 rows, 4 stacks
    assert (cfg.tile_n, cfg.stack, cfg.split_k) == (16, 4, 2)
    assert wo.plan(2, 14336, 4096, mx4, m1_kernel="mma") == wo.plan(2, 14336, 4096, mx4)
    with pytest.raises(ValueError, match="m1_kernel must be one of"):
        wo.plan(1, 4096, 4096, mx4, m1_kernel="tensor")
    for layout in wo.LAYOUTS.values():
        for n, k in ((4096, 4096), (14336, 4096), (1024, 4096), (1024, 256), (40, 1344)):
            assert wo.plan(1, n, k, layout, m1_kernel="mma") in wo._configs(layout)


def test_stacking_needs_the_plain_loads():
    with pytest.raises(ValueError, match="stack=2 needs unroll=1"):
        wo.WeightOnlyConfig(8, 32, unroll=2, stack=2)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4, MXFP8_E4M3], ids=["mxfp4", "nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("unroll", [2, 4, 8])
def test_fma_kernel_loads_match_reference(emulated, fmt, unroll):
    # K = 1344 as above: with 8 K tiles per load the last (or only) load reaches past K, and splits of
    # 2 and 4 leave some blocks no load at all; M = 1 as in a decode step, N = 40 (a partial block).
    m, n, k = 1, 40, 1344
    w_q = quantized_weight(fmt, n, k, seed=3, scale_bytes=(105, 122) if fmt.is_mx else (1, 0x50))
    packed = prepack(w_q)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    bias = torch.randn(n)
    for split in (1, 2, 4):
        out = _run(x, packed, _gemv(1, split, unroll), bias)
        assert_matches(out.float(), _reference(x, w_q, bias), torch.bfloat16)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4], ids=["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tile_n", [64, 128])
def test_fma_kernel_wide_blocks_match_reference(emulated, fmt, tile_n):
    """The FMA kernel's wider blocks that ``tune_weight_only.py --gemv`` times (each thread then holds
    several weight rows): N = 200 leaves a partial block, K = 1344 (6 K tiles) a second load of 4
    reaching past K, and the split of 2 gives each block one of the two loads."""
    m, n, k = 1, 200, 1344
    w_q = quantized_weight(fmt, n, k, seed=5, scale_bytes=(105, 122) if fmt.is_mx else (1, 0x50))
    packed = prepack(w_q)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(6)) * 3).to(torch.bfloat16)
    bias = torch.randn(n)
    for split in (1, 2):
        cfg = wo.WeightOnlyConfig(1, tile_n, split, 4, 8 if tile_n == 64 else 4, unroll=4, gemv=1)
        out = _run(x, packed, cfg, bias)
        assert_matches(out.float(), _reference(x, w_q, bias), torch.bfloat16)


def test_plan_schemes():
    """One row of x: the FMA kernel, 8 K tiles per load where K has them, a K split only for K above
    8192 and below one block per SM; 4-bit weights with more than one wave of blocks at four per SM: eight per SM. Up
    to 16 rows, where the output tiles alone fill the GPU: one MMA per K tile (4-bit weights: two K
    tiles per load); otherwise a K split loading two K tiles at a time; from tile_m 32 on, neither."""
    mx4, mx8 = wo.LAYOUTS["mxfp4"], wo.LAYOUTS["mxfp8_e4m3"]
    cfg = wo.plan(1, 8192, 8192, mx4)  # 512 blocks: one wave at four per SM
    assert (cfg.gemv, cfg.tile_m, cfg.split_k, cfg.unroll, cfg.occupancy) == (1, 1, 1, 8, 4)
    cfg = wo.plan(1, 14336, 4096, mx4)  # 896 blocks: one wave at eight per SM, 4 K tiles per load
    assert (cfg.gemv, cfg.tile_m, cfg.split_k, cfg.unroll, cfg.occupancy) == (1, 1, 1, 4, 8)
    cfg = wo.plan(1, 14336, 4096, mx8)  # 8-bit weights: four per SM
    assert (cfg.gemv, cfg.split_k, cfg.occupancy) == (1, 1, 4)
    cfg = wo.plan(1, 4096, 14336, mx8)
    assert (cfg.gemv, cfg.split_k, cfg.unroll) == (1, 1, 8)
    cfg = wo.plan(1, 1024, 1024, mx4)  # 64 blocks of 16 rows, 4 K tiles
    assert (cfg.gemv, cfg.split_k, cfg.unroll) == (1, 1, 2)
    for n, k in ((1024, 4096), (256, 4096), (2048, 8192)):  # short K: no split, however few the blocks
        assert wo.plan(1, n, k, mx4).split_k == wo.plan(1, n, k, mx8).split_k == 1
    assert wo.plan(1, 512, 14336, mx4).split_k == 4 and wo.plan(1, 512, 14336, mx8).split_k == 8
    cfg = wo.plan(2, 14336, 4096, mx4)
    assert not cfg.gemv
    cfg = wo.plan(16, 14336, 4096, mx4)
    assert (cfg.split_k, cfg.cat, cfg.unroll, cfg.occupancy) == (1, 1, 2, 3)
    cfg = wo.plan(16, 14336, 4096, mx8)
    assert (cfg.split_k, cfg.cat, cfg.unroll, cfg.occupancy) == (1, 1, 1, 2)
    cfg = wo.plan(16, 2048, 14336, mx4)
    assert cfg.split_k > 1 and cfg.unroll == 2 and not cfg.cat and cfg.stack == 1
    assert wo.plan(64, 8192, 8192, mx4).split_k == 1 and wo.plan(64, 4096, 14336, mx4).split_k == 4
    cfg = wo.plan(32, 4096, 14336, mx4)
    assert cfg.unroll == 1 and not cfg.cat and cfg.stack == 1
    # 2 .. 16 rows: stacked K tiles where 32- or 16-row blocks fill the GPU without a K split
    for m, n, k, shape in ((4, 8192, 8192, (8, 32, 2)), (8, 4096, 14336, (8, 16, 4)),
                           (4, 28672, 8192, (8, 32, 2)), (16, 8192, 28672, (16, 32, 2)),
                           (16, 4096, 14336, (16, 32, 4))):
        cfg = wo.plan(m, n, k, mx4)
        assert (cfg.tile_m, cfg.tile_n, cfg.stack, cfg.split_k, cfg.cat) == (*shape, 1, 1)
    # ... and the 64-row blocks where those leave a partial second wave, or need a split (long K)
    for m, n, k in ((4, 14336, 4096), (16, 14336, 4096), (16, 28672, 4096), (16, 2048, 14336), (4, 1024, 14336)):
        assert wo.plan(m, n, k, mx4).stack == 1
    # Short K: stacked blocks without a split, however few, for every format: the "few" blocks of one
    # warpgroup (8 weight rows, 8 K tiles up to 8 rows of x; 16 rows, 4 K tiles above) while they are at
    # most one per SM, the narrow ones above that (at 9-16 rows of x not for NVFP4)
    nv4 = wo.LAYOUTS["nvfp4"]
    for layout in (mx4, nv4, mx8):
        for m, n, want in ((2, 256, (8, 8, 8)), (4, 1024, (8, 8, 8)), (8, 1056, (8, 8, 8)), (8, 1064, (8, 16, 4)),
                           (8, 2048, (8, 16, 4)), (12, 256, (16, 16, 4)), (16, 1024, (16, 16, 4)),
                           (16, 2048, (16, 16, 4))):
            cfg = wo.plan(m, n, 4096, layout)
            assert (cfg.tile_m, cfg.tile_n, cfg.stack, cfg.split_k, cfg.num_worker_warps) == (*want, 1, 4), (
                layout, m, n)
            assert wo.short_k_stacked(m, n, 4096, layout, 132)
    for layout in (mx4, mx8):
        cfg = wo.plan(16, 4096, 4096, layout)
        assert (cfg.tile_n, cfg.stack, cfg.split_k, cfg.num_worker_warps) == (32, 4, 1, 8)
    assert wo.plan(16, 4096, 4096, nv4).stack == 1 and not wo.short_k_stacked(16, 4096, 4096, nv4, 132)
    # 17-32 rows: the 16-row few blocks over two M tiles, one launch (8-bit weights too)
    for layout in (mx4, nv4, mx8):
        k = 8192 if layout is not mx8 else 4096  # weight rows of at most 4 KiB
        for m, n in ((17, 1024), (32, 1024), (24, 1056)):
            cfg = wo.plan(m, n, k, layout)
            assert (cfg.tile_m, cfg.tile_n, cfg.stack, cfg.split_k) == (16, 16, 4, 1), (layout, m, n)
            assert wo.short_k_stacked(m, n, k, layout, 132)
        cfg = wo.plan(24, 2048, 4096, layout)  # two M tiles of 128 16-row blocks: too many; 32-row ones
        assert (cfg.tile_m, cfg.tile_n, cfg.stack, cfg.split_k) == (16, 32, 4, 1)
        assert not wo.short_k_stacked(24, 4096, 4096, layout, 132)
        assert wo.plan(32, 4096, 4096, layout).stack == 1 and wo.plan(33, 1024, 4096, layout).stack == 1
    from tilemm.kernels import hopper_weight_only_large as wl

    assert wl.plan(24, 1024, 4096, mx8) is None and wl.plan(32, 1024, 4096, mx8) is None  # not the decode design
    # 8-bit rows of 8 KiB (1024 x 8192) at 17-32 rows: the decode design (0.71-0.73x against 0.63-0.68x)
    assert not wo.short_k_stacked(24, 1024, 8192, mx8, 132) and wl.plan(24, 1024, 8192, mx8).kind == "decode"
    assert wo.short_k_stacked(16, 1024, 8192, mx8, 132)  # up to 16 rows the stacked blocks stay
    # ... but not over a long K, where the split wins
    for layout in (mx4, nv4, mx8):
        assert wo.plan(16, 1024, 14336, layout).stack == 1 and not wo.short_k_stacked(16, 1024, 14336, layout, 132)
    assert wo.plan(16, 4096, 14336, wo.LAYOUTS["nvfp4"]).stack == 1
    assert wo.plan(8, 4096, 14336, wo.LAYOUTS["nvfp4"]).stack == 4
    for layout in wo.LAYOUTS.values():
        for m in (1, 2, 8, 16, 32, 64, 128):
            for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192),
                         (1024, 256)):
                assert wo.plan(m, n, k, layout) in wo._configs(layout)


def test_split_k_workspace_is_kept_per_stream():
    """A prepared launch keeps one split-K workspace per stream, keyed by the raw handle (an int, as the
    runner passes it) or a Stream object's handle; streams never share one."""
    packed = prepack(quantized_weight(MXFP4, 40, 1024))
    prepared = wo.Prepared(packed.words, packed.scale_t, packed.constants, torch.zeros(40), packed.layout,
                           wo.WeightOnlyConfig(16, 16, 4), 5, torch.float32)
    out = torch.empty(5, 40)

    class FakeStream:
        cuda_stream = 7

    first = prepared._workspace(out, 7)
    assert prepared._workspace(out, 7) is first
    assert prepared._workspace(out, FakeStream()) is first
    other = prepared._workspace(out, 8)
    assert other[0] is not first[0] and other[1] is not first[1]
    assert first[0].shape == (4, 5, 40) and first[1].dtype == torch.int32
    unsplit = wo.Prepared(packed.words, packed.scale_t, packed.constants, torch.zeros(40), packed.layout,
                          wo.WeightOnlyConfig(16, 16, 1), 5, torch.float32)
    assert unsplit._workspace(out, 7)[0] is out  # no split: stand-ins the kernel never reads


# --------------------------------------------------------------------------------------------------
# linear(x, packed, out_dtype=...)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32],
                         ids=["default", "bf16", "fp16", "fp32"])
def test_linear_weight_only_honours_out_dtype(x_dtype, out_dtype):
    # The weight-only path rounds its fp32 accumulator once to out_dtype (None: x's dtype), as the
    # block-scaled path does; it used to ignore out_dtype and return x's dtype.
    w_q = tilemm.quantize_nvfp4(torch.randn(24, 64, generator=torch.Generator().manual_seed(0)))
    packed = prepack(w_q)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(x_dtype)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(2))
    out = tilemm.linear(x, packed, out_dtype=out_dtype, bias=bias)
    assert out.dtype == (out_dtype or x_dtype)
    fp32 = tilemm.linear(x, packed, out_dtype=torch.float32, bias=bias)
    assert torch.equal(out, fp32.to(out.dtype))  # one rounding of the same fp32 result
    assert_matches(fp32, _reference(x, w_q, bias), torch.float32)
    with pytest.raises(TypeError, match="out_dtype"):
        tilemm.linear(x, packed, out_dtype=torch.int8)


def test_linear_weight_only_out_dtype_under_compile():
    packed = prepack(tilemm.quantize_mxfp4(torch.randn(16, 64, generator=torch.Generator().manual_seed(0))))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    f = torch.compile(lambda t: tilemm.linear(t, packed, out_dtype=torch.float32), fullgraph=True)
    out = f(x)
    assert out.dtype == torch.float32 and torch.equal(out, tilemm.linear(x, packed, out_dtype=torch.float32))


def test_nvfp4_weight_with_an_inf_poisons_only_its_output_column():
    # The quantizer gives the Inf's block the NaN scale (docs/numerics.md, NVFP4); prepack and the
    # weight-only path carry it to the one output column that reads it, the others as without it.
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)) * 1e-2
    clean = tilemm.quantize_nvfp4(w)
    w[5, 40] = float("inf")
    w_q = tilemm.quantize_nvfp4(w)
    assert torch.equal(w_q.global_scale, clean.global_scale)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    out = tilemm.linear(x, prepack(w_q), out_dtype=torch.float32)
    assert out[:, 5].isnan().all()
    keep = torch.arange(24) != 5
    assert not out[:, keep].isnan().any()
    assert torch.equal(out[:, keep], tilemm.linear(x, prepack(clean), out_dtype=torch.float32)[:, keep])


def test_a_call_is_one_launch_and_only_the_output_allocation(monkeypatch):
    """What the custom op runs per call (a runner that keeps nothing, no bias, a K split): exactly one
    kernel launch and, of torch operations, only the output's allocation and views -- no fill kernel
    (zeroed counters, a zero bias) and no workspace allocation, so that under torch.compile's CUDA
    graphs a weight-only linear is one kernel. The launch is stubbed; the first call sets up the shared
    persistent buffers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import tilemm.weight_only as wol

    launches = []

    class Stub:
        def __getattr__(self, name):
            return getattr(wo.ct, name)

        @staticmethod
        def launch(stream, grid, kernel, args):
            launches.append(args)

    monkeypatch.setattr(wo, "ct", Stub())
    monkeypatch.setattr(wol, "stream_handle", lambda device: 0)
    packed = prepack(quantized_weight(MXFP4, 40, 8448))  # K above 8192: the 64-row blocks split K
    x = torch.randn(5, 8448)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def call():
        runner = wol.WeightOnlyRunner(packed, None, keep_workspace=False)
        runner._sms = 132
        assert runner.plan(5).split_k > 1
        return runner(x)

    call()
    launches.clear()
    with Ops() as ops:
        call()
    assert len(launches) == 1
    allocations = [n for n in ops.names if n.startswith(("empty", "zeros", "full", "new_", "fill", "zero"))]
    assert allocations == ["empty.memory_format"], ops.names
    assert set(ops.names) <= {"empty.memory_format", "slice.Tensor", "view.default", "alias.default"}, ops.names
    partial, counters = launches[0][7], launches[0][8]
    split = wo.plan(5, 40, 8448, packed.layout, 132).split_k
    assert partial.shape == (split, 5, 40) and counters.dtype == torch.int32
    assert partial.untyped_storage().data_ptr() == wo._WORKSPACES[(x.device, 0)]["partial"].untyped_storage().data_ptr()


def test_shared_workspace_split_k_matches_reference(emulated):
    """Launches on one stream share the persistent split-K workspace: consecutive launches of
    different shapes and splits (on the emulator) each match the reference and leave the counters
    at zero."""
    for (m, n, k, split, fmt) in ((5, 40, 1024, 4, MXFP4), (3, 70, 1344, 2, NVFP4), (5, 40, 1024, 2, MXFP8_E4M3)):
        w_q = quantized_weight(fmt, n, k, seed=m + n, scale_bytes=(105, 122) if fmt.is_mx else (1, 0x50))
        packed = prepack(w_q)
        x = torch.randn(m, k)
        prepared = wo.Prepared(packed.words, packed.scale_t, packed.constants, wo.zero_bias(x.device, n),
                               packed.layout, wo.WeightOnlyConfig(16, 16, split), m, x.dtype,
                               keep_workspace=False)
        out = torch.full((m, n), float("nan"))
        prepared.run(x, out, 11)
        assert_matches(out, _reference(x, w_q), torch.float32)
        assert int(wo._WORKSPACES[(x.device, 11)]["counters"].count_nonzero()) == 0
    assert int(wo.zero_bias(x.device, 70).count_nonzero()) == 0


def test_a_capture_on_a_fresh_stream_uses_the_graph_workspace(monkeypatch):
    """A non-capturing call sizes both its stream's workspace and the device's graph workspace, so a
    CUDA-graph capture on another stream (the usual warm-up-elsewhere pattern) finds a workspace
    without allocating; a capture that finds none allocates in the graph."""
    device = torch.device("cpu")
    monkeypatch.setattr(wo, "_WORKSPACES", {})
    eager = wo.workspace(device, 5, 4, 5, 40, 3)
    graphs = wo._WORKSPACES[(device, "graphs")]
    monkeypatch.setattr(wo, "_capturing", lambda d: True)
    partial, counters = wo.workspace(device, 9, 4, 5, 40, 3)
    assert partial.untyped_storage().data_ptr() == graphs["partial"].untyped_storage().data_ptr()
    assert counters.untyped_storage().data_ptr() == graphs["counters"].untyped_storage().data_ptr()
    assert partial.untyped_storage().data_ptr() != eager[0].untyped_storage().data_ptr()
    assert (device, 9) not in wo._WORKSPACES  # nothing allocated outside the graph while capturing
    big = wo.workspace(device, 9, 4, 5, 60000, 3)  # larger than any workspace: allocated in the graph
    assert big[0].shape == (4, 5, 60000) and int(big[1].count_nonzero()) == 0
    assert (device, 9) not in wo._WORKSPACES


def test_runner_cache_stays_out_of_copies():
    # linear(x, packed) keeps its eager runners on the PackedWeight; copies and pickles of the weight
    # leave them out, and the cache keeps one runner per bias (a new one when the bias changes).
    import copy
    import pickle

    from tilemm.weight_only import runner_for

    packed = tilemm.prepack(tilemm.quantize_mxfp4(torch.randn(8, 64)))
    bias = torch.randn(8)
    runner = runner_for(packed, None)
    assert runner_for(packed, None) is runner
    with_bias = runner_for(packed, bias)
    assert with_bias is not runner and runner_for(packed, bias) is with_bias
    bias.add_(1.0)  # an in-place change bumps the version: a new runner with the new values
    assert runner_for(packed, bias) is not with_bias
    for twin in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert "_runners" not in twin.__dict__ and torch.equal(twin.words, packed.words)


# --------------------------------------------------------------------------------------------------
# NVFP4 weights whose scale bytes are all normal (Layout.normal_scales)
# --------------------------------------------------------------------------------------------------

def normal_nvfp4(n, k, *, seed=0, zero_blocks=0, lo=0x08, hi=0x7F):
    """An NVFP4 (N, K) weight with every element code and scale bytes in [lo, hi) (normal: 0x08 ..
    0x7E); the first ``zero_blocks`` blocks of row 0 get scale 0 and zero data (sign bits kept)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.randint(lo, hi, (n, k // 16), dtype=torch.uint8, generator=gen)
    for b in range(zero_blocks):
        codes[0, 16 * b:16 * (b + 1)] &= 0x8
        scale[0, b] = 0
    return tilemm.NVFP4Tensor(tilemm.numerics.pack_e2m1(codes), scale.view(torch.float8_e4m3fn),
                              torch.tensor(0.0123, dtype=torch.float32))


def test_prepack_finds_normal_scales():
    assert prepack(normal_nvfp4(16, 64)).normal_scales
    assert prepack(normal_nvfp4(16, 64, zero_blocks=2)).normal_scales  # 0 over zero elements
    assert prepack(tilemm.quantize_nvfp4(torch.randn(32, 64))).normal_scales
    assert prepack(tilemm.quantize_nvfp4(torch.zeros(32, 64))).normal_scales
    assert not prepack(normal_nvfp4(16, 64, lo=0x01, hi=0x08)).normal_scales  # subnormal bytes
    w = normal_nvfp4(16, 64)
    for byte in (0x7F, 0x80 | 0x38, 0x00):  # NaN, negative, 0 over nonzero elements
        scale = w.scale.view(torch.uint8).clone()
        scale[3, 1] = byte
        if byte == 0x00:
            assert bool((unpack_e2m1(w.data)[3, 16:32] & 0x7).any())
        assert not prepack(tilemm.NVFP4Tensor(w.data, scale.view(torch.float8_e4m3fn), w.global_scale)).normal_scales
    nan = tilemm.quantize_nvfp4(torch.tensor([[float("nan")] + [1.0] * 31] * 4))  # a NaN block: scale 0x7F
    assert not prepack(nan).normal_scales
    for fmt in (MXFP4, MXFP8_E4M3):
        assert not prepack(quantized_weight(fmt, 16, 64)).normal_scales
    packed = prepack(normal_nvfp4(16, 64))
    assert packed.layout.normal_scales and packed.layout.scale_mode == 2
    assert wo.LAYOUTS["nvfp4"].scale_mode == 0 and wo.LAYOUTS["mxfp4"].scale_mode == 1
    with pytest.raises(ValueError, match="normal_scales"):
        wo.Layout(MXFP4, planes=4, group=2, normal_scales=True)


def test_normal_scales_survive_copies_and_layers():
    import copy
    import pickle

    packed = prepack(normal_nvfp4(16, 64))
    assert pickle.loads(pickle.dumps(packed)).normal_scales
    assert copy.deepcopy(packed).normal_scales
    assert tilemm.packed.expert(prepack([normal_nvfp4(16, 64), normal_nvfp4(16, 64, seed=1)]), 1).normal_scales
    assert not prepack([normal_nvfp4(16, 64), normal_nvfp4(16, 64, lo=1, hi=8)]).normal_scales
    lin = torch.nn.Linear(64, 16)
    layer = tilemm.nn.Linear.from_float(lin, "nvfp4", weight_only=True)
    assert layer.packed_weight().normal_scales
    loaded = tilemm.nn.Linear(64, 16, format="nvfp4", weight_only=True)
    loaded.load_state_dict(layer.state_dict())
    assert loaded.packed_weight().normal_scales


@pytest.mark.parametrize("x_dtype,hi,exponent", [(torch.bfloat16, 0x7F, 7), (torch.float32, 0x7F, 7),
                                                  (torch.bfloat16, 0x50, 1), (torch.bfloat16, 0x30, 0)],
                         ids=["bf16", "fp32", "bf16-E1", "bf16-E0"])
def test_normal_scale_kernels_match_reference(emulated, x_dtype, hi, exponent):
    # Scale bytes over the normal range 0x08 .. hi - 1 (E = 7 for the whole range), two zero blocks;
    # K = 320 leaves a zero-padded last K tile, whose scale bytes load as 0.
    m, n, k = 3, 20, 320
    w_q = normal_nvfp4(n, k, seed=4, zero_blocks=2, hi=hi)
    packed = prepack(w_q)
    assert packed.normal_scales and packed.exponent == exponent
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(5)) * 3).to(x_dtype)
    bias = torch.randn(n)
    for cfg in (wo.WeightOnlyConfig(16, 16, 1), wo.WeightOnlyConfig(16, 16, 2), _gemv(1, 1, 2), _gemv(2, 2, 1)):
        out = _run(x, packed, cfg, bias)
        assert_matches(out.float(), _reference(x, w_q, bias), torch.float32 if x_dtype == torch.float32
                       else x_dtype)
    deq = wo.dequantize(packed.words, packed.scale_t, packed.constants, packed.layout, k)
    general = wo.dequantize(packed.words, packed.scale_t, packed.constants, wo.LAYOUTS["nvfp4"], k)
    assert torch.equal(deq.view(torch.int16), general.view(torch.int16))  # signed zeros too
    expected = w_q.dequantize().double() * 2.0 ** -packed.exponent / w_q.global_scale.double()
    torch.testing.assert_close(deq.double(), expected, rtol=2 ** -20, atol=0)


def test_the_operator_takes_normal_scales(monkeypatch):
    """``torch.ops.tilemm.weight_only_linear`` carries the PackedWeight's flag to what it runs (under
    torch.compile the layer is this operator), from ``tilemm.linear`` and from ``nn.Linear``; the
    flag is refused on other formats."""
    import tilemm.weight_only as wol

    seen = []
    run = wol.run_weight_only
    monkeypatch.setattr(wol, "run_weight_only", lambda *a, **k: seen.append(a[-1]) or run(*a, **k))
    packed = prepack(normal_nvfp4(16, 64))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    tilemm.linear(x, packed)
    tilemm.linear(x, dataclasses.replace(packed, normal_scales=False))
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(64, 16), "nvfp4", weight_only=True)
    layer(x)
    assert seen == [True, False, True]
    with pytest.raises(ValueError, match="normal_scales is for NVFP4"):
        dataclasses.replace(prepack(quantized_weight(MXFP4, 16, 64)), normal_scales=True)


def test_a_layer_pickled_before_normal_scales_still_runs():
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(64, 16), "nvfp4", weight_only=True)
    del layer._normal_scales  # as a layer saved whole before the attribute existed
    assert not layer.packed_weight().normal_scales
    layer(torch.randn(2, 64))


def test_scale_rows_start_on_16_byte_boundaries():
    """N not a multiple of 16: prepack pads the scale rows (the kernels' tile loads need 16-byte row
    strides), moving the weight keeps them so, and a runner aligns a weight built any other way, once."""
    import tilemm.weight_only as wol
    from tilemm.packed import aligned_scale_t

    w_q = quantized_weight(MXFP4, 1000, 256)
    packed = prepack(w_q)
    assert packed.scale_t.shape == (8, 1000) and packed.scale_t.stride() == (1008, 1)
    moved = packed.to("meta").scale_t  # a move that copies (on the CPU, .to("cpu") is the same tensor)
    assert moved is not packed.scale_t and moved.stride() == (1008, 1)
    assert torch.equal(unpack(packed).scale.view(torch.uint8), w_q.scale.view(torch.uint8))
    aligned = prepack(quantized_weight(MXFP4, 1024, 256)).scale_t
    assert aligned_scale_t(aligned) is aligned and aligned.is_contiguous()
    plain = dataclasses.replace(packed, scale_t=packed.scale_t.contiguous())
    runner = wol.WeightOnlyRunner(plain)
    assert runner.packed.scale_t.stride() == (1008, 1) and torch.equal(runner.packed.scale_t, plain.scale_t)
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(256, 1000), "mxfp4", weight_only=True)
    before = layer.weight_scale_packed
    layer._apply(torch.clone)  # what Module.to(device) does to every buffer: a contiguous copy
    assert layer.weight_scale_packed is not before and layer.weight_scale_packed.stride() == (1008, 1)
    assert torch.equal(layer.weight_scale_packed, before)


def test_nvfp4_scales_are_row_major():
    """A single NVFP4 weight keeps its scale bytes row-major (N, K / 16), rows on 16-byte boundaries;
    the MX formats and stacked experts keep them transposed. A scale tensor of the other orientation
    is refused, and a weight pickled before the row-major layout (version 2) is turned row-major."""
    from tilemm.packed import LAYOUT_VERSION, expert

    w_q = quantized_weight(NVFP4, 40, 480)  # K / 16 = 30 bytes per row: padded to 32
    packed = prepack(w_q)
    assert packed.scale_rows and packed.scale_t.shape == (40, 30) and packed.scale_t.stride() == (32, 1)
    assert torch.equal(packed.scale_t, _bytes(w_q.scale))
    assert torch.equal(unpack(packed).scale.view(torch.uint8), _bytes(w_q.scale))
    # The kernels key the orientation on the block size (``_scale_tile``): the layouts must agree.
    assert all(layout.scale_rows == (layout.block == 16) for layout in wo.LAYOUTS.values())
    assert [name for name, layout in wo.LAYOUTS.items() if layout.scale_rows] == ["nvfp4"]
    mx = prepack(quantized_weight(MXFP4, 40, 480))
    assert not mx.scale_rows and mx.scale_t.shape == (15, 40)
    with pytest.raises(ValueError, match=r"scale_t must be \(N, K/B\) = \(40, 30\)"):
        dataclasses.replace(packed, scale_t=packed.scale_t.t())
    with pytest.raises(ValueError, match=r"scale_t must be \(K/B, N\) = \(15, 40\)"):
        dataclasses.replace(mx, scale_t=mx.scale_t.t())
    with pytest.raises(ValueError, match=r"scale_t must be \(N, K/B\) = \(40, 30\)"):
        dataclasses.replace(packed, scale_t=packed.scale_t.unsqueeze(0))  # stacked scales, single words

    state = packed.__getstate__()
    assert state.pop("layout_version") == LAYOUT_VERSION == 3
    state.update(layout_version=2, scale_t=packed.scale_t.t().contiguous())  # as pickled by version 2
    old = object.__new__(type(packed))
    old.__setstate__(state)
    assert torch.equal(old.scale_t, packed.scale_t) and old.scale_t.stride() == (32, 1)

    stacked = prepack([w_q, quantized_weight(NVFP4, 40, 480, seed=1)])
    assert not stacked.scale_rows and stacked.scale_t.shape == (2, 30, 40)
    first = expert(stacked, 0)
    assert first.scale_rows and torch.equal(first.scale_t, packed.scale_t)
    assert torch.equal(unpack(stacked).scale[0].view(torch.uint8), _bytes(w_q.scale))


def test_a_layer_pickled_before_row_major_scales_still_runs():
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(64, 16), "nvfp4", weight_only=True)
    x = torch.randn(2, 64)
    expected = layer(x)
    # as a layer saved whole by version 2: transposed scales, no version attribute
    layer.weight_scale_packed = layer.weight_scale_packed.t().contiguous()
    del layer._packed_version
    layer._runner = None
    assert layer.packed_weight().scale_t.shape == (16, 4)
    assert torch.equal(layer(x), expected)


def test_normal_scale_experts_under_a_shared_exponent(emulated):
    """Stacked experts share the largest exponent (here 7 against an expert's own 0): each expert's
    multipliers move down, and the normal-scale decode still gives the expert's product."""
    from tilemm.packed import expert

    small, large = normal_nvfp4(20, 256, seed=6, hi=0x30), normal_nvfp4(20, 256, seed=7)
    stacked = prepack([small, large])
    assert stacked.normal_scales and stacked.exponent == 7 and prepack(small).exponent == 0
    x = torch.randn(3, 256).to(torch.bfloat16)
    for e, w_q in enumerate((small, large)):
        out = _run(x, expert(stacked, e), wo.WeightOnlyConfig(16, 16, 1))
        assert_matches(out.float(), _reference(x, w_q), torch.bfloat16)
