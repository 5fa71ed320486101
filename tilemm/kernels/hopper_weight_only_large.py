"""Weight-only matmul for many rows of x (prefill, batched decode: M = 64 ... thousands), three designs,
each computing ``out = (x @ dequantize(w).T) * alpha + bias`` with fp32 accumulation and one rounding,
as ``weight_only_kernels`` documents it (the decoded weight is ``dequantize(w) * 2^-E``, exact in bf16):

* ``_large_kernel``, fused (Hopper): a persistent mixed-input tensor-core kernel. Per K tile it decodes
  the prepacked weight tile in registers with ``weight_only_kernels``' helpers and feeds it to wgmma
  as the left operand (registers) against the x tile that TMA brings to shared memory, ``acc (TN, TM)
  += decode(W) @ x.T``: M is the MMA's N dimension, and no bf16 copy of the weight exists. Work items
  are output tiles in grouped order, or (``split_k``) output tiles times K ranges where the output has
  too few tiles for the GPU, the fp32 partial tiles then added by a second launch
  (``_partial_sum_kernel``). Two warpgroups per block, or one (``warps``); a 2-CTA cluster can share
  one x tile by TMA multicast (``num_ctas``).
* ``decode_gemm``: the weight decoded to bf16 (``_dequantize_kernel``), whole or ``chunk`` rows at a
  time into a buffer that stays in L2, each chunk multiplied by cuBLAS's bf16 GEMM into its output
  columns (cuBLAS's fp32 epilogue applies alpha and rounds once).
* ``overlap_gemm``: as ``decode_gemm`` in chunks, the next chunk decoded on a side stream into one of
  two persistent buffers while cuBLAS multiplies this one (events order them; CUDA-graph capturable).

``plan`` picks the design and config per (M, N, K) from rules on the problem's quantities (``RULES``),
fitted to ``benchmarks/investigations/tune_weight_only_large.py``'s
sweep, which also times ``VARIANTS``. What sm_90
compiles of the fused kernel show (tileiras 13.4): every ``ct.mma`` ends in a wait for all its wgmmas,
so a warpgroup's decode never overlaps its own MMA, only other warpgroups'; instructions per weight
element per config: ``benchmarks/decode_cost.py --large``; the findings and figures:
``benchmarks/results/decode-cost-large-sm90.md``.
"""

from __future__ import annotations

import dataclasses
import functools

import cuda.tile as ct
import torch
from cuda.tile import compilation as cc

from ..numerics import ceil_div
from ._aot import AotVariant, array
from ._common import Described, hinted, sm90_hints, tile_coords_at
from . import weight_only_kernels as _wo
from .weight_only_kernels import _epilogue, _k_tile, _scale_tile

__all__ = ["LargeConfig", "FamilyRule", "RULES", "CANDIDATES", "plan", "first_m", "decode_fallback", "family",
           "output_tiles", "wave_fill", "with_split", "SWEEP", "VARIANTS", "grid", "launch", "Prepared", "decode_gemm",
           "overlap_gemm", "pingpong", "aot_variants"]

ConstInt = ct.Constant[int]

_ZERO = ct.PaddingMode.ZERO


# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def _load_x(X, bm, kt, TM, TK, LATENCY):
    if LATENCY > 0:
        return ct.load(X, (bm, kt), (TM, TK), padding_mode=_ZERO, latency=LATENCY)
    return ct.load(X, (bm, kt), (TM, TK), padding_mode=_ZERO)


def _load_w(W, bn, kt, TN, WORDS, LATENCY):
    if LATENCY > 0:
        return ct.bitcast(ct.load(W, (bn, kt), (TN, WORDS), padding_mode=_ZERO, latency=LATENCY), ct.uint32)
    return ct.bitcast(ct.load(W, (bn, kt), (TN, WORDS), padding_mode=_ZERO), ct.uint32)


