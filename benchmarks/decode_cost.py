"""Decode cost of the small-M kernels, without a GPU: SASS instructions per weight element.

    python benchmarks/decode_cost.py              # every weight-only layout's kernels as plan
                                                  # picks them at M = 1 and 16, and the block-scaled
                                                  # stream kernel for comparison
    python benchmarks/decode_cost.py --json out.json
    python benchmarks/decode_cost.py --cpu-smoke --out-dir /tmp/smoke   # the first variant only
    python benchmarks/decode_cost.py --large      # instead: every fused config of the large-M kernel
    python benchmarks/decode_cost.py --moe-pairs  # instead: the per-pair MoE kernel (4-bit weights)
    python benchmarks/decode_cost.py --gemv       # instead: the M = 1 FMA kernel with wider blocks

Writes ``decode-cost-sm90.json`` and what it prints to ``decode-cost-sm90.txt`` (``--out-dir``,
``benchmarks/_results.py``).

Each kernel variant is compiled ahead of time for sm_90 (``tileiras``, as CI does), disassembled with
``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel), and its main loop -- the smallest loop of the
disassembly that contains the tensor-core instructions (HGMMA; for the FMA kernel, its one loop of
FFMAs) -- is counted: instructions per
iteration, divided by the weight elements one thread handles per iteration, with the most frequent
opcodes. This is a static count (the loop body as compiled), the quantity that bounds a decode-limited
kernel: at small M the weight-only kernel issues these instructions for every weight element it reads.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import Transcript, add_options, command, results_path  # noqa: E402

import cuda.tile as ct  # noqa: E402
from cuda.tile import compilation as cc  # noqa: E402

from tilemm.kernels import hopper_block_scaled as hbs  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wol  # noqa: E402
from tilemm.kernels import moe_kernels  # noqa: E402
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402
from tilemm.kernels._aot import AotVariant, array, compile_variant  # noqa: E402
from tilemm.formats import MXFP4, MXFP8_E4M3, NVFP4  # noqa: E402


def nvdisasm() -> str:
    """Path of nvdisasm: on PATH, or from the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            for path in pathlib.Path(root).glob("*/bin/nvdisasm"):
                return str(path)
    except ImportError:
        pass
    raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")


def main_loop(cubin: bytes, unroll: int = 1, marker: str = "HGMMA") -> collections.Counter:
    """Opcode counts of the main loop: the smallest loop that contains ``marker`` instructions (HGMMA
    for the MMA kernels, FFMA for the FMA kernel), or, for a kernel that loads ``unroll`` K tiles at a
    time (and has a one-tile loop for the remainder), the smallest loop with ``unroll`` times that
    loop's markers. A backward branch whose span contains an unpredicated EXIT is not a loop: ptxas
    puts a barrier wait's retry path after the kernel's EXIT, and its branch back into the body would
    span the body, what follows the loop and the EXIT (such a span, one FFMA longer than the FMA
    kernel's K loop, was once counted as that loop: ``benchmarks/results/decode-cost-sm90.txt``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout
    ins, labels = [], {}
    for line in text.splitlines():
        m = re.match(r"\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1).strip())
    exits = [i for i, t in enumerate(ins) if re.match(r"EXIT\b", t)]  # unpredicated
    loops = []
    for i, t in enumerate(ins):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", t)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            if any(labels[m.group(1)] <= e < i for e in exits):
                continue  # an out-of-line retry path's jump back, not a loop
            body = ins[labels[m.group(1)]:i + 1]
            hits = sum(marker in b for b in body)
            if hits:
                loops.append((len(body), hits, body))
    if not loops:
        raise ValueError(f"no loop with {marker} instructions in the disassembly")
    if marker == "FFMA":  # the FMA kernel's FMAs all sit in its main loop; other loops may hold a few
        most = max(lp[1] for lp in loops)
        return _opcodes(min((lp for lp in loops if lp[1] == most), key=lambda lp: lp[0])[2])
    smallest = min(loops, key=lambda lp: lp[0])
    body = min((lp for lp in loops if lp[1] == unroll * smallest[1]), key=lambda lp: lp[0], default=smallest)[2]
    return _opcodes(body)


def _opcodes(body: list[str]) -> collections.Counter:
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body)


#: NVFP4's layout for weights whose scale bytes are all normal (``Layout.normal_scales``), which is
#: what prepack gives a quantized trained weight; counted beside the general layouts.
NORMAL = "nvfp4_normal"


def _layout(name: str) -> wo.Layout:
    return wo.NVFP4_NORMAL if name == NORMAL else wo.LAYOUTS[name]


def _layouts() -> dict:
    """The layouts the default count covers: ``weight_only_kernels.LAYOUTS`` and NVFP4's normal one."""
    return {**wo.LAYOUTS, NORMAL: _layout(NORMAL)}


