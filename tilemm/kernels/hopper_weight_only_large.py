"""Weight-only matmul for many rows of x (prefill, batched decode: M = 64 ... thousands), two designs:

* ``_large_kernel``, fused (the runner takes it on Hopper): a persistent mixed-input tensor-core
  kernel. Each block takes output tiles of TN weight rows by TM rows of x in grouped order
  (``tile_coords_at``: the blocks running at once
  share weight tiles and x tiles in L2), and per K tile decodes the prepacked weight tile in registers
  with the decode helpers of ``weight_only_kernels`` (``_k_tile``: the same shifts, masks and bf16
  multipliers as the small-M kernel) and multiplies it as wgmma's left operand (registers) against the
  x tile, which TMA brings to shared memory: ``acc (TN, TM) += decode(W tile) @ x_tile.T``. No bf16
  copy of the weight exists anywhere. ``num_worker_warps = 8`` (two MMA warpgroups; without it an
  accumulator above 128x128 spills on sm_90).
* ``decode_gemm``, two-pass (any GPU): the prepacked weight decoded to bf16 (``weight_only_kernels``'s
  ``_dequantize_kernel``), ``chunk`` weight rows at a time into a buffer small enough to stay in L2
  (or the whole weight at once: ``chunk = 0``), each chunk multiplied by cuBLAS's bf16 GEMM into its
  columns of the output, rounded once to the output's dtype by cuBLAS's fp32 epilogue.

Both compute ``out = (x @ dequantize(w).T) * alpha + bias`` with fp32 accumulation and one rounding,
exactly as ``weight_only_kernels`` documents it (the decoded weight is ``dequantize(w) * 2^-E``, exact
in bf16; alpha carries 2^E). Which design and which config serves an (M, N, K) problem is a table
(``PLAN``) that ``benchmarks/tune_weight_only_large.py`` measures and prints.
"""

from __future__ import annotations

import dataclasses

import cuda.tile as ct
import torch

from ._aot import AotVariant, array
from ._common import hinted, sm90_hints, tile_coords_at
from . import weight_only_kernels as _wo
from .weight_only_kernels import _epilogue, _k_tile

__all__ = ["LargeConfig", "PLAN", "CANDIDATES", "plan", "first_m", "family", "grid", "launch", "decode_gemm",
           "aot_variants"]

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


def _step(X, W, S, Mult, acc, bm, bn, kt, ELEMENT, SCALE_E8M0, BLOCK, PLANES, GROUP, TM, TN, LATENCY_W,
          LATENCY_X, X_PARTS, CAT):
    """acc + decode(W tile (bn, kt)) @ x tile (bm, kt).T."""
    WORDS = GROUP * BLOCK // 2
    TK = PLANES * GROUP * BLOCK
    SC = PLANES * GROUP
    w = _load_w(W, bn, kt, TN, WORDS, LATENCY_W)
    s_raw = ct.load(S, (kt, bn), (SC, TN), padding_mode=_ZERO).transpose()
    x = _load_x(X, bm, kt, TM, TK, LATENCY_X)
    return _k_tile(w, s_raw, Mult, x, acc, ELEMENT, SCALE_E8M0, BLOCK, PLANES, GROUP, TN, TM, X_PARTS, CAT)


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=8))
def _large_kernel(X, W, S, C, Alpha, Mult, Bias,
                  ELEMENT: ConstInt, SCALE_E8M0: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                  GROUP: ConstInt, TM: ConstInt, TN: ConstInt, GROUP_SIZE_M: ConstInt,
                  LATENCY_W: ConstInt, LATENCY_X: ConstInt, X_PARTS: ConstInt, CAT: ConstInt):
    """C (M, N) = (X (M, K) @ decode(W).T) * alpha + bias, persistent over output tiles.

    X (M, K) activations (bf16; fp16 / fp32 split exactly into X_PARTS bf16 parts as in the small-M
    kernel); W (N, k_tiles * WORDS) int32 prepacked words; S (K / BLOCK, N) scale bytes; Alpha (1,)
    and Mult (1,) fp32 (the PackedWeight's constants); Bias (N,) fp32. Grid: any number of blocks;
    block b takes tiles b, b + blocks, ... of cdiv(M, TM) * cdiv(N, TN), numbered in GROUP_SIZE_M-row
    groups of M tiles. LATENCY_W / LATENCY_X: the loads' latency hints (0: the compiler's choice).
    CAT = 1: the K tile's decoded planes concatenated into one MMA operand (one wait for the tensor
    cores per K tile instead of one per plane; all planes' registers live at once).
    """
    M = X.shape[0]
    N = C.shape[1]
    TK = PLANES * GROUP * BLOCK
    k_tiles = ct.cdiv(X.shape[1], TK)
    tiles = ct.cdiv(M, TM) * ct.cdiv(N, TN)
    for t in range(ct.bid(0), tiles, ct.num_blocks(0)):
        _, bm, bn = tile_coords_at(t, M, N, TM, TN, GROUP_SIZE_M)
        # The first K tile outside the loop: a loop that starts from zeros makes tileiras 13.4 select
        # between the accumulator and a copy of it on every iteration (2 instructions per accumulator
        # register, about 1 per weight element at 128x128; sm_90 SASS).
        acc = _step(X, W, S, Mult, ct.zeros((TN, TM), ct.float32), bm, bn, 0, ELEMENT, SCALE_E8M0, BLOCK,
                    PLANES, GROUP, TM, TN, LATENCY_W, LATENCY_X, X_PARTS, CAT)
        for kt in range(1, k_tiles):
            acc = _step(X, W, S, Mult, acc, bm, bn, kt, ELEMENT, SCALE_E8M0, BLOCK, PLANES, GROUP, TM, TN,
                        LATENCY_W, LATENCY_X, X_PARTS, CAT)
        _epilogue(acc.transpose(), C, Alpha, Bias, bm, bn, TM, TN)