def _step(X, W, S, Mult, acc, bm, bn, kt, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TM, TN, LATENCY_W,
          LATENCY_X, X_PARTS, CAT):
    """acc + decode(W tile (bn, kt)) @ x tile (bm, kt).T."""
    WORDS = GROUP * BLOCK // 2
    TK = PLANES * GROUP * BLOCK
    SC = PLANES * GROUP
    w = _load_w(W, bn, kt, TN, WORDS, LATENCY_W)
    s_raw = _scale_tile(S, kt, bn, SC, TN, BLOCK)
    x = _load_x(X, bm, kt, TM, TK, LATENCY_X)
    return _k_tile(w, s_raw, Mult, x, acc, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TN, TM, X_PARTS, CAT)


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=8))
def _large_kernel(X, W, S, C, Alpha, Mult, Bias, Partial, Splits,
                  ELEMENT: ConstInt, SCALE_MODE: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                  GROUP: ConstInt, TM: ConstInt, TN: ConstInt, GROUP_SIZE_M: ConstInt,
                  LATENCY_W: ConstInt, LATENCY_X: ConstInt, X_PARTS: ConstInt, CAT: ConstInt,
                  SPLIT: ConstInt):
    """C (M, N) = (X (M, K) @ decode(W).T) * alpha + bias, persistent over work items.

    X (M, K) activations (bf16; fp16 / fp32 split exactly into X_PARTS bf16 parts as in the small-M
    kernel); W (N, k_tiles * WORDS) int32 prepacked words; S scale bytes (``_scale_tile``); Alpha (1,)
    and Mult (1,) fp32 (the PackedWeight's constants); Bias (N,) fp32. Grid: any number of blocks;
    block b takes work items b, b + blocks, ... of Splits * cdiv(M, TM) * cdiv(N, TN): item i is
    output tile i % tiles (numbered in GROUP_SIZE_M-row groups of M tiles) and K range i // tiles.
    LATENCY_W / LATENCY_X: the loads' latency hints (0: the compiler's choice). CAT = 1: the K tile's
    decoded planes concatenated into one MMA operand (one wait for the tensor cores per K tile instead
    of one per plane; all planes' registers live at once).

    SPLIT = 1 (few output tiles: N of a few thousand below M = 2048): K is split into Splits ranges (a
    run-time count, 1 <= Splits <= k_tiles, so that one compiled kernel serves every split), range s
    being K tiles [s * k_tiles // Splits, (s + 1) * k_tiles // Splits), never empty; each item stores
    its fp32 partial tile in Partial (Splits, M, N), and ``_partial_sum_kernel``, launched next, adds
    the partials in split order and runs the epilogue (C, Alpha and Bias are not read here). The sum
    is a launch of its own because finishing in this kernel (an arrival counter per output tile, the
    last arrival adding the partials) made tileiras 13.4 build a much slower main loop, slower than
    both launches together (``benchmarks/results/split-probe-nvidia-h100-80gb-hbm3.txt``). SPLIT = 0
    leaves Partial and Splits unread.
    """
    M = X.shape[0]
    N = C.shape[1]
    TK = PLANES * GROUP * BLOCK
    k_tiles = ct.cdiv(X.shape[1], TK)
    num_m = ct.cdiv(M, TM)
    tiles = num_m * ct.cdiv(N, TN)
    if SPLIT == 0:
        for t in range(ct.bid(0), tiles, ct.num_blocks(0)):
            _, bm, bn = tile_coords_at(t, M, N, TM, TN, GROUP_SIZE_M)
            # The first K tile outside the loop: a loop that starts from zeros makes tileiras 13.4
            # select between the accumulator and a copy of it on every iteration (2 instructions per
            # accumulator register, about 1 per weight element at 128x128; sm_90 SASS).
            acc = _step(X, W, S, Mult, ct.zeros((TN, TM), ct.float32), bm, bn, 0, ELEMENT, SCALE_MODE, BLOCK,
                        PLANES, GROUP, TM, TN, LATENCY_W, LATENCY_X, X_PARTS, CAT)
            for kt in range(1, k_tiles):
                acc = _step(X, W, S, Mult, acc, bm, bn, kt, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TM, TN,
                            LATENCY_W, LATENCY_X, X_PARTS, CAT)
            _epilogue(acc.transpose(), C, Alpha, Bias, bm, bn, TM, TN)
    else:
        for item in range(ct.bid(0), tiles * Splits, ct.num_blocks(0)):
            _, bm, bn = tile_coords_at(item % tiles, M, N, TM, TN, GROUP_SIZE_M)
            split = item // tiles
            k_begin = split * k_tiles // Splits
            k_end = (split + 1) * k_tiles // Splits
            # The first K tile peeled, as above (the range is never empty).
            acc = _step(X, W, S, Mult, ct.zeros((TN, TM), ct.float32), bm, bn, k_begin, ELEMENT, SCALE_MODE,
                        BLOCK, PLANES, GROUP, TM, TN, LATENCY_W, LATENCY_X, X_PARTS, CAT)
            for kt in range(k_begin + 1, k_end):
                acc = _step(X, W, S, Mult, acc, bm, bn, kt, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TM, TN,
                            LATENCY_W, LATENCY_X, X_PARTS, CAT)
            ct.store(Partial, (split, bm, bn), acc.transpose().reshape((1, TM, TN)))


#: The output tile of ``_partial_sum_kernel`` (rows of x, weight rows).
SUM_TILE = (64, 128)


@ct.kernel
def _partial_sum_kernel(Partial, C, Alpha, Bias, Splits, TM: ConstInt, TN: ConstInt):
    """C (M, N) tile = (the Splits fp32 partial tiles of Partial (Splits, M, N), added in split order
    from zero) * alpha + bias, rounded once to C's dtype: the second launch of ``_large_kernel``'s K
    split. One block per (TM, TN) output tile, M tiles fastest."""
    num_m = ct.cdiv(C.shape[0], TM)
    bm = ct.bid(0) % num_m
    bn = ct.bid(0) // num_m
    total = ct.zeros((TM, TN), ct.float32)
    for s in range(Splits):
        total = total + ct.load(Partial, (s, bm, bn), (1, TM, TN), padding_mode=_ZERO).reshape((TM, TN))
    _epilogue(total, C, Alpha, Bias, bm, bn, TM, TN)


# --------------------------------------------------------------------------------------------------
# Configs and the plan's rules
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LargeConfig:
    """A large-M design and its settings.

    ``kind`` "fused" (``_large_kernel``: tile_n weight rows x tile_m rows of x per output tile,
    GROUP_SIZE_M, load latency hints, blocks per SM), "decode" (``decode_gemm``: ``chunk`` weight
    rows decoded per cuBLAS GEMM, 0 for the whole weight at once) or "overlap" (``overlap_gemm``:
    ``chunk`` weight rows per GEMM, the next chunk decoded on a side stream meanwhile)."""

    kind: str = "fused"
    tile_m: int = 128
    tile_n: int = 128
    group_size_m: int = 8
    latency_w: int = 0
    latency_x: int = 0
    occupancy: int = 1
    chunk: int = 0
    cat: int = 0
    split_k: int = 1
    warps: int = 8
    num_ctas: int = 1

    def __post_init__(self):
        if self.kind not in ("fused", "decode", "overlap"):
            raise ValueError(f"LargeConfig: kind must be 'fused', 'decode' or 'overlap', got {self.kind!r}")
        if self.kind == "overlap" and self.chunk <= 0:
            raise ValueError(f"LargeConfig: an 'overlap' config needs chunk > 0 weight rows, got {self.chunk}")
        if self.warps not in (4, 8) or self.num_ctas not in (1, 2) or self.split_k < 1:
            raise ValueError(f"LargeConfig: warps must be 4 or 8, num_ctas 1 or 2, split_k >= 1; got warps="
                             f"{self.warps}, num_ctas={self.num_ctas}, split_k={self.split_k}")

    @property
    def kernel(self):
        return hinted(_large_kernel, **sm90_hints(self.warps, self.occupancy if self.occupancy > 1 else None,
                                                  self.num_ctas if self.num_ctas > 1 else None))

    @property
    def name(self) -> str:
        """``decode_c<chunk>``, or ``fused_<weight rows>x<rows of x>_g<group>`` and the settings."""
        if self.kind in ("decode", "overlap"):
            return f"{self.kind}_c{self.chunk}"
        s = f"fused_{self.tile_n}x{self.tile_m}_g{self.group_size_m}"
        if self.latency_w or self.latency_x:
            s += f"_lw{self.latency_w}lx{self.latency_x}"
        s += f"_occ{self.occupancy}" if self.occupancy > 1 else ""
        s += f"_w{self.warps}" if self.warps != 8 else ""
        s += f"_{self.num_ctas}cta" if self.num_ctas > 1 else ""
        s += f"_s{self.split_k}" if self.split_k > 1 else ""
        return s + ("_cat" if self.cat else "")


