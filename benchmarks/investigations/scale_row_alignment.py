"""Scale rows padded to 16 bytes against contiguous ones, for weights whose N is not a multiple of 16.

    python benchmarks/investigations/scale_row_alignment.py [mxfp4,nvfp4,mxfp8]

``tilemm.prepack`` lays the (K / B, N) scale bytes out with rows padded to a multiple of 16 bytes
(``packed.aligned_scale_t``; a single NVFP4 weight's are row-major, (N, K / 16), since layout
version 3, so for NVFP4 N no longer sets the row length and the two cases below coincide where K / 16
is a multiple of 16), since the kernels' scale tiles are loaded by the tensor memory
accelerator, which takes 16-byte row strides only. For N = 1000 (K = 4000 and 4096) and 50257 (a
GPT-2-sized vocabulary), per format and M, this times the layer and the plan's kernel on the padded
scale rows and on the same bytes contiguous (row stride N, what ``prepack`` wrote before), as
ratios to cuBLAS bf16 ``F.linear`` in the same run (CUDA-graph replays, L2 flushed, median of 20).
Where the plan takes the decode design, only the layer is timed. cuBLAS bf16 is itself slow at
N = 50257 (its output rows are not 16-byte aligned either), so those ratios say more about cuBLAS.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402


def main() -> int:
    dev = torch.device("cuda")
    timer = Timer(20, dev)
    print("# scale rows padded to 16 bytes (aligned) against contiguous (stride N), the plan's kernel, same run")
    for fmt in sys.argv[1].split(",") if len(sys.argv) > 1 else ("mxfp4", "nvfp4", "mxfp8"):
        for n, k in ((1000, 4000), (1000, 4096), (50257, 4096)):
            torch.manual_seed(0)
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            layer = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
            p = layer.packed_weight()
            plain = p.scale_t.contiguous()
            for m in (1, 16, 64, 256):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                tb = timer(lambda: F.linear(x, lin.weight))[0]
                tl = timer(lambda: layer(x))[0]
                large = wl.plan(m, n, k, p.layout, sms=132)
                cells = []
                if large is None or large.kind == "fused":
                    for label, st in (("aligned", p.scale_t), ("contiguous", plain)):
                        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                        if large is None:
                            cfg = wo.plan(m, n, k, p.layout, 132)
                            prep = wo.Prepared(p.words, st, p.constants, wo.zero_bias(dev, n), p.layout, cfg, m, x.dtype)
                        else:
                            cfg = large
                            prep = wl.Prepared(p.words, st, p.constants, wo.zero_bias(dev, n), p.layout, cfg, m, 132, x.dtype)
                        t = timer(lambda: prep.run(x, out, torch.cuda.current_stream(dev)))[0]
                        cells.append(f"{label} {t*1e3:.1f}us {tb/t:.2f}x")
                    name = cfg.name
                else:
                    name = large.name
                print(f"{fmt} {n}x{k} M={m} bf16 {tb*1e3:.1f}us layer {tl*1e3:.1f}us {tb/tl:.2f}x | {name}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
