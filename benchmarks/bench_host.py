"""Host time of one eager call, where it goes, and how many kernels it launches.

    python benchmarks/bench_host.py [--n 1024 --k 1024]

On a layer small enough that the GPU finishes each kernel before the host issues the next, the wall
time of many back-to-back eager calls (one synchronisation at the end) is the host time per call. It
prints, per format and mode, at M = 1: ``F.linear`` (bf16) for reference, ``tilemm.nn.Linear``, and the
pieces of the weight-only call (the prepared ``ct.launch`` alone, the runner with its output
allocation), plus kernels per call (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import tilemm


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


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
    rows = {"shape": f"M=1 N={args.n} K={args.k}", "F.linear bf16": per_call_us(lambda: lin(x))}
    empty = torch.empty(1, device=dev)
    rows["torch.empty (1,)"] = per_call_us(lambda: torch.empty(1, device=dev))
    del empty
    for fmt in args.formats.split(","):
        wo = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
        wo(x)
        runner = wo._runner
        prepared = runner._prepared[(1, x.dtype)]
        out = torch.empty(1, args.n, device=dev, dtype=x.dtype)
        stream = torch.cuda.current_stream()
        rows[f"{fmt} weight-only: ct.launch alone"] = per_call_us(lambda: prepared.run(x, out, stream))
        rows[f"{fmt} weight-only: runner"] = per_call_us(lambda: runner(x))
        rows[f"{fmt} weight-only: nn.Linear"] = per_call_us(lambda: wo(x))
        rows[f"{fmt} weight-only: kernels"] = kernels_per_call(lambda: wo(x))
        both = tilemm.nn.Linear.from_float(lin, fmt)
        rows[f"{fmt} both sides: nn.Linear"] = per_call_us(lambda: both(x), calls=300)
        rows[f"{fmt} both sides: kernels"] = kernels_per_call(lambda: both(x))
    for k, v in rows.items():
        print(f"{k:45s} {v:8.1f}" if isinstance(v, float) else f"{k:45s} {v}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
