"""Few rows of x on weights with few rows: the FMA kernel (``_gemv_kernel``, all M rows per block)
against the layer as planned, on one GPU.

    python benchmarks/investigations/gemv_few_rows.py [--formats mxfp4,nvfp4] [--ms 2,4,8,16]
                                                      [--shapes 256x4096,1024x4096,2048x4096]

From 2 rows on, the plan took the tensor-core kernels, whose blocks hold 64 weight rows (one wgmma):
where N gives few such blocks (the k / v projections of grouped-query attention, 1024 x 4096), they
split K, and a split's finish costs microseconds (``tune-weight-only-gemv-split-*``). Per shape and
M this times the layer as planned (``tilemm.nn.Linear(weight_only=True)``, what a user runs) and,
without a K split, either the FMA kernel with tile_m = M (16 weight rows, 4 warps, 4 blocks per SM,
8 or 2 K tiles per load; it spends M FMAs and M conversions of x per weight element; M a power of two) or, with
``--stacked``, the MMA kernel's narrow stacked blocks (16 or 32 weight rows, K tiles stacked into the
wgmma's rows; ``--more-blocks`` adds, above 8 rows, two configs with more blocks, ``--eight-rows``
blocks of 8 weight rows), against cuBLAS bf16 in the same run (CUDA-graph replays, L2 flushed). Each output is
checked against the layer's (the two differ in the order of the fp32 sums, then each rounds to bf16:
"ERR" flags a relative difference of 1e-2 or more).
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
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402


def planned(layer, m: int) -> str:
    """The name of the design the layer's plan gives M rows: the large-M plan's config where it names
    one, else the small-M kernel's."""
    runner = layer._make_runner(layer.weight_packed.device)
    large, _ = runner._large_route(m, torch.bfloat16, torch.bfloat16)
    return "large " + large.name if large is not None else runner.plan(m).name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gemv_few_rows.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="mxfp4,nvfp4")
    ap.add_argument("--ms", default="2,4,8,16")
    ap.add_argument("--shapes", default="256x4096,1024x4096,2048x4096")
    ap.add_argument("--stacked", action="store_true",
                    help="instead of the FMA kernel: the MMA kernel's narrow stacked blocks without a K split "
                         "(tile_m 8 up to 8 rows, 16 above; weight_only_kernels._STACKED)")
    ap.add_argument("--more-blocks", action="store_true",
                    help="with --stacked, above 8 rows also: tile_m 8's narrow blocks over two M tiles "
                         "(twice the blocks, each weight tile read twice, the second time mostly from L2), "
                         "and tile_m 16 on 16 weight rows (one warpgroup, three blocks per SM)")
    ap.add_argument("--configs", default="",
                    help="also these stacked configs of the MMA kernel, at every M: tile_m x tile_n x stack x "
                         "split x warps x blocks per SM, comma-separated (e.g. 16x16x4x2x4x3)")
    ap.add_argument("--eight-rows", action="store_true",
                    help="with --stacked, also: blocks of 8 weight rows, 8 K tiles stacked (64 MMA rows, one "
                         "warpgroup, three blocks per SM)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    timer = Timer(20, dev)
    print(f"# {torch.cuda.get_device_name(dev)}; ratios: cuBLAS bf16 time / time (> 1 is faster)", flush=True)
    for fmt in args.formats.split(","):
        for n, k in (tuple(map(int, s.split("x"))) for s in args.shapes.split(",")):
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            layer = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
            packed = layer.packed_weight()
            w = lin.weight.detach()
            zero = torch.zeros(n, device=dev)
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t_bf16, _ = timer(lambda: F.linear(x, w))
                t_layer, _ = timer(lambda: layer(x))
                want = layer(x).float()
                line = [f"{fmt} N={n} K={k} M={m} bf16 {t_bf16 * 1e3:.1f} us | layer {t_layer * 1e3:.1f} us "
                        f"{t_bf16 / t_layer:.2f}x ({planned(layer, m)})"]
                if args.stacked:
                    tile_m = 8 if m <= 8 else 16
                    tile_n, stack, warps, occupancy = wo._STACKED[tile_m][1]
                    cfgs = [("stacked", wo.WeightOnlyConfig(tile_m, tile_n, 1, warps, occupancy, cat=1, stack=stack))]
                    if args.more_blocks and m > 8:
                        tile_n, stack, warps, occupancy = wo._STACKED[8][1]
                        cfgs.append(("8-row tiles", wo.WeightOnlyConfig(8, tile_n, 1, warps, occupancy, cat=1,
                                                                        stack=stack)))
                        tile_n, stack, warps, occupancy = wo._STACKED[16][2]  # 16 rows, 4 K tiles
                        cfgs.append(("16x16", wo.WeightOnlyConfig(16, tile_n, 1, warps, occupancy, cat=1, stack=stack)))
                    if args.eight_rows:
                        tile_n, stack, warps, occupancy = wo._STACKED[8][2]  # 8 rows, 8 K tiles
                        cfgs.append((f"{tile_m}x8 s8", wo.WeightOnlyConfig(tile_m, tile_n, 1, warps, occupancy, cat=1,
                                                                           stack=stack)))
                elif m & (m - 1) == 0:  # tile_m = M: cuTile tiles take powers of two
                    cfgs = [(f"fma u{u}", wo.WeightOnlyConfig(m, 16, 1, 4, 4, unroll=u, gemv=1)) for u in (8, 2)]
                else:
                    cfgs = []
                for spec in filter(None, args.configs.split(",")):
                    tm, tn, stack, split, warps, occupancy = map(int, spec.split("x"))
                    cfgs.append((spec, wo.WeightOnlyConfig(tm, tn, split, warps, occupancy, cat=1, stack=stack)))
                for label, cfg in cfgs:
                    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                    run = lambda: wo.launch(x, packed.words, packed.scale_t, packed.constants, zero, out,  # noqa: E731
                                            packed.layout, cfg)
                    try:
                        run()
                    except Exception as e:  # noqa: BLE001 (a config that does not compile: say so, go on)
                        line.append(f"{label} failed: {type(e).__name__}: {str(e)[:80]}")
                        continue
                    err = ((out.float() - want).norm() / want.norm()).item()
                    t, _ = timer(run)
                    line.append(f"{label} {t * 1e3:.1f} us {t_bf16 / t:.2f}x" + ("" if err < 1e-2 else f" ERR {err:.1e}"))
                print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
