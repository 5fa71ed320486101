"""The quantizer kernels' tile code on the CPU (tests/_emulator.py), against the reference.

NVFP4 inputs with NaN, +Inf and -Inf: the amax pass takes the maximum over the finite elements, a
block holding a non-finite value gets the NaN scale (0x7F), and every other byte equals the
reference's (docs/numerics.md, "NVFP4"). MXFP8 / MXFP4: every e8m0 scale byte from 0 to 255 that a
block can get, through the quantize kernel and the fake-quant kernel (the shared e8m0 / e2m1 decode of
``kernels._common``). This checks the kernels' index arithmetic and numerics, not cuTile's
compiler or the hardware (``pytest -m gpu tests/test_quantize_gpu.py tests/test_small_batch_gpu.py``
does that on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from _emulator import TileEmulator
from tilemm.kernels import quantize_kernels as qk
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2
from tilemm.quantize import (_quantize_mxfp4_reference, _quantize_mxfp8_reference, _quantize_nvfp4_reference,
                             dequantize_mxfp4, dequantize_mxfp8, dequantize_nvfp4)

INF, NAN = float("inf"), float("nan")
TILE_R, TILE_K = 16, 64  # small tiles: partial row and K tiles at the edges of a (20, 96) input


def _input(case: str, dtype) -> torch.Tensor:
    x = (torch.randn(20, 96, generator=torch.Generator().manual_seed(1)) * 1e-3).to(dtype)
    if case == "inf":
        x[3, 17] = INF
    elif case == "neg_inf":
        x[19, 95] = -INF
    elif case == "mixed":
        x[0, 0], x[7, 40], x[12, 80] = INF, NAN, -INF
    elif case == "all_nonfinite":
        x[:] = INF
        x[5, 5] = NAN
    return x


def _emulated_amax(emu, x3, blocks=3):
    partial = torch.zeros(qk.AMAX_PARTIALS, dtype=torch.int32)
    emu.launch(None, (blocks, 1, 1), qk._amax_kernel, (x3, partial[:blocks], False, False, TILE_R, TILE_K))
    return partial[:blocks].clone()


CASES = ["finite", "inf", "neg_inf", "mixed", "all_nonfinite"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("given", [False, True], ids=["amax", "given_scale"])
def test_nvfp4_kernel_matches_reference(case, dtype, given):
    emu = TileEmulator()
    x = _input(case, dtype)
    x3 = x.unsqueeze(0)
    r, k = x.shape
    gs = torch.tensor(2.0 ** -14, dtype=torch.float32) if given else None
    glob = gs.reshape(1) if given else _emulated_amax(emu, x3)
    data = torch.full((1, r, k // 2), 0xAA, dtype=torch.uint8)
    scale = torch.full((1, r, k // 16), 0xAA, dtype=torch.uint8)
    g_out = torch.full((1,), NAN, dtype=torch.float32)
    tiles = -(-r // TILE_R) * -(-k // TILE_K)
    emu.launch(None, (tiles, 1, 1), qk._nvfp4_quantize_kernel,
               (x3, data, scale, glob, g_out, not given, False, False, False, TILE_R, TILE_K))
    ref = _quantize_nvfp4_reference(x, gs, False)
    assert torch.equal(data[0], ref.data)
    assert torch.equal(scale[0], ref.scale.view(torch.uint8))
    assert torch.equal(g_out.reshape(()), ref.global_scale)
    if case != "finite":
        assert (scale == 0x7F).any()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("source", ["amax_pass", "grid_amax", "whole", "whole_blocks"])
def test_nvfp4_fake_quant_kernel_matches_reference(case, source):
    # FakeQuant (the small-batch activation path) decodes what the quantizer stores: e2m1 * s_b, with
    # S_dec * alpha in AlphaOut. The grid-wide amax runs as one block (the emulator runs blocks one
    # after another, so a barrier over several would never open). "whole": every block loads all of x
    # for the amax, in the launch FakeQuant makes for this x (one block) and in three blocks.
    emu = TileEmulator()
    x = _input(case, torch.bfloat16)
    r, k = x.shape
    whole_r = whole_k = 1
    amax = torch.zeros(3, dtype=torch.int32)
    if source == "grid_amax":
        amax_source, tile_r, tile_k = qk.AMAX_GRID, 32, 128
    elif source == "amax_pass":
        amax_source, tile_r, tile_k = qk.AMAX_PARTIALS, TILE_R, TILE_K
        amax = _emulated_amax(emu, x.unsqueeze(0))
    else:
        amax_source = qk.AMAX_WHOLE
        whole_r, whole_k, tile_r, tile_k = qk._whole_tiles(r, k)
        assert (whole_r, whole_k, tile_r, tile_k) == (32, 128, 32, 128)
        if source == "whole_blocks":
            tile_k = 32
    blocks = -(-r // tile_r) * -(-k // tile_k)
    if source == "whole_blocks":
        assert blocks == 3  # no block's own tile holds all of x
    out = torch.full((r, k), NAN, dtype=torch.bfloat16)
    alpha = torch.tensor([3.0])
    alpha_out = torch.full((1,), NAN)
    emu.launch(None, (blocks, 1, 1), qk._fake_quant_kernel,
               (x, out, 0, amax, alpha, alpha_out, qk._E2M1, True, amax_source, whole_r, whole_k, tile_r, tile_k))
    ref = _quantize_nvfp4_reference(x, None, False)
    expected = dequantize_nvfp4(ref.data, ref.scale, 1.0)  # e2m1 * s_b
    assert torch.equal(out.float().isnan(), expected.isnan())
    assert torch.equal(out.float().nan_to_num(), expected.nan_to_num())
    assert alpha_out.item() == (ref.global_scale * alpha).item()  # fp32 product
    assert amax.tolist() == [0, 0, 0] or source == "amax_pass"  # the barrier's words left zeroed


@pytest.mark.parametrize("case", CASES)
def test_tile_amax_slots_exchanged_quantize_as_the_tensor_amax(monkeypatch, case):
    # The row-wise tensor-parallel small-batch path: each rank's K-slice's per-tile maxima
    # (``tile_amax``) in as many slots as the widest slice has tiles (a narrower slice's extra blocks
    # write 0), combined slot by slot as the MAX all-reduce does, make the fake-quantize of every slice
    # exactly what the whole tensor's amax makes it. Slices of 80 and 16 columns: 4 and 2 tiles.
    from _emulator import LaunchProxy

    emu = TileEmulator()
    monkeypatch.setattr(qk, "ct", LaunchProxy(emu))
    monkeypatch.setattr(qk, "AMAX_CONFIG", qk.QuantizeConfig(TILE_R, TILE_K))
    x = _input(case, torch.bfloat16)
    slices = [x[:, :80].contiguous(), x[:, 80:].contiguous()]
    slots = qk.amax_slots(20, 80)
    assert slots == 4 and qk.amax_slots(20, 16) == 2
    maxima = [qk.tile_amax(s, slots, None) for s in slices]
    assert maxima[1][2:].tolist() == [0, 0]
    exchanged = torch.maximum(*maxima)
    whole = _emulated_amax(emu, x.unsqueeze(0)).amax().reshape(1)  # the amax every rank had before
    assert exchanged.max() == whole[0]
    for s in slices:
        r, k = s.shape
        blocks = -(-r // TILE_R) * -(-k // TILE_K)
        outs = []
        for amax in (exchanged, whole):
            out = torch.full((r, k), NAN, dtype=torch.bfloat16)
            alpha_out = torch.full((1,), NAN)
            emu.launch(None, (blocks, 1, 1), qk._fake_quant_kernel,
                       (s, out, 0, amax, torch.tensor([3.0]), alpha_out, qk._E2M1, True, qk.AMAX_PARTIALS, 1, 1,
                        TILE_R, TILE_K))
            outs.append((out.view(torch.int16), alpha_out.view(torch.int32)))
        assert all(torch.equal(a, b) for a, b in zip(*outs))


MX_FORMATS = [MXFP8_E4M3, MXFP8_E5M2, MXFP4]


def _mx_input(special: bool = True) -> torch.Tensor:
    """(20, 96): three 32-element blocks per row, each row at its own magnitude from 2^-140 (fp32
    subnormals: scale byte 0) to 2^126 (the largest bytes), and odd sizes so that row and K tiles are
    partial; with ``special``, a zero block, a -0.0 block, and +-Inf and NaN blocks (byte 255)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(20, 96, generator=gen)
    x = x * torch.pow(2.0, torch.linspace(-140 if special else -100, 126, 20)).reshape(20, 1)
    if special:
        x[1, :32] = 0.0
        x[2, 32:64] = -0.0
        x[4, 5], x[6, 70], x[8, 40] = float("inf"), float("-inf"), float("nan")
    return x