# --------------------------------------------------------------------------------------------------
# Configs and the plan table
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LargeConfig:
    """A large-M design and its settings.

    ``kind`` "fused" (``_large_kernel``: tile_n weight rows x tile_m rows of x per output tile,
    GROUP_SIZE_M, load latency hints, blocks per SM) or "decode" (``decode_gemm``: ``chunk`` weight
    rows decoded per cuBLAS GEMM, 0 for the whole weight at once)."""

    kind: str = "fused"
    tile_m: int = 128
    tile_n: int = 128
    group_size_m: int = 8
    latency_w: int = 0
    latency_x: int = 0
    occupancy: int = 1
    chunk: int = 0
    cat: int = 0

    def __post_init__(self):
        if self.kind not in ("fused", "decode"):
            raise ValueError(f"LargeConfig: kind must be 'fused' or 'decode', got {self.kind!r}")

    @property
    def kernel(self):
        return hinted(_large_kernel, **sm90_hints(8, self.occupancy if self.occupancy > 1 else None))

    @property
    def name(self) -> str:
        """``decode_c<chunk>``, or ``fused_<weight rows>x<rows of x>_g<group>`` and the settings."""
        if self.kind == "decode":
            return f"decode_c{self.chunk}"
        s = f"fused_{self.tile_n}x{self.tile_m}_g{self.group_size_m}"
        if self.latency_w or self.latency_x:
            s += f"_lw{self.latency_w}lx{self.latency_x}"
        return s + (f"_occ{self.occupancy}" if self.occupancy > 1 else "") + ("_cat" if self.cat else "")


#: The plan: per weight family ("4bit": MXFP4 / NVFP4, "8bit": MXFP8), rows of (smallest M, config or
#: None); a problem takes the entry of the last row whose M it reaches. None, and any M below the first
#: row, means the small-M plan of ``weight_only_kernels``. ``benchmarks/tune_weight_only_large.py``
#: prints this table from its measurements, ready to paste. Until a measured table replaces them, the
#: rows keep the dispatch that was measured before this module (the small-M plan below M = 512, the
#: whole weight decoded for cuBLAS from 512 on), with cuBLAS writing bf16 itself instead of fp32
#: followed by a cast.
PLAN = {
    "4bit": (
        (512, LargeConfig("decode", chunk=0)),
    ),
    "8bit": (
        (512, LargeConfig("decode", chunk=0)),
    ),
}


def family(layout: _wo.Layout) -> str:
    return "4bit" if layout.planes == 4 else "8bit"


def first_m(layout: _wo.Layout, table: dict | None = None) -> int:
    """The smallest M the table has a row for (no row: never)."""
    rows = (table or PLAN)[family(layout)]
    return min((r[0] for r in rows), default=1 << 62)


