"""What prepacked bf16 block scales would save the weight-only kernels, counted without a GPU.

    python benchmarks/investigations/scale_bf16_cost.py

The weight-only kernels read each block scale as a byte and turn it into the bf16 multiplier
``scale * 2^(OFFSET - E)`` in the K loop (``weight_only_kernels._multipliers``): for e8m0 (MXFP4 /
MXFP8) an integer multiply-add and a min, for e4m3 (NVFP4) a conversion through fp16 and a multiply.
In the MMA operand's register layout each thread makes that multiplier for four times the blocks its
elements use. A prepacked layout could store the multiplier itself, as bf16 (exact: an e4m3 or e8m0
value times a power of two that ``prepack``'s E keeps in range), two bytes per block instead of one
(MXFP4 +3 % bytes per weight element, NVFP4 +11 %).

This script compiles the large-M fused kernel (``hopper_weight_only_large._large_kernel``) and the
small-M kernels as ``plan`` picks them at M = 1 and 16 for sm_90, twice per config: as it is, and with ``_multipliers`` replaced, for this process only, by one that
takes S as those bf16 words (SCALE_MODE = 3, a value no layout has). It then counts the main loop as
``benchmarks/decode_cost.py`` does (SASS instructions per weight element). It runs nothing and
changes no committed kernel: a count to decide on, before building the layout.
"""

from __future__ import annotations

import pathlib
import sys

import cuda.tile as ct
from cuda.tile import compilation as cc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: decode_cost
import decode_cost  # noqa: E402

from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402
from tilemm.kernels._aot import AotVariant, array  # noqa: E402

#: The configs counted: the fused kernel's first candidate (128 x 128, one MMA per K tile) and the
#: one-warpgroup split blocks the plan takes at few rows of x.
CONFIGS = (wl.CANDIDATES[0], wl.LargeConfig("fused", 16, 64, warps=4, occupancy=3, split_k=2),
           wl.LargeConfig("fused", 64, 64, warps=4, occupancy=2, split_k=2))
BF16_SCALES = 3  # the SCALE_MODE value that selects the stand-in below


def _with_bf16_scales(original):
    def multipliers(s_raw, Mult, SCALE_MODE):
        if SCALE_MODE == BF16_SCALES:  # S holds the multipliers themselves
            return s_raw
        return original(s_raw, Mult, SCALE_MODE)
    return multipliers


def variant(name: str, cfg, bf16_scales: bool) -> AotVariant:
    layout = wo.LAYOUTS[name]
    consts = list(wl._constants(layout, cfg, 1))
    if bf16_scales:
        consts[1] = BF16_SCALES
    partial = array(ct.float32, 3) if cfg.split_k > 1 else array(ct.float32, 1)
    params = [array(ct.bfloat16, 2), array(ct.int32, 2), array(ct.bfloat16 if bf16_scales else ct.uint8, 2),
              array(ct.bfloat16, 2), array(ct.float32, 1), array(ct.float32, 1), array(ct.float32, 1), partial,
              cc.ScalarConstraint(ct.int32), *consts]
    kind = "bf16" if bf16_scales else "byte"
    return AotVariant(f"scale_{kind}_{name}_{cfg.name}", cfg.kernel, params, targets=("sm_90",))


def small_variant(name: str, cfg, bf16_scales: bool) -> AotVariant:
    """The small-M kernels (``weight_only_kernels``: the MMA kernel, or the FMA one for ``cfg.gemv``)."""
    layout = wo.LAYOUTS[name]
    consts = list(wo._constants(layout, cfg, 1))
    if bf16_scales:
        consts[1] = BF16_SCALES
    split = cfg.split_k > 1
    params = [array(ct.bfloat16, 2), array(ct.int32, 2), array(ct.bfloat16 if bf16_scales else ct.uint8, 2),
              array(ct.bfloat16, 2), array(ct.float32, 1), array(ct.float32, 1), array(ct.float32, 1),
              array(ct.float32, 3) if split else array(ct.bfloat16, 2),
              array(ct.int32 if split else ct.float32, 1), *consts]
    kind = "bf16" if bf16_scales else "byte"
    return AotVariant(f"scale_{kind}_{name}_{cfg.name}", cfg.kernel, params)


#: The small-M configs counted: the plan's at M = 1 (the FMA kernel) and M = 16 (N = 14336, K = 4096).
SMALL = ((1, 14336, 4096), (16, 14336, 4096))


def main() -> int:
    wo._multipliers = _with_bf16_scales(wo._multipliers)
    print("# python benchmarks/investigations/scale_bf16_cost.py  (sm_90 SASS, nvdisasm; no GPU)")
    for name in ("mxfp4", "nvfp4"):
        layout = wo.LAYOUTS[name]
        for cfg in CONFIGS:
            elements = cfg.tile_n // cfg.num_ctas * layout.tile_k / (32 * cfg.warps)
            cells = []
            for bf16_scales in (False, True):
                row = decode_cost.report(variant(name, cfg, bf16_scales), elements)
                top = " ".join(f"{k}:{v}" for k, v in row["top"].items())
                cells.append(f"{'bf16' if bf16_scales else 'byte'} {row['per_element']:.2f} ({top})")
            print(f"{name} {cfg.name}: " + " | ".join(cells), flush=True)
        for m, n, k in SMALL:
            cfg = wo.plan(m, n, k, layout)
            elements = cfg.tile_n * cfg.stack * layout.tile_k * cfg.unroll / (32 * cfg.num_worker_warps)
            cells = []
            for bf16_scales in (False, True):
                row = decode_cost.report(small_variant(name, cfg, bf16_scales), elements,
                                         1 if cfg.gemv else cfg.unroll)
                top = " ".join(f"{k}:{v}" for k, v in row["top"].items())
                cells.append(f"{'bf16' if bf16_scales else 'byte'} {row['per_element']:.2f} ({top})")
            print(f"{name} {cfg.name} (M = {m}): " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
