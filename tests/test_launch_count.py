"""Kernel launches per eager call, with ``ct.launch`` stubbed (no GPU): the Hopper block-scaled matmul
up to M = 16 and ``quantize_nvfp4`` of an activation are one launch each, and the launcher runs no
torch kernel besides (no fill, no host-side multiply of NVFP4's decode scales). The bit-identity of the
one-launch forms is checked on the emulator (tests/test_hopper_emulated.py); tests/test_small_batch_gpu.py
counts the kernels on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import cuda.tile as ct
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tilemm.formats import MXFP4, MXFP8_E4M3, NVFP4
from tilemm.kernels import hopper_block_scaled as hbs
from tilemm.kernels import quantize_kernels as qk
from tilemm.matmul import BlockScaledProblem

#: torch operations a launcher may run per call: views and the output's allocation (no compute).
_VIEWS = {"view.default", "slice.Tensor", "alias.default", "reshape.default", "_reshape_alias.default",
          "transpose.int", "unsqueeze.default", "as_strided.default", "expand.default", "t.default"}
_ALLOCATIONS = {"empty.memory_format"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _Stub:
    """cuda.tile with ``launch`` recording (grid, kernel, args) instead of running."""

    def __init__(self, module):
        self._ct = module.ct
        self.launches = []

    def launch(self, stream, grid, kernel, args):
        self.launches.append((grid, kernel, args))

    def __getattr__(self, name):
        return getattr(self._ct, name)


def _problem(fmt, m, n, k, swizzled):
    ks = k // fmt.block
    data = torch.zeros((1, m, fmt.data_k(k)), dtype=torch.uint8)
    weight = torch.zeros((1, n, fmt.data_k(k)), dtype=torch.uint8)
    if swizzled:
        sa = torch.zeros((1, -(-m // 128), -(-ks // 4), 32, 16), dtype=torch.uint8)
        sb = torch.zeros((1, -(-n // 128), -(-ks // 4), 32, 16), dtype=torch.uint8)
    else:
        sa, sb = torch.zeros((1, m, ks), dtype=torch.uint8), torch.zeros((1, n, ks), dtype=torch.uint8)
    if not fmt.is_packed:
        data, weight = data.view(fmt.data_dtype), weight.view(fmt.data_dtype)
    scales = (torch.tensor(0.5), torch.tensor(0.25)) if fmt is NVFP4 else None
    return BlockScaledProblem(fmt=fmt, a=data, a_scale=sa, b=weight, b_scale=sb, swizzled=swizzled,
                              out=torch.empty((1, m, n), dtype=torch.bfloat16), bias=None,
                              alpha=torch.tensor(0.75), global_scales=scales)


@pytest.mark.parametrize("swizzled", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("fmt", [MXFP8_E4M3, MXFP4, NVFP4], ids=["mxfp8", "mxfp4", "nvfp4"])
def test_hopper_block_scaled_call_is_one_launch(monkeypatch, fmt, m, swizzled):
    # N = K = 4096 on 132 SMs: the plan splits K (few output tiles); the call is still one launch.
    stub = _Stub(hbs)
    monkeypatch.setattr(hbs, "ct", stub)
    monkeypatch.setattr(hbs, "num_sms", lambda device: 132)
    problem = _problem(fmt, m, 4096, 4096, swizzled)
    prepared = hbs.Prepared(problem)
    assert prepared.direct and prepared.cfg.split_k > 1 and not prepared.cfg.x16
    prepared.run(problem, 5)  # the first call of a stream sets up its persistent workspace
    stub.launches.clear()
    with _Ops() as ops:
        prepared.run(problem, 5)
    [(grid, kernel, args)] = stub.launches
    assert kernel is prepared.kernel and grid == prepared.grid
    assert set(ops.names) <= _VIEWS, ops.names  # no fill, no allocation, no multiply
    gx, gy = args[6], args[7]
    if fmt is NVFP4:  # the decode scales reach the kernel as they are, multiplied there
        assert (float(gx), float(gy)) == (0.5, 0.25)
    partial, counters = args[9], args[10]
    assert partial.shape == (prepared.cfg.split_k, m, 4096) and counters.dtype == torch.int32


def test_hopper_block_scaled_unsplit_call_is_one_launch(monkeypatch):
    stub = _Stub(hbs)
    monkeypatch.setattr(hbs, "ct", stub)
    monkeypatch.setattr(hbs, "num_sms", lambda device: 132)
    problem = _problem(MXFP4, 16, 65536, 1024, True)
    prepared = hbs.Prepared(problem)
    assert prepared.cfg.split_k == 1
    prepared.run(problem, 5)
    assert len(stub.launches) == 1


@pytest.fixture
def quantize_recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(qk, "_launch_kernel", lambda device, grid, kernel, args: calls.append((grid, kernel, args)))
    monkeypatch.setattr(qk, "num_sms", lambda device: 132)
    monkeypatch.setattr(qk, "stream_handle", lambda device: 5)
    return calls


@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("m", [1, 16])
def test_quantize_nvfp4_of_an_activation_is_one_launch(quantize_recorded, m, swizzle):
    x = torch.zeros(m, 4096, dtype=torch.bfloat16)
    qk.quantize_nvfp4(x, None, swizzle)  # the first call of a stream sets up its zeroed sync words
    quantize_recorded.clear()
    with _Ops() as ops:
        qk.quantize_nvfp4(x, None, swizzle)
    [(grid, kernel, args)] = quantize_recorded
    assert grid[0] <= 132
    assert args[5] is True and args[6] is True  # FROM_AMAX, GRID_AMAX: the amax inside the launch
    assert args[3] is qk._grid_sync(x.device, 5)
    assert set(ops.names) <= _VIEWS | _ALLOCATIONS, ops.names


def test_quantize_nvfp4_of_a_weight_takes_the_amax_first(quantize_recorded):
    # 4096 x 4096: more tiles than SMs, so the grid cannot wait for itself: tensor_amax, then quantize.
    qk.quantize_nvfp4(torch.zeros(4096, 4096, dtype=torch.bfloat16), None, True)
    assert [c[1] for c in quantize_recorded] == [qk._kernel(qk._amax_kernel, qk.plan("amax")),
                                                 qk._kernel(qk._nvfp4_quantize_kernel,
                                                            qk.plan("nvfp4", swizzled=True))]
    assert quantize_recorded[1][2][6] is False


def test_quantize_nvfp4_with_a_given_scale_is_one_launch(quantize_recorded):
    qk.quantize_nvfp4(torch.zeros(16, 4096, dtype=torch.bfloat16), torch.tensor(0.01), True)
    [(_, _, args)] = quantize_recorded
    assert args[5] is False and args[6] is False


class _TwoPassGridAmax:
    """``_grid_amax`` for the sequential emulator, which cannot wait for blocks that run later: a first
    launch collects every block's contribution (its results are discarded), the second hands each
    block their maximum, which is what the barrier gives on the GPU."""

    def __init__(self):
        self.contributions = []
        self.total = None

    def __call__(self, sync, bits):
        from _emulator import Tile

        if self.total is None:
            self.contributions.append(int(bits))
            return Tile(np.zeros(1, dtype=np.int64), ct.int32)
        return Tile(np.full(1, self.total, dtype=np.int64), ct.int32)


@pytest.mark.parametrize("swizzle", [False, True], ids=["logical", "swizzled"])
@pytest.mark.parametrize("shape", [(1, 512), (16, 512), (3, 40, 256)], ids=["1x512", "16x512", "3x40x256"])
def test_quantize_nvfp4_amax_in_the_launch_emulated(monkeypatch, shape, swizzle):
    # The one-launch quantize (its tile code on the NumPy model of cuTile) gives the reference's bits,
    # and those of the launch that reads a tensor amax computed beforehand; a NaN and an Inf included.
    from _emulator import LaunchProxy, TileEmulator
    from tilemm import quantize as tq

    emu = TileEmulator()
    monkeypatch.setattr(qk, "ct", LaunchProxy(emu))
    monkeypatch.setattr(qk, "num_sms", lambda device: 132)
    monkeypatch.setattr(qk, "stream_handle", lambda device: 5)
    grid_amax = _TwoPassGridAmax()
    monkeypatch.setattr(qk, "_grid_amax", grid_amax)
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(shape, generator=gen) * 4).to(torch.bfloat16)
    x.view(-1)[5] = float("nan")
    x.view(-1)[-2] = float("-inf")
    launches = []
    monkeypatch.setattr(qk, "_launch_kernel", lambda device, grid, kernel, args: (
        launches.append(args), emu.launch(None, grid, kernel, args)))
    qk.quantize_nvfp4(x, None, swizzle)  # the first pass
    grid_amax.total = max(grid_amax.contributions)
    launches.clear()
    one = qk.quantize_nvfp4(x, None, swizzle)
    assert len(launches) == 1 and launches[0][6] is True
    ref = tq._quantize_nvfp4_reference(x, None, swizzle)
    amax = ref.global_scale.new_tensor([grid_amax.total], dtype=torch.int32)
    two = qk.quantize_nvfp4(x, None, swizzle, amax=amax)
    magnitudes = x.float().abs()
    assert torch.equal(torch.tensor(grid_amax.total, dtype=torch.int32).view(torch.float32),
                       magnitudes[magnitudes.isfinite()].max())  # NVFP4's amax: over the finite elements
    for got, other, want in zip(one, two, ref):
        got, other, want = (t.reshape(-1).view(torch.uint8) for t in (got, other, want))
        assert torch.equal(got, want) and torch.equal(other, want)
