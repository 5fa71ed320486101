"""The large-M weight-only designs (``tilemm.kernels.hopper_weight_only_large``) on the CPU: the fused
persistent kernel's tile code through the NumPy model of cuTile (tests/_emulator.py), the two-pass
decode + GEMM in chunks, and the plan table."""

from __future__ import annotations

import pytest
import torch

from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4
from tilemm.kernels import weight_only_kernels as wo
from tilemm.kernels import hopper_weight_only_large as wl
from tilemm.packed import prepack

from _emulator import LaunchProxy, TileEmulator, assert_matches
from test_weight_only import _reference, quantized_weight

FORMATS = [MXFP4, NVFP4, MXFP8_E4M3, MXFP8_E5M2]
IDS = [f.name for f in FORMATS]


@pytest.fixture
def emulated(monkeypatch):
    emu = TileEmulator()
    monkeypatch.setattr(wl, "ct", LaunchProxy(emu))
    monkeypatch.setattr(wo, "ct", LaunchProxy(emu))
    return emu


def _weight(fmt, n, k, seed):
    return quantized_weight(fmt, n, k, seed=seed, scale_bytes=(105, 122) if fmt.is_mx else (1, 0x50))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_fused_kernel_matches_reference(emulated, fmt):
    # M = 37 and N = 50 leave partial tiles on both sides; K = 1344 is 5.25 4-bit K tiles (10.5 8-bit
    # ones): the last reads zero words and zero-padded x. 3 x 4 output tiles on 5 persistent blocks
    # (some take two tiles, in grouped order with GROUP_SIZE_M 2), then on more blocks than tiles;
    # one MMA per plane and one per K tile (cat).
    m, n, k = 37, 50, 1344
    w_q = _weight(fmt, n, k, seed=7)
    packed = prepack(w_q)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(8)) * 3).to(torch.bfloat16)
    bias = torch.randn(n)
    for cfg, sms in ((wl.LargeConfig("fused", 16, 16, group_size_m=2), 5),
                     (wl.LargeConfig("fused", 16, 16, latency_w=3, latency_x=2), 64),
                     (wl.LargeConfig("fused", 16, 16, cat=1), 5)):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        wl.launch(x, packed.words, packed.scale_t, packed.constants, bias, out, packed.layout, cfg, sms, None)
        assert_matches(out.float(), _reference(x, w_q, bias), torch.bfloat16)


def test_fused_kernel_with_alpha_and_fp16_x(emulated):
    """An alpha tensor replaces the weight's epilogue factor; fp16 x is split exactly into bf16 parts."""
    m, n, k = 20, 24, 512
    w_q = _weight(MXFP4, n, k, seed=3)
    packed = prepack(w_q)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    out = torch.empty((m, n), dtype=torch.float16)
    alpha = packed.constants[0:1] * 0.5
    wl.launch(x, packed.words, packed.scale_t, packed.constants, torch.zeros(n), out, packed.layout,
              wl.LargeConfig("fused", 16, 16), 3, None, alpha)
    assert_matches(out.float(), _reference(x, w_q) * 0.5, torch.float16)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4, MXFP8_E4M3], ids=["mxfp4", "nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("chunk", [0, 32, 48])
def test_decode_gemm_matches_reference(emulated, fmt, chunk):
    """Two passes: the weight decoded to bf16 (all at once, or 32 / 48 rows at a time, the last chunk
    partial), each chunk multiplied into its output columns, alpha (2^E * decode scale) in the GEMM."""
    m, n, k = 5, 100, 320
    w_q = _weight(fmt, n, k, seed=11)
    packed = prepack(w_q)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    wl.decode_gemm(x, packed.words, packed.scale_t, packed.constants, packed.alpha_host, out, packed.layout,
                   k, chunk, None)
    assert_matches(out.float(), _reference(x, w_q), torch.bfloat16)


def test_plan_table():
    """Below the table's first M: None (the small-M plan); then the last row whose M the problem
    reaches; a table can be passed in (the sweep's printed one)."""
    mx4, mx8 = wo.LAYOUTS["mxfp4"], wo.LAYOUTS["mxfp8_e4m3"]
    first = wl.PLAN["4bit"][0][0]
    assert wl.plan(first - 1, 4096, 4096, mx4) is None
    assert wl.plan(first, 4096, 4096, mx4) == wl.PLAN["4bit"][0][1]
    assert wl.plan(1 << 20, 4096, 4096, mx8) == wl.PLAN["8bit"][-1][1]
    table = {"4bit": ((64, wl.LargeConfig("decode", chunk=0)),), "8bit": ()}
    assert wl.plan(64, 1, 1, mx4, table).kind == "decode" and wl.plan(10 ** 6, 1, 1, mx8, table) is None
    with pytest.raises(ValueError, match="kind must be"):
        wl.LargeConfig("other")
    # A fused config that would leave more than half of the SMs idle gives way to the small-M plan.
    fused = {"4bit": ((256, wl.LargeConfig("fused", 256, 128)),), "8bit": ()}
    assert wl.plan(256, 1024, 4096, mx4, fused, sms=132) is None  # 8 tiles
    assert wl.plan(256, 14336, 4096, mx4, fused, sms=132) == fused["4bit"][0][1]  # 112 tiles
    assert wl.first_m(mx4, fused) == 256 and wl.first_m(mx8, fused) > 1 << 40


@pytest.mark.parametrize("kind", ["fused", "decode"])
def test_runner_dispatches_through_the_table(emulated, monkeypatch, kind):
    """``WeightOnlyRunner`` takes the design the table names for bf16 x (here from M = 16 on, with
    small tiles so that the emulator is quick); below the table's first row, the small-M kernel."""
    import tilemm.weight_only as wol

    cfg = wl.LargeConfig("fused", 16, 16) if kind == "fused" else wl.LargeConfig("decode", chunk=32)
    monkeypatch.setattr(wl, "PLAN", {"4bit": ((16, cfg),), "8bit": ()})
    monkeypatch.setattr(wol, "stream_handle", lambda device: 0)
    monkeypatch.setattr(wol, "family", lambda device: wol.Family.HOPPER)
    calls = []
    for name in ("launch", "decode_gemm"):
        original = getattr(wl, name)
        monkeypatch.setattr(wl, name, (lambda f, nm: lambda *a, **k: (calls.append(nm), f(*a, **k))[1])(original, name))
    w_q = _weight(MXFP4, 40, 512, seed=9)
    runner = wol.WeightOnlyRunner(prepack(w_q), None)
    runner._sms = 4
    for m in (20, 5):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        assert_matches(runner(x).float(), _reference(x, w_q), torch.bfloat16)
    assert calls == ["launch" if kind == "fused" else "decode_gemm"]
