"""Sweep of the weight-only kernel's tile shape, hints and K split on one GPU (CUDA-graph replays, L2
flushed), against cuBLAS bf16 in the same run; the winners set ``weight_only_kernels.plan``.

    python benchmarks/investigations/tune_weight_only.py [--formats mxfp4] [--ms 1,16]
    python benchmarks/investigations/tune_weight_only.py --plans [--formats mxfp4,nvfp4,mxfp8] [--ms 1,4,16]
    python benchmarks/investigations/tune_weight_only.py --gemv-grid --warm-procs 24 --shapes 1024x4096,4096x4096

``--gemv-grid`` times, at M = 1, the FMA kernel's plan against every (K split, K tiles per load, blocks per
SM) of ``GEMV_GRID`` with the plan's 16-row blocks, each output checked bit for bit against the plan's;
``--warm-procs P`` first compiles them in P processes at once (cuTile's disk cache then serves the
timing process), since compiling, not timing, takes most of such a sweep.

``--plans`` times, instead of the tile-shape candidates, the configs ``plan`` can give: at each M the
default plan; at M = 1 also ``plan(..., m1_kernel=...)`` for every kernel of ``M1_KERNELS`` (the FMA
kernel and the MMA kernel with stacked K tiles), and the MMA kernel's other stacked block shape; from
2 to 16 rows the stacked block shapes of ``_STACKED`` (K split by ``_one_row_mma``'s rule).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402

NK = [(14336, 4096), (4096, 14336), (8192, 8192)]
# (tile_n, num_worker_warps, occupancy, blocks per SM the K split aims at)
CANDIDATES = [(128, 8, None, 1), (128, 8, 2, 2), (64, 4, 3, 3), (64, 4, 4, 4), (128, 8, 2, 4), (256, 8, None, 1)]


#: ``--gemv``: the FMA kernel's plan, and the plan with these fields replaced (a new tile_n gets the K
#: split ``gemv_split`` gives it). The 64- and 128-row blocks let one conversion of x feed 4 / 8 FMAs
#: (``benchmarks/decode_cost.py --gemv``: fewer instructions per weight element, no spills; 64 rows with
#: 8 K tiles per load for 8-bit weights).
GEMV_VARIANTS = [("plan", {}), ("occ8", dict(occupancy=8)), ("u4", dict(unroll=4)),
                 ("occ8_u4", dict(occupancy=8, unroll=4)), ("n64", dict(tile_n=64, occupancy=8, unroll=4)),
                 ("n64_u8", dict(tile_n=64, occupancy=4, unroll=8)), ("n128", dict(tile_n=128, occupancy=4, unroll=4))]


#: ``--gemv-grid``: (split_k, unroll, occupancy) of the FMA kernel's 16-row, 4-warp blocks; combinations
#: whose K split would leave a split without a load group are skipped at each K.
GEMV_GRID = [(s, u, o) for s in (1, 2, 4, 8, 16) for u in (1, 2, 4, 8) for o in (4, 8)]


def gemv_grid(n: int, k: int, layout, sms: int) -> list:
    """(label, config) pairs of ``--gemv-grid`` at one shape, the plan first (M = 1)."""
    base = wo.plan(1, n, k, layout, sms)
    out = [("plan", base)]
    k_tiles = -(-k // layout.tile_k)
    for split, unroll, occupancy in GEMV_GRID:
        if -(-k_tiles // unroll) < split:
            continue
        cfg = dataclasses.replace(base, tile_n=16, num_worker_warps=4, split_k=split, unroll=unroll,
                                  occupancy=occupancy)
        if cfg != base:
            out.append((f"s{split}u{unroll}o{occupancy}", cfg))
    return out


def _warm(args, part: str) -> int:
    """Compile (by launching once) the ``--gemv-grid`` configs of slice ``part`` ("i/P") of the sweep."""
    i, parts = map(int, part.split("/"))
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else NK
    packs = {}
    for fmt in args.formats.split(","):
        for n, k in shapes:
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            packs[fmt, n, k] = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True).packed_weight()
    jobs = [(key, cfg) for key, packed in packs.items() for _, cfg in gemv_grid(key[1], key[2], packed.layout, sms)]
    for (fmt, n, k), cfg in jobs[i::parts]:
        packed = packs[fmt, n, k]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        wo.launch(x, packed.words, packed.scale_t, packed.constants, torch.zeros(n, device=dev), out,
                  packed.layout, cfg)
    torch.cuda.synchronize()
    return 0


def gemv_split(cfg, n: int, k: int, layout, sms: int):
    """``cfg`` with the K split of ``weight_only_kernels._gemv``'s rule for its own tile_n: doubled
    while the blocks are fewer than the SMs and each split keeps at least one load."""
    tiles = -(-n // cfg.tile_n)
    groups = -(-(-(-k // layout.tile_k)) // cfg.unroll)
    split = 1
    while tiles * split < sms and split * 2 <= 16 and groups >= split * 2:
        split *= 2
    return dataclasses.replace(cfg, split_k=split)


def split_for(tiles: int, k_tiles: int, per_sm: int, sms: int) -> int:
    split = 1
    while tiles * split * 2 <= per_sm * sms and k_tiles >= split * 2 * 2:
        split *= 2
    return split


def plan_variants(m: int, n: int, k: int, layout, sms: int) -> list:
    """(label, config) pairs that ``--plans`` times at one shape: the default plan first."""
    out = [("plan", wo.plan(m, n, k, layout, sms))]
    if m == 1:
        out += [(f"m1={kind}", wo.plan(m, n, k, layout, sms, m1_kernel=kind)) for kind in wo.M1_KERNELS]
    if m <= 16:
        tile_m = 8 if m <= 8 else 16
        for tile_n, stack, warps, occupancy in wo._STACKED[tile_m]:
            split = 1
            stacks = -(-(-(-k // layout.tile_k)) // stack)
            while -(-n // tile_n) * split < sms and split * 2 <= 16 and stacks >= split * 4:
                split *= 2
            out.append((f"stack{stack}x{tile_n}", wo.WeightOnlyConfig(tile_m, tile_n, split, warps, occupancy, cat=1,
                                                                      stack=stack)))
    seen, unique = set(), []
    for label, cfg in out:
        if cfg not in seen:
            seen.add(cfg)
            unique.append((label, cfg))
    return unique


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tune_weight_only.py")
    ap.add_argument("--formats", default="mxfp4")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--candidates", default=None,
                    help="JSON list of [tile_n, warps, occupancy, per_sm(, unroll, cat)]")
    ap.add_argument("--shapes", default=None, help="NxK,NxK,... (default: the three of the targets)")
    ap.add_argument("--tile-m", type=int, default=None,
                    help="force this tile_m (default: the smallest of 16, 32, 64, 128 that covers M)")
    ap.add_argument("--plans", action="store_true",
                    help="time the configs plan can give (default, m1_kernel choices, stacked shapes)")
    ap.add_argument("--gemv", action="store_true",
                    help="time the FMA kernel's plan against more blocks per SM and fewer K tiles per load "
                         "(GEMV_VARIANTS; outputs checked bit for bit against the plan's)")
    ap.add_argument("--gemv-grid", action="store_true",
                    help="M = 1: the FMA kernel's plan against every K split / K tiles per load / blocks per SM "
                         "of GEMV_GRID (outputs checked bit for bit against the plan's)")
    ap.add_argument("--warm-procs", type=int, default=0,
                    help="--gemv-grid: compile the configs in this many processes first")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warm_part:
        return _warm(args, args.warm_part)
    if args.gemv_grid and args.warm_procs > 1:
        import subprocess
        argv_now = sys.argv[1:] if argv is None else list(argv)
        procs = [subprocess.Popen([sys.executable, __file__, *argv_now, "--warm-part", f"{i}/{args.warm_procs}"])
                 for i in range(args.warm_procs)]
        failed = [p.wait() for p in procs]
        if any(failed):
            print(f"warm-up: {sum(1 for f in failed if f)} of {len(procs)} processes failed", flush=True)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = Timer(20, dev)
    cands = json.loads(args.candidates) if args.candidates else CANDIDATES
    rows = []
    for fmt in args.formats.split(","):
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else NK
        for n, k in shapes:
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            w = lin.weight.detach()
            packed = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True).packed_weight()
            bias = torch.zeros(n, device=dev)
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t_bf16, _ = timer(lambda: F.linear(x, w))
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                line = []

                def time_cfg(cfg):
                    return timer(lambda: wo.launch(x, packed.words, packed.scale_t, packed.constants, bias, out,
                                                   packed.layout, cfg))[0]

                def against_plan(variants):
                    """Time (label, config) pairs, the first the reference: rows and their labels, each
                    output compared bit for bit with the first's (another K split: another sum order)."""
                    wo.launch(x, packed.words, packed.scale_t, packed.constants, bias, out, packed.layout,
                              variants[0][1])
                    want, timed = out.clone(), []
                    for label, cfg in variants:
                        out.fill_(float("nan"))
                        wo.launch(x, packed.words, packed.scale_t, packed.constants, bias, out, packed.layout, cfg)
                        same = torch.equal(out, want)
                        t = time_cfg(cfg)
                        row = {"fmt": fmt, "n": n, "k": k, "m": m, "cfg": cfg.name, "label": label,
                               "us": t * 1e3, "vs_bf16": t_bf16 / t, "same_bits": same}
                        rows.append(row)
                        differs = ("" if same else " (other sum order)" if cfg.split_k != variants[0][1].split_k
                                   else " DIFFERENT BITS")
                        timed.append((row, differs))
                    return timed

                if args.gemv_grid:
                    if m != 1:
                        continue
                    timed = against_plan(gemv_grid(n, k, packed.layout, sms))
                    plan_row, best = timed[0][0], min((r for r, _ in timed), key=lambda r: r["us"])
                    print(f"{fmt} N={n} K={k} M=1 bf16 {t_bf16 * 1e3:.1f} us | plan {plan_row['cfg']} "
                          f"{plan_row['vs_bf16']:.2f}x | best {best['label']} {best['cfg']} {best['us']:.1f} us "
                          f"{best['vs_bf16']:.2f}x | us: " + " ".join(f"{r['label']} {r['us']:.1f}{d}" for r, d in timed),
                          flush=True)
                    continue
                if args.gemv:
                    base = wo.plan(m, n, k, packed.layout, sms)
                    if not base.gemv:
                        continue
                    variants = []
                    for label, changes in GEMV_VARIANTS:
                        cfg = dataclasses.replace(base, **changes) if changes else base
                        if "tile_n" in changes:
                            cfg = gemv_split(cfg, n, k, packed.layout, sms)
                        variants.append((label, cfg))
                    line = [f"{r['label']} {r['cfg']}: {r['us']:.1f} us {r['vs_bf16']:.2f}x{d}"
                            for r, d in against_plan(variants)]
                    print(f"{fmt} N={n} K={k} M={m} bf16 {t_bf16 * 1e3:.1f} us | " + " | ".join(line), flush=True)
                    continue
                if args.plans:
                    for label, cfg in plan_variants(m, n, k, packed.layout, sms):
                        t = time_cfg(cfg)
                        rows.append({"fmt": fmt, "n": n, "k": k, "m": m, "cfg": cfg.name, "label": label,
                                     "us": t * 1e3, "vs_bf16": t_bf16 / t})
                        line.append(f"{label} {cfg.name}: {t * 1e3:.1f} us {t_bf16 / t:.2f}x")
                    print(f"{fmt} N={n} K={k} M={m} bf16 {t_bf16 * 1e3:.1f} us | " + " | ".join(line), flush=True)
                    continue
                for tn, warps, occ, per_sm, *extra in cands:
                    tm = args.tile_m or next(t for t in (16, 32, 64, 128) if t >= m)
                    tiles = -(-m // tm) * -(-n // tn)
                    split = split_for(tiles, -(-k // packed.layout.tile_k), per_sm, sms)
                    cfg = wo.WeightOnlyConfig(tm, tn, split, warps, occ, *extra)
                    t = time_cfg(cfg)
                    rows.append({"fmt": fmt, "n": n, "k": k, "m": m, "cfg": cfg.name, "per_sm": per_sm,
                                 "us": t * 1e3, "vs_bf16": t_bf16 / t})
                    line.append(f"{cfg.name}/{per_sm}: {t_bf16 / t:.2f}x")
                print(f"{fmt} N={n} K={k} M={m} bf16 {t_bf16 * 1e3:.1f} us | " + " | ".join(line), flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