def family(layout: _wo.Layout) -> str:
    return "4bit" if layout.planes == 4 else "8bit"


@dataclasses.dataclass(frozen=True)
class FamilyRule:
    """How ``plan`` picks a large-M design for one weight family, from quantities of the problem only
    (M, N, K, the SMs, each candidate's output tiles), so that a shape the sweep never saw gets the
    design its measured neighbours got.

    * ``first_m``: below it, the small-M plan (``weight_only_kernels.plan``); so too, whatever the
      family, up to ``weight_only_kernels._FEW_M`` rows where its stacked blocks take the problem
      without a K split (``weight_only_kernels.short_k_stacked``).
    * Up to ``narrow_m`` rows: the first ``split`` entry's config (``last_m`` >= M) with the K split
      ``with_split`` gives it, where N gives fewer than one 32-row block per SM (the small-M kernels
      then split K or stack narrow blocks); else the small-M plan.
    * Up to ``whole_m`` rows: that entry's config with its K split, split or not.
    * ``large`` from ``large_m`` rows of x on, and for a weight whose bf16 copy takes at most
      ``l2_bytes`` (it then stays in L2 between the decode and the GEMM, and the fused kernels have
      too few output tiles to fill the GPU).
    * Up to 64 rows: the first ``split`` entry's config with its K split, where that splits; else the
      small-M plan.
    * Above 64 rows: of the ``fused`` (config, tiles per SM) whose tile_m M reaches and whose output
      tiles reach that many per SM, the first, unless a later one fills its last wave of blocks
      better by more than ``wave_margin`` (``wave_fill``); none: the first ``split`` entry whose
      ``last_m`` reaches M, with ``with_split``'s K split; none either: the small-M plan.
    """

    first_m: int
    large_m: int
    large: LargeConfig
    l2_bytes: int
    fused: tuple
    split: tuple = ()
    wave_margin: float = 0.15
    narrow_m: int = 0
    whole_m: int = 0


def output_tiles(cfg: LargeConfig, m: int, n: int) -> int:
    return ceil_div(m, cfg.tile_m) * ceil_div(n, cfg.tile_n)


def wave_fill(cfg: LargeConfig, m: int, n: int, sms: int) -> float:
    """The output tiles over the block slots of the waves they take (``occupancy`` blocks per SM):
    1.0 when the last wave is full."""
    tiles, slots = output_tiles(cfg, m, n), sms * cfg.occupancy
    return tiles / (ceil_div(tiles, slots) * slots)


#: Largest K split ``with_split`` gives, and the fewest K tiles a split's range may hold (each item
#: writes a (tile_n, tile_m) fp32 partial tile: at 2 K tiles of 128 weight rows that is as many bytes
#: as the 4-bit weight it reads).
MAX_SPLIT = 16
MIN_SPLIT_K_TILES = 2


def with_split(cfg: LargeConfig, m: int, n: int, k: int, layout: _wo.Layout, sms: int) -> LargeConfig:
    """``cfg`` with the K split that fills the GPU's block slots (``occupancy`` per SM, ``num_ctas`` SMs
    per block): the largest power of two that keeps the work items within one wave of slots, up to
    ``MAX_SPLIT`` and at least ``MIN_SPLIT_K_TILES`` K tiles per range; 1 where the output tiles
    alone fill half the slots."""
    tiles, slots = output_tiles(cfg, m, n), sms * cfg.occupancy // cfg.num_ctas
    k_tiles = ceil_div(k, layout.tile_k)
    split = 1
    while (tiles * split * 2 <= slots and split * 2 <= MAX_SPLIT
           and k_tiles >= split * 2 * MIN_SPLIT_K_TILES):
        split *= 2
    return dataclasses.replace(cfg, split_k=split)


#: The weight rows of the small-M kernels' wide stacked blocks (``weight_only_kernels._STACKED``): with
#: fewer such blocks than SMs they split K or stack narrow blocks.
_NARROW_ROWS = _wo._STACKED[16][0][0]

_DECODE = LargeConfig("decode", chunk=0)
_MID_4 = LargeConfig("fused", 128, 128)
# One-warpgroup blocks of 64 weight rows by 64 / 32 / 16 rows of x, for the K split at few rows.
_SPLIT_X64 = LargeConfig("fused", 64, 64, warps=4, occupancy=2)
_SPLIT_X32 = LargeConfig("fused", 32, 64, warps=4, occupancy=2)
_SPLIT_X16 = LargeConfig("fused", 16, 64, warps=4, occupancy=3)
_MID_8 = LargeConfig("fused", 128, 128, cat=1)
_WIDE_8 = LargeConfig("fused", 256, 128)

