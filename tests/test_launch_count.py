"""Kernel launches per eager call, with ``ct.launch`` stubbed (no GPU): the Hopper block-scaled matmul
up to M = 16 and ``quantize_nvfp4`` of an activation are one launch each, and the launcher runs no
torch kernel besides (no fill, no host-side multiply of NVFP4's decode scales). Every public entry on
the CUDA route (``benchmarks/investigations/host_path.py``'s ``cuda_route``): its launches per call,
and that a repeated call, which skips the checks and the planning, launches exactly what the full
path launches for the same tensors. The bit-identity of the one-launch forms is checked on the
emulator (tests/test_hopper_emulated.py); tests/test_small_batch_gpu.py and
tests/test_host_path_gpu.py count the kernels and compare the bits on the GPU.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import cuda.tile as ct
import torch

import tilemm
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
    monkeypatch.setattr(qk, "_target", lambda device: "sm_90")
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


def _emulated_quantize(monkeypatch):
    """The quantize kernels on the NumPy model of cuTile (132 SMs, a stand-in stream), the in-launch
    grid amax run as two passes: (the emulator, the ``_TwoPassGridAmax``)."""
    from _emulator import LaunchProxy, TileEmulator

    emu = TileEmulator()
    monkeypatch.setattr(qk, "ct", LaunchProxy(emu))
    monkeypatch.setattr(qk, "num_sms", lambda device: 132)
    monkeypatch.setattr(qk, "stream_handle", lambda device: 5)
    grid_amax = _TwoPassGridAmax()
    monkeypatch.setattr(qk, "_grid_amax", grid_amax)
    return emu, grid_amax


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
    from tilemm import quantize as tq

    emu, grid_amax = _emulated_quantize(monkeypatch)
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


@pytest.mark.parametrize("m", [1, 16])
def test_quantize_fp8_per_tensor_of_an_activation_is_one_launch(quantize_recorded, m):
    x = torch.zeros(m, 4096, dtype=torch.bfloat16)
    qk.quantize_fp8(x, qk.FP8_E4M3, "tensor", False)
    quantize_recorded.clear()
    with _Ops() as ops:
        qk.quantize_fp8(x, qk.FP8_E4M3, "tensor", False)
    [(grid, kernel, args)] = quantize_recorded
    assert grid[0] <= 132 and args[8] is True  # GRID_AMAX: the amax inside the launch
    assert args[3] is qk._grid_sync(x.device, 5)
    assert set(ops.names) <= _VIEWS | _ALLOCATIONS, ops.names


def test_quantize_fp8_per_tensor_of_a_weight_takes_the_amax_first(quantize_recorded):
    qk.quantize_fp8(torch.zeros(4096, 4096, dtype=torch.bfloat16), qk.FP8_E4M3, "tensor", False)
    assert [c[1] for c in quantize_recorded] == [qk._kernel(qk._amax_kernel, qk.plan("amax")),
                                                 qk._kernel(qk._fp8_quantize_kernel, qk.plan("fp8_tensor"))]
    assert quantize_recorded[1][2][8] is False


@pytest.mark.parametrize("special", ["finite", "nan", "inf"])
@pytest.mark.parametrize("shape,axis", [((1, 512), -1), ((16, 384), -1), ((3, 40, 256), -1), ((256, 48), -2)],
                         ids=["1x512", "16x384", "3x40x256", "256x48-axis-2"])
def test_quantize_fp8_per_tensor_amax_in_the_launch_emulated(monkeypatch, shape, axis, special):
    # FP8 per tensor in one launch (its tile code on the NumPy model of cuTile) gives the reference's
    # bits and those of the launch that reads the amax taken first; its amax propagates NaN.
    from tilemm import quantize as tq

    emu, grid_amax = _emulated_quantize(monkeypatch)
    monkeypatch.setattr(qk, "_target", lambda device: "sm_90")
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(shape, generator=gen) * 4).to(torch.bfloat16)
    if special == "nan":
        x.view(-1)[7] = float("nan")
    elif special == "inf":
        x.view(-1)[-3] = float("-inf")
    source = x.mT if axis == -2 else x
    launches = []
    monkeypatch.setattr(qk, "_launch_kernel", lambda device, grid, kernel, args: (
        launches.append(args), emu.launch(None, grid, kernel, args)))
    qk.quantize_fp8(source, qk.FP8_E4M3, "tensor", False)  # the first pass
    grid_amax.total = max(grid_amax.contributions)
    launches.clear()
    one = qk.quantize_fp8(source, qk.FP8_E4M3, "tensor", False)
    assert len(launches) == 1 and launches[0][8] is True
    ref = tq._quantize_fp8_reference(source.contiguous(), qk.FP8_E4M3, "tensor", False)
    amax = torch.tensor([grid_amax.total], dtype=torch.int32)
    two = qk.quantize_fp8(source, qk.FP8_E4M3, "tensor", False, amax=amax.view(torch.float32))
    assert launches[1][8] is False
    if special == "nan":
        assert torch.isnan(amax.view(torch.float32)).all() and torch.isnan(one[1])
    else:
        assert amax.view(torch.float32).item() == x.float().abs().max().item()
    for got, other, want in zip(one, two, ref):
        got, other, want = (t.reshape(-1).view(torch.int8 if t.element_size() == 1 else torch.int32)
                            for t in (got, other, want))
        assert torch.equal(got, want) and torch.equal(other, want)


# --------------------------------------------------------------------------------------------------
# Every public entry on the CUDA route (CPU tensors made to take it, launches recorded, not run;
# benchmarks/investigations/host_path.py): the launches per call, and that a repeated call of a
# signature, which skips the checks and the planning, launches exactly what the full path launches.
# --------------------------------------------------------------------------------------------------

def _host_path():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "investigations" / "host_path.py"
    spec = importlib.util.spec_from_file_location("host_path", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOST_PATH = _host_path()


def _launch_form(launches, tensors, own_bytes=True):
    """What a call launched, independent of where its tensors happen to live: per argument, a tensor's
    shape, strides, dtype and which of ``tensors`` (the call's inputs and outputs) it views, by start
    address; a buffer of the library's own (e.g. a bias converted to fp32, a workspace) by its order
    of appearance, and its bytes unless it passes from one launch to the next (then it is scratch the
    first launch fills, or ``own_bytes`` is False); other arguments as they are."""
    starts = {t.data_ptr(): i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.numel()}
    own, launches_of = {}, {}
    for n, (_, _, args) in enumerate(launches):
        for a in args:
            if isinstance(a, torch.Tensor) and a.data_ptr() not in starts:
                own.setdefault(a.data_ptr(), len(own))
                launches_of.setdefault(a.data_ptr(), set()).add(n)
    form = []
    for grid, kernel, args in launches:
        described = []
        for a in args:
            if isinstance(a, torch.Tensor):
                ptr = a.data_ptr()
                if ptr in starts:
                    role = ("arg", starts[ptr])
                else:
                    scratch = len(launches_of[ptr]) > 1 or not own_bytes
                    role = ("own", own[ptr], None if scratch else bytes(a.contiguous().view(torch.uint8).numpy()))
                described.append((tuple(a.shape), a.stride(), a.dtype, role))
            else:
                described.append(("value", id(a) if hasattr(a, "_tensor") else a))
        form.append((grid, kernel, tuple(described)))
    return form


def _fresh(value):
    """value with every tensor copied to new memory (the same signature)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).copy_(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_fresh(v) for v in value))
    return value