def weight_only_variant(name: str, cfg: wo.WeightOnlyConfig) -> tuple[AotVariant, float, int]:
    """(variant, weight elements per thread per main-loop iteration, K tiles per iteration) for a bf16
    activation; ``name`` a key of ``_layouts()``."""
    layout = _layout(name)
    if name == NORMAL:
        v = [wo.aot_variant("nvfp4", cfg, normal_scales=True)]
    else:
        v = [a for a in wo.aot_variants(full=True) if a.name == f"weight_only_{name}_bfloat16_{cfg.name}"]
    if not v:
        raise KeyError(f"no weight-only variant {name} {cfg.name}")
    threads = 32 * cfg.num_worker_warps
    # The FMA kernel's one loop takes all of a load's K tiles (no remainder loop): count it whole.
    return v[0], cfg.tile_n * cfg.stack * layout.tile_k * cfg.unroll / threads, 1 if cfg.gemv else cfg.unroll


def large_variant(name: str, cfg) -> tuple[AotVariant, float, int]:
    """(variant, weight elements per thread per main-loop iteration, 1) of the large-M fused kernel
    (``hopper_weight_only_large``) for a bf16 activation: each K tile's tile_n x tile_k weight elements
    are decoded once by the block's threads and feed tile_m columns of x."""
    layout = _layout(name)
    v = [a for a in wol.aot_variants() if a.name == f"weight_only_large_{name}_{cfg.name}"]
    if not v and name == NORMAL:  # a config the rules do not name for it: specialised here
        partial = array(ct.float32, 3) if cfg.split_k > 1 else array(ct.float32, 1)
        v = [AotVariant(f"weight_only_large_{name}_{cfg.name}", cfg.kernel,
                        [array(ct.bfloat16, 2), array(ct.int32, 2), array(ct.uint8, 2), array(ct.bfloat16, 2),
                         array(ct.float32, 1), array(ct.float32, 1), array(ct.float32, 1), partial,
                         cc.ScalarConstraint(ct.int32), *wol._constants(layout, cfg, 1)], targets=("sm_90",))]
    if not v:
        raise KeyError(f"no large-M weight-only variant {name} {cfg.name}")
    # A block of num_ctas CTAs: each CTA's 32 * warps threads decode its tile_n / num_ctas rows.
    return v[0], cfg.tile_n // cfg.num_ctas * layout.tile_k / (32 * cfg.warps), 1


def stream_variant(fmt, tile_m: int = 16) -> tuple[AotVariant, float, int]:
    """The block-scaled stream kernel (both operands quantized) as ``plan`` picks it for small M."""
    cfg = hbs.plan(fmt, 1, tile_m, 14336, 4096)
    name = f"hopper_{fmt.name}_swz_bf16_{cfg.name}"
    v = [a for a in hbs.aot_variants() if a.name == name]
    if not v:
        raise KeyError(name)
    return v[0], cfg.tile_n * cfg.tile_k / (32 * cfg.num_worker_warps), 1


#: The architecture the kernels are compiled for; the results files' ``<gpu>``.
TARGET = "sm90"