def plan(m: int, n: int, k: int, layout: _wo.Layout, table: dict | None = None, sms: int = 132
         ) -> LargeConfig | None:
    """The large-M config for an (M, K) x (N, K) problem, or None where the small-M plan applies.

    A fused config whose output tiles would leave more than half of the ``sms`` SMs idle (it has no K
    split; 1024 weight rows at M = 256 make 16 tiles) gives way to the small-M plan, which splits K."""
    chosen = None
    for first_m, cfg in (table or PLAN)[family(layout)]:
        if m >= first_m:
            chosen = cfg
    if chosen is not None and chosen.kind == "fused":
        if 2 * -(-m // chosen.tile_m) * -(-n // chosen.tile_n) < sms:
            return None
    return chosen


def _constants(layout: _wo.Layout, cfg: LargeConfig, x_parts: int) -> tuple:
    return (layout.element, int(layout.scale == "e8m0"), layout.block, layout.planes, layout.group,
            cfg.tile_m, cfg.tile_n, cfg.group_size_m, cfg.latency_w, cfg.latency_x, x_parts, cfg.cat)


def grid(cfg: LargeConfig, m: int, n: int, sms: int) -> tuple:
    """Persistent grid: at most one block per SM slot (``occupancy`` per SM), at most one per tile."""
    tiles = -(-m // cfg.tile_m) * -(-n // cfg.tile_n)
    return (max(1, min(tiles, sms * cfg.occupancy)), 1, 1)


def launch(x: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
           bias: torch.Tensor, out: torch.Tensor, layout: _wo.Layout, cfg: LargeConfig, sms: int,
           stream, alpha: torch.Tensor | None = None) -> None:
    """out (M, N) = (x @ W.T) * alpha + bias with the fused kernel; arguments as
    ``weight_only_kernels.launch`` (``alpha`` replaces constants[0] when given), on ``stream``."""
    m, n = out.shape
    ct.launch(stream, grid(cfg, m, n, sms), cfg.kernel,
              (x, words, scale_t, out, constants[0:1] if alpha is None else alpha, constants[1:2], bias,
               *_constants(layout, cfg, _wo._X_PARTS[x.dtype])))


# --------------------------------------------------------------------------------------------------
# Two-pass: decode (in chunks) + cuBLAS
# --------------------------------------------------------------------------------------------------

def _decode_rows(words, scale_t, mult, layout: _wo.Layout, out16: torch.Tensor, stream) -> None:
    """out16 (rows, Kp) bf16 = the prepacked rows ``words`` (rows, k_tiles * WORDS) decoded, times 2^-E."""
    rows = words.shape[0]
    k_tiles = words.shape[1] // layout.words_per_tile
    ct.launch(stream, (-(-rows // _wo.DEQUANT_TN) * k_tiles, 1, 1), _wo._dequantize_kernel,
              (words, scale_t, out16, mult, layout.element, int(layout.scale == "e8m0"), layout.block,
               layout.planes, layout.group, _wo.DEQUANT_TN))


def decode_gemm(x: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
                alpha_host: float, out: torch.Tensor, layout: _wo.Layout, k: int, chunk: int, stream,
                buffer: torch.Tensor | None = None) -> torch.Tensor:
    """out (M, N) = (x @ (decode(W) * 2^-E).T) * alpha_host, x bf16, no bias: the weight decoded to bf16
    ``chunk`` rows at a time (all at once for chunk = 0) and multiplied by cuBLAS, whose fp32 epilogue
    applies alpha and rounds once to out's dtype (bf16). ``buffer`` (chunk or N rows, Kp) bf16 is the
    decode's destination (allocated when None). Returns out."""
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
            w16 = buffer[:r1 - r0]
            _decode_rows(words[r0:r1], scale_t[:, r0:r1], mult, layout, w16, stream)
            target = out[:, r0:r1]
            if alpha_host == 1.0:
                torch.mm(x, w16[:, :k].t(), out=target)
            else:
                torch.addmm(target, x, w16[:, :k].t(), beta=0, alpha=alpha_host, out=target)
    finally:
        flags.allow_bf16_reduced_precision_reduction = reduced
    return out


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

def _configs() -> list[LargeConfig]:
    """The fused configs of the plan table and of the sweep's candidates."""
    seen = []
    for rows in PLAN.values():
        for _, cfg in rows:
            if cfg is not None and cfg.kind == "fused" and cfg not in seen:
                seen.append(cfg)
    for cfg in CANDIDATES:
        if cfg.kind == "fused" and cfg not in seen:
            seen.append(cfg)
    return seen


#: Fused configs the sweep times (besides the decode designs); every one compiles ahead of time
#: under ``aot_full``.
#: What sm_90 compiles say (tileiras 13.4, MXFP4; registers, spill stack, shared memory, main-loop
#: SASS per weight element; ``benchmarks/results/weight-only-designs-*.md``): 128x128 with one MMA per
#: K tile (cat) 168 / 0 / 164 KB / 3.22 (NVFP4 3.85, MXFP8 4.30); one MMA per plane 3.64; 256 rows of
#: x 250 / 0 / 146 KB / 4.41 (per element it decodes, which then feeds twice the columns; with cat it
#: spills); 256 weight rows spill, so no candidate has them; 64 rows of x at occupancy 2: 80 / 0 /
#: 100 KB / 4.20. The latency hints change nothing for 4-bit weights and remove MXFP8's small spill
#: without cat.
CANDIDATES = (
    LargeConfig("fused", 128, 128, cat=1),
    LargeConfig("fused", 128, 128),
    LargeConfig("fused", 256, 128),
    LargeConfig("fused", 128, 128, latency_w=4, latency_x=2),
    LargeConfig("fused", 256, 128, group_size_m=16),
    LargeConfig("fused", 64, 128, occupancy=2),
)


def aot_variants(full: bool = True) -> list[AotVariant]:
    """The fused kernel per (layout, config) for bf16 x and output (the large-M plan runs bf16 x only),
    on sm_90: the runner takes the fused design on Hopper only (elsewhere the decode design; sm_120
    compiles of the 256-column tiles took minutes and megabytes of code)."""
    variants = []
    for name, layout in _wo.LAYOUTS.items():
        for cfg in _configs():
            params = [array(ct.bfloat16, 2), array(ct.int32, 2), array(ct.uint8, 2), array(ct.bfloat16, 2),
                      array(ct.float32, 1), array(ct.float32, 1), array(ct.float32, 1),
                      *_constants(layout, cfg, 1)]
            variants.append(AotVariant(f"weight_only_large_{name}_{cfg.name}", cfg.kernel, params,
                                       targets=("sm_90",)))
    return variants
