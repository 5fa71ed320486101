"""How the L2 flush before each timed replay changes what a small-M matmul measures.

    python benchmarks/investigations/timing_flush.py

Times cuBLAS bf16 ``F.linear`` and the MXFP4 weight-only ``tilemm.nn.Linear`` at M = 1 as CUDA-graph
replays (median of 30) after each of: a flush by writes (zeroing 256 MB, which leaves the L2 full of
dirty lines), a flush by reads (summing 256 MB: clean lines, what ``_timing.Timer`` does), and no
flush. The shapes' bf16 weights are larger than the H100's 50 MB L2, so without a flush they still
come from DRAM.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import _graph_or_eager, median_ms  # noqa: E402

import tilemm  # noqa: E402

SHAPES = [(14336, 4096), (4096, 14336), (8192, 8192), (4096, 4096)]


def main() -> int:
    dev = torch.device("cuda")
    buf = torch.zeros(64 * 1024 * 1024, dtype=torch.float32, device=dev)
    sink = torch.empty((), dtype=torch.float32, device=dev)
    flushes = {"writes": buf.zero_, "reads": lambda: torch.sum(buf, dim=(0,), out=sink), "none": lambda: None}

    def median_us(run, flush, reps=30):  # each flush before its call's interval
        return median_ms(run, reps, before_each=flush) * 1e3

    print(f"{torch.cuda.get_device_name(dev)}; M = 1, bf16 activations; us per call, median of 30")
    print(f"{'N':>6} {'K':>6} {'flush':>7} {'bf16':>8} {'mxfp4 wo':>9} {'ratio':>6}")
    for n, k in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        layer = tilemm.nn.Linear.from_float(lin, "mxfp4", weight_only=True)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w = lin.weight.detach()
        run_bf16, _ = _graph_or_eager(lambda: F.linear(x, w))
        run_q, _ = _graph_or_eager(lambda: layer(x))
        for name, flush in flushes.items():
            tb, tq = median_us(run_bf16, flush), median_us(run_q, flush)
            print(f"{n:6d} {k:6d} {name:>7} {tb:8.1f} {tq:9.1f} {tb / tq:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
