"""One row of x through the FMA kernel (``_gemv_kernel``) as bf16 and as fp32 holding the same values,
bf16 output both ways, against cuBLAS bf16 in the same run (CUDA-graph replays, L2 flushed).

    python benchmarks/investigations/gemv_fp32_x.py [--formats mxfp4,nvfp4] [--shapes 14336x4096,...]

Why: with bf16 x the kernel turns every x element into fp32 by bit operations once per weight row a
thread holds (one), about 0.9 of its 5.7 SASS instructions per weight element; fp32 x needs none (4.8,
``decode_cost``). The block-scaled layer's fake quant could write its bf16-exact activation as fp32
for this kernel. Worth building only if the fewer instructions show as time.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing, _results
from _results import Transcript, command, device_name, results_path  # noqa: E402
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gemv_fp32_x.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="mxfp4,nvfp4")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,8192x8192")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    timer = Timer(50, torch.device("cuda"))
    say = Transcript(command("investigations/gemv_fp32_x.py", argv), device_name(torch.device("cuda")))
    say(f"{'format':8s} {'N':>6s} {'K':>6s} {'bf16 us':>8s} {'x bf16 us':>10s} {'x fp32 us':>10s} {'plan':>28s}")
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
            layer = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
            runner = layer._make_runner(layer.weight_packed.device)
            x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
            x32 = x.float()
            a = runner(x)
            b = runner(x32, None, torch.bfloat16)
            diff = (a.float() - b.float()).abs().max().item() / a.float().abs().max().item()
            t_ref = timer(lambda: F.linear(x, lin.weight))[0] * 1e3
            t16 = timer(lambda: runner(x))[0] * 1e3
            t32 = timer(lambda: runner(x32, None, torch.bfloat16))[0] * 1e3
            say(f"{fmt:8s} {n:6d} {k:6d} {t_ref:8.1f} {t16:10.1f} {t32:10.1f} {runner.plan(1).name:>28s}"
                f"{'  ERR %.1e' % diff if diff > 1e-2 else ''}")
    say.write(results_path(args.out_dir, "gemv-fp32-x", device_name(torch.device("cuda")), "txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