#: The plan's rules per weight family ("4bit": MXFP4 / NVFP4, "8bit": MXFP8), fitted to the H100
#: sweep (``benchmarks/results/tune-weight-only-large-nvidia-h100-80gb-hbm3.txt``, every per-shape
#: figure), whose per-shape winners they reproduce from M, K and tile counts instead of a table of shapes:
#:
#: * The decode design wins from M = 2048 on everywhere, and from M = 33 on the GQA k / v projection
#:   (1024x4096: 8 MiB of bf16 weight, L2-resident between the two passes), ahead of every kernel that
#:   reads the packed weight.
#: * NVFP4 as MXFP4 since its single weights keep their scales row-major (``Layout.scale_rows``): its
#:   fused kernel then ran within 3 % of MXFP4's at M = 512-1024
#:   (``benchmarks/results/inference-rows-m80-nvidia-h100-80gb-hbm3.md``) and ahead of the decode
#:   design up to M = 1024 (before, NVFP4 took the decode design from M = 512;
#:   ``benchmarks/results/tune-weight-only-large-nvfp4-rows-nvidia-h100-80gb-hbm3.txt``).
#: * 4-bit, M = 2-16: 64 weight rows x 16 rows of x on one warpgroup, three blocks per SM, with the K
#:   split that fills the block slots, where N gives fewer than one 32-row block per SM (4096x14336,
#:   1024x4096: there the small-M kernels stack narrow blocks or end a K split in the kernel, and ran
#:   level or slower); else the small-M plan, faster on 6144x4096 and 8192x8192, level on 14336x4096.
#:   M = 17-32: 64 weight rows x 32 rows of x, two blocks per SM, with the split where it fills the
#:   slots, on every shape (level with the small-M plan or ahead of it;
#:   ``benchmarks/results/tune-weight-only-large-m2-nvidia-h100-80gb-hbm3.txt``, MXFP4 and NVFP4).
#: * 4-bit, M = 33-64: 64 weight rows x 64 rows of x on one warpgroup, two blocks per SM, with the K
#:   split that fills the block slots (4096x14336, 8192x8192, 6144x4096), where it splits; else
#:   (14336x4096) the small-M plan, within a few percent of it there. (At M = 32 those 64-row x tiles,
#:   half empty, lost to the small-M plan's 32-row ones on three of four shapes:
#:   ``benchmarks/results/tune-weight-only-large-m32-nvidia-h100-80gb-hbm3.txt``.)
#: * 4-bit, 64 < M < 2048: 128x128 tiles (below M = 128 one partly empty x tile), with the K split
#:   that fills the GPU where they give fewer than 0.7 tiles per SM (two launches: the partial tiles,
#:   then their sum). At M = 80-128 they ran ahead of the one-warpgroup 64x64 blocks, whose second x
#:   tile is mostly empty below M = 128, on three of four shapes (geomean 1.21-1.23x bf16 against
#:   0.84-0.96x at M = 80 / 96; 6144x4096 at M = 128: 0.84-0.86x against 0.92-0.93x;
#:   ``benchmarks/results/tune-weight-only-large-m80-nvidia-h100-80gb-hbm3.txt``).
#: * 8-bit: 128x128 tiles with one MMA per K tile (cat) from 0.7 tiles per SM, 256 rows of x from 0.7
#:   tiles per SM at M >= 256, unless cat's 128-row tiles fill their last wave better by more than
#:   0.15 (6144x4096, M = 1024: 192 tiles of 256 rows fill 0.73 of two waves, 384 of 128 rows 0.97
#:   of three, and cat wins); with fewer tiles, cat's 128x128 tiles with the K split. At M = 17-64,
#:   64 weight rows x 64 rows of x on one warpgroup, two blocks per SM, with the K split where it
#:   splits (4096x14336, 8192x8192, 6144x4096: ahead of the small-M kernels and of cat's split tiles
#:   at M = 32-64, ``benchmarks/results/tune-weight-only-large-m8-nvidia-h100-80gb-hbm3.txt``; at
#:   17-31 rows, half empty or more, 1.18-1.21x bf16 against the small-M plan's 0.96-0.99x on
#:   4096x14336 and 8192x8192 and the 32-row x tiles' 1.05-1.10x,
#:   ``benchmarks/results/tune-weight-only-m17-mxfp8-nvidia-h100-80gb-hbm3.txt``), else the small-M
#:   plan; below 17 rows the one-warpgroup blocks with 16 or 32 rows of x ran slower than the small-M
#:   plan on every shape.
#: * Any family, up to ``weight_only_kernels._FEW_M`` rows: the small-M plan where its stacked blocks
#:   take the problem without a split (``short_k_stacked``: few weight rows, rows of at most 4 KiB).
#:
#: What the rules reach on that sweep, per family and M (geomean over the five shapes of the picked
#: candidate's speed-up over bf16, against the per-shape best candidate, one candidate per (family, M)
#: chosen by geomean, and the plan the sweep timed), is what ``python
#: benchmarks/investigations/plan_rule_check.py
#: benchmarks/results/tune-weight-only-large-nvidia-h100-80gb-hbm3.txt`` prints.
#:
#: ``tests/test_weight_only_large.py`` checks the picks on those shapes.
RULES = {
    "4bit": FamilyRule(first_m=2, large_m=2048, large=_DECODE, l2_bytes=16 << 20, fused=((_MID_4, 0.7),),
                       split=((_SPLIT_X16, 16), (_SPLIT_X32, 32), (_SPLIT_X64, 64), (_MID_4, 1 << 30)),
                       narrow_m=16, whole_m=32),
    "8bit": FamilyRule(first_m=17, large_m=2048, large=_DECODE, l2_bytes=16 << 20,
                       fused=((_WIDE_8, 0.7), (_MID_8, 0.7)), split=((_SPLIT_X64, 64), (_MID_8, 1 << 30))),
}


def _rule(layout: _wo.Layout, rules: dict | None) -> FamilyRule:
    """The layout's rule: its family's."""
    return (rules or RULES)[family(layout)]


def first_m(layout: _wo.Layout, rules: dict | None = None) -> int:
    """The smallest M for which the large-M plan may name a design."""
    return _rule(layout, rules).first_m


#: From this many rows of x the decode design stands in for a fused config that cannot serve a call;
#: below, the small-M plan does: on the H100 sweep
#: (``benchmarks/results/tune-weight-only-large-nvidia-h100-80gb-hbm3.txt``, geomean over its shapes,
#: both families) the small-M plan ran ahead of the decode design up to M = 256, level at 512, behind
#: from 1024.
DECODE_FALLBACK_M = 512