def _flat(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [t for v in value for t in _flat(v)]
    return []


def _seeded_linear(k: int, n: int, seed: int, bias: bool = True):
    """(a bf16 torch.nn.Linear (k -> n) with normal weights (and bias) from ``seed``, the generator to
    draw inputs from next)."""
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin, gen


def _repeat_launches_as_the_full_path(call, args, launches_per_call, expect_prepared=True, own_bytes=True,
                                      forget=lambda: None, kept=lambda: (), target="sm_90"):
    """``call(*args)`` twice on new memory: the second, a prepared launch (unless ``expect_prepared`` is
    False: the entries that take the full path on every call), launches what the full path (the plan
    table emptied, and ``forget()`` called: a layer's own prepared calls dropped) launches for the same
    tensors (``own_bytes``: see ``_launch_form``). ``kept()``: prepared launches a module keeps itself;
    ``target``: the GPU whose route the calls take."""
    from tilemm import kernels

    launches = HOST_PATH.LAUNCHES
    with HOST_PATH.cuda_route(target):
        kernels.PLANS.clear()
        call(*args)  # the first call of the signature: checked, planned, its launch kept
        prepared = any(type(v).__name__ in ("_Launch", "_QuantizeLaunch", "_MoELinearLaunch", "_MoEExpertsLaunch")
                       for v in (*kernels.PLANS.values(), *kept()))
        again = tuple(_fresh(a) for a in args)
        launches.clear()
        out = call(*again)
        repeated = _launch_form(launches, [*_flat(again), *_flat(out)], own_bytes)
        assert len(launches) == launches_per_call
        kernels.PLANS.clear()
        forget()
        launches.clear()
        out = call(*again)
        full = _launch_form(launches, [*_flat(again), *_flat(out)], own_bytes)
        launches.clear()
    assert prepared == expect_prepared and repeated == full


def _quantized(m, n, k, fmt, swizzle):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    if fmt == "fp8_row":
        return tilemm.quantize_fp8(x, granularity="row"), tilemm.quantize_fp8(w, granularity="row")
    if fmt == "fp8_blocks":
        return tilemm.quantize_fp8(x, granularity=(1, 128)), tilemm.quantize_fp8(w, granularity=(128, 128))
    if fmt == "fp8_tensor":  # per tensor: the kernel reads each scale's one value
        return tilemm.quantize_fp8(x, granularity="tensor"), tilemm.quantize_fp8(w, granularity="tensor")
    if fmt == "fp8_mixed":
        return tilemm.quantize_fp8(x, granularity="row"), tilemm.quantize_fp8(w, granularity="tensor")
    q = getattr(tilemm, f"quantize_{fmt}")
    return q(x, swizzle=swizzle), q(w, swizzle=swizzle)


MATMUL_CASES = [("mxfp8", True), ("mxfp8", False), ("mxfp4", True), ("nvfp4", True), ("nvfp4", False),
                ("fp8_row", False), ("fp8_blocks", False), ("fp8_tensor", False), ("fp8_mixed", False)]


@pytest.mark.parametrize("m", [1, 16, 64])  # 64: the activation's dequantize launch comes first (x16)
@pytest.mark.parametrize("fmt,swizzle", MATMUL_CASES, ids=[f"{f}-{'swz' if s else 'log'}" for f, s in MATMUL_CASES])
def test_matmul_entries_repeat_the_full_launch(fmt, swizzle, m):
    xq, wq = _quantized(m, 256, 256, fmt, swizzle)
    x16 = m == 64 and not fmt.startswith("fp8")
    bias = torch.randn(256).to(torch.bfloat16)
    alpha = torch.tensor(0.5)
    _repeat_launches_as_the_full_path(lambda xq, wq, bias, alpha: tilemm.linear(xq, wq, bias=bias, alpha=alpha),
                                      (xq, wq, bias, alpha), 2 if x16 else 1)
    if fmt == "fp8_blocks":
        return
    if fmt.startswith("fp8"):
        def matmul(xq, wq, bias):
            return tilemm.fp8_matmul(xq.data, xq.scale, wq.data.t(), wq.scale.t(), bias=bias)
    elif fmt == "nvfp4":
        def matmul(xq, wq, bias):
            return tilemm.nvfp4_matmul(xq.data, xq.scale, wq.data.t(), wq.scale if swizzle else wq.scale.t(),
                                       global_scale_x=xq.global_scale, global_scale_y=wq.global_scale, bias=bias)
    else:
        def matmul(xq, wq, bias):
            fn = getattr(tilemm, f"{fmt}_matmul")
            return fn(xq.data, xq.scale, wq.data.t(), wq.scale if swizzle else wq.scale.t(), bias=bias)
    _repeat_launches_as_the_full_path(matmul, (xq, wq, None), 2 if x16 else 1)


def test_nvfp4_decode_scales_are_read_from_the_tensors_passed():
    # The prepared launch keeps the word of the last decode scale seen per operand (a weight's, passed on
    # every call); each call must still read the tensors it is given: the same objects, new ones, a
    # float64 scale (converted: a copy) and the kept one again after a change in place.
    from tilemm import kernels

    xq, wq = _quantized(1, 256, 256, "nvfp4", True)

    def read(gx, gy):
        launches = HOST_PATH.LAUNCHES
        launches.clear()
        tilemm.nvfp4_matmul(xq.data, xq.scale, wq.data.t(), wq.scale, global_scale_x=gx, global_scale_y=gy)
        (_, _, args), = launches
        return [a for a in args if isinstance(a, torch.Tensor) and a.shape == (1,) and a.dtype == torch.float32]

    gx, gy = xq.global_scale.clone(), wq.global_scale.clone()
    with HOST_PATH.cuda_route("sm_90"):
        kernels.PLANS.clear()
        read(gx, gy)
        for a, b in [(gx, gy), (gx.clone(), gy), (gx, gy.clone()), (gx.clone(), gy.clone()), (gx, gy)]:
            words = read(a, b)
            assert [w.data_ptr() for w in words[1:]] == [a.data_ptr(), b.data_ptr()]  # after alpha
        gx.mul_(2)  # in place: the kept word reads the new value
        assert read(gx, gy)[1].item() == gx.item()
        wide = gy.to(torch.float64)  # not fp32: a converted copy each call, never kept
        assert read(gx, wide)[2].item() == wide.item()
        wide.mul_(2)
        assert read(gx, wide)[2].item() == wide.item()
        kernels.PLANS.clear()


QUANTIZE_CASES = [("mxfp8", dict(swizzle=True)), ("mxfp8", dict(swizzle=False, elem_dtype=torch.float8_e5m2)),
                  ("mxfp4", dict(swizzle=True)), ("mxfp4", dict(swizzle=False, axis=-2)),
                  ("nvfp4", dict(swizzle=True)), ("nvfp4", dict(swizzle=False)),
                  ("fp8", dict(granularity="row")), ("fp8", dict(granularity=(1, 128))),
                  ("fp8", dict(granularity=(128, 128))), ("fp8", dict(granularity="tensor")),
                  ("fp8", dict(granularity="tensor", axis=-2)), ("fp8", dict(granularity="row", axis=-2))]


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("fmt,options", QUANTIZE_CASES, ids=[f"{f}-{o}" for f, o in QUANTIZE_CASES])
def test_quantizers_repeat_the_full_launch(fmt, options, m):
    # One launch each (FP8 per tensor takes its amax inside the launch), but FP8 per row along
    # axis=-2 (the column maxima first; a (K, 1) x is read as rows).
    x = torch.randn(m, 256).to(torch.bfloat16)
    if options.get("axis") == -2:
        x = torch.randn(256, m).to(torch.bfloat16)
    two = fmt == "fp8" and options["granularity"] == "row" and options.get("axis") == -2 and m > 1
    q = getattr(tilemm, f"quantize_{fmt}")
    _repeat_launches_as_the_full_path(lambda x: q(x, **options), (x,), 2 if two else 1)


@pytest.mark.parametrize("granularity", ["row", "tensor", (128, 128)], ids=["row", "tensor", "blocks"])
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_linear_layer_is_two_launches(granularity, m):
    # tilemm.nn.Linear, FP8 both sides: the activation's quantize and the matmul, and no torch kernel
    # besides the outputs' allocations (the bf16 bias is converted to fp32 once, not on every call).
    from tilemm import kernels

    lin, gen = _seeded_linear(256, 384, seed=5)
    layer = tilemm.nn.Linear.from_float(lin, "fp8", granularity=granularity)
    x = torch.randn(m, 256, generator=gen).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        kernels.PLANS.clear()
        layer(x)  # the full path, which prepares the layer's launches
        layer(x)  # the first prepared call: it takes its views of the stream's scratch once
        HOST_PATH.LAUNCHES.clear()
        with _Ops() as ops:
            layer(x)
        launches = list(HOST_PATH.LAUNCHES)
        HOST_PATH.LAUNCHES.clear()
    assert [k for _, k, _ in launches][0] is not launches[1][1] and len(launches) == 2
    assert set(ops.names) <= _VIEWS | _ALLOCATIONS, ops.names
    assert ops.names.count("empty.memory_format") == 1, ops.names  # the output; the quantized x is scratch
    bias = launches[1][2][6]  # the matmul's bias argument: the layer's, in fp32
    assert bias.dtype == torch.float32 and torch.equal(bias, lin.bias.float())


@pytest.mark.parametrize("granularity", ["row", "tensor", (128, 128)], ids=["row", "tensor", "blocks"])
@pytest.mark.parametrize("shape", [(1, 256), (16, 256), (2, 3, 256)], ids=["m1", "m16", "3d"])
def test_fp8_linear_layer_repeats_the_full_launch(granularity, shape):
    # The layer keeps its own prepared calls (the activation's quantize and the matmul on its weight):
    # a repeated call launches what the full path, with nothing prepared, launches for the same x.
    gen = torch.Generator().manual_seed(6)
    lin = torch.nn.Linear(256, 384, dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, "fp8", granularity=granularity)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)

    def forget():
        layer._runner = None

    _repeat_launches_as_the_full_path(layer, (x,), 2, forget=forget)
    with HOST_PATH.cuda_route():
        layer(x)
        assert type(layer._runner).__name__ == "_PreparedFP8" and all(layer._runner.calls.values())
        HOST_PATH.LAUNCHES.clear()


