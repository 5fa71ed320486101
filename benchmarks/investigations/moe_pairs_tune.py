"""The per-pair MoE kernel's block shape (``moe_kernels.PairsConfig``: weight rows per block, blocks
per SM, K tiles per load) timed on the layers that take the per-pair design: gpt-oss-20b / 120b at
T = 1, 2, 4 and the Qwen-shaped anchor (NVFP4, MXFP4) at T = 1, 2, 4, uniform and skewed routing.

    python benchmarks/investigations/moe_pairs_tune.py [--reps 20] [--plans base,rows32]

Each plan is a function (K, layout) -> PairsConfig that replaces ``moe_kernels._pairs_config`` (the
block ``moe_kernels.plan`` takes) for the whole layer (gate_up and down); ``combine`` / ``no_combine``
keep the block and force the down projection's weighted sum into its epilogue or out of it. Every plan's output is
compared bit for bit with the committed plan's (the same fp32 sums; a block shape whose reduction over
K runs in another order shows as DIFFERENT BITS, as 8-row blocks did on an H100), then the layer is
timed as ``bench_moe.py`` times it (CUDA-graph replays, L2 flushed, median). The SASS counts:
``benchmarks/results/decode-cost-moe-pairs-sm90.txt``; the H100 runs, in order (the first with 4
blocks per SM and up to 8 K tiles per load as the committed plan, the last one after it became 8
blocks per SM and at most 4): ``moe-pairs-tune-nvidia-h100-80gb-hbm3.txt``; with ``--sorted``:
``moe-pairs-tune-sorted-nvidia-h100-80gb-hbm3.txt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys

import torch

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parents[2])]

from tilemm.kernels import moe_kernels as mk  # noqa: E402
from tilemm.moe import MoEExperts  # noqa: E402
from bench_moe import random_packed, routing  # noqa: E402
from _results import Transcript, add_options, command, device_name, results_path  # noqa: E402

LAYERS = [("gpt-oss-20b", 2880, 2880, 32, 4, "mxfp4", "gpt-oss", (1, 2, 4)),
          ("gpt-oss-120b", 2880, 2880, 128, 4, "mxfp4", "gpt-oss", (1, 4, 8)),
          ("anchor", 2048, 512, 256, 8, "nvfp4", "silu", (1, 2, 4)),
          ("anchor", 2048, 512, 256, 8, "mxfp4", "silu", (1, 2, 4))]
SMOKE_LAYERS = [("tiny", 512, 256, 8, 2, "mxfp4", "gpt-oss", (1, 2)),
                ("tiny-silu", 512, 256, 8, 2, "nvfp4", "silu", (1, 2))]

_COMMITTED = mk._pairs_config.__wrapped__


def _rows(tile_n: int, occupancy_for_unroll: dict):
    @functools.lru_cache(maxsize=None)  # one config object per case: its kernel is hinted once
    def plan(k, layout):
        unroll = _COMMITTED(k, layout).unroll
        return mk.PairsConfig(unroll, tile_n=tile_n, occupancy=occupancy_for_unroll.get(unroll, 4))
    return plan


# Every plan's combining launch (the down projection's weighted sum, T >= 2) takes PairsConfig's
# defaults for it (two pairs per step, 6 blocks per SM, since they were adopted); the runs recorded
# before that ran one pair per step at the plan's own occupancy.
PLANS = {
    "base": _COMMITTED,
    # 32 weight rows per block: fewer address and loop instructions per weight element; blocks per
    # SM lowered where 4 would spill (the SASS counts).
    "rows32": _rows(32, {2: 4, 4: 2, 8: 2}),
    "rows32_occ3": _rows(32, {2: 3, 4: 3, 8: 2}),
    "rows16_occ2": _rows(16, {2: 2, 4: 2, 8: 2}),
    # More blocks in flight per SM (the launches at a few tokens wait on each block's loads): the
    # compiler's register budget for 6 or 8 blocks of 4 warps; and 8-row blocks, twice as many.
    "occ6": _rows(16, {2: 6, 4: 6, 8: 6}),
    "occ8": _rows(16, {2: 8, 4: 8, 8: 8}),
    "rows8_occ8": _rows(8, {2: 8, 4: 8, 8: 8}),
    # 64 weight rows per block: each thread then holds four rows, so one conversion of x to fp32 feeds
    # four FMAs (``decode_cost.py --moe-pairs``: 4.76 against 5.66 instructions per weight element at 4 K
    # tiles per load, MXFP4, no spills at 8 blocks per SM).
    "rows64": _rows(64, {2: 8, 4: 8, 8: 8}),
}


def _half_unroll(k, layout):
    """Half the committed K tiles per load (at least 2): a block's K loop of two or more loads, so
    that its next load is in flight while the current one is decoded."""
    unroll = _COMMITTED(k, layout).unroll
    return mk.PairsConfig(max(2, unroll // 2))


PLANS["half_unroll"] = functools.lru_cache(maxsize=None)(_half_unroll)
#: Plans that keep the block and force the down projection's weighted sum in its epilogue on or off
#: (``moe_kernels._combine_pays``) instead.
COMBINE_PLANS = {"combine": True, "no_combine": False}
PLANS.update({name: _COMMITTED for name in COMBINE_PLANS})
# (Since the committed plan took 8 blocks per SM and at most 4 K tiles per load, occ8 is the committed
# plan and occ8_half is half_unroll; kept by name for the recorded runs.)
PLANS["occ8_half"] = functools.lru_cache(maxsize=None)(
    lambda k, layout: mk.PairsConfig(max(2, _COMMITTED(k, layout).unroll // 2), occupancy=8))


def _slots(slots: int, occupancy: int):
    """The committed block, with a combining launch running ``slots`` pairs per step at
    ``occupancy`` blocks per SM (``PairsConfig.slots`` / ``combine_occupancy``)."""
    @functools.lru_cache(maxsize=None)
    def plan(k, layout):
        return dataclasses.replace(_COMMITTED(k, layout), slots=slots, combine_occupancy=occupancy)
    return plan


#: The combining launch: one pair per step at 8 blocks per SM (the design before two pairs per step),
#: two per step at 8 (spills) or 6, one per step at 6.
PLANS.update({"slots1_occ8": _slots(1, 8), "slots2_occ8": _slots(2, 8), "slots2_occ6": _slots(2, 6),
              "slots1_occ6": _slots(1, 6)})
_COMMITTED_SORTED = mk._sorted_config

#: The sorted design's configs for many tokens (``--sorted``): replacements of ``moe_kernels._sorted_config``.
SORTED_PLANS = {
    "base": _COMMITTED_SORTED,
    "m64": lambda tokens, top_k, num_experts, layout: mk._config(64, layout),
    "m128_w8_occ1": lambda tokens, top_k, num_experts, layout: mk.MoEConfig(128, 128, 8, 1),
    "m128x64_w4": lambda tokens, top_k, num_experts, layout: mk.MoEConfig(128, 64, 4, 1),
}
SORTED_LAYERS = [("gpt-oss-20b", 2880, 2880, 32, 4, "mxfp4", "gpt-oss", (256, 1024)),
                 ("gpt-oss-120b", 2880, 2880, 128, 4, "mxfp4", "gpt-oss", (1024,))]
SMOKE_SORTED_LAYERS = [("tiny", 512, 256, 8, 2, "mxfp4", "gpt-oss", (40,))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moe_pairs_tune.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--plans", default=None, help="comma-separated (default: all of the mode's)")
    ap.add_argument("--layers", default=None, help="comma-separated name:format, e.g. anchor:nvfp4 (default: all)")
    ap.add_argument("--ts", default=None, help="comma-separated T (default: each layer's)")
    ap.add_argument("--sorted", action="store_true",
                    help="the sorted design's tile configs at T = 256 / 1024 instead (plans: "
                    + ", ".join(SORTED_PLANS) + ")")
    add_options(ap)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    say = Transcript(command("investigations/moe_pairs_tune.py", argv), device_name(device))
    timer = None
    if device.type == "cuda":
        from _timing import Timer

        timer = Timer(args.reps, device)
    table = SORTED_PLANS if args.sorted else PLANS
    plans = {name: table[name] for name in (args.plans.split(",") if args.plans else table)}
    attribute = "_sorted_config" if args.sorted else "_pairs_config"
    committed = getattr(mk, attribute)
    combine_pays = mk._combine_pays
    failed = False
    if args.sorted:
        layers = SMOKE_SORTED_LAYERS if args.cpu_smoke else SORTED_LAYERS
    else:
        layers = SMOKE_LAYERS if args.cpu_smoke else LAYERS
    if args.layers:
        layers = [lay for lay in layers if f"{lay[0]}:{lay[5]}" in args.layers.split(",")]
    for name, hidden, inter, e, k, fmt, activation, tokens in layers:
        if args.ts:
            tokens = tuple(int(t) for t in args.ts.split(","))
        gen = torch.Generator().manual_seed(0)
        biases = activation == "gpt-oss"
        gub = torch.randn(e, 2 * inter, generator=gen).to(device) * 0.1 if biases else None
        db = torch.randn(e, hidden, generator=gen).to(device) * 0.1 if biases else None
        ours = MoEExperts(random_packed(fmt, e, 2 * inter, hidden, device, seed=1),
                          random_packed(fmt, e, hidden, inter, device, seed=2), gub, db, activation=activation)
        for kind in ("uniform", "skewed"):
            for t in tokens:
                ids, weights = routing(kind, t, e, k, device, gen)
                x = (torch.randn(t, hidden, generator=gen) * 0.5).to(torch.bfloat16).to(device)
                cells, want = [], None
                for pname, plan in plans.items():
                    setattr(mk, attribute, plan)
                    if pname in COMBINE_PLANS and not args.sorted:
                        mk._combine_pays = (lambda v: lambda *a, **k: v)(COMBINE_PLANS[pname])
                    ours._launches.clear()  # the module keeps its prepared launches: plan them anew
                    try:
                        got = ours(x, ids, weights)
                        if want is None:
                            want = got
                        elif not torch.equal(got, want):
                            failed = True
                            cells.append(f"{pname} DIFFERENT BITS")
                            continue
                        if timer is None:
                            cells.append(f"{pname} ok")
                            continue
                        ms, _ = timer(lambda: ours(x, ids, weights))
                        cells.append(f"{pname} {ms * 1e3:7.1f} us")
                    finally:
                        setattr(mk, attribute, committed)
                        mk._combine_pays = combine_pays
                        ours._launches.clear()
                say(f"{name:12s} {fmt} {kind:7s} T={t:<3d} " + " | ".join(cells))
    path = results_path(args.out_dir, "moe-pairs-tune", device_name(device), "txt",
                        variant="sorted" if args.sorted else None)
    say.write(path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
