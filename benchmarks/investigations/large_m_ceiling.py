"""What a cuTile tensor-core kernel reaches at prefill sizes when it has no decode to do: the project's
dense bf16 GEMM (``tilemm.kernels.hopper_gemm``, the ``ct.mma`` K loop the fused weight-only kernel is
built on) against cuBLAS bf16, beside the 4-bit weight-only layer as the plan runs it, per shape of
the inference benchmark.

    python benchmarks/investigations/large_m_ceiling.py [--ms 256,512,1024,2048,4096] [--format mxfp4]

Question: from M = 512 on, cuBLAS's bf16 GEMM is bound by the tensor cores, not by reading the
weight, so a 4-bit weight saves little there; a fused kernel can be no faster than the same ``ct.mma``
loop fed bf16 tiles that need no decode. The best dense config's speed-up over cuBLAS therefore bounds
what any fused cuTile design reaches at these sizes (decode + cuBLAS adds the decode to cuBLAS's time,
so it stays below 1.0 by construction).

Each dense config's output is checked against cuBLAS's (relative Frobenius error below 1e-2; a
failing config is reported and not timed). Times are CUDA-graph replays with the L2 flushed, median
of 20 (``benchmarks/_timing.py``); cuBLAS is timed before and after the others and the faster time is
the baseline, as in ``bench_inference.py``.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.kernels import hopper_gemm as hg  # noqa: E402

SHAPES = [(14336, 4096), (4096, 14336), (8192, 8192)]
#: Dense bf16 configs: the fused kernel's tile (128x128, two warpgroups) and the shapes a bf16 GEMM
#: favours on Hopper (128x256 / 256x128 with two MMA warpgroups), with deeper load pipelines.
CONFIGS = {
    "128x128": hg.GemmConfig(128, 128, 64),
    "128x128_l3": hg.GemmConfig(128, 128, 64, latency_a=3, latency_b=3),
    "128x256": hg.GemmConfig(128, 256, 64),
    "128x256_l3": hg.GemmConfig(128, 256, 64, latency_a=3, latency_b=3),
    "256x128": hg.GemmConfig(256, 128, 64),
    "128x256_pers": hg.GemmConfig(128, 256, 64, persistent=True),
}


def main():
    ap = argparse.ArgumentParser(prog="large_m_ceiling.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="256,512,1024,2048,4096")
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = Timer(20, dev)
    names = args.configs.split(",")
    ratios: dict[tuple[str, int], list[float]] = {}
    failed: set[str] = set()
    print(f"# {torch.cuda.get_device_name(dev)}; speed-up over cuBLAS bf16 (> 1 is faster)", flush=True)
    for n, k in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        w = lin.weight.detach()
        layer = tilemm.nn.Linear.from_float(lin, args.format, weight_only=True)
        w3 = w.unsqueeze(0)
        alpha = torch.ones(1, dtype=torch.float32, device=dev)
        bias = torch.zeros(n, dtype=torch.float32, device=dev)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x3 = x.unsqueeze(0)
            out = torch.empty(1, m, n, dtype=torch.bfloat16, device=dev)
            ref = F.linear(x, w).float()
            t_bf16, _ = timer(lambda: F.linear(x, w))
            res = {f"wo_{args.format}": timer(lambda: layer(x))[0]}
            for name in names:
                if name in failed:
                    continue
                cfg = CONFIGS[name]

                def dense(cfg=cfg):
                    hg.launch_gemm(x3, alpha, w3, alpha, out, alpha, bias, cfg, fast_acc=False, scaled=False)

                try:
                    dense()
                    torch.cuda.synchronize()
                    err = ((out[0].float() - ref).norm() / ref.norm()).item()
                except Exception as e:  # a config that does not compile here: say so, leave it out
                    print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    failed.add(name)
                    continue
                if not err < 1e-2:
                    print(f"  {name}: relative error {err:.2e}, left out", flush=True)
                    failed.add(name)
                    continue
                res[f"cutile_bf16_{name}"] = timer(dense)[0]
            t_again, _ = timer(lambda: F.linear(x, w))
            t_bf16 = min(t_bf16, t_again)
            speed = {key: t_bf16 / t for key, t in res.items()}
            best = max((v for key, v in speed.items() if key.startswith("cutile")), default=float("nan"))
            speed["cutile_bf16_best"] = best
            for key, v in speed.items():
                ratios.setdefault((key, m), []).append(v)
            print(f"{n}x{k} M={m} bf16 {t_bf16 * 1e3:.1f}us ({2 * m * n * k / t_bf16 / 1e9:.0f} TFLOPS): "
                  + " | ".join(f"{key} {v:.2f}x" for key, v in speed.items()), flush=True)
        del layer
        torch.cuda.empty_cache()
    print("geomean over the shapes:")
    for (key, m), vs in sorted(ratios.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        print(f"  {key:28s} M={m:5d} {math.exp(sum(math.log(v) for v in vs) / len(vs)):.2f}x")


if __name__ == "__main__":
    main()
