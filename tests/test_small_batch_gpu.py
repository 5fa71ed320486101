"""A block-scaled ``tilemm.nn.Linear`` at small batch on Hopper: the activation decoded once
(``quantize_kernels.FakeQuant``), bit for bit what the quantizers store, then the weight-only kernel;
against the block-scaled path and an fp64 oracle, in a CUDA graph, and the kernels per eager call."""

from __future__ import annotations

import pytest
import torch

import tilemm
from tilemm.formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4
from tilemm.kernels.quantize_kernels import FakeQuant

from _gpu import capture, kernels_per_call, requires_gpu
from test_weight_only_gpu import _model

pytestmark = requires_gpu

DEV = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3 + 1e-5, torch.float16: 1e-3 + 1e-5}


def _activation(m, k, dtype, seed):
    """Rows whose 16-element groups span 2^-20 .. 2^20 (fp16: 2^-8 .. 2^8), with a zero block, a NaN and
    an Inf."""
    g = torch.Generator().manual_seed(seed)
    span = 8 if dtype == torch.float16 else 20
    powers = torch.exp2(torch.randint(-span, span + 1, (m, k // 16, 1), generator=g).float())
    x = torch.randn(m, k, generator=g) * powers.repeat_interleave(16, dim=-1).reshape(m, k)
    x[0, :32] = 0.0
    if m > 2:
        x[1, 40] = float("nan")
        x[2, 70] = float("inf")
    return x.to(dtype).to(DEV)


def _same(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out (bf16) holds exactly ref's values (fp32, each a bf16 number), NaN where ref is NaN."""
    ref = ref.float()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(ref[~nan].to(torch.bfloat16).float(), ref[~nan])  # ref is a bf16 number
    assert torch.equal(out.float()[~nan], ref[~nan])


# K = 288: 9 MX blocks / 18 NVFP4 blocks, one whole and one partial 256-column tile. NVFP4's tensor
# amax: up to 16 rows of K = 288, and one row of K = 14336 (four blocks), every block loads all of x;
# 40 rows, the grid-wide barrier; K = 36864 with 3 rows (144 tiles, more than the H100's 132 SMs),
# tensor_amax first.
@pytest.mark.parametrize("m,k", [(1, 288), (5, 288), (16, 288), (40, 288), (1, 14336), (3, 36864)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fmt,rounding", [(MXFP4, "rceil"), (MXFP4, "floor"), (MXFP8_E4M3, "rceil"),
                                          (MXFP8_E4M3, "floor"), (MXFP8_E5M2, "rceil"), (NVFP4, None)],
                         ids=["mxfp4", "mxfp4_floor", "e4m3", "e4m3_floor", "e5m2", "nvfp4"])
def test_fake_quant_is_the_quantizers_decode(fmt, rounding, dtype, m, k):
    x = _activation(m, k, dtype, seed=m)
    alpha = torch.tensor([3.0], device=DEV)
    out, alpha_out = FakeQuant(fmt, rounding, alpha).run(x, torch.cuda.current_stream())
    assert out.dtype == torch.bfloat16 and out.shape == (m, k)
    if fmt is NVFP4:
        q = tilemm.quantize_nvfp4(x)
        _same(out, tilemm.NVFP4Tensor(q.data, q.scale, torch.ones((), device=DEV)).dequantize())
        assert torch.equal(alpha_out, (q.global_scale * alpha).reshape(1))
    else:
        q = (tilemm.quantize_mxfp4(x, rounding=rounding) if fmt is MXFP4 else
             tilemm.quantize_mxfp8(x, rounding=rounding, elem_dtype=fmt.data_dtype))
        _same(out, q.dequantize())
        assert alpha_out is None


def _oracle(x, layer):
    """fp64 product of the quantized activation and weight, decoded exactly."""
    xq = layer._options.quantize_activation(x).dequantize().double()
    out = xq @ layer.dequantize_weight().double().T
    return out + layer.bias.double()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m", [1, 7, 16, 100])
def test_small_batch_matches_the_block_scaled_path(fmt, dtype, m):
    torch.manual_seed(m)
    lin = torch.nn.Linear(1056, 200, device=DEV)  # K: not a multiple of the weight tile; N: a partial tile
    layer = tilemm.nn.Linear.from_float(lin, fmt)
    x = torch.randn(m, 1056, device=DEV, dtype=dtype)
    out = layer(x)
    assert layer._runner.runner is not None  # the small-batch path ran
    assert out.dtype == dtype and out.shape == (m, 200)
    ref = _oracle(x, layer)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err
    blocked = tilemm.linear(layer._options.quantize_activation(x), layer.quantized_weight(), bias=layer.bias,
                            out_dtype=dtype)
    err_blocked = ((blocked.double() - ref).norm() / ref.norm()).item()
    assert err <= max(2 * err_blocked, 1e-6), (err, err_blocked)


def test_small_batch_follows_a_new_weight():
    lin = torch.nn.Linear(512, 64, device=DEV)
    layer = tilemm.nn.Linear.from_float(lin, "mxfp4")
    x = torch.randn(2, 512, device=DEV)
    before = layer(x)
    other = tilemm.nn.Linear.from_float(torch.nn.Linear(512, 64, device=DEV), "mxfp4")
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x), other(x))
    assert not torch.equal(layer(x), before)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
def test_small_batch_in_a_cuda_graph(fmt):
    net = _model(fmt, weight_only=False)
    x = torch.randn(4, 512, device=DEV, dtype=torch.bfloat16)
    g, static_x, static_out = capture(net, x)
    static_x.copy_(x * 2)
    g.replay()
    assert torch.equal(static_out, net(x * 2))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("m", [1, 16])
def test_an_eager_block_scaled_call_launches_at_most_two_kernels(fmt, m):
    # The activation's fake quantization and the weight-only kernel; where the weight-only plan takes
    # the fused kernel's K split (here NVFP4 at 16 rows; MXFP4 takes the stacked small-M kernel there
    # since its plan changed), that is two launches (the partial tiles, then their sum).
    from tilemm.kernels import hopper_weight_only_large as wl
    from tilemm.kernels.weight_only_kernels import LAYOUTS

    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(4096, 4096, device=DEV, dtype=torch.bfloat16), fmt)
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    kernels = kernels_per_call(lambda: layer(x))
    large = wl.plan(m, 4096, 4096, LAYOUTS[{"mxfp8": "mxfp8_e4m3"}.get(fmt, fmt)])
    split = large is not None and large.kind == "fused" and large.split_k > 1
    assert 1 <= len(kernels) <= 2 + split, kernels


def test_layers_sharing_the_activation_scratch(monkeypatch):
    # Both-sides layers of several formats and widths, called back to back on one stream: they share
    # the stream's activation scratch (started empty, so that it grows on the way from 1 to 100 rows
    # while launches are queued), and each output is the bits of the same call made alone, the GPU
    # idle before and after it.
    from tilemm.kernels import quantize_kernels
    torch.manual_seed(0)
    specs = [("nvfp4", 512, 256), ("mxfp4", 2048, 128), ("fp8", 256, 384), ("mxfp8", 1056, 200)]
    layers = [tilemm.nn.Linear.from_float(torch.nn.Linear(k, n, device=DEV, dtype=torch.bfloat16), fmt)
              for fmt, k, n in specs]
    calls = [(layer, torch.randn(m, k, device=DEV).to(torch.bfloat16))
             for m in (1, 100, 16, 1) for layer, (_, k, _) in zip(layers, specs)]
    alone = []
    for layer, x in calls:
        torch.cuda.synchronize()
        alone.append(layer(x).clone())
        torch.cuda.synchronize()
    monkeypatch.setattr(quantize_kernels, "_SCRATCH", {})
    together = [layer(x) for layer, x in calls]
    torch.cuda.synchronize()
    for (layer, x), a, b in zip(calls, alone, together):
        assert torch.equal(a, b), (layer.format, x.shape)
