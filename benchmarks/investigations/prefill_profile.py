"""Where an eager prefill's time goes: the Llama-3-8B-shaped model of ``bench_decode.py`` (its first
few layers), a prompt of 512 tokens at batch 1, bf16 against 4-bit weight-only (``quantize_model``).

    python benchmarks/investigations/prefill_profile.py [--layers 4] [--format mxfp4] [--prompt 512]

Per variant: the prefill's wall time (best of 5, synchronized at both ends), the GPU time of its
kernels summed (torch.profiler, one prefill) and the ten kernels that take the most. Then per linear
shape at M = prompt rows: one eager call's wall time in a loop of 20 (host and GPU overlapped as in a
model), its GPU time alone (CUDA events around a CUDA-graph replay) and F.linear's, so that host
cost and kernel cost can be told apart.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parents[2])]

import tilemm  # noqa: E402
from bench_decode import LLAMA3_8B, build_model, make_cache, prefill  # noqa: E402
from _results import Transcript, add_options, command, device_name, results_path  # noqa: E402

SHAPES = {"q / o": (4096, 4096), "k / v": (1024, 4096), "gate / up": (14336, 4096), "down": (4096, 14336)}


def wall(fn, reps: int) -> float:
    """Best seconds of ``reps`` calls, each synchronized at both ends."""
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def loop_us(fn, calls: int = 20) -> float:
    """Microseconds per call of ``calls`` back-to-back eager calls (one synchronization at the end)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def graph_us(fn, reps: int = 20) -> float:
    """GPU microseconds per call: CUDA events around replays of a graph of one call (median)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def profile(say, model, cache_fn, prompt) -> None:
    acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        prefill(model, cache_fn(), prompt)
        torch.cuda.synchronize()
    kernels = collections.Counter()
    counts = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name[:70]] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            counts[ev.name[:70]] += 1
    api = collections.Counter()
    api_n = collections.Counter()
    for ev in prof.events():  # CUDA runtime / driver calls (synchronizations, copies, launches)
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith(("cuda", "cu")):
            api[ev.name] += ev.cpu_time_total
            api_n[ev.name] += 1
    say("  CUDA API calls by host time: " + ", ".join(
        f"{name} {us / 1e3:.2f} ms x{api_n[name]}" for name, us in api.most_common(8)))
    total = sum(kernels.values())
    say(f"  GPU kernel time {total / 1e3:.2f} ms in {sum(counts.values())} kernels")
    for name, us in kernels.most_common(10):
        say(f"    {us / 1e3:7.2f} ms  x{counts[name]:<4d} {name}")


def host_profile(say, fn, calls: int = 50, sort: str = "cumulative", lines: int = 18) -> None:
    """The Python functions of ``calls`` eager calls by host time (cProfile, sorted by ``sort``)."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(lines)
    say(f"  host {host:.1f} us per call under cProfile; by {sort}:")
    for line in text.getvalue().splitlines():
        if line.strip() and ("{" in line or "/" in line or "ncalls" in line):
            say("    " + line.strip()[:170])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="prefill_profile.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--host-profile", action="store_true", help="cProfile each shape's eager calls")
    ap.add_argument("--no-model", action="store_true", help="the linear shapes only")
    add_options(ap)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    say = Transcript(command("investigations/prefill_profile.py", argv), device_name(device))
    prompt = torch.randint(LLAMA3_8B["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    model = None if args.no_model else build_model(LLAMA3_8B, args.layers, device)

    def cache():
        return make_cache(model, 1, args.prompt + 8, device)

    for name in () if args.no_model else ("bf16", f"{args.format}-weight-only"):
        if name != "bf16":
            tilemm.quantize_model(model, args.format, skip=["lm_head"], weight_only=True)
        prefill(model, cache(), prompt)  # warm-up (compiles)
        seconds = wall(lambda: prefill(model, cache(), prompt), 5)
        say(f"{name}: {args.layers} layers, prefill of {args.prompt} tokens {seconds * 1e3:.2f} ms (wall, best of 5)")
        profile(say, model, cache, prompt)
        if args.host_profile:
            host_profile(say, lambda: prefill(model, cache(), prompt), calls=3, sort="tottime", lines=30)

    m = args.prompt
    gen = torch.Generator().manual_seed(1)
    for label, (n, k) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
        q = tilemm.nn.Linear.from_float(lin, args.format, weight_only=True)
        x = (torch.randn(m, k, generator=gen) * 0.5).to(torch.bfloat16).to(device)
        row = [f"{label:9s} {n}x{k} M={m}:"]
        for tag, fn in (("F.linear", lambda: F.linear(x, lin.weight)), (args.format, lambda: q(x))):
            row.append(f"{tag} eager {loop_us(fn):7.1f} us/call, GPU {graph_us(fn):7.1f} us")
        say(" | ".join(row))
        if args.host_profile:
            host_profile(say, lambda: q(x))
    say.write(results_path(args.out_dir, "prefill-profile", device_name(device), "txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
