"""Why did the fused large-M kernel's K split cost so much? Times, per shape and M, the fused kernel
(``hopper_weight_only_large``) of one tile config unsplit and with its K split (two launches: the
partial tiles, then their sum), and diagnostic copies of its split path (``_diag_kernel``), against
cuBLAS bf16, CUDA-graph replays with the L2 flushed (``benchmarks/_timing.py``):

    python benchmarks/investigations/split_probe.py --ms 128 --shapes 8192x8192,14336x4096 --splits 0,1,2 --diag 1,2,3
    python benchmarks/investigations/split_probe.py --ms 128 --shapes 4096x14336 --splits 0,2,4 --diag 1,4,5,6

Diagnostic modes (``--diag``, each at every ``--splits`` above 0, 1 included): 1 = the split path as
the kernel had it before the two launches (each item stores its partial tile, counts its arrival per
output tile, and the last arrival adds the partials and runs the epilogue); 2 = the K loop and the
partial tile's store only (no counter, no sum: no output, a timing of the loop alone); 3 = as 1 with
the loop from zeros (no peeled first K tile); 4 / 5 = as 1 with the partial tiles read / read and
written without TMA; 6 = 2, then the kernel's sum launch (``_partial_sum_kernel``: the two launches,
as the kernel now does).
Each output is checked against an fp32 product first. The modes with an arrival counter hang when a
block takes more than one work item (more items than blocks: keep splits x output tiles within the
SMs).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import cuda.tile as ct
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _timing
from _timing import Timer  # noqa: E402

import tilemm  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402
from tilemm.kernels._common import hinted, tile_coords_at  # noqa: E402
from tilemm.kernels.weight_only_kernels import _epilogue, _split_k_finish  # noqa: E402

COMPILE_TIMEOUT = 120  # seconds per kernel compile
ConstInt = ct.Constant[int]


def _finish_no_tma(out, C, Alpha, Bias, Partial, Counter, split, bm, bn, num_m, SPLIT_K, TM, TN, STORE_TMA):
    """``_split_k_finish`` with the partial tiles read (and, unless STORE_TMA, written) without TMA."""
    if STORE_TMA:
        ct.store(Partial, (split, bm, bn), out.reshape((1, TM, TN)))
    else:
        ct.store(Partial, (split, bm, bn), out.reshape((1, TM, TN)), allow_tma=False)
    tile = bn * num_m + bm
    arrived = ct.atomic_add(Counter, tile, 1)
    if arrived == SPLIT_K - 1:
        total = ct.zeros((TM, TN), ct.float32)
        for s in range(SPLIT_K):
            total = total + ct.load(Partial, (s, bm, bn), (1, TM, TN), padding_mode=ct.PaddingMode.ZERO,
                                    allow_tma=False).reshape((TM, TN))
        _epilogue(total, C, Alpha, Bias, bm, bn, TM, TN)
        ct.atomic_xchg(Counter, tile, 0)


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=8))
def _diag_kernel(X, W, S, C, Alpha, Mult, Bias, Partial, Counter, Splits,
                 ELEMENT: ConstInt, SCALE_E8M0: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                 GROUP: ConstInt, TM: ConstInt, TN: ConstInt, GROUP_SIZE_M: ConstInt,
                 LATENCY_W: ConstInt, LATENCY_X: ConstInt, X_PARTS: ConstInt, CAT: ConstInt,
                 SPLIT: ConstInt):
    """Diagnostic copies of the fused kernel's split path, mode ``SPLIT`` as the module docstring
    lists them (Counter: one int32 per output tile, zero between launches)."""
    M = X.shape[0]
    N = C.shape[1]
    TK = PLANES * GROUP * BLOCK
    k_tiles = ct.cdiv(X.shape[1], TK)
    num_m = ct.cdiv(M, TM)
    tiles = num_m * ct.cdiv(N, TN)
    per_split = ct.cdiv(k_tiles, Splits)
    for item in range(ct.bid(0), tiles * Splits, ct.num_blocks(0)):
        _, bm, bn = tile_coords_at(item % tiles, M, N, TM, TN, GROUP_SIZE_M)
        split = item // tiles
        k_begin = split * per_split
        k_end = max(min(k_begin + per_split, k_tiles), k_begin)
        if SPLIT == 3:  # from a zero accumulator, no peeled first K tile
            acc = ct.zeros((TN, TM), ct.float32)
            first = k_begin
        else:  # the first K tile peeled, as the kernel does
            acc = wl._step(X, W, S, Mult, ct.zeros((TN, TM), ct.float32), bm, bn, k_begin, ELEMENT, SCALE_E8M0,
                           BLOCK, PLANES, GROUP, TM, TN, LATENCY_W, LATENCY_X, X_PARTS, CAT)
            first = k_begin + 1
        for kt in range(first, k_end):
            acc = wl._step(X, W, S, Mult, acc, bm, bn, kt, ELEMENT, SCALE_E8M0, BLOCK, PLANES, GROUP, TM, TN,
                           LATENCY_W, LATENCY_X, X_PARTS, CAT)
        out = acc.transpose()
        if SPLIT == 2:
            ct.store(Partial, (split, bm, bn), out.reshape((1, TM, TN)))
        elif SPLIT >= 4:
            _finish_no_tma(out, C, Alpha, Bias, Partial, Counter, split, bm, bn, num_m, Splits, TM, TN, SPLIT == 4)
        else:
            _split_k_finish(out, C, Alpha, Bias, Partial, Counter, split, bm, bn, num_m, Splits, TM, TN)


def _launch(packed, x, out, zero, cfg, splits, sms, diag=0):
    """Without ``diag``: the fused kernel as ``hopper_weight_only_large.launch`` runs it, unsplit
    (``splits`` 0 or 1) or with ``splits`` K ranges (two launches). With ``diag``: ``_diag_kernel``
    in that mode with ``splits`` K ranges (1 included), and for mode 6 the kernel's sum launch after it."""
    m, n = out.shape
    dev = x.device
    if not diag:
        run_cfg = dataclasses.replace(cfg, split_k=splits) if splits > 1 else cfg
        return lambda: wl.launch(x, packed.words, packed.scale_t, packed.constants, zero, out, packed.layout,
                                 run_cfg, sms, torch._C._cuda_getCurrentRawStream(dev.index))
    consts = wl._constants(packed.layout, dataclasses.replace(cfg, split_k=2), 1)[:-1] + (2 if diag == 6 else diag,)
    kernel = hinted(_diag_kernel, num_worker_warps=ct.ByTarget(sm_90=cfg.warps))
    tiles = wl.output_tiles(cfg, m, n)
    grid = (max(1, min(tiles * splits, sms * cfg.occupancy // cfg.num_ctas)), 1, 1)
    alpha = packed.constants[0:1]

    def run():
        stream = torch._C._cuda_getCurrentRawStream(dev.index)
        partial, counter = wo.workspace(dev, stream, splits, m, n, tiles)
        ct.launch(stream, grid, kernel,
                  (x, packed.words, packed.scale_t, out, alpha, packed.constants[1:2], zero, partial, counter,
                   splits, *consts))
        if diag == 6:  # two launches: the partial tiles, then their sum and the epilogue (the kernel's)
            ct.launch(stream, (-(-m // wl.SUM_TILE[0]) * -(-n // wl.SUM_TILE[1]), 1, 1), wl._partial_sum_kernel,
                      (partial, out, alpha, zero, splits, *wl.SUM_TILE))
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="split_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="mxfp4")
    ap.add_argument("--ms", default="64,128,256")
    ap.add_argument("--shapes", default="14336x4096,8192x8192,4096x14336")
    ap.add_argument("--configs", default="128x128,128x128cat",
                    help="weight rows x rows of x, 'cat' for one MMA per K tile")
    ap.add_argument("--splits", default="0,1,2,4")
    ap.add_argument("--diag", default="", help="also these _diag_kernel modes (module docstring) at --splits > 0")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--verbose", action="store_true", help="print each candidate's first-call time")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = Timer(args.reps, dev)
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs; us per replay (ratio to cuBLAS bf16)", flush=True)
    cfgs = []
    for c in args.configs.split(","):
        cat = c.endswith("cat")
        tn, tm = map(int, c.removesuffix("cat").split("x"))
        cfgs.append((c, wl.LargeConfig("fused", tm, tn, cat=int(cat))))
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            packed = tilemm.nn.Linear.from_float(lin, fmt, weight_only=True).packed_weight()
            w = lin.weight.detach()
            w_deq = tilemm.unpack(packed).dequantize().float()
            zero = wo.zero_bias(dev, n)
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = x.float() @ w_deq.T
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                t_bf16 = timer(lambda: F.linear(x, w))[0]
                line = []
                for cname, cfg in cfgs:
                    runs = [(s, 0) for s in map(int, args.splits.split(",")) if s != 1]
                    runs += [(s, d) for d in map(int, filter(None, args.diag.split(",")))
                             for s in map(int, args.splits.split(",")) if s]
                    for s, d in runs:
                        fn = _launch(packed, x, out, zero, cfg, s, sms, diag=d)
                        out.fill_(float("nan"))
                        began = time.time()
                        with ct.compiler_timeout(COMPILE_TIMEOUT):
                            fn()
                        torch.cuda.synchronize()
                        if args.verbose:
                            print(f"#   {cname} s{s}: first call {time.time() - began:.1f} s", flush=True)
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        label = f"{cname}_s{s}{f'_d{d}' if d else ''}"
                        if not err < 1e-2 and d != 2:  # diag 2 writes no output
                            line.append(f"{label} WRONG ({err:.1e})")
                            continue
                        t = timer(fn)[0]
                        line.append(f"{label} {t * 1e3:.1f} ({t_bf16 / t:.2f})")
                print(f"{fmt} {n}x{k} M={m} bf16 {t_bf16 * 1e3:.1f} | " + " | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
