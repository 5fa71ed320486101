"""Host time of one eager call, where it goes, and how many kernels it launches.

    python benchmarks/bench_host.py [--n 1024 --k 1024]

The host time of a call is the time to issue it: a few hundred calls back to back, which the GPU's
launch queue absorbs, timed on the host (best of five), then one synchronisation. It
prints, per format and mode, at M = 1: ``F.linear`` (bf16) for reference, ``tilemm.nn.Linear``, and the
pieces of the call (weight-only: the prepared ``ct.launch`` alone, the runner with its output
allocation; both sides on Hopper: the activation decode alone, the two-launch runner), plus kernels
per call (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import tilemm


def per_call_us(fn, calls: int = 300, reps: int = 5) -> float:
    """Host time per call: the time to issue ``calls`` calls back to back (fewer than the GPU's launch
    queue holds, so the host never waits for the GPU), best of ``reps``; the GPU catches up between
    repetitions."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best / calls * 1e6


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_host.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--formats", default="mxfp4,nvfp4,mxfp8")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = torch.nn.Linear(args.k, args.n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, args.k, device=dev, dtype=torch.bfloat16)
    rows = {"shape": f"M=1 N={args.n} K={args.k}", "torch.nn.Linear bf16": per_call_us(lambda: lin(x)),
            "F.linear bf16": per_call_us(lambda: torch.nn.functional.linear(x, lin.weight, lin.bias))}
    empty = torch.empty(1, device=dev)
    rows["torch.empty (1,)"] = per_call_us(lambda: torch.empty(1, device=dev))
    rows["torch.cuda.current_stream()"] = per_call_us(lambda: torch.cuda.current_stream())
    rows["raw stream handle"] = per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0))
    del empty
    for fmt in args.formats.split(","):
        wo = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
        wo(x)
        runner = wo._runner
        prepared = runner._prepared[(1, x.dtype)]
        out = torch.empty(1, args.n, device=dev, dtype=x.dtype)
        stream = torch._C._cuda_getCurrentRawStream(dev.index or 0)
        rows[f"{fmt} weight-only: ct.launch alone"] = per_call_us(lambda: prepared.run(x, out, stream))
        rows[f"{fmt} weight-only: runner"] = per_call_us(lambda: runner(x))
        rows[f"{fmt} weight-only: nn.Linear"] = per_call_us(lambda: wo(x))
        rows[f"{fmt} weight-only: kernels"] = kernels_per_call(lambda: wo(x))
        both = tilemm.nn.Linear.from_float(lin, fmt)
        both(x)
        small = both._runner.runner  # the small-batch path (Hopper), or None
        if small is not None:
            rows[f"{fmt} both sides: FakeQuant.run"] = per_call_us(lambda: small.fake_quant.run(x, stream))
            rows[f"{fmt} both sides: runner"] = per_call_us(lambda: small(x))
        rows[f"{fmt} both sides: nn.Linear"] = per_call_us(lambda: both(x))
        rows[f"{fmt} both sides: kernels"] = kernels_per_call(lambda: both(x))
    for k, v in rows.items():
        print(f"{k:45s} {v:8.1f}" if isinstance(v, float) else f"{k:45s} {v}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