def decode_fallback(m: int) -> bool:
    """Whether the decode design stands in for a fused config that cannot serve a call (another GPU
    than Hopper, an output other than bf16), rather than the small-M plan (``DECODE_FALLBACK_M``)."""
    return m >= DECODE_FALLBACK_M


def plan(m: int, n: int, k: int, layout: _wo.Layout, rules: dict | None = None, sms: int = 132,
         fused_only: bool = False) -> LargeConfig | None:
    """The large-M config for an (M, K) x (N, K) problem, or None where the small-M plan applies
    (``FamilyRule`` says how). ``fused_only``: never the ``large`` design (the decode for cuBLAS),
    for a call whose epilogue factor is on the device (cuBLAS's alpha is a host number): the fused
    configs as for fewer rows instead."""
    rule = _rule(layout, rules)
    if fused_only:
        rule = dataclasses.replace(rule, large_m=1 << 62, l2_bytes=-1)
    if m < rule.first_m or (m <= _wo._FEW_M and _wo.short_k_stacked(m, n, k, layout, sms)):
        return None
    splits = [cfg for cfg, last_m in rule.split if m <= last_m]
    if m <= max(rule.narrow_m, rule.whole_m):
        if not splits or (m <= rule.narrow_m and ceil_div(n, _NARROW_ROWS) >= sms):
            return None
        return with_split(splits[0], m, n, k, layout, sms)
    if m >= rule.large_m or n * k * 2 <= rule.l2_bytes:
        return rule.large
    if m <= 64:
        cfg = with_split(splits[0], m, n, k, layout, sms) if splits else None
        return cfg if cfg is not None and cfg.split_k > 1 else None
    eligible = [cfg for cfg, fill in rule.fused if m >= cfg.tile_m and output_tiles(cfg, m, n) >= fill * sms]
    if not eligible:
        return with_split(splits[0], m, n, k, layout, sms) if splits else None
    first = eligible[0]
    bar = wave_fill(first, m, n, sms) + rule.wave_margin
    later = [cfg for cfg in eligible[1:] if wave_fill(cfg, m, n, sms) > bar]
    return later[0] if later else first


def _constants(layout: _wo.Layout, cfg: LargeConfig, x_parts: int) -> tuple:
    return (layout.element, layout.scale_mode, layout.block, layout.planes, layout.group,
            cfg.tile_m, cfg.tile_n, cfg.group_size_m, cfg.latency_w, cfg.latency_x, x_parts, cfg.cat,
            int(cfg.split_k > 1))