def test_a_prepared_fp8_layer_still_checks_what_changes():
    # A new buffer (another weight, a bias set to None) or an input the checks refuse is not served by
    # the prepared calls of the old one.
    lin = torch.nn.Linear(256, 128, dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, "fp8")
    x = torch.randn(4, 256).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        layer(x)
        layer(x)
        layer.bias = None
        HOST_PATH.LAUNCHES.clear()
        layer(x)
        assert HOST_PATH.LAUNCHES[1][2][6].abs().sum() == 0  # the matmul's bias: zeros now
        with pytest.raises(TypeError, match="input dtype must be"):
            layer(x.to(torch.float64))
        with pytest.raises(ValueError, match="input must be"):
            layer(torch.randn(4, 128).to(torch.bfloat16))
        HOST_PATH.LAUNCHES.clear()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_a_prepared_layer_follows_replaced_buffers(fmt):
    # Buffers assigned anew (layer.weight = ..., load_state_dict(assign=True)) between calls: the next
    # call rebuilds its prepared path from the new tensors (its key holds identities and versions,
    # never tensors to compare).
    lin = torch.nn.Linear(256, 128, dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, fmt)
    x = torch.randn(4, 256).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        layer(x)
        layer(x)
        old = layer._runner
        layer.weight = layer.weight.clone()
        layer.bias = layer.bias.clone()
        layer(x)
        layer(x)
        assert layer._runner is not old and layer._runner.tensors[0] is layer.weight
        assert layer._runner.tensors[-1] is layer.bias
        HOST_PATH.LAUNCHES.clear()


