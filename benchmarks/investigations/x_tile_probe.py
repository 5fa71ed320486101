"""Fused configs of the large-M weight-only kernel (``hopper_weight_only_large``) timed side by side.

    python benchmarks/investigations/x_tile_probe.py [--formats mxfp4,nvfp4] [--ms 128,256,512,1024]
        [--configs plan,128x128c0,128x256c0] [--shapes 14336x4096,...]

Configs are ``<weight rows>x<rows of x>c<cat>``, optionally with ``s<split>`` (else the K split
``with_split`` gives) and ``g<group size>``; "plan" is what the committed plan picks. Every config is
checked against an fp32 product with the exactly dequantized weight (relative Frobenius error printed),
then timed as CUDA-graph replays with the L2 flushed (median; ``benchmarks/_timing.Timer``), as ratios
to cuBLAS bf16 ``F.linear`` in the same run. Weights are ``nn.Linear``'s random initialisation (NVFP4:
normal scales). ``benchmarks/results/x-tile-probe-*.txt`` holds what it measured, with the two kernel
variants it then timed (x loaded per plane; NVFP4 scales read row-major), since folded in or dropped.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm import packed as packed_mod  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402


def parse(spec: str) -> wl.LargeConfig:
    m = re.fullmatch(r"(\d+)x(\d+)c([01])(?:s(\d+))?(?:g(\d+))?", spec)
    if not m:
        raise ValueError(f"config {spec!r}: expected <weight rows>x<rows of x>c<cat: 0 or 1>[s<split>][g<group>]")
    tn, tm, cat, split, group = m.groups()
    return wl.LargeConfig("fused", int(tm), int(tn), cat=int(cat), split_k=int(split or 1),
                          group_size_m=int(group or 8))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="mxfp4,nvfp4")
    ap.add_argument("--ms", default="128,256,512,1024")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,8192x8192", help="NxK,...")
    ap.add_argument("--configs", default="plan,128x128c0,128x256c0")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = Timer(args.reps, dev)
    print(f"# {torch.cuda.get_device_name(dev)}; {args.configs}", flush=True)
    for fmt in args.formats.split(","):
        quantize = getattr(tilemm, f"quantize_{fmt}")
        for n, k in (tuple(map(int, s.split("x"))) for s in args.shapes.split(",")):
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            packed = tilemm.prepack(quantize(lin.weight.detach()))
            layout = packed_mod.layout_of(packed.fmt, packed.normal_scales)
            w_deq = tilemm.unpack(packed).dequantize().float()
            zero = wo.zero_bias(dev, n)
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = x.float() @ w_deq.T
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                t_bf16 = timer(lambda: F.linear(x, lin.weight))[0]
                cells = []
                for spec in args.configs.split(","):
                    if spec == "plan":
                        cfg = wl.plan(m, n, k, layout, sms=sms)
                        if cfg is None or cfg.kind != "fused":
                            cells.append(f"plan {cfg.name if cfg else 'small'}: not timed")
                            continue
                    else:
                        cfg = wl.with_split(parse(spec), m, n, k, layout, sms) if "s" not in spec else parse(spec)
                    try:
                        prep = wl.Prepared(packed.words, packed.scale_t, packed.constants, zero, layout, cfg, m,
                                           sms, x.dtype)
                        run = lambda: prep.run(x, out, torch.cuda.current_stream(dev))  # noqa: E731
                        out.fill_(float("nan"))
                        run()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        ms = timer(run)[0]
                        cells.append(f"{spec} {cfg.name} {ms * 1e3:.1f} us {t_bf16 / ms:.2f}x (err {err:.1e})")
                    except Exception as exc:  # a config that does not compile or run: say so, go on
                        cells.append(f"{spec}: {type(exc).__name__}: {str(exc)[:120]}")
                print(f"{fmt} N={n} K={k} M={m} bf16 {t_bf16 * 1e3:.1f} us | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
