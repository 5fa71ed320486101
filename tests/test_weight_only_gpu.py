"""The weight-only kernel on the GPU: against the CPU path on the same prepacked weight, inside CUDA
graphs and torch.compile, and the number of kernels an eager ``tilemm.nn.Linear`` call launches."""

from __future__ import annotations

import pytest
import torch

import tilemm
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4
from tilemm.kernels import weight_only_kernels as wo

from _gpu import capture, kernels_per_call, requires_gpu
from test_weight_only import quantized_weight

pytestmark = requires_gpu

DEV = torch.device("cuda")
FORMATS = [MXFP4, NVFP4, MXFP8_E4M3, MXFP8_E5M2]
IDS = [f.name for f in FORMATS]
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3 + 1e-5, torch.float16: 1e-3 + 1e-5}


def _oracle(x, w_q, bias):
    out = x.double() @ w_q.dequantize().double().T
    return out + bias.double() if bias is not None else out


def _check(out, ref, dtype):
    out64 = out.double().cpu()
    assert torch.isfinite(out64).all()
    err = ((out64 - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
# M: one row, a partial 16-row tile, 33 (tile_m 64), 200 (tile_m 128, two M tiles), 600 (bf16: the
# large-M plan of hopper_weight_only_large, with a bias); N = 200: a partial
# weight tile and an unaligned scale row; K = 4128: not a multiple of tile_k, splits over many tiles.
@pytest.mark.parametrize("m", [1, 7, 33, 200, 600])
def test_matches_the_oracle(fmt, x_dtype, m):
    n, k = 200, 4128
    w_q = quantized_weight(fmt, n, k, seed=3, scale_bytes=(112, 124) if fmt.is_mx else (1, 0x50))
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
    bias = torch.randn(n)
    out = tilemm.linear(x.to(DEV), packed, bias=bias.to(DEV))
    assert out.dtype == x_dtype and out.shape == (m, n)
    _check(out, _oracle(x, w_q, bias), x_dtype)
    cpu = tilemm.linear(x, tilemm.prepack(w_q), bias=bias)
    _check(out, cpu.double(), x_dtype)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m", [1, 7, 200, 600])  # the FMA kernel, stacked, the MMA kernel, bf16's large-M path
def test_out_dtype(x_dtype, out_dtype, m):
    # linear(x, packed, out_dtype=...) rounds the fp32 sum once to out_dtype, on every path.
    n, k = 200, 4128
    w_q = quantized_weight(NVFP4, n, k, seed=3, scale_bytes=(1, 0x50))
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
    bias = torch.randn(n)
    out = tilemm.linear(x.to(DEV), packed, bias=bias.to(DEV), out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    _check(out, _oracle(x, w_q, bias), out_dtype)


_STACKED = [wo.WeightOnlyConfig(tm, tn, 1, warps, occupancy, cat=1, stack=stack)
            for tm, shapes in wo._STACKED.items() for tn, stack, warps, occupancy in shapes]


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("cfg", _STACKED, ids=[c.name for c in _STACKED])
def test_stacked_configs_match_the_oracle(fmt, x_dtype, cfg):
    """Every stacked config ``plan`` can pick, forced on a small problem: M = 3 (and 13 and 29 for
    tile_m 16: a partial tile, then two M tiles, the second partial) of a partial tile, N = 200 over
    partial blocks, K = 4128 (a partial last stack)."""
    n, k = 200, 4128
    w_q = quantized_weight(fmt, n, k, seed=6, scale_bytes=(112, 124) if fmt.is_mx else (1, 0x50))
    packed = tilemm.prepack(w_q).to(DEV)
    bias = torch.randn(n)
    for m in (3, 13, 29) if cfg.tile_m == 16 else (3,):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
        out = torch.empty(m, n, device=DEV, dtype=x_dtype)
        wo.launch(x.to(DEV), packed.words, packed.scale_t, packed.constants, bias.to(DEV), out,
                  packed.layout, cfg)
        _check(out, _oracle(x, w_q, bias), x_dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n,k", [(200, 4128), (8192, 1024), (1024, 4096)])
def test_one_row_on_the_mma_kernel(monkeypatch, fmt, x_dtype, n, k):
    """``M1_KERNEL = "mma"``: one row of x through ``tilemm.linear`` on the MMA kernel (the config of
    ``plan(..., m1_kernel="mma")``: narrow blocks with a K split, wide blocks), against the oracle and
    the CPU path."""
    monkeypatch.setattr(wo, "M1_KERNEL", "mma")
    w_q = quantized_weight(fmt, n, k, seed=9, scale_bytes=(112, 124) if fmt.is_mx else (1, 0x50))
    packed = tilemm.prepack(w_q).to(DEV)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert not wo.plan(1, n, k, packed.layout, sms).gemv
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(10)).to(x_dtype)
    bias = torch.randn(n)
    out = tilemm.linear(x.to(DEV), packed, bias=bias.to(DEV))
    _check(out, _oracle(x, w_q, bias), x_dtype)
    _check(out, tilemm.linear(x, tilemm.prepack(w_q), bias=bias).double(), x_dtype)


@pytest.mark.parametrize("m", [4, 16])
def test_plan_picks_stacked_k_tiles_at_llm_widths(m):
    """N = 8192: the plan's stacked config, through ``tilemm.linear``, against the oracle."""
    n, k = 8192, 1024
    w_q = quantized_weight(MXFP4, n, k, seed=7)
    packed = tilemm.prepack(w_q).to(DEV)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert wo.plan(m, n, k, packed.layout, sms).stack > 1
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    _check(tilemm.linear(x.to(DEV), packed), _oracle(x, w_q, None), torch.bfloat16)


@pytest.mark.parametrize("split", [1, 2, 8])
def test_every_split_gives_the_same_bits_per_split(split):
    """Split-K sums its partials in a fixed order: a config's result is the same on every call."""
    w_q = quantized_weight(MXFP4, 256, 8192, seed=4)
    packed = tilemm.prepack(w_q).to(DEV)
    x = torch.randn(16, 8192, device=DEV, dtype=torch.bfloat16)
    cfg = wo.WeightOnlyConfig(16, 128, split)
    bias = torch.zeros(256, device=DEV)
    outs = []
    for _ in range(3):
        out = torch.empty(16, 256, device=DEV, dtype=torch.bfloat16)
        wo.launch(x, packed.words, packed.scale_t, packed.constants, bias, out, packed.layout, cfg)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    _check(outs[0], _oracle(x.cpu(), w_q, None), torch.bfloat16)


def test_nan_scale_and_large_scales():
    w_q = quantized_weight(MXFP4, 128, 512, seed=5, scale_bytes=(120, 150))
    scale = w_q.scale.view(torch.uint8).clone()
    scale[7, 3] = 255
    w_q = tilemm.MXFP4Tensor(w_q.data, scale.view(torch.float8_e8m0fnu))
    packed = tilemm.prepack(w_q)
    assert packed.exponent > 0
    x = torch.randn(3, 512)
    out = tilemm.linear(x.to(DEV), packed.to(DEV)).cpu()
    ref = _oracle(x, w_q, None)
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan()[:, 7].all()
    keep = ~ref.isnan().any(0)
    _check(out[:, keep], ref[:, keep], torch.float32)


def _model(fmt, weight_only):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    net = net.to(DEV, torch.bfloat16)
    return tilemm.quantize_model(net, fmt, weight_only=weight_only)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("m", [1, 4], ids=["fma_kernel", "mma_kernel"])
def test_cuda_graph_and_compile(fmt, m):
    # A fresh Dynamo cache: each case compiles new layers, and under pytest-xdist one worker can run
    # enough cases to pass Dynamo's recompile limit for the shared forward code objects.
    torch._dynamo.reset()
    net = _model(fmt, True)
    x = torch.randn(m, 512, device=DEV, dtype=torch.bfloat16)
    eager = net(x)
    g, _, static_out = capture(net, x)
    g.replay()
    assert torch.equal(static_out, eager)
    compiled = torch.compile(net, fullgraph=True)
    assert torch.equal(compiled(x), eager)
    reduce_overhead = torch.compile(net, mode="reduce-overhead")
    for _ in range(3):
        out = reduce_overhead(x)
    assert torch.equal(out, eager)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
def test_an_eager_weight_only_call_launches_at_most_two_kernels(fmt):
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(4096, 4096, device=DEV, dtype=torch.bfloat16), fmt,
                                        weight_only=True)
    x = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    kernels = kernels_per_call(lambda: layer(x))
    assert 1 <= len(kernels) <= 2, kernels