def report(variant: AotVariant, elements: float, unroll: int = 1) -> dict:
    marker = "FFMA" if "_wo_gemv" in variant.name or "_moe_pairs_" in variant.name else "HGMMA"
    counts = main_loop(compile_variant(variant, "sm_90"), unroll, marker)
    total = sum(counts.values())
    return {"variant": variant.name, "loop_instructions": total, "elements_per_thread": elements,
            "per_element": total / elements, "top": dict(counts.most_common(8)),
            "spills": counts["LDL"] + counts["STL"]}


def _planned(layout) -> list:
    """The weight-only configs ``default_variants`` counts for one layout, each once, in order."""
    cfgs = [wo.plan(1, 14336, 4096, layout)]
    cfgs += [wo.plan(1, n, 4096, layout, m1_kernel="mma") for n in (14336, 4096)]
    cfgs += [wo.plan(m, n, k, layout) for m, n, k in ((16, 2048, 14336), (16, 14336, 4096), (4, 8192, 4096),
                                                       (4, 4096, 4096), (16, 4096, 4096), (4, 1024, 4096),
                                                       (16, 1024, 4096))]
    return list(dict.fromkeys(cfgs))


def default_variants():
    """The weight-only kernels as ``plan`` picks them, per layout: the FMA kernel at M = 1 (N = 14336,
    K = 4096), the MMA kernel at M = 1 (``m1_kernel="mma"``: N = 14336, 32-row blocks of stacks of 2;
    N = 4096, 16-row blocks of stacks of 4), the MMA kernel at M = 16 with a K split (N = 2048, K = 14336; at
K = 4096 4-bit MX weights take stacked blocks there) and without (N = 14336, K = 4096),
    with stacked K tiles at M = 4 (N = 8192: 32-row blocks; N = 4096: 16-row blocks; N = 1024: the
    "few" blocks of 8 rows) and M = 16 (N = 4096: 32 rows in 128 MMA rows; N = 1024: the few blocks of
    16 rows), for every layout and NVFP4's normal-scale one (``NORMAL``); the block-scaled stream
    kernel at M = 16; and the large-M fused
    kernel (its first candidate: 128 weight rows x 128 rows of x, one MMA per K tile) and its
    one-warpgroup split blocks that the runner takes at few rows (``few_rows_fused``)."""
    out = [weight_only_variant(name, cfg) for name, layout in _layouts().items() for cfg in _planned(layout)]
    out += [stream_variant(fmt) for fmt in (MXFP4, NVFP4, MXFP8_E4M3)]
    large = ("mxfp4", "nvfp4", NORMAL, "mxfp8_e4m3")
    out += [large_variant(name, wol.CANDIDATES[0]) for name in large]
    out += [large_variant(name, cfg) for name in large for cfg in few_rows_fused(name)]
    return out


def few_rows_fused(name: str) -> list:
    """The fused kernel's configs that the weight-only runner takes at few rows of x (the large-M
    plan's one-warpgroup split blocks: 4096 x 14336 at M = 16 / 32 for 4-bit weights, M = 32 for 8-bit
    ones), each once, with split_k 2 (the count is a run-time argument: one code path)."""
    cfgs = [wol.plan(m, 4096, 14336, _layout(name)) for m in (16, 32)]
    return list(dict.fromkeys(dataclasses.replace(c, split_k=2) for c in cfgs if c is not None and c.kind == "fused"))