def grid(cfg: LargeConfig, m: int, n: int, sms: int) -> tuple:
    """Persistent grid: at most one block (of ``num_ctas`` CTAs) per ``num_ctas`` SM slots
    (``occupancy`` per SM), at most one per work item (output tile and K range)."""
    items = output_tiles(cfg, m, n) * cfg.split_k
    return (max(1, min(items, sms * cfg.occupancy // cfg.num_ctas)), 1, 1)


def launch(x: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
           bias: torch.Tensor, out: torch.Tensor, layout: _wo.Layout, cfg: LargeConfig, sms: int,
           stream, alpha: torch.Tensor | None = None) -> None:
    """out (M, N) = (x @ W.T) * alpha + bias with the fused kernel; arguments as
    ``weight_only_kernels.launch`` (``alpha`` replaces constants[0] when given), on ``stream``. A K
    split (``cfg.split_k``, at most one range per K tile) is two launches: the partial tiles, in the
    persistent split-K workspace, then their sum (``Prepared``: the same launches kept for many calls)."""
    Prepared(words, scale_t, constants, bias, layout, cfg, out.shape[0], sms, x.dtype,
             keep_workspace=False).run(x, out, stream, alpha)


class Prepared:
    """One fused launch (two with a K split) with everything but the activation and the output worked
    out: grid, kernel, constants, the fixed tensors described once (``Described``) and, per stream,
    the split workspace's view, as ``weight_only_kernels.Prepared`` keeps them for the small-M
    kernels. ``run`` makes the launches ``launch`` makes, with no allocation and little host work:
    the runner keeps one per (M, x dtype) for the eager calls of a model."""

    __slots__ = ("m", "n", "splits", "grid", "kernel", "consts", "fixed", "alpha", "rest", "sum_grid", "_work")

    def __init__(self, words, scale_t, constants, bias, layout: _wo.Layout, cfg: LargeConfig, m: int, sms: int,
                 x_dtype: torch.dtype, keep_workspace: bool = True):
        self.m, self.n = m, words.shape[0]
        self.grid, self.kernel, self.consts = _prepared(cfg, layout, m, self.n, sms, _wo._X_PARTS[x_dtype])
        k_tiles = words.shape[1] // layout.words_per_tile
        # K ranges (at most one per K tile); 0 for an unsplit config (one launch, no workspace)
        self.splits = min(cfg.split_k, k_tiles) if cfg.split_k > 1 else 0
        self.sum_grid = (ceil_div(m, SUM_TILE[0]) * ceil_div(self.n, SUM_TILE[1]), 1, 1)
        wrap = Described if keep_workspace and words.is_cuda else (lambda t: t)
        self.fixed = (wrap(words), wrap(scale_t))
        self.alpha = wrap(constants[0:1])
        self.rest = (wrap(constants[1:2]), wrap(bias))
        self._work = {} if keep_workspace else None

    def run(self, x: torch.Tensor, out: torch.Tensor, stream, alpha: torch.Tensor | None = None) -> None:
        """out (M, N) = the product for x (M, K), on ``stream``; ``alpha`` (a (1,) fp32 tensor) replaces
        the weight's epilogue factor when given."""
        alpha = self.alpha if alpha is None else alpha
        if self.splits:
            partial = _wo.kept_workspace(self._work, out, stream, self.splits, self.m, self.n, 0)[0]
            ct.launch(stream, self.grid, self.kernel,
                      (x, *self.fixed, out, alpha, *self.rest, partial, self.splits, *self.consts))
            ct.launch(stream, self.sum_grid, _partial_sum_kernel,
                      (partial, out, alpha, self.rest[1], self.splits, *SUM_TILE))
        else:  # a stand-in the kernel never reads
            ct.launch(stream, self.grid, self.kernel, (x, *self.fixed, out, alpha, *self.rest, alpha, 1, *self.consts))


@functools.lru_cache(maxsize=4096)
def _prepared(cfg: LargeConfig, layout: _wo.Layout, m: int, n: int, sms: int, x_parts: int) -> tuple:
    """(grid, hinted kernel, constant arguments) of one fused launch, worked out once per problem."""
    return grid(cfg, m, n, sms), cfg.kernel, _constants(layout, cfg, x_parts)


# --------------------------------------------------------------------------------------------------
# Two-pass: decode (in chunks) + cuBLAS
# --------------------------------------------------------------------------------------------------

def _scale_rows(scale_t: torch.Tensor, r0: int, r1: int, layout: _wo.Layout) -> torch.Tensor:
    """The scale bytes of weight rows r0:r1 (``scale_t`` row-major for NVFP4, transposed otherwise)."""
    return scale_t[r0:r1] if layout.scale_rows else scale_t[:, r0:r1]


def _decode_rows(words, scale_t, mult, layout: _wo.Layout, out16: torch.Tensor, stream) -> None:
    """out16 (rows, Kp) bf16 = the prepacked rows ``words`` (rows, k_tiles * WORDS) decoded, times 2^-E."""
    rows = words.shape[0]
    k_tiles = words.shape[1] // layout.words_per_tile
    ct.launch(stream, (ceil_div(rows, _wo.DEQUANT_TN) * k_tiles, 1, 1), _wo._dequantize_kernel,
              (words, scale_t, out16, mult, layout.element, layout.scale_mode, layout.block,
               layout.planes, layout.group, _wo.DEQUANT_TN))


def decode_gemm(x: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
                alpha_host: float, out: torch.Tensor, layout: _wo.Layout, k: int, chunk: int, stream,
                buffer: torch.Tensor | None = None, decoded: bool = False,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """out (M, N) = (x @ (decode(W) * 2^-E).T) * alpha_host + bias, x bf16, ``bias`` (N,) bf16 or None:
    the weight decoded to bf16 ``chunk`` rows at a time (all at once for chunk = 0) and multiplied by
    cuBLAS, whose fp32 epilogue applies alpha, adds the bias (bf16 values, exact in fp32) and rounds
    once to out's dtype (bf16). ``buffer`` (chunk or N rows, Kp) bf16 is the
    decode's destination (allocated when None); ``decoded``: it already holds the whole weight's
    decode (chunk 0; ``tilemm.weight_only.decoded_once``), so only the GEMM runs. Returns out."""
    if decoded and (buffer is None or chunk > 0):
        raise ValueError("decode_gemm: decoded=True needs the whole weight's decode in buffer (chunk 0)")
    n = words.shape[0]
    rows = n if chunk <= 0 else min(chunk, n)
    kp = words.shape[1] // layout.words_per_tile * layout.tile_k
    if buffer is None:
        buffer = torch.empty((rows, kp), dtype=torch.bfloat16, device=x.device)
    mult = constants[1:2]
    flags = torch.backends.cuda.matmul
    reduced = flags.allow_bf16_reduced_precision_reduction
    # cuBLAS may otherwise add split-K partial sums in bf16: one rounding per output is the contract.
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            whole = r0 == 0 and r1 == n  # the usual case: no views to make (each costs host time per call)
            w16 = buffer if whole else buffer[:r1 - r0]
            if not decoded:
                _decode_rows(words if whole else words[r0:r1],
                             scale_t if whole else _scale_rows(scale_t, r0, r1, layout), mult,
                             layout, w16, stream)
            target = out if whole else out[:, r0:r1]
            w16t = (w16 if w16.shape[1] == k else w16[:, :k]).t()
            if bias is not None:
                torch.addmm(bias if whole else bias[r0:r1], x, w16t, alpha=alpha_host, out=target)
            elif alpha_host == 1.0:
                torch.mm(x, w16t, out=target)
            else:
                torch.addmm(target, x, w16t, beta=0, alpha=alpha_host, out=target)
    finally:
        flags.allow_bf16_reduced_precision_reduction = reduced
    return out


# --------------------------------------------------------------------------------------------------
# Overlapped: the next chunk decoded on a side stream while cuBLAS multiplies this one
# --------------------------------------------------------------------------------------------------

#: (device, stream key) and (device, "graphs") -> {"pingpong": bf16 buffer}: the two chunk buffers of
#: ``overlap_gemm``, persistent like the split-K workspace (``weight_only_kernels.workspace``).
_PINGPONG: dict = {}
#: (device, main stream key) -> (side stream, [events]): the side stream the decodes run on (high
#: priority) and the events that order them against the GEMMs, reused from call to call (a wait takes
#: the event's most recent record at the time it is enqueued).
_SIDE: dict = {}


def pingpong(device: torch.device, stream, rows: int, kp: int) -> torch.Tensor:
    """(2, rows, kp) bf16: the two chunk buffers for launches on ``stream``, a view of a persistent
    buffer allocated outside CUDA-graph pools, chosen as ``weight_only_kernels.workspace`` chooses its
    workspace (eager: the stream's own; in a capture: the capture stream's or the device's graph buffer,
    which every eager call sizes; neither large enough: a buffer of the graph). Calls that share one
    are ordered by their main stream: each call's first decode waits for everything enqueued on the
    main stream before it, the GEMMs of the previous call included."""
    need = 2 * rows * kp
    key = (device, _wo._stream_key(stream))

    def fits(k):
        buf = _PINGPONG.get(k, {}).get("pingpong")
        return buf is not None and buf.numel() >= need

    if _wo._capturing(device):
        for k in (key, (device, "graphs")):
            if fits(k):
                return _PINGPONG[k]["pingpong"][:need].view(2, rows, kp)
        return torch.empty((2, rows, kp), dtype=torch.bfloat16, device=device)
    for k in (key, (device, "graphs")):
        if not fits(k):
            _wo._grow(_PINGPONG, k, "pingpong", need,
                      lambda: torch.empty(need, dtype=torch.bfloat16, device=device))
    return _PINGPONG[key]["pingpong"][:need].view(2, rows, kp)


def _side(device: torch.device, main, events: int):
    """The side stream of ``main`` (a torch.cuda.Stream) and at least ``events`` events."""
    key = (device, main.cuda_stream)
    side, evs = _SIDE.get(key) or (None, [])
    if side is None:
        # High priority: the decode is what the next GEMM waits for, so its blocks should take SMs as
        # soon as the running GEMM frees them.
        side = torch.cuda.Stream(device=device, priority=-1)
    while len(evs) < events:
        evs.append(torch.cuda.Event())
    _SIDE[key] = (side, evs)
    return side, evs


def overlap_gemm(x: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
                 alpha_host: float, out: torch.Tensor, layout: _wo.Layout, k: int, chunk: int) -> torch.Tensor:
    """out (M, N) = (x @ (decode(W) * 2^-E).T) * alpha_host, x bf16, no bias, as ``decode_gemm``
    computes it (cuBLAS's fp32 epilogue rounds once to out's dtype; its reduced-precision split-K
    reduction off), with the decode of weight rows [(i+1) c, (i+2) c) running on a side stream into
    one of two ping-pong buffers while cuBLAS multiplies rows [i c, (i+1) c) from the other into their
    output columns on the current stream.

    Ordering: the side stream first waits for the current stream (the fork: x, and every earlier use
    of the buffers, are ready); GEMM i waits for decode i's event; decode i + 2 waits for GEMM i's
    event (it overwrites GEMM i's buffer); the current stream's wait for the last decode joins the
    side stream back. So the call can be captured into a CUDA graph (the side stream joins the
    capture at the fork). On the CPU (the emulator) the same steps run in order, without streams."""
    n = words.shape[0]
    rows = min(chunk, n)
    chunks = ceil_div(n, rows)
    k_tiles = words.shape[1] // layout.words_per_tile
    kp = k_tiles * layout.tile_k
    mult = constants[1:2]
    cuda = x.is_cuda
    if cuda:
        main = torch.cuda.current_stream(x.device)
        side, events = _side(x.device, main, 2 * chunks)
        decoded, multiplied = events[:chunks], events[chunks:]
        buffers = pingpong(x.device, main, rows, kp)
        side.wait_stream(main)
        side_handle = side.cuda_stream
    else:
        buffers = torch.empty((2, rows, kp), dtype=torch.bfloat16)
        side_handle = None

    def decode(i):
        r0, r1 = i * rows, min((i + 1) * rows, n)
        if cuda and i >= 2:
            side.wait_event(multiplied[i - 2])
        _decode_rows(words[r0:r1], _scale_rows(scale_t, r0, r1, layout), mult, layout, buffers[i % 2, :r1 - r0],
                     side_handle)
        if cuda:
            decoded[i].record(side)

    flags = torch.backends.cuda.matmul
    reduced = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False  # one rounding per output, as decode_gemm
    try:
        decode(0)
        for i in range(chunks):
            if i + 1 < chunks:
                decode(i + 1)
            r0, r1 = i * rows, min((i + 1) * rows, n)
            w16 = buffers[i % 2, :r1 - r0, :k]
            if cuda:
                main.wait_event(decoded[i])
            target = out[:, r0:r1]
            if alpha_host == 1.0:
                torch.mm(x, w16.t(), out=target)
            else:
                torch.addmm(target, x, w16.t(), beta=0, alpha=alpha_host, out=target)
            if cuda:
                multiplied[i].record(main)
    finally:
        flags.allow_bf16_reduced_precision_reduction = reduced
    return out


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

#: The layouts whose ``VARIANTS`` compile ahead of time (the ones the sweep times per family).
_VARIANT_LAYOUTS = {"4bit": ("mxfp4", "nvfp4"), "8bit": ("mxfp8_e4m3",)}


def _configs(layout_name: str | None = None) -> list[LargeConfig]:
    """The fused configs the rules name and the sweep's candidates, and, for ``layout_name`` (a key of
    ``weight_only_kernels.LAYOUTS``) the sweep times them on, its family's variants (a split one with
    split_k 2: the count is a run-time argument)."""
    seen = []
    for rule in RULES.values():
        splits = (dataclasses.replace(c, split_k=2) for c, _ in rule.split)  # any split: one code path
        for cfg in (rule.large, *(c for c, _ in rule.fused), *splits):
            if cfg is not None and cfg.kind == "fused" and cfg not in seen:
                seen.append(cfg)
    for cfg in CANDIDATES:
        if cfg.kind == "fused" and cfg not in seen:
            seen.append(cfg)
    for fam, variants in VARIANTS.items():
        if layout_name not in _VARIANT_LAYOUTS[fam]:
            continue
        for cfg, split, _, _ in variants:
            cfg = dataclasses.replace(cfg, split_k=2) if split else cfg  # any split: one code path
            if cfg not in seen:
                seen.append(cfg)
    return seen


#: Fused configs the sweep times (besides the decode designs); every one compiles ahead of time
#: under ``aot_full``.
#: What sm_90 compiles say (tileiras 13.4; registers, spill stack, shared memory and main-loop SASS
#: per weight element of each config and format, in the compile table of
#: ``benchmarks/results/tune-weight-only-designs-nvidia-h100-80gb-hbm3.md``): of the 128x128 configs,
#: one MMA per K tile (cat) issues the fewest instructions per element; 256 rows of x issue more per
#: element decoded, which then feeds twice the columns (with cat they spill); 256 weight rows spill,
#: so no candidate has them; 64 rows of x fit two blocks per SM. The latency hints change nothing for
#: 4-bit weights and remove MXFP8's small spill without cat. On the H100
#: (``benchmarks/results/tune-weight-only-large-nvidia-h100-80gb-hbm3.txt``) the latency hints (4 / 2)
#: and GROUP_SIZE_M 16 for 256 rows of x gained nothing over the same configs without them on any
#: shape, so the sweep no longer times them; which family times which config: ``SWEEP``.
CANDIDATES = (
    LargeConfig("fused", 128, 128, cat=1),
    LargeConfig("fused", 128, 128),
    LargeConfig("fused", 256, 128),
    LargeConfig("fused", 64, 128, occupancy=2),
)

#: The designs ``benchmarks/investigations/tune_weight_only_large.py`` times per weight family besides the small-M
#: plan and the old two-pass path: the fused configs the family's rules can pick (on the first H100
#: sweep, ``benchmarks/results/tune-weight-only-large-nvidia-h100-80gb-hbm3.txt``, 4-bit weights ran
#: slower with cat or 256 rows of x than without, and 8-bit weights never won with 128x128 tiles without cat or 64
#: rows of x), the whole weight decoded for cuBLAS, and the overlapped design in chunks of 1024 and
#: 2048 weight rows (timed from M = 256).
SWEEP = {
    "4bit": (CANDIDATES[1], CANDIDATES[3], LargeConfig("decode", chunk=0), LargeConfig("overlap", chunk=1024),
             LargeConfig("overlap", chunk=2048)),
    "8bit": (CANDIDATES[0], CANDIDATES[2], LargeConfig("decode", chunk=0), LargeConfig("overlap", chunk=1024),
             LargeConfig("overlap", chunk=2048)),
}


#: The fused kernel's structural variants that ``benchmarks/investigations/tune_weight_only_large.py``
#: times beside the committed candidates, per family: (config, split, first M, last M). ``split``: the
#: config runs with ``with_split``'s K split for the shape (named ``..._sauto``). What each one tests:
#: the K split at M = 64-256, where N / 128 output tiles leave SMs idle (N = 1024 ... 8192: 8-64
#: tiles on 132 SMs); 64 weight rows per block with one warpgroup, two blocks per SM (more
#: independent warpgroups per SM to overlap one's decode with another's MMA: within a warpgroup every
#: MMA is waited for before the next decode); 2-CTA clusters of 128 weight rows each sharing one x
#: tile by TMA multicast (half the x bytes from L2 per weight byte; at M >= 128 x's bytes exceed the
#: 4-bit weight's); one MMA per K tile (``cat``) for 4-bit weights; one-warpgroup blocks of 64 weight
#: rows with 32 or 16 rows of x and the K split, for the M = 2-64 that the small-M kernels take (their
#: split still ends in the kernel, as the fused kernel's did when that made it slow; not yet timed).
#: (The K split of 64 rows of x at two blocks per SM did not finish compiling for sm_90 in 10 minutes:
#: not here.) Instructions per element of each: ``benchmarks/results/decode-cost-large-sm90.md``.
VARIANTS = {
    "4bit": ((LargeConfig("fused", 128, 128), True, 64, 512),
             (LargeConfig("fused", 128, 128, cat=1), True, 64, 256),
             (LargeConfig("fused", 64, 128), True, 64, 64),
             (LargeConfig("fused", 64, 64, warps=4, occupancy=2), True, 32, 256),
             (LargeConfig("fused", 32, 64, warps=4, occupancy=2), True, 16, 64),
             (LargeConfig("fused", 16, 64, warps=4, occupancy=3), True, 2, 16),
             (LargeConfig("fused", 64, 256, num_ctas=2), True, 64, 256),
             (LargeConfig("fused", 128, 256, num_ctas=2), False, 128, 1024),
             (LargeConfig("fused", 128, 128, cat=1), False, 128, 1024)),
    "8bit": ((LargeConfig("fused", 128, 128, cat=1), True, 64, 256),
             (LargeConfig("fused", 64, 64, warps=4, occupancy=2), True, 32, 128),
             (LargeConfig("fused", 32, 64, warps=4, occupancy=2), True, 16, 64),
             (LargeConfig("fused", 16, 64, warps=4, occupancy=3), True, 2, 16),
             (LargeConfig("fused", 128, 256, num_ctas=2), False, 128, 1024)),
}


def aot_variants(full: bool = True) -> list[AotVariant]:
    """The fused kernel per (layout, config) for bf16 x and output (the large-M plan runs bf16 x only),
    on sm_90: the runner takes the fused design on Hopper only (elsewhere the decode design; sm_120
    compiles of the 256-column tiles took minutes and megabytes of code)."""
    variants = []
    # NVFP4 with normal scale bytes (``Layout.normal_scales``): the configs its family's rules name.
    rule = RULES["4bit"]
    named = [c for c, _ in rule.fused] + [dataclasses.replace(c, split_k=2) for c, _ in rule.split]
    normal = [("nvfp4_normal", _wo.NVFP4_NORMAL,
               [c for c in dict.fromkeys(named) if c.kind == "fused"])]
    for name, layout, configs in (*((n, lay, _configs(n)) for n, lay in _wo.LAYOUTS.items()), *normal):
        for cfg in configs:
            partial = array(ct.float32, 3) if cfg.split_k > 1 else array(ct.float32, 1)  # or a stand-in
            params = [array(ct.bfloat16, 2), array(ct.int32, 2), array(ct.uint8, 2), array(ct.bfloat16, 2),
                      array(ct.float32, 1), array(ct.float32, 1), array(ct.float32, 1), partial,
                      cc.ScalarConstraint(ct.int32), *_constants(layout, cfg, 1)]
            variants.append(AotVariant(f"weight_only_large_{name}_{cfg.name}", cfg.kernel, params,
                                       targets=("sm_90",)))
    variants.append(AotVariant("weight_only_large_partial_sum_bfloat16", _partial_sum_kernel,
                               [array(ct.float32, 3), array(ct.bfloat16, 2), array(ct.float32, 1),
                                array(ct.float32, 1), cc.ScalarConstraint(ct.int32), *SUM_TILE],
                               targets=("sm_90",)))
    return variants
