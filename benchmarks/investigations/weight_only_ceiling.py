"""Load-only ceilings of the weight-only kernel at one row of x: how fast cuTile kernels that only
load what the FMA kernel loads (the prepacked weight words, its scale bytes and x) run, against cuBLAS
bf16 and tilemm's weight-only layer in the same run, per shape of the inference benchmark.

    python benchmarks/investigations/weight_only_ceiling.py [mxfp4,nvfp4,mxfp8]
    python benchmarks/investigations/weight_only_ceiling.py mxfp4 --stream 8   # per layer inside a graph of 8 layers

A kernel cannot stream its operands faster than a kernel that loads the same tiles and does nothing
else with them, so the load-only speed-up over bf16 bounds what any decode built on these loads
reaches. Variants (name: rows per block, K tiles per load, blocks per SM):

* ``tma16u8o4``: the FMA kernel's loads (``ct.load`` tiles, TMA), one block per 16 weight rows;
* ``ldg*``: the same tiles loaded without TMA (``allow_tma=False``: plain global loads to registers);
* ``tma16u4o8``: half the bytes per load, twice the blocks per SM;
* ``pers*``: a persistent grid (SMs x blocks per SM), each block looping over row blocks.

Each load-only kernel sums what it loads (so no load can be dropped) and stores one value per row.
``hbm`` is the bound of the weight's bytes at the device-to-device copy bandwidth of the same run.
cuBLAS is timed before and after the others at each shape; the faster time is the baseline.
``--stream N`` times, per layer, graphs of N layers of one shape with their own weights (as
``bench_layer_stream.py`` does) for cuBLAS, the layer and the fastest load-only variants.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import cuda.tile as ct
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
Z = ct.PaddingMode.ZERO


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=4))
def load_only(X, W, S, C, TN: ConstInt, WORDS: ConstInt, UNROLL: ConstInt, SC: ConstInt, TK: ConstInt,
              TMA: ConstBool, ROWS: ConstBool):
    # ROWS: S holds row-major scales (N, K / B), as a single NVFP4 weight's (``Layout.scale_rows``).
    bn = ct.bid(0)
    groups = ct.cdiv(W.shape[1], UNROLL * WORDS)
    acc = ct.zeros((TN, UNROLL * WORDS), ct.int32)
    xacc = ct.zeros((1, UNROLL * TK), ct.float32)
    sacc = ct.zeros((UNROLL * SC, TN), ct.int32)
    racc = ct.zeros((TN, UNROLL * SC), ct.int32)
    for g in range(groups):
        acc = acc + ct.load(W, (bn, g), (TN, UNROLL * WORDS), padding_mode=Z, allow_tma=TMA)
        if ROWS:
            racc = racc + ct.load(S, (bn, g), (TN, UNROLL * SC), padding_mode=Z, allow_tma=TMA).astype(ct.int32)
        else:
            sacc = sacc + ct.load(S, (g, bn), (UNROLL * SC, TN), padding_mode=Z, allow_tma=TMA).astype(ct.int32)
        xacc = xacc + ct.load(X, (0, g), (1, UNROLL * TK), padding_mode=Z, allow_tma=TMA).astype(ct.float32)
    scales = ct.sum(racc, axis=1) if ROWS else ct.sum(sacc, axis=0)
    tot = ct.sum(acc, axis=1).astype(ct.float32) + scales.astype(ct.float32) + ct.sum(xacc)
    ct.store(C, (bn,), tot)


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=4))
def load_only_persistent(X, W, S, C, TN: ConstInt, WORDS: ConstInt, UNROLL: ConstInt, SC: ConstInt,
                         TK: ConstInt, ROWS: ConstBool):
    groups = ct.cdiv(W.shape[1], UNROLL * WORDS)
    tiles = ct.cdiv(W.shape[0], TN)
    for bn in range(ct.bid(0), tiles, ct.num_blocks(0)):
        acc = ct.zeros((TN, UNROLL * WORDS), ct.int32)
        xacc = ct.zeros((1, UNROLL * TK), ct.float32)
        sacc = ct.zeros((UNROLL * SC, TN), ct.int32)
        racc = ct.zeros((TN, UNROLL * SC), ct.int32)
        for g in range(groups):
            acc = acc + ct.load(W, (bn, g), (TN, UNROLL * WORDS), padding_mode=Z)
            if ROWS:
                racc = racc + ct.load(S, (bn, g), (TN, UNROLL * SC), padding_mode=Z).astype(ct.int32)
            else:
                sacc = sacc + ct.load(S, (g, bn), (UNROLL * SC, TN), padding_mode=Z).astype(ct.int32)
            xacc = xacc + ct.load(X, (0, g), (1, UNROLL * TK), padding_mode=Z).astype(ct.float32)
        scales = ct.sum(racc, axis=1) if ROWS else ct.sum(sacc, axis=0)
        tot = ct.sum(acc, axis=1).astype(ct.float32) + scales.astype(ct.float32) + ct.sum(xacc)
        ct.store(C, (bn,), tot)


# (name, weight rows per block, K tiles per load, blocks per SM, TMA, persistent grid)
VARIANTS = [("tma16u8o4", 16, 8, 4, True, False), ("ldg16u8o4", 16, 8, 4, False, False),
            ("ldg16u4o4", 16, 4, 4, False, False), ("tma16u4o8", 16, 4, 8, True, False),
            ("pers16u8o4", 16, 8, 4, True, True), ("pers64u4o2", 64, 4, 2, True, True)]


def kernel_for(persistent, occ):
    return (load_only_persistent if persistent else load_only).replace_hints(occupancy=occ)


def launcher(variant, kernel, packed, x, out, sms):
    """A function that launches the load-only ``variant`` over the prepacked weight ``packed``."""
    _, tn, unroll, occ, tma, pers = variant
    tiles = -(-packed.words.shape[0] // tn)
    grid = (min(tiles, sms * occ) if pers else tiles, 1, 1)
    L = packed.layout
    args = (x, packed.words, packed.scale_t, out, tn, L.words_per_tile, unroll, L.planes * L.group, L.tile_k)
    args = (args if pers else args + (tma,)) + (packed.scale_rows,)
    return lambda: ct.launch(torch.cuda.current_stream(), grid, kernel, args)


SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]


def geomeans(fmt, ratios, what):
    print(f"{fmt} geomean of 6{what}: " + " ".join(
        f"{a} {math.exp(sum(map(math.log, v)) / len(v)):.2f}x" for a, v in ratios.items()), flush=True)
    print(f"{fmt} geomean of 14336x4096, 4096x14336, 8192x8192{what}: " + " ".join(
        f"{a} {math.exp(sum(map(math.log, v[1:4])) / 3):.2f}x" for a, v in ratios.items()), flush=True)


def stream(fmt, copies, timer, sms, kernels):
    """Per-layer ratios to bf16 inside graphs of ``copies`` layers, each with its own weight."""
    dev = torch.device("cuda")
    ratios = {}
    for n, k in SHAPES:
        lins = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        weights = [lin.weight.detach() for lin in lins]
        layers = [tilemm.nn.Linear.from_float(lin, fmt, weight_only=True) for lin in lins]
        del lins
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        c = torch.empty(n, dtype=torch.float32, device=dev)

        def bf16():
            for w in weights:
                F.linear(x, w)

        def run_layers():
            for layer in layers:
                layer(x)

        t_bf16 = timer(bf16)[0]
        res = {"layer": timer(run_layers)[0]}
        for variant in VARIANTS:
            name = variant[0]
            if name not in ("tma16u8o4", "pers16u8o4"):
                continue
            launches = [launcher(variant, kernels[name], layer.packed_weight(), x, c, sms) for layer in layers]

            def run(launches=launches):
                for launch in launches:
                    launch()

            res[name] = timer(run)[0]
        t_bf16 = min(t_bf16, timer(bf16)[0])
        res = {key: t_bf16 / t for key, t in res.items()}
        for key, v in res.items():
            ratios.setdefault(key, []).append(v)
        print(f"{fmt} {n}x{k} M=1, {copies} layers per graph, bf16 {t_bf16 / copies * 1e3:.1f}us per layer: "
              + " ".join(f"{a} {b:.2f}x" for a, b in res.items()), flush=True)
        del layers, weights
        torch.cuda.empty_cache()
    geomeans(fmt, ratios, f", {copies} layers per graph")


def main():
    ap = argparse.ArgumentParser(prog="weight_only_ceiling.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("formats", nargs="?", default="mxfp4")
    ap.add_argument("--stream", type=int, default=0, help="layers per graph (0: one layer per replay)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = Timer(30, dev)
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (timer(lambda: dst.copy_(src))[0] * 1e-3)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    kernels = {v[0]: kernel_for(v[5], v[3]) for v in VARIANTS}
    for fmt in args.formats.split(","):
        if args.stream:
            stream(fmt, args.stream, timer, sms, kernels)
            continue
        ratios = {}
        for n, k in SHAPES:
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            w = lin.weight.detach()
            layer = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True)
            p = layer.packed_weight()
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            c = torch.empty(n, dtype=torch.float32, device=dev)
            t_bf16, _ = timer(lambda: F.linear(x, w))
            t_lay, _ = timer(lambda: layer(x))
            bound = (p.words.numel() * 4 + p.scale_t.numel()) / bw * 1e3
            res = {"hbm": t_bf16 / bound, "layer": t_bf16 / t_lay}
            for variant in VARIANTS:
                res[variant[0]] = t_bf16 / timer(launcher(variant, kernels[variant[0]], p, x, c, sms))[0]
            # cuBLAS again, after the others: a shape's first measurement can run slow
            # (results/timing-flush-*.txt); the faster of the two is the baseline, as in bench_inference.
            t_again, _ = timer(lambda: F.linear(x, w))
            if t_again < t_bf16:
                res = {key: v * t_again / t_bf16 for key, v in res.items()}
                t_bf16 = t_again
            for key, v in res.items():
                ratios.setdefault(key, []).append(v)
            print(f"{fmt} {n}x{k} M=1 bf16 {t_bf16 * 1e3:.1f}us: "
                  + " ".join(f"{a} {b:.2f}x" for a, b in res.items()), flush=True)
        geomeans(fmt, ratios, "")


if __name__ == "__main__":
    main()
