"""The NVFP4 quantizer kernels' tile code on the CPU (tests/_emulator.py), against the reference.

Inputs with NaN, +Inf and -Inf: the amax pass takes the maximum over the finite elements, a block
holding a non-finite value gets the NaN scale (0x7F), and every other byte equals the reference's
(docs/numerics.md, "NVFP4"). This checks the kernels' index arithmetic and numerics, not cuTile's
compiler or the hardware (``pytest -m gpu tests/test_quantize_gpu.py tests/test_small_batch_gpu.py``
does that on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from _emulator import TileEmulator
from tilemm.kernels import quantize_kernels as qk
from tilemm.quantize import _quantize_nvfp4_reference, dequantize_nvfp4

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
               (x3, data, scale, glob, g_out, not given, False, False, TILE_R, TILE_K))
    ref = _quantize_nvfp4_reference(x, gs, False)
    assert torch.equal(data[0], ref.data)
    assert torch.equal(scale[0], ref.scale.view(torch.uint8))
    assert torch.equal(g_out.reshape(()), ref.global_scale)
    if case != "finite":
        assert (scale == 0x7F).any()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("grid_amax", [False, True], ids=["amax_pass", "grid_amax"])
def test_nvfp4_fake_quant_kernel_matches_reference(case, grid_amax):
    # FakeQuant (the small-batch activation path) decodes what the quantizer stores: e2m1 * s_b, with
    # S_dec * alpha in AlphaOut. The grid-wide amax runs as one block (the emulator runs blocks one
    # after another, so a barrier over several would never open).
    emu = TileEmulator()
    x = _input(case, torch.bfloat16)
    r, k = x.shape
    if grid_amax:
        tile_r, tile_k, blocks = 32, 128, 1
        amax = torch.zeros(3, dtype=torch.int32)
    else:
        tile_r, tile_k, blocks = TILE_R, TILE_K, -(-r // TILE_R) * -(-k // TILE_K)
        amax = _emulated_amax(emu, x.unsqueeze(0))
    out = torch.full((r, k), NAN, dtype=torch.bfloat16)
    alpha = torch.tensor([3.0])
    alpha_out = torch.full((1,), NAN)
    emu.launch(None, (blocks, 1, 1), qk._fake_quant_kernel,
               (x, out, 0, amax, alpha, alpha_out, qk._E2M1, True, grid_amax, tile_r, tile_k))
    ref = _quantize_nvfp4_reference(x, None, False)
    expected = dequantize_nvfp4(ref.data, ref.scale, 1.0)  # e2m1 * s_b
    assert torch.equal(out.float().isnan(), expected.isnan())
    assert torch.equal(out.float().nan_to_num(), expected.nan_to_num())
    assert alpha_out.item() == (ref.global_scale * alpha).item()  # fp32 product
    if grid_amax:
        assert amax.tolist() == [0, 0, 0]  # left zeroed for the next launch
