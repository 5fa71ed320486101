"""Per-layer time inside a stream of layers, as a model's CUDA graph runs them: cuBLAS bf16 against
tilemm's weight-only and block-scaled linears at small M.

    python benchmarks/bench_layer_stream.py [--ms 1,16] [--copies 8] [--formats mxfp4,nvfp4,mxfp8]

``bench_inference.py`` times one layer per CUDA-graph replay, after an L2 flush: each replay then
also pays the graph's launch latency and the kernel's ramp-up, a few microseconds that a layer in
the middle of a model's graph does not pay in full (its kernel follows the previous one). Here one
graph runs ``--copies`` layers of the same shape back to back, each with its own weight (together far
larger than the L2 cache, so every layer reads its weight from DRAM), on the same activation; the
time per layer is the replay's time divided by the copies (median of the replays, L2 flushed before
each). The ratio to bf16 is per layer, like bench_inference's, whose rule for the baseline it follows too
(cuBLAS timed before and after the others, the faster time counts). Writes what it prints to
``layer-stream-<gpu>.txt`` (``benchmarks/_results.py``); ``--cpu-smoke``: one 128x64 shape, M = 1, two
copies, on the CPU (wall times of the reference path).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import Transcript, add_options, command, device_name, results_path  # noqa: E402
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402

NK = [(14336, 4096), (4096, 14336), (8192, 8192)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_layer_stream.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--formats", default="mxfp4,nvfp4,mxfp8")
    ap.add_argument("--shapes", default=None, help="NxK,NxK,... (default: 14336x4096, 4096x14336, 8192x8192)")
    add_options(ap)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.ms, args.copies, args.shapes = "1", 2, "128x64"
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    timer = Timer(3 if args.cpu_smoke else 20, dev)
    copies = args.copies
    formats = args.formats.split(",")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else NK
    say = Transcript(command("bench_layer_stream.py", argv), device_name(dev))
    say(f"{device_name(dev)}: {copies} layers per graph; per-layer us and ratio to bf16")
    ratios: dict = {}
    for n, k in shapes:
        torch.manual_seed(0)
        lins = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        weights = [lin.weight.detach() for lin in lins]
        stacks = {}
        for fmt in formats:
            stacks[f"wo_{fmt}"] = [tilemm.nn.Linear.from_float(lin, fmt, weight_only=True) for lin in lins]
            stacks[f"bs_{fmt}"] = [tilemm.nn.Linear.from_float(lin, fmt) for lin in lins]
        del lins
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            def bf16():
                for w in weights:
                    F.linear(x, w)

            t_bf16 = timer(bf16)[0] / copies
            line = []
            for name, layers in stacks.items():
                def run(layers=layers):
                    for layer in layers:
                        layer(x)
                t = timer(run)[0] / copies
                line.append((name, t))
            t_bf16 = min(t_bf16, timer(bf16)[0] / copies)  # the faster of two, as in bench_inference
            for name, t in line:
                ratios.setdefault((name, m), []).append(t_bf16 / t)
            line = [f"{name} {t * 1e3:.1f} ({t_bf16 / t:.2f}x)" for name, t in line]
            say(f"N={n:5d} K={k:5d} M={m:3d} bf16 {t_bf16 * 1e3:.1f} | " + " | ".join(line))
        del stacks, weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    say("geomean over the shapes, ratio to bf16 per layer:")
    for (name, m), v in ratios.items():
        say(f"  {name:10s} M={m:3d} {math.exp(sum(map(math.log, v)) / len(v)):.2f}x")
    say.write(results_path(args.out_dir, "layer-stream", device_name(dev), "txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