def moe_pairs_variants():
    """The per-pair MoE kernel's variants (``moe_kernels.aot_variants``, 4-bit weights): each 16-row
    block's K loop takes unroll K tiles per load, for one pair, or for two in a combining block of
    two pairs per step (``PairsConfig.slots``), whose loop over the steps then holds both pairs' loads
    (and, at one load per pair, their epilogues)."""
    out = []
    for v in moe_kernels.aot_variants(full=True):
        name = v.name
        if "_moe_pairs_" not in name or not name.startswith(("moe_mxfp4_", "moe_nvfp4_")):
            continue
        unroll = int(name.split("_moe_pairs_")[1].split("_u")[1].split("_")[0])
        pairs = 2 if "_s2_combine" in name else 1
        out.append((v, 16 * wo.LAYOUTS[name.split("_")[1]].tile_k * unroll * pairs / 128, 1))
    # 64-row blocks (not planned; ``investigations/moe_pairs_tune.py --plans rows64`` times them): one
    # conversion of x feeds four weight rows' FMAs, as in ``gemv_variants``.
    for name in ("mxfp4", "nvfp4"):
        v = moe_kernels.pairs_aot_variant(name, moe_kernels.PairsConfig(4, tile_n=64, occupancy=8))
        out.append((v, 64 * wo.LAYOUTS[name].tile_k * 4 / 128, 1))
    return out


#: ``--gemv``: the FMA kernel's block shapes counted at M = 1 (tile_n, unroll, occupancy), 4 warps.
GEMV_SHAPES = [(16, 8, 4), (16, 4, 8), (32, 4, 4), (32, 2, 8), (64, 4, 8), (64, 2, 4), (64, 4, 4), (64, 8, 4),
               (128, 4, 4), (128, 2, 4)]


def gemv_variants():
    """The FMA kernel (``_gemv_kernel``) at M = 1 with wider blocks than the plan's 16 rows, for MXFP4,
    NVFP4 and MXFP8 (``GEMV_SHAPES``): a thread holds one weight row per 16 rows of the block, so wider
    blocks let one conversion of x to fp32 feed more FMAs; whether the registers still fit shows in
    the count as LDL / STL (spills)."""
    out = []
    for name in ("mxfp4", "nvfp4", "mxfp8_e4m3"):
        layout = wo.LAYOUTS[name]
        for tile_n, unroll, occupancy in GEMV_SHAPES:
            cfg = wo.WeightOnlyConfig(1, tile_n, 1, 4, occupancy, unroll=unroll, gemv=1)
            out.append((wo.aot_variant(name, cfg), tile_n * layout.tile_k * unroll / (32 * cfg.num_worker_warps), 1))
    return out


def large_variants():
    """Every fused config of the large-M kernel (``hopper_weight_only_large``: the rules' configs, the
    sweep's candidates and its structural variants) for MXFP4, NVFP4 and MXFP8 (e4m3)."""
    return [large_variant(name, cfg) for name in ("mxfp4", "nvfp4", "mxfp8_e4m3") for cfg in wol._configs(name)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="decode_cost.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--large", action="store_true",
                    help="instead: every fused config of the large-M kernel (about 35 compiles)")
    ap.add_argument("--moe-pairs", action="store_true",
                    help="instead: the per-pair MoE kernel's variants, 4-bit weights (about 32 compiles)")
    ap.add_argument("--gemv", action="store_true",
                    help="instead: the M = 1 FMA kernel with wider blocks (GEMV_SHAPES; 30 compiles)")
    add_options(ap)  # no GPU either way; --cpu-smoke: the first variant only
    args = ap.parse_args(argv)
    rows = []
    say = Transcript(command("decode_cost.py", argv), "sm_90 SASS, nvdisasm")
    variants = (large_variants() if args.large else moe_pairs_variants() if args.moe_pairs
                else gemv_variants() if args.gemv else default_variants())
    for variant, elements, unroll in variants[:1 if args.cpu_smoke else None]:
        row = report(variant, elements, unroll)
        rows.append(row)
        top = " ".join(f"{k}:{v}" for k, v in row["top"].items())
        say(f"{row['variant']:60s} {row['per_element']:5.2f} instr/element "
            f"({row['loop_instructions']} per loop, {elements:.0f} elements/thread)  {top}"
            + (f"  spills: {row['spills']} LDL / STL" if row["spills"] else ""))
    path = results_path(args.out_dir, "decode-cost", TARGET, "json",
                        variant="large" if args.large else "moe-pairs" if args.moe_pairs
                        else "gemv" if args.gemv else None)
    path.write_text(json.dumps(rows, indent=1))
    say.write(path.with_suffix(".txt"))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