def _experts(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return tilemm.prepack(tilemm.quantize_mxfp4(torch.randn(8, n, k, generator=gen).to(torch.bfloat16)))


@pytest.mark.parametrize("tokens", [1, 16])  # 1: the per-pair design; 16 tokens of 8 experts: sorted
def test_moe_entries_repeat_the_full_launch(tokens):
    # moe_linear and MoEExperts.forward: a repeated eager call launches what the first one did (one
    # per-pair launch, or the routing and one grouped launch per projection).
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.arange(tokens) % 8, (torch.arange(tokens) + 3) % 8], dim=1).to(torch.int32)
    stacked = _experts(128, 256, 1)
    bias = torch.randn(8, 128, generator=gen).to(torch.bfloat16)
    _repeat_launches_as_the_full_path(lambda x, ids, bias: tilemm.moe_linear(x, stacked, ids, bias), (x, ids, bias),
                                      1 if tokens == 1 else 2)
    block = tilemm.moe.MoEExperts(_experts(2 * 64, 256, 2), _experts(256, 64, 3))
    weights = torch.rand(tokens, 2, generator=gen).to(torch.bfloat16)
    # Its launches write buffers that a torch operation reads (y, before the weighted sum): their bytes
    # are what the stubbed launches left, so only their shapes and roles are compared.
    _repeat_launches_as_the_full_path(lambda x, ids, weights: block(x, ids, weights), (x, ids, weights),
                                      2 if tokens == 1 else 3, own_bytes=False, forget=block._launches.clear,
                                      kept=lambda: block._launches.values())
    # SiLU-gated experts (the gating fused in gate_up's epilogue): the same launches, own prepared key.
    silu = tilemm.moe.MoEExperts(_experts(2 * 64, 256, 2), _experts(256, 64, 3), activation="silu")
    _repeat_launches_as_the_full_path(lambda x, ids, weights: silu(x, ids, weights), (x, ids, weights),
                                      2 if tokens == 1 else 3, own_bytes=False, forget=silu._launches.clear,
                                      kept=lambda: silu._launches.values())


def test_moe_calls_autograd_would_record_take_the_operator():
    # An input that requires grad: not the prepared launch (whose output would carry no gradient) but
    # the custom operator, which has no backward and says so when backward runs.
    stacked = _experts(128, 256, 1)
    x = torch.randn(4, 256).to(torch.bfloat16).requires_grad_()
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with HOST_PATH.cuda_route():
        out = tilemm.moe_linear(x, stacked, ids)
        HOST_PATH.LAUNCHES.clear()
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="autograd"):
        out.float().sum().backward()


def test_a_prepared_moe_call_still_checks_what_changes():
    # check_ids reads values: never prepared; a new signature (ids of another shape) is checked again.
    stacked = _experts(128, 256, 1)
    x = torch.randn(4, 256).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        tilemm.moe_linear(x, stacked, torch.zeros(4, 2, dtype=torch.int64))
        with pytest.raises(ValueError, match="topk_ids must lie in"):
            tilemm.moe_linear(x, stacked, torch.full((4, 2), 8, dtype=torch.int64), check_ids=True)
        with pytest.raises(ValueError, match="topk_ids must be"):
            tilemm.moe_linear(x, stacked, torch.zeros(3, 2, dtype=torch.int64))
        with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
            tilemm.moe_linear(x, stacked, torch.zeros(4, 2, dtype=torch.float32))
        HOST_PATH.LAUNCHES.clear()


def test_a_prepared_quantize_still_refuses_what_the_checks_refuse():
    # swizzle=1 equals swizzle=True (and hashes alike), axis=-1.0 equals -1: a call with them after one
    # with the right types must still raise, not find the prepared launch.
    x = torch.randn(4, 64).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        tilemm.quantize_mxfp8(x, swizzle=True)
        tilemm.quantize_fp8(x, granularity="row", axis=-1)
        with pytest.raises(TypeError, match="swizzle must be True or False"):
            tilemm.quantize_mxfp8(x, swizzle=1)
        with pytest.raises(TypeError, match="axis must be -1 or -2"):
            tilemm.quantize_fp8(x, granularity="row", axis=-1.0)
        HOST_PATH.LAUNCHES.clear()


def test_byte_operands_repeat_the_full_launch():
    # FP8 data as uint8 bytes (NumPy / CuPy arrays have no float8) and NVFP4 scales as bytes: the
    # prepared launch reinterprets them as the full path does.
    xq, wq = _quantized(16, 256, 256, "mxfp8", True)
    as_bytes = (xq.data.view(torch.uint8), xq.scale, wq.data.view(torch.uint8), wq.scale)
    _repeat_launches_as_the_full_path(lambda x, xs, w, ws: tilemm.mxfp8_matmul(x, xs, w.t(), ws), as_bytes, 1)
    xq, wq = _quantized(16, 256, 256, "nvfp4", False)
    _repeat_launches_as_the_full_path(
        lambda x, xs, w, ws, gx, gw: tilemm.nvfp4_matmul(x, xs, w.t(), ws.t(), global_scale_x=gx, global_scale_y=gw),
        (xq.data, xq.scale.view(torch.uint8), wq.data, wq.scale.view(torch.uint8), xq.global_scale,
         wq.global_scale), 1)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8"])
