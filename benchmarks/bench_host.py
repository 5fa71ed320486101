"""Host time of one eager call of every public entry, beside ``F.linear``, and kernels per call.

    python benchmarks/bench_host.py [--n 4096 --k 4096 --m 1,16]

The host time of a call is the time to issue it: a short run of calls back to back (40: few enough
that the GPU's launch queue never fills, which would time the GPU instead), timed on the host, then one
synchronisation. The entries take turns, one run each per round, and each keeps its best of 15 rounds,
so that every entry and ``F.linear`` are measured in the same stretch of time (the host's speed
drifts: timing each entry alone, one after another, moved single entries by 1.5x); the ratio uses the
best rounds, and the medians over the rounds are printed beside them, to show the spread. For each M it
prints ``F.linear`` (bf16), then per format (MXFP8, MXFP4, NVFP4; FP8 per row): the format's
``*_matmul`` on pre-quantized swizzled operands, ``tilemm.linear(xq, wq)`` (both sides quantized),
``tilemm.linear(x, prepack(wq))`` (weight-only), ``tilemm.nn.Linear`` both sides and weight-only, and
the quantizer of an (M, K) activation (``swizzle=True``), each with its ratio to ``F.linear`` and its
kernels per call (torch.profiler). Writes ``host-<gpu>.json`` and what it prints to ``host-<gpu>.txt``
(``benchmarks/_results.py``). ``--cpu-smoke``: N = 128, K = 64, M = 1 on the CPU (the reference path's
host times; no kernel counts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tilemm  # noqa: E402
from _results import Transcript, add_options, command, device_name, results_path  # noqa: E402
from _timing import issue_us  # noqa: E402

FORMATS = {"mxfp8": tilemm.quantize_mxfp8, "mxfp4": tilemm.quantize_mxfp4, "nvfp4": tilemm.quantize_nvfp4}


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def entries(m: int, n: int, k: int, formats, dev) -> list:
    """(name, callable) for every public entry at batch M."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    named = [("F.linear bf16", lambda: F.linear(x, lin.weight, lin.bias))]
    for fmt in formats:
        named += _format_entries(fmt, lin, x)
    return named


def _format_entries(fmt: str, lin: torch.nn.Linear, x: torch.Tensor) -> list:
    """One format's entries (a function of its own, so that each closure keeps its own operands)."""
    if fmt == "fp8":
        xq = tilemm.quantize_fp8(x, granularity="row")
        wq = tilemm.quantize_fp8(lin.weight, granularity="row")
        both = tilemm.nn.Linear.from_float(lin, "fp8")
        return [("fp8_matmul (row scales)", lambda: tilemm.fp8_matmul(xq.data, xq.scale, wq.data.t(), wq.scale.t())),
                ("fp8 linear(xq, wq)", lambda: tilemm.linear(xq, wq)),
                ("fp8 nn.Linear both sides", lambda: both(x)),
                ("quantize_fp8(x, 'row')", lambda: tilemm.quantize_fp8(x, granularity="row"))]
    q = FORMATS[fmt]
    xq, wq = q(x, swizzle=True), q(lin.weight, swizzle=True)
    matmul = getattr(tilemm, f"{fmt}_matmul")
    if fmt == "nvfp4":
        def product():
            return matmul(xq.data, xq.scale, wq.data.t(), wq.scale, global_scale_x=xq.global_scale,
                          global_scale_y=wq.global_scale)
    else:
        def product():
            return matmul(xq.data, xq.scale, wq.data.t(), wq.scale)
    packed = tilemm.prepack(q(lin.weight))
    both = tilemm.nn.Linear.from_float(lin, fmt)
    wo = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
    return [(f"{fmt}_matmul", product),
            (f"{fmt} linear(xq, wq)", lambda: tilemm.linear(xq, wq)),
            (f"{fmt} linear(x, packed) weight-only", lambda: tilemm.linear(x, packed)),
            (f"{fmt} nn.Linear both sides", lambda: both(x)),
            (f"{fmt} nn.Linear weight-only", lambda: wo(x)),
            (f"quantize_{fmt}(x, swizzle=True)", lambda: q(x, swizzle=True))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_host.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--formats", default="mxfp8,mxfp4,nvfp4,fp8")
    add_options(ap)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.n, args.k, args.m = 128, 64, "1"
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    calls, rounds = (5, 1) if args.cpu_smoke else (40, 15)
    report = {"device": device_name(dev), "command": command("bench_host.py", argv), "n": args.n, "k": args.k,
              "calls": calls, "rounds": rounds, "rows": []}
    say = Transcript(report["command"], report["device"])
    say(f"# {report['device']}, N={args.n} K={args.k}; host us per eager call (best of {rounds} interleaved "
        f"rounds of {calls} calls), ratio to F.linear, the same of the rounds' medians, kernels")
    for m in (int(v) for v in args.m.split(",")):
        named = entries(m, args.n, args.k, args.formats.split(","), dev)
        kernels = [kernels_per_call(fn) if dev.type == "cuda" else None for _, fn in named]
        for _, fn in named:  # one warm-up call each (one-time work, such as a first kernel compile)
            fn()
        times = [[] for _ in named]
        for _ in range(rounds):
            for i, (_, fn) in enumerate(named):
                times[i].append(issue_us(fn, calls, 1, warmup=1))
        best = [min(t) for t in times]
        median = [statistics.median(t) for t in times]
        base, base_median = best[0], median[0]
        for (name, _), us, mid, count in zip(named, best, median, kernels):
            report["rows"].append({"m": m, "entry": name, "us": round(us, 1), "x_f_linear": round(us / base, 2),
                                   "median_us": round(mid, 1), "median_x_f_linear": round(mid / base_median, 2),
                                   "kernels": count})
            say(f"M={m:<4d} {name:42s} {us:8.1f} us {us / base:6.2f}x  "
                f"(median {mid:6.1f} us {mid / base_median:5.2f}x)  {'-' if count is None else count} kernel(s)")
    path = results_path(args.out_dir, "host", report["device"], "json")
    path.write_text(json.dumps(report, indent=1))
    say.write(path.with_suffix(".txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