def _mx_reference(x, fmt, rounding):
    if fmt is MXFP4:
        return _quantize_mxfp4_reference(x, rounding, False)
    return _quantize_mxfp8_reference(x, fmt, rounding, False)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("fmt", MX_FORMATS, ids=lambda f: f.name)
def test_mx_kernel_matches_reference(fmt, rounding):
    # MXFP8 without zero or non-finite blocks, and in whole tiles (zero padding would make zero
    # blocks): the emulator cannot run the fp8 path's byte selects (a bit-cast back to the tile's own
    # float8 dtype). MXFP4 takes every block kind and partial tiles.
    emu = TileEmulator()
    x = _mx_input(special=fmt.is_packed)
    r, k = x.shape
    tile_r, tile_k = (TILE_R, TILE_K) if fmt.is_packed else (4, 32)
    ref = _mx_reference(x, fmt, rounding)
    data = torch.full((1, r, fmt.data_k(k)), 0xAA, dtype=torch.uint8)
    scale = torch.full((1, r, k // 32), 0xAA, dtype=torch.uint8)
    tiles = -(-r // tile_r) * -(-k // tile_k)
    emu.launch(None, (tiles, 1, 1), qk._mx_quantize_kernel,
               (x.unsqueeze(0), data if fmt.is_packed else data.view(fmt.data_dtype), scale,
                int(rounding == "floor"), fmt.element_code, False, False, tile_r, tile_k))
    assert torch.equal(scale[0], ref.scale.view(torch.uint8))
    assert torch.equal(data[0], ref.data.view(torch.uint8))
    if fmt.is_packed:
        assert {0, 255} <= set(scale.unique().tolist())


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("fmt", MX_FORMATS, ids=lambda f: f.name)
def test_mx_fake_quant_kernel_matches_reference(fmt, rounding):
    # dequantize(quantize(x)) in one pass, as bf16: the reference's fp32 decode rounded once to bf16.
    emu = TileEmulator()
    x = _mx_input().to(torch.bfloat16).float() * 1.0  # bf16 values: the small-batch path's activations
    r, k = x.shape
    ref = _mx_reference(x, fmt, rounding)
    if fmt is MXFP4:
        expected = dequantize_mxfp4(ref.data, ref.scale)
    else:
        expected = dequantize_mxfp8(ref.data, ref.scale)
    out = torch.full((r, k), float("nan"), dtype=torch.bfloat16)
    alpha = torch.tensor([3.0])
    emu.launch(None, (-(-r // TILE_R) * -(-k // TILE_K), 1, 1), qk._fake_quant_kernel,
               (x, out, int(rounding == "floor"), torch.zeros(1, dtype=torch.int32), alpha, alpha,
                fmt.element_code, False, qk.AMAX_PARTIALS, 1, 1, TILE_R, TILE_K))
    expected = expected.to(torch.bfloat16)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num().view(torch.int16), expected.nan_to_num().view(torch.int16))