def test_an_empty_quantize_is_not_prepared(fmt):
    # An empty x takes the reference (no launch; NVFP4's decode scale is computed there): a repeated
    # call must compute it again, not return unfilled outputs.
    from tilemm import kernels

    q = getattr(tilemm, f"quantize_{fmt}")
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    with HOST_PATH.cuda_route():
        kernels.PLANS.clear()
        first = q(x)
        assert not any(type(v).__name__ == "_QuantizeLaunch" for v in kernels.PLANS.values())
        second = q(x)
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                           if b.element_size() == 1 else b)


class _RecordingGroup:
    """A process group whose all-reduce records (tensors, reduce op) and returns no work: what a
    sharded layer hands to NCCL, without communicating."""

    def __init__(self):
        self.calls = []

    def allreduce(self, tensors, opts):
        self.calls.append((list(tensors), opts.reduceOp))


@contextlib.contextmanager
def _rowwise_nvfp4_shard(rank: int, lin: torch.nn.Linear):
    """``lin`` as an NVFP4 (both sides) row-wise shard of rank ``rank`` of 2 (torch's fake process
    group), its all-reduces recorded (``_RecordingGroup``), inside the CUDA route."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tilemm.parallel import shard_linear

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        layer = shard_linear(tilemm.nn.Linear.from_float(lin, "nvfp4"), init_device_mesh("cpu", (2,)), "rowwise")
        group = layer._tp.group = _RecordingGroup()
        with HOST_PATH.cuda_route():
            yield layer, group
            HOST_PATH.LAUNCHES.clear()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("m", [1, 16])
def test_sharded_nvfp4_rowwise_exchanges_the_slots_without_a_runner(monkeypatch, rank, m):
    # A rank whose slice has no small-batch runner (prepack may refuse one rank's slice) still
    # all-reduces the same number of words as the ranks that have one: collectives of one length.
    import torch.distributed as dist

    from tilemm.parallel import ShardedLinear

    monkeypatch.setattr(ShardedLinear, "_small_batch_runner", lambda self, device: None)
    with _rowwise_nvfp4_shard(rank, torch.nn.Linear(512, 256, dtype=torch.bfloat16)) as (layer, group):
        layer(torch.randn(m, 256).to(torch.bfloat16))
    slots = qk.amax_slots(m, 256)
    assert [(tuple(t[0].shape), op) for t, op in group.calls] == [((slots,), dist.ReduceOp.MAX),
                                                                    ((m, 256), dist.ReduceOp.SUM)]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("m", [1, 16])
def test_sharded_nvfp4_rowwise_small_batch_launches(rank, m):
    # A row-wise NVFP4 (both sides) shard at small batch on the CUDA route: the per-tile amax maxima of
    # its K-slice (one launch into the slots that every rank fills alike), their MAX all-reduce, then
    # exactly the unsharded small-batch launches (fake-quantize reading those all-reduced maxima, the
    # weight-only matmul) and the SUM all-reduce of the partial sums; no torch kernel besides views
    # and the outputs' allocations.
    import torch.distributed as dist

    lin, gen = _seeded_linear(512, 256, seed=6, bias=False)
    x = torch.randn(m, 256, generator=gen).to(torch.bfloat16)  # this rank's K-slice
    with _rowwise_nvfp4_shard(rank, lin) as (layer, group):
        layer(x)  # the first call builds the small-batch runner
        HOST_PATH.LAUNCHES.clear()
        group.calls.clear()
        with _Ops() as ops:
            out = layer(x)
        launches = list(HOST_PATH.LAUNCHES)
    slots = qk.amax_slots(m, 256)  # the widest K-slice: 512 / 2
    (grid, amax_kernel, amax_args), (_, quant_kernel, quant_args), *matmul = launches
    assert grid == (slots, 1, 1) and amax_args[1].shape == (slots,) and amax_args[0].shape == (1, m, 256)
    assert len(matmul) == 1 and quant_args[3] is amax_args[1]
    assert [(t[0] is amax_args[1], op) for t, op in group.calls] == [(True, dist.ReduceOp.MAX),
                                                                      (False, dist.ReduceOp.SUM)]
    assert group.calls[1][0][0] is out
    assert set(ops.names) <= _VIEWS | _ALLOCATIONS, ops.names


@pytest.mark.parametrize("runner", [True, False], ids=["runner", "no-runner"])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("m", [1, 16])
def test_sharded_nvfp4_rowwise_small_batch_one_shot_exchange(monkeypatch, rank, m, runner):
    # Where the one-shot all-reduce is live (a CUDA-graph capture), a row-wise NVFP4 (both sides) shard
    # at small batch writes its per-tile amax maxima straight into its region of the exchange vector
    # (the other ranks' regions zero), gathers every rank's maxima side by side with one one-shot
    # kernel, and the fake-quantize kernel reduces them: no reduction launch before or after the
    # exchange, no NCCL MAX. A rank without a small-batch runner exchanges the same vector (one
    # length on every rank) and reduces it to one word for the quantize kernel.
    import torch.distributed as dist

    from tilemm.parallel import ShardedLinear

    if not runner:
        monkeypatch.setattr(ShardedLinear, "_small_batch_runner", lambda self, device: None)
    lin, gen = _seeded_linear(512, 256, seed=6, bias=False)
    x = torch.randn(m, 256, generator=gen).to(torch.bfloat16)  # this rank's K-slice
    slots = qk.amax_slots(m, 256)  # the widest K-slice: 512 / 2
    with _rowwise_nvfp4_shard(rank, lin) as (layer, group):
        layer(x)  # builds the small-batch runner; the one-shot set-up fails on the CPU
        one_shot = layer._tp.one_shot
        assert one_shot.amax_tiles(x.device, slots) is None  # no exchange set up: no vector
        one_shot.amax_slots = (torch.zeros(4, dtype=torch.int32), None)  # as a GPU's set-up leaves it
        monkeypatch.setattr(one_shot, "live", lambda: True)
        gathered = torch.zeros(2 * slots, dtype=torch.int32)
        exchanged = []
        monkeypatch.setattr(one_shot, "amax_gather", lambda v: exchanged.append(("gather", v)) or gathered)
        monkeypatch.setattr(one_shot, "amax_max", lambda v: exchanged.append(("max", v)) or gathered[:1])
        HOST_PATH.LAUNCHES.clear()
        group.calls.clear()
        out = layer(x)
        launches = list(HOST_PATH.LAUNCHES)
        vector, mine = one_shot.amax_tiles(x.device, slots)
    assert vector.shape == (2 * slots,) and mine.shape == (slots,)
    assert mine.data_ptr() == vector.data_ptr() + rank * slots * 4
    (grid, _, amax_args), (_, _, quant_args), *matmul = launches
    assert grid == (slots, 1, 1) and amax_args[1] is mine and amax_args[0].shape == (1, m, 256)
    assert [(what, v is vector) for what, v in exchanged] == [("gather" if runner else "max", True)]
    if runner:
        assert quant_args[3] is gathered and len(matmul) == 1
    assert [op for _, op in group.calls] == [dist.ReduceOp.SUM]  # the partial sums only
    assert group.calls[0][0][0].shape == out.shape


def test_a_prepared_experts_call_follows_replaced_buffers():
    # MoEExperts' prepared call holds the buffers of its first call: a module given another one since
    # is served with it (checked and planned again), never by the launches bound to the old one.
    gen = torch.Generator().manual_seed(4)
    block = tilemm.moe.MoEExperts(_experts(2 * 64, 256, 2), _experts(256, 64, 3),
                                  torch.randn(8, 128, generator=gen), torch.randn(8, 256, generator=gen))
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[1, 5]], dtype=torch.int32)
    weights = torch.rand(1, 2, generator=gen).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        block(x, ids, weights)
        block(x, ids, weights)  # the prepared, bound launches
        first_bias = block.down_bias
        new_bias = torch.randn(8, 256, generator=gen)
        block.down_bias = new_bias
        HOST_PATH.LAUNCHES.clear()
        block(x, ids, weights)
        launches = list(HOST_PATH.LAUNCHES)
        HOST_PATH.LAUNCHES.clear()
    assert len(launches) == 2 and len(block._launches) == 1
    assert all(t is not old for launch in block._launches.values() for t in launch.held for old in (first_bias,))
    down_args = launches[1][2]
    assert any(a is block.down_bias for a in down_args) and block.down_bias is not None
    assert torch.equal(block.down_bias, new_bias.to(block.down_bias.dtype))


def test_moving_experts_drops_their_prepared_launches():
    # The prepared launches hold the module's buffers: .to() / .cpu() must not keep the old ones alive.
    block = tilemm.moe.MoEExperts(_experts(2 * 64, 256, 2), _experts(256, 64, 3))
    x = torch.randn(1, 256).to(torch.bfloat16)
    ids = torch.tensor([[1, 5]], dtype=torch.int32)
    weights = torch.rand(1, 2).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        block(x, ids, weights)
        HOST_PATH.LAUNCHES.clear()
    assert len(block._launches) == 1
    block.to(torch.device("cpu"))
    assert block._launches == {}
    block.load_state_dict(block.state_dict())
    assert block._launches == {}


def test_experts_with_a_bias_that_requires_grad_take_the_operator():
    # A float buffer that requires grad (in grad mode): the operator, as for an input that does.
    gen = torch.Generator().manual_seed(2)
    block = tilemm.moe.MoEExperts(_experts(2 * 64, 256, 2), _experts(256, 64, 3), None,
                                  torch.randn(8, 256, generator=gen))
    block.down_bias.requires_grad_()
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[1, 5]], dtype=torch.int32)
    weights = torch.rand(1, 2, generator=gen).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        out = block(x, ids, weights)
        HOST_PATH.LAUNCHES.clear()
    assert block._launches == {} and out.requires_grad
    with pytest.raises(RuntimeError, match="autograd"):
        out.float().sum().backward()


BLACKWELL_CASES = [("mxfp8", True), ("mxfp8", False), ("mxfp4", True), ("nvfp4", True), ("nvfp4", False)]


@pytest.mark.parametrize("target", ["sm_100", "sm_120"])
@pytest.mark.parametrize("fmt,swizzle", BLACKWELL_CASES, ids=[f"{f}-{'swz' if s else 'log'}" for f, s in BLACKWELL_CASES])
def test_blackwell_matmul_entries_repeat_the_full_launch(fmt, swizzle, target):
    # On Blackwell too a repeated eager call is the prepared launch: what the full path launches
    # (NVFP4's decode scales folded into the one alpha as the full path folds them), with and without
    # alpha and bias, and a batched x whose batch the launcher folds into M.
    xq, wq = _quantized(16, 256, 256, fmt, swizzle)
    bias = torch.randn(256).to(torch.bfloat16)
    alpha = torch.tensor(0.5)
    _repeat_launches_as_the_full_path(lambda xq, wq, bias, alpha: tilemm.linear(xq, wq, bias=bias, alpha=alpha),
                                      (xq, wq, bias, alpha), 1, target=target)
    _repeat_launches_as_the_full_path(lambda xq, wq: tilemm.linear(xq, wq), (xq, wq), 1, target=target)
    if swizzle:  # (a swizzled batch folds only with whole 128-row blocks)
        xb, _ = _quantized(256, 256, 256, fmt, swizzle)
    else:
        xb, _ = _quantized(2 * 16, 256, 256, fmt, swizzle)
    q = getattr(tilemm, f"quantize_{fmt}")
    x3 = torch.randn(2, xb.data.shape[0] // 2 if not swizzle else 128, 256).to(torch.bfloat16)
    x3q = q(x3, swizzle=swizzle)
    _repeat_launches_as_the_full_path(lambda xq, wq: tilemm.linear(xq, wq), (x3q, wq), 1, target=target)


@pytest.mark.parametrize("fmt", ["fp8_row", "fp8_blocks", "fp8_tensor"])
def test_blackwell_fp8_entries_repeat_the_full_launch(fmt):
    # Blackwell FP8: row and block scales are views, so a repeated call is the prepared launch; a
    # per-tensor scale is copied per row for the kernel, so those calls stay on the planned path.
    xq, wq = _quantized(16, 256, 256, fmt, False)
    bias = torch.randn(256).to(torch.bfloat16)
    _repeat_launches_as_the_full_path(lambda xq, wq, bias: tilemm.linear(xq, wq, bias=bias), (xq, wq, bias), 1,
                                      expect_prepared=fmt != "fp8_tensor", target="sm_100")


def test_blackwell_fp8_layer_repeats_the_full_launch():
    # The FP8 layer's own prepared calls bind the Blackwell launch to the weight as on Hopper.
    gen = torch.Generator().manual_seed(6)
    lin = torch.nn.Linear(256, 384, dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, "fp8", granularity="row")
    x = torch.randn(16, 256, generator=gen).to(torch.bfloat16)
    _repeat_launches_as_the_full_path(layer, (x,), 2, forget=lambda: setattr(layer, "_runner", None),
                                      target="sm_100")
    with HOST_PATH.cuda_route("sm_100"):
        layer(x)
        assert type(layer._runner).__name__ == "_PreparedFP8" and all(layer._runner.calls.values())
        HOST_PATH.LAUNCHES.clear()


@pytest.mark.parametrize("m", [2, 8, 16])
def test_weight_only_few_rows_short_k_is_one_launch(m):
    # The same layer with K = 4096 (Llama's k / v / o projections): up to 16 rows, one launch of the
    # MMA kernel's "few" stacked blocks without a K split (``weight_only_kernels.short_k_stacked``).
    from tilemm.kernels import weight_only_kernels as wo

    lin = torch.nn.Linear(4096, 1024, bias=False, dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, "mxfp4", weight_only=True)
    x = torch.randn(m, 4096, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        HOST_PATH.LAUNCHES.clear()
        layer(x)
        launches = list(HOST_PATH.LAUNCHES)
        HOST_PATH.LAUNCHES.clear()
    assert len(launches) == 1
    (grid, kernel, args), = launches
    cfg = wo.plan(m, 1024, 4096, wo.LAYOUTS["mxfp4"])
    assert cfg.stack == (8 if m <= 8 else 4) and cfg.split_k == 1 and args[0] is x
    assert grid[0] == -(-1024 // cfg.tile_n)


@pytest.mark.parametrize("m", [1, 16, 32])
def test_weight_only_few_rows_launches(m):
    # A 4-bit weight-only layer of 4096 x 12288 (fewer than one 32-row block per SM at 132 SMs, K long
    # enough to split): one launch at M = 1 (the FMA kernel); at M = 16 / 32 the fused kernel's K
    # split, two launches (its partial tiles, then their sum). A repeated call makes the same launches
    # on the same split workspace and the same described weight: nothing is allocated or described
    # anew but the output.
    from tilemm.kernels import hopper_weight_only_large as wl

    gen = torch.Generator().manual_seed(m)
    lin = torch.nn.Linear(12288, 4096, bias=False, dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, "mxfp4", weight_only=True)
    x = torch.randn(m, 12288, generator=gen).to(torch.bfloat16)
    calls = []
    with HOST_PATH.cuda_route():
        for _ in range(2):
            HOST_PATH.LAUNCHES.clear()
            layer(x)
            calls.append(list(HOST_PATH.LAUNCHES))
        HOST_PATH.LAUNCHES.clear()
    first, second = calls
    assert len(first) == len(second) == (1 if m == 1 else 2)
    assert [k for _, k, _ in first] == [k for _, k, _ in second]
    (_, _, a1), (_, _, a2) = first[0], second[0]
    assert a1[0] is x and a2[0] is x
    assert a1[1] is a2[1] and a1[2] is a2[2]  # the weight's words and scales, described once
    if m > 1:
        (_, fused, args), (_, summed, sum_args) = second
        assert summed is wl._partial_sum_kernel
        partial = args[7]
        assert sum_args[0] is partial and first[0][2][7] is partial  # the kept workspace view
        assert args[8] == sum_args[4] > 1  # K ranges


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("m", [300, 2048])
def test_block_scaled_layer_at_many_rows_runs_the_weight_only_path(monkeypatch, fmt, m):
    # A block-scaled tilemm.nn.Linear on Hopper at prefill sizes, as at small batch: the activation's
    # fake quant (one launch: NVFP4's amax in it, or in a launch of its own first), then exactly the
    # launches of the weight-only runner for that many rows, given the alpha the fake quant gives
    # (NVFP4: a device tensor, so at 2048 rows the fused kernel, never the decode for cuBLAS); never
    # the block-scaled matmul, which decodes both operands for every output tile.
    from tilemm import weight_only

    # The CPU has no fp32-output bf16 GEMM: the flag that records it, scoped to this test.
    monkeypatch.setattr(weight_only, "_GEMM_FP32_OUT", [True])
    lin = torch.nn.Linear(1024, 512, dtype=torch.bfloat16)
    layer = tilemm.nn.Linear.from_float(lin, fmt)
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    with HOST_PATH.cuda_route():
        layer(x)  # builds the runner
        HOST_PATH.LAUNCHES.clear()
        layer(x)
        launches = list(HOST_PATH.LAUNCHES)
        HOST_PATH.LAUNCHES.clear()
        runner = layer._runner.runner
        assert runner is not None
        runner.inner(x, None if fmt != "nvfp4" else runner.fake_quant.alpha)
        weight_only = list(HOST_PATH.LAUNCHES)
        HOST_PATH.LAUNCHES.clear()
    quantize = [k for _, k, _ in launches].index(runner.fake_quant._kernel)
    assert quantize <= (1 if fmt == "nvfp4" else 0)
    rest = launches[quantize + 1:]
    assert [(g, k) for g, k, _ in rest] == [(g, k) for g, k, _ in weight_only]
    if fmt == "nvfp4":
        fused = runner.inner._large[(m, torch.bfloat16, torch.bfloat16, True)][1]
        assert fused is not None and rest[0][1] is fused.kernel


@pytest.mark.parametrize("m,k,capturing,source,blocks", [
    (1, 4096, False, "whole", 1), (1, 14336, True, "whole", 4), (4, 4096, False, "whole", 4),
    (16, 4096, False, "grid", 16), (16, 4096, True, "partials", 16), (3, 36864, False, "partials", 144)])
def test_nvfp4_fake_quant_takes_the_amax_without_a_barrier_when_x_is_small(monkeypatch, m, k, capturing,
                                                                            source, blocks):
    # NVFP4's fake quant needs the tensor amax before any block can round: a small x is loaded whole by
    # every block (one launch, no atomics); a larger one goes through the grid-wide barrier in eager
    # calls while its tiles fit one wave (one launch), else -- and inside CUDA graphs, where the
    # barrier costs more GPU time than a launch -- tensor_amax first (two).
    x = torch.randn(m, k).to(torch.bfloat16)
    with HOST_PATH.cuda_route(), monkeypatch.context() as patch:
        patch.setattr(qk, "_capturing", lambda device: capturing)  # over the route's own, undone first
        fq = qk.FakeQuant(NVFP4, None, torch.ones(1))
        fq._sms = 132  # an H100's
        HOST_PATH.LAUNCHES.clear()
        fq.run(x, None)
        launches = list(HOST_PATH.LAUNCHES)
        HOST_PATH.LAUNCHES.clear()
    grid, kernel, args = launches[-1]
    want = {"whole": qk.AMAX_WHOLE, "grid": qk.AMAX_GRID, "partials": qk.AMAX_PARTIALS}[source]
    assert len(launches) == (2 if source == "partials" else 1)
    assert args[8] == want and grid[0] == blocks
    assert kernel is (fq._whole_kernel if source == "whole" else fq._kernel)
    if source == "whole":
        whole_r, whole_k, tile_r, tile_k = args[9:13]
        assert whole_r >= m and whole_k >= k and whole_r * whole_k <= qk.WHOLE_ELEMENTS
        assert blocks == -(-m // tile_r) * -(-k // tile_k)


def test_a_prefill_activation_does_not_grow_the_scratch(monkeypatch):
    # The fake-quantized activation between the two launches lives in the stream's scratch (kept for
    # good) only up to SCRATCH_ELEMENTS; a prefill's is allocated per call, so the scratch stays small.
    from tilemm import weight_only

    monkeypatch.setattr(qk, "_SCRATCH", {})
    monkeypatch.setattr(weight_only, "_GEMM_FP32_OUT", [True])
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(4096, 256, dtype=torch.bfloat16), "mxfp4")
    with HOST_PATH.cuda_route():
        for m in (16, 1024):
            out = layer(torch.randn(m, 4096).to(torch.bfloat16))
            assert out.shape == (m, 256)
        HOST_PATH.LAUNCHES.clear()
    sizes = [s.values.numel() for s in qk._SCRATCH.values()] + [
        t.numel() for s in qk._SCRATCH.values() for t in s.retired]
    assert sizes and max(sizes) <= qk.SCRATCH_ELEMENTS and 1024 * 4096 > qk.SCRATCH_ELEMENTS


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_nvfp4_rowwise_many_rows_runs_the_weight_only_path(monkeypatch, rank):
    # Above 128 rows a row-wise NVFP4 shard exchanges one amax word (its slice's, MAX-all-reduced),
    # then on Hopper makes the unsharded layer's launches: the fake quant reading that word, the
    # weight-only plan of that many rows; never the block-scaled matmul.
    import torch.distributed as dist

    from tilemm import weight_only

    monkeypatch.setattr(weight_only, "_GEMM_FP32_OUT", [True])
    m = 300
    lin, gen = _seeded_linear(512, 256, seed=7, bias=False)
    x = torch.randn(m, 256, generator=gen).to(torch.bfloat16)  # this rank's K-slice
    with _rowwise_nvfp4_shard(rank, lin) as (layer, group):
        layer(x)  # builds the runner
        HOST_PATH.LAUNCHES.clear()
        group.calls.clear()
        out = layer(x)
        launches = list(HOST_PATH.LAUNCHES)
        runner = layer._runner.runner
    assert runner is not None
    kernels = [k for _, k, _ in launches]
    quantize = kernels.index(runner.fake_quant._kernel)
    amax_word = launches[quantize][2][3]
    assert amax_word.numel() == 1
    assert [(tuple(t[0].shape), op) for t, op in group.calls] == [((1,), dist.ReduceOp.MAX),
                                                                    ((m, 256), dist.ReduceOp.SUM)]
    fused = runner.inner._large[(m, torch.bfloat16, torch.bfloat16, True)][1]
    assert fused is not None and kernels[quantize + 1:] == [fused.kernel] * (len(kernels) - quantize - 1)
    assert group.calls[1][0][0] is out


def test_an_activation_past_int32_offsets_takes_the_block_scaled_matmul(monkeypatch):
    # The fake quant indexes x with int32 offsets: from 2^31 elements (here a lowered bound) a
    # block-scaled layer runs the block-scaled matmul, which launches per piece, and builds no runner.
    monkeypatch.setattr(tilemm.nn, "_INT32_LIMIT", 300 * 1024)
    layer = tilemm.nn.Linear.from_float(torch.nn.Linear(1024, 256, dtype=torch.bfloat16), "mxfp4")
    with HOST_PATH.cuda_route():
        HOST_PATH.LAUNCHES.clear()
        out = layer(torch.randn(300, 1024).to(torch.bfloat16))
        launches = list(HOST_PATH.LAUNCHES)
        assert layer._runner is None and launches and out.shape == (300, 256)
        layer(torch.randn(299, 1024).to(torch.bfloat16))
        assert layer._runner is not None and layer._runner.runner is not None
        HOST_PATH.LAUNCHES.clear()
