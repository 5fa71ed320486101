"""NVFP4 weight-only kernels with the e4m3 scale decode for normal scales (``Layout.normal_scales``:
one integer multiply-add per scale byte) against the general one (convert, then multiply), timed.

    python benchmarks/investigations/normal_scales_time.py [--ms 1,16,64,128,256] [--shapes 14336x4096,...]

For each shape and M it builds the kernel the plan picks (the small-M kernels or the large-M fused
kernel; the decode design is reported and skipped) twice from the same prepacked weight, once per
layout, checks both against an fp32 product with the exactly dequantized weight, and times
CUDA-graph replays with the L2 flushed (median; ``benchmarks/_timing.Timer``), as ratios to cuBLAS
bf16 ``F.linear`` in the same run. The weights are ``nn.Linear``'s random initialisation, whose
block scales are all normal.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,16,64,128,256")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,8192x8192,1024x4096", help="NxK,...")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = Timer(args.reps, dev)
    print(f"# {torch.cuda.get_device_name(dev)}; NVFP4 weight-only, general e4m3 scale decode against normal_scales",
          flush=True)
    for n, k in (tuple(map(int, s.split("x"))) for s in args.shapes.split(",")):
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        packed = tilemm.prepack(tilemm.quantize_nvfp4(lin.weight.detach()))
        general = wo.LAYOUTS["nvfp4"]
        normal = wo.NVFP4_NORMAL
        w_deq = tilemm.unpack(packed).dequantize().float()
        zero = wo.zero_bias(dev, n)
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w_deq.T
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            t_bf16 = timer(lambda: F.linear(x, lin.weight))[0]
            large = wl.plan(m, n, k, general, sms=sms)
            if large is not None and large.kind != "fused":
                print(f"nvfp4 N={n} K={k} M={m} | plan {large.name}: the decode design, not timed", flush=True)
                continue
            runs = {}
            for label, layout in (("general", general), ("normal", normal)):
                if large is None:
                    cfg = wo.plan(m, n, k, layout, sms)
                    prep = wo.Prepared(packed.words, packed.scale_t, packed.constants, zero, layout, cfg, m, x.dtype)
                else:
                    cfg = large
                    prep = wl.Prepared(packed.words, packed.scale_t, packed.constants, zero, layout, cfg, m, sms,
                                       x.dtype)
                runs[label] = (cfg.name, prep)
            cells = []
            for label, (name, prep) in runs.items():
                run = lambda: prep.run(x, out, torch.cuda.current_stream(dev))  # noqa: E731
                out.fill_(float("nan"))
                run()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = timer(run)[0]
                cells.append(f"{label} {ms * 1e3:.1f} us {t_bf16 / ms:.2f}x (err {err:.1e})")
            print(f"nvfp4 N={n} K={k} M={m} bf16 {t_bf16 * 1e3:.1f} us | {runs['general'][0]}: " + " | ".join(cells),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
