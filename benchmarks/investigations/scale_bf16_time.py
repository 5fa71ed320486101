"""What prepacked bf16 block scales would save the weight-only kernels, timed on a GPU.

    python benchmarks/investigations/scale_bf16_time.py [--formats mxfp4,nvfp4] [--ms 16,64,128,256]

``scale_bf16_cost.py`` counts the saving in SASS; this script times it. For each shape and M it runs
the kernel the plan picks (the small-M kernels, or the large-M fused kernel) twice: as committed, and
with ``_multipliers`` replaced, for this process only, by one that takes the scales as the bf16
multipliers themselves (``scale_bf16_cost._with_bf16_scales``). The stand-in's scale tensor is the
byte scales cast to bf16, so its outputs are not the layer's (only the timing means anything); the
bytes it reads per block are the two a bf16 layout would store. Where the plan takes the decode
design (decode to bf16, then cuBLAS) the row says so and times nothing else.

CUDA-graph replays with L2 flushed, median (``benchmarks/_timing.Timer``); ratios to cuBLAS bf16
``F.linear`` in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scale_bf16_cost
import scale_bf16_cost  # noqa: E402
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Bf16Layout(wo.Layout):
    """The layout with SCALE_MODE = scale_bf16_cost.BF16_SCALES: the kernels read S as bf16 multipliers."""

    @property
    def scale_mode(self) -> int:
        return scale_bf16_cost.BF16_SCALES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="mxfp4,nvfp4")
    ap.add_argument("--ms", default="16,64,128,256")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,8192x8192", help="NxK,...")
    args = ap.parse_args(argv)
    wo._multipliers = scale_bf16_cost._with_bf16_scales(wo._multipliers)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = Timer(20, dev)
    print(f"# python benchmarks/investigations/scale_bf16_time.py --formats {args.formats} --ms {args.ms} "
          f"--shapes {args.shapes}")
    print(f"# {torch.cuda.get_device_name(dev)}; CUDA-graph replays, L2 flushed, median of 20; x: ratio to "
          "cuBLAS bf16 in the same run")
    for fmt in args.formats.split(","):
        for n, k in (tuple(map(int, s.split("x"))) for s in args.shapes.split(",")):
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            packed = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True).packed_weight()
            layout = packed.layout
            bl = Bf16Layout(layout.format, layout.planes, layout.group)
            scale16 = packed.scale_t.to(torch.bfloat16)
            zero = wo.zero_bias(dev, n)
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                t_bf16 = timer(lambda: F.linear(x, lin.weight))[0]  # ms
                large = wl.plan(m, n, k, layout, sms=sms)
                if large is not None and large.kind != "fused":
                    print(f"{fmt} N={n} K={k} M={m} bf16 {t_bf16 * 1e3:.1f} us | plan {large.name}: the decode design, "
                          "not timed", flush=True)
                    continue
                if large is None:
                    cfg = wo.plan(m, n, k, layout, sms)
                    byte = wo.Prepared(packed.words, packed.scale_t, packed.constants, zero, layout, cfg, m, x.dtype)
                    wide = wo.Prepared(packed.words, scale16, packed.constants, zero, bl, cfg, m, x.dtype)
                    name = cfg.name
                else:
                    cfg, name = large, large.name
                    byte = wl.Prepared(packed.words, packed.scale_t, packed.constants, zero, layout, cfg, m, sms,
                                       x.dtype)
                    wide = wl.Prepared(packed.words, scale16, packed.constants, zero, bl, cfg, m, sms, x.dtype)
                cells = []
                for label, prepared in (("byte scales", byte), ("bf16 scales", wide)):
                    ms = timer(lambda: prepared.run(x, out, torch.cuda.current_stream(dev)))[0]
                    cells.append(f"{label} {ms * 1e3:.1f} us {t_bf16 / ms:.2f}x")
                print(f"{fmt} N={n} K={k} M={m} bf16 {t_bf16 * 1e3:.1f} us | {name}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
