"""The Python cost of an eager call of every public entry on the CUDA route, measured on the CPU.

    python benchmarks/investigations/host_path.py [--n 4096 --k 4096 --m 1,16] [--profile ENTRY]

This measures Python only, not launch cost: no GPU is used and no kernel runs. The calls take the
route an eager call on an sm_90 GPU takes (``cuda_route``: ``TILEMM_ARCH=sm_90``, ``Tensor.is_cuda``
reported True, the stream handle, SM count and graph-capture checks stubbed), on CPU tensors, with
``ct.launch`` replaced by a stub that records the launch (``LAUNCHES``; the MoE routing's order is
zeroed after its stub, so that the gather after it reads valid rows). So each figure is what the
library's own Python (argument handling, plan lookup, output allocation, argument assembly) costs
per call. A GPU call adds the launch itself (about 14 us for an empty ``ct.launch`` from Python on an
H100, plus cuTile's description of each tensor argument); a CPU ``torch.empty`` costs more than the
CUDA caching allocator's. ``--profile ENTRY`` prints cProfile's top functions for one entry (a name as
printed). tests/test_launch_count.py uses ``cuda_route`` to check what the route launches.

Each figure: best of seven timings of ``--number`` calls back to back, in microseconds per call,
after warm-up calls that fill the plan table. Launches per call are counted on one call. Timed with
``timeit``, not ``benchmarks/_timing.py``: what it times is host time on the CPU, with no GPU work.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import pathlib
import pstats
import sys
import timeit

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository: tilemm

import tilemm  # noqa: E402
from tilemm import matmul as _matmul  # noqa: E402
from tilemm import quantize as _quantize  # noqa: E402
from tilemm import weight_only as _weight_only  # noqa: E402
from tilemm.kernels import _common  # noqa: E402
from tilemm.kernels import hopper_block_scaled, hopper_fp8, hopper_gemm, quantize_kernels  # noqa: E402
from tilemm.kernels import blackwell_block_scaled, blackwell_fp8, moe_kernels, weight_only_kernels  # noqa: E402
from tilemm.kernels import hopper_weight_only_large  # noqa: E402

#: (grid, kernel, args) of every launch made under ``cuda_route`` (cleared by its users).
LAUNCHES = []


class _NoLaunch:
    """``cuda.tile`` with ``launch`` recorded in ``LAUNCHES`` instead of run."""

    def __init__(self, ct):
        self._ct = ct

    def launch(self, stream, grid, kernel, args):
        LAUNCHES.append((grid, kernel, args))

    def __getattr__(self, name):
        return getattr(self._ct, name)


class _Plain:
    """``_common.Described`` for CPU tensors: holds the tensor (CPU tensors have no CUDA interface)."""

    __slots__ = ("_tensor",)

    def __init__(self, t):
        self._tensor = t


@contextlib.contextmanager
def cuda_route(target: str = "sm_90"):
    """Make eager calls on CPU tensors take the CUDA route of ``target`` ("sm_90", or "sm_100" /
    "sm_120": the Blackwell matmul launchers), with launches recorded, not run. The launches the
    route prepared (``tilemm.kernels.PLANS``, keyed by signatures that name the CPU device) are
    forgotten on the way out, so that a later CPU call outside it takes the CPU path."""
    patches = []
    arch = os.environ.get("TILEMM_ARCH")
    os.environ["TILEMM_ARCH"] = target

    def patch(owner, name, value):
        if hasattr(owner, name):
            patches.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    kernel_modules = (hopper_block_scaled, hopper_fp8, hopper_gemm, quantize_kernels, weight_only_kernels, moe_kernels,
                      blackwell_block_scaled, blackwell_fp8, hopper_weight_only_large)
    for module in kernel_modules:
        patch(module, "ct", _NoLaunch(module.ct))
        patch(module, "num_sms", lambda device: 132)
        patch(module, "_capturing", lambda device: False)
        patch(module, "Described", _Plain)
    for module in (_matmul, _quantize, _weight_only, _common, tilemm.parallel, *kernel_modules):
        patch(module, "stream_handle", lambda device: 0)
    patch(_weight_only, "num_sms", lambda device: 132)
    patch(_common, "num_sms", lambda device: 132)
    patch(torch.cuda, "current_stream", lambda *a, **k: 0)
    patch(torch.cuda, "is_current_stream_capturing", lambda: False)
    patch(torch.cuda, "synchronize", lambda *a, **k: None)
    for module in (_quantize, quantize_kernels):
        patch(module, "has_kernels", lambda device: True)
    patch(quantize_kernels, "_target", lambda device: target)
    patch(_matmul, "_on_gpu", lambda device: True)
    route = moe_kernels.route

    def routed(*args, **kwargs):  # the stubbed routing wrote nothing: valid rows for the gather after it
        order, *rest = route(*args, **kwargs)
        return (order.zero_(), *rest)

    patch(moe_kernels, "route", routed)
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        tilemm.kernels.PLANS.clear()
        del torch.Tensor.is_cuda
        if arch is None:
            del os.environ["TILEMM_ARCH"]
        else:
            os.environ["TILEMM_ARCH"] = arch
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)


def entries(m: int, n: int, k: int):
    """(name, callable) per public entry at batch M, the operands prepared on the CPU reference path."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, dtype=torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    quantizers = {"mxfp8": tilemm.quantize_mxfp8, "mxfp4": tilemm.quantize_mxfp4, "nvfp4": tilemm.quantize_nvfp4}
    for fmt, q in quantizers.items():
        xq, wq = q(x, swizzle=True), q(lin.weight, swizzle=True)
        matmul = getattr(tilemm, f"{fmt}_matmul")
        if fmt == "nvfp4":
            yield (f"{fmt}_matmul", lambda xq=xq, wq=wq, mm=matmul: mm(
                xq.data, xq.scale, wq.data.t(), wq.scale, global_scale_x=xq.global_scale,
                global_scale_y=wq.global_scale))
        else:
            yield f"{fmt}_matmul", lambda xq=xq, wq=wq, mm=matmul: mm(xq.data, xq.scale, wq.data.t(), wq.scale)
        yield f"{fmt} linear(xq, wq)", lambda xq=xq, wq=wq: tilemm.linear(xq, wq)
        both = tilemm.nn.Linear.from_float(lin, fmt)
        yield f"{fmt} nn.Linear both sides", lambda both=both: both(x)
        only = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
        yield f"{fmt} nn.Linear weight-only", lambda only=only: only(x)
        yield f"quantize_{fmt}(x, swizzle=True)", lambda q=q: q(x, swizzle=True)
    xq, wq = tilemm.quantize_fp8(x, granularity="row"), tilemm.quantize_fp8(lin.weight, granularity="row")
    yield "fp8_matmul (row scales)", lambda: tilemm.fp8_matmul(xq.data, xq.scale, wq.data.t(), wq.scale.t())
    yield "fp8 linear(xq, wq) row", lambda: tilemm.linear(xq, wq)
    xt, wt = tilemm.quantize_fp8(x, granularity="tensor"), tilemm.quantize_fp8(lin.weight, granularity="tensor")
    yield "fp8_matmul (tensor scales)", lambda: tilemm.fp8_matmul(xt.data, xt.scale, wt.data.t(), wt.scale)
    yield "fp8 linear(xq, wq) tensor", lambda: tilemm.linear(xt, wt)
    xb = tilemm.quantize_fp8(x, granularity=(1, 128))
    wb = tilemm.quantize_fp8(lin.weight, granularity=(128, 128))
    yield "fp8 linear(xq, wq) blocks", lambda: tilemm.linear(xb, wb)
    for gran in ("row", "tensor", (128, 128)):
        both = tilemm.nn.Linear.from_float(lin, "fp8", granularity=gran)
        yield f"fp8 nn.Linear both sides {gran}", lambda both=both: both(x)
    for gran in ("row", "tensor", (1, 128)):
        yield f"quantize_fp8(x, {gran!r})", lambda gran=gran: tilemm.quantize_fp8(x, granularity=gran)
    # Mixture of experts: 8 MXFP4 experts of (N, K), top-2 routing.
    experts, top_k = 8, 2
    ids = torch.stack([torch.arange(m) % experts, (torch.arange(m) + 1) % experts], dim=1)
    stacked = tilemm.prepack(tilemm.quantize_mxfp4(torch.randn(experts, n, k, dtype=torch.bfloat16)))
    yield "moe_linear", lambda: tilemm.moe_linear(x, stacked, ids)
    gate_up = tilemm.prepack(tilemm.quantize_mxfp4(torch.randn(experts, n, k, dtype=torch.bfloat16)))
    down = tilemm.prepack(tilemm.quantize_mxfp4(torch.randn(experts, k, n // 2, dtype=torch.bfloat16)))
    block = tilemm.moe.MoEExperts(gate_up, down)
    weights = torch.full((m, top_k), 1.0 / top_k, dtype=torch.bfloat16)
    yield "moe.MoEExperts", lambda: block(x, ids, weights)


def per_call_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, setup=LAUNCHES.clear, number=number, repeat=7)) / number * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="host_path.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--number", type=int, default=2000, help="calls per timing")
    ap.add_argument("--profile", default=None, help="an entry's name: print its cProfile top functions")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# CPU, N={args.n} K={args.k}: Python us per eager call on the sm_90 route (no launch), launches")
    for m in (int(v) for v in args.m.split(",")):
        for name, fn in entries(m, args.n, args.k):
            us, launches = measure(fn, args.number, profile=args.profile == name)
            print(f"M={m:<4d} {name:42s} {us:8.1f} us  {launches} launch(es)", flush=True)
    return 0


def measure(fn, number: int, profile: bool = False, top: int = 25, sort: str = "tottime") -> tuple[float, int]:
    """(us per call, launches per call) of ``fn`` on the CUDA route, after warm-up calls; with
    ``profile``, cProfile's ``top`` functions of ``number`` calls too (garbage collection off, as
    timeit does, so that no collection's time is charged to the function it interrupts)."""
    with cuda_route():
        for _ in range(3):
            fn()
        LAUNCHES.clear()
        fn()
        launches = len(LAUNCHES)
        us = per_call_us(fn, number)
        if profile:
            prof = cProfile.Profile()
            gc.disable()
            try:
                prof.runcall(lambda: [fn() for _ in range(number)])
            finally:
                gc.enable()
            LAUNCHES.clear()
            pstats.Stats(prof).sort_stats(sort).print_stats(top)
    return us, launches


if __name__ == "__main__":
    sys.exit(main())
