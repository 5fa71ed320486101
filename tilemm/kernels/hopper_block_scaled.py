"""MXFP8, MXFP4 and NVFP4 matmuls on Hopper (sm_90), exact, in cuTile.

What it computes (NUMERICS.md): for each batch entry, ``out = (dequantize(a) @ dequantize(b).T) *
alpha + bias`` with fp32 accumulation, rounded once to ``out``'s dtype. ``a`` is (Ba, M, Kd), ``b`` is
the (Bb, N, Kd) weight form (both K-contiguous), scales are e8m0 bytes (MX) or e4m3 (NVFP4, whose two
per-tensor decode scales arrive folded into ``alpha``).

Why emulate: sm_90 has no block-scaled tensor-core instruction, and cuTile rejects float8_e8m0fnu and
float4_e2m1fn there, so ``ct.mma_scaled`` cannot run. Scales and packed FP4 data come in as uint8 and
are decoded with integer operations and ``ct.bitcast``.

Design (one kernel, one output tile per block):

* Grid: 1-D over B * cdiv(M, TM) * cdiv(N, TN) tiles, GROUP_SIZE_M-swizzled for L2 reuse; Ba or Bb of 1
  broadcasts (batch index ``batch % Ba``). num_worker_warps = 8 so 128x256 fp32 accumulators fit.
* Per K step both operand tiles are loaded K-major ((TM, TK) and (TN, TK), B transposed in registers),
  decoded and multiplied by their block scale in a 16-bit float type, then fed to ``ct.mma`` with an
  fp32 accumulator:

  - MXFP8 (e4m3 / e5m2): element -> bf16 (exact), times 2^(s-127) in bf16 (``e8m0_to_bf16``).
  - MXFP4: nibble -> bf16 bits of e2m1 * 2^-126, times 2^126, times 2^(s-127), all in bf16.
  - NVFP4: nibble -> fp16 bits of e2m1 * 2^-14, times 2^14, times the e4m3 scale (-> fp16), in fp16.
    Packed bytes are split into a low-nibble and a high-nibble half tile, concatenated along K. Both
    operands use the same order, so the permutation of K leaves every dot product unchanged.

* Epilogue: ``acc * alpha + bias`` (alpha a 1-element fp32 device tensor, bias (N,) fp32; absent ones
  are replaced by cached 1.0 / zeros so one specialisation serves all calls), one cast, masked store.

Exactness: every scaled element is exactly representable in the 16-bit type, and the tensor cores
multiply 16-bit floats exactly into the fp32 accumulator, so the only rounding is fp32 accumulation,
as in the reference.
* e4m3 x 2^k is exact in bf16 for k >= -124 and e5m2 x 2^k for k >= -117 (below that the smallest
  element magnitudes fall under bf16's subnormal step 2^-133); at the top, bf16 and fp32 overflow at the
  same point. So MXFP8 is exact for scale bytes s >= 3 (e4m3) / s >= 10 (e5m2); for smaller s, products
  below 2^-133 are lost, where the fp32 reference keeps them down to 2^-149 (an absolute difference of
  at most 2^-133 per element, far below any normally scaled data).
* e2m1 x 2^k is exact in bf16 for every e8m0 byte (MXFP4), e2m1 x e4m3 (max 2688, step 2^-10) in fp16.
* Scale byte 255 (MX) or an e4m3 NaN (NVFP4) becomes NaN, so NaN reaches exactly the outputs whose
  row (x) or column (y) has it, whatever the element value (NaN * 0 = NaN).
* K beyond the operand (K a multiple of the block but not of TK) loads as zero data with zero scale
  bytes (2^-127 or 0.0: finite), so it contributes exactly 0. Scale rows beyond M / N (padding of the
  swizzled layout, possibly garbage) only reach accumulator rows / columns that are never stored.

Swizzled (32x4x4) scales are loaded as whole 128-row blocks (TM and TN are multiples of 128) and
unswizzled in registers; scale columns past K/B are forced to 0 so that only real data is scaled.

Speed (H100, 8192^3, bf16 out, swizzled scales, 2026-11-22): MXFP8 222-224 TFLOPS, MXFP4 191-195,
NVFP4 141-147, against cuBLAS bf16 747-752 and eager dequantize + cuBLAS bf16 351-364 / 223-225 /
196-206. The SASS shows why: each K step converts, stores the B operand to shared memory, runs the
HGMMAs and waits for them (``WARPGROUP.DEPBAR gsb0``) before converting the next tile, so conversion
never overlaps the tensor cores. Overlapping the two is the first thing to tune.
"""

from __future__ import annotations

import dataclasses

import cuda.tile as ct
import torch

from ..formats import MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Format
from ._aot import AotVariant, array
from ._common import (SWIZZLE_COLS, SWIZZLE_ROWS, e2m1_hi_bits_bf16, e2m1_hi_bits_fp16, e2m1_lo_bits_bf16,
                      e2m1_lo_bits_fp16, e8m0_to_bf16, epilogue, hinted, ones_scalar, swizzled_scale_view,
                      tile_coords, unswizzle_scale_tile, zeros_vector)

__all__ = ["launch", "aot_variants", "TileConfig", "config_for"]

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

# Element decodings the kernel knows (the ELEMENT constant).
_MXFP8 = 0  # e4m3 / e5m2 elements (the array's dtype says which), e8m0 scales, bf16 math
_MXFP4 = 1  # packed e2m1, e8m0 scales, bf16 math
_NVFP4 = 2  # packed e2m1, e4m3 scales, fp16 math

_ZERO = ct.PaddingMode.ZERO


# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def _load_scales(S, b, rt, kt, ROWS, SC, SWIZZLED, KS):
    """Scale tile (ROWS, SC) for rows rt*ROWS.. and K tile kt (SC scale columns per K tile).

    Logical S is (Bs, R, Ks): out-of-bounds rows and columns load as 0. Swizzled S is the 6-D view
    from ``swizzled_scale_view``; columns at or past KS (the 4-column padding) are forced to 0.
    """
    if SWIZZLED:
        c = min(SC, SWIZZLE_COLS)
        g = SWIZZLE_COLS // c
        kg = max(SC // SWIZZLE_COLS, 1)
        t = ct.load(S, (b, rt, kt // g, 0, kt % g, 0), (1, ROWS // SWIZZLE_ROWS, kg, SWIZZLE_ROWS, 1, c),
                    padding_mode=_ZERO)
        t = unswizzle_scale_tile(t.reshape((ROWS // SWIZZLE_ROWS, kg, SWIZZLE_ROWS, c)), ROWS, SC)
        col = kt * SC + ct.arange(SC, dtype=ct.int32)
        keep = ct.broadcast_to((col < KS).reshape((1, SC)), (ROWS, SC))
        return ct.where(keep, t, ct.zeros((ROWS, SC), t.dtype))
    return ct.load(S, (b, rt, kt), (1, ROWS, SC), padding_mode=_ZERO).reshape((ROWS, SC))


def _scale_blocks(x, s, ROWS, WIDTH, SC):
    """x (ROWS, WIDTH) times s (ROWS, SC), each scale covering WIDTH / SC consecutive columns."""
    x = x.reshape((ROWS, SC, WIDTH // SC)) * s.reshape((ROWS, SC, 1))
    return x.reshape((ROWS, WIDTH))


def _dequantize(raw, s_raw, ROWS, TK, SC, ELEMENT):
    """Raw operand tile (ROWS, TK or TK/2 bytes) and its raw scale tile (ROWS, SC) -> (ROWS, TK) in bf16
    (MX) or fp16 (NVFP4), each element times its block scale, exactly."""
    if ELEMENT == _MXFP8:
        return _scale_blocks(raw.astype(ct.bfloat16), e8m0_to_bf16(s_raw), ROWS, TK, SC)
    p = raw.astype(ct.uint16)
    if ELEMENT == _MXFP4:
        s = e8m0_to_bf16(s_raw)
        lo = ct.bitcast(e2m1_lo_bits_bf16(p), ct.bfloat16) * ct.bfloat16(2.0 ** 126)
        hi = ct.bitcast(e2m1_hi_bits_bf16(p), ct.bfloat16) * ct.bfloat16(2.0 ** 126)
    else:
        s = s_raw.astype(ct.float16)
        lo = ct.bitcast(e2m1_lo_bits_fp16(p), ct.float16) * ct.float16(2.0 ** 14)
        hi = ct.bitcast(e2m1_hi_bits_fp16(p), ct.float16) * ct.float16(2.0 ** 14)
    # Element 2j of the tile is the low nibble of byte j, element 2j + 1 its high nibble; both sit in
    # block (2j) // B = j // (B / 2), so each half tile takes the scales with half the block width.
    lo = _scale_blocks(lo, s, ROWS, TK // 2, SC)
    hi = _scale_blocks(hi, s, ROWS, TK // 2, SC)
    return ct.cat((lo, hi), 1)


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=8))
def _block_scaled_kernel(A, A_scale, B, B_scale, C, Alpha, Bias,
                         ELEMENT: ConstInt, SCALE_BLOCK: ConstInt, SWIZZLED: ConstBool,
                         TM: ConstInt, TN: ConstInt, TK: ConstInt, GROUP_SIZE_M: ConstInt,
                         LATENCY: ConstInt):
    """One (TM, TN) tile of C[batch] = (deq(A[ba]) @ deq(B[bb]).T) * alpha + bias.

    A (Ba, M, Kd), B (Bb, N, Kd): data (Kd = K, or K/2 packed bytes). A_scale / B_scale: logical
    (B*, R, K/SCALE_BLOCK) or the 6-D swizzled view. C (B, M, N). Alpha (1,) fp32, Bias (N,) fp32.
    """
    M = C.shape[1]
    N = C.shape[2]
    batch, bm, bn = tile_coords(M, N, TM, TN, GROUP_SIZE_M)
    ba = batch % A.shape[0]
    bb = batch % B.shape[0]

    EPB = 1 if ELEMENT == _MXFP8 else 2  # elements per stored byte
    TKD = TK // EPB                       # stored K per tile
    SC = TK // SCALE_BLOCK                # scale columns per tile
    KS = A.shape[2] * EPB // SCALE_BLOCK  # scale columns in all

    acc = ct.zeros((TM, TN), ct.float32)
    for kt in range(ct.cdiv(A.shape[2], TKD)):
        if LATENCY > 0:
            a_raw = ct.load(A, (ba, bm, kt), (1, TM, TKD), padding_mode=_ZERO, latency=LATENCY)
            b_raw = ct.load(B, (bb, bn, kt), (1, TN, TKD), padding_mode=_ZERO, latency=LATENCY)
        else:
            a_raw = ct.load(A, (ba, bm, kt), (1, TM, TKD), padding_mode=_ZERO)
            b_raw = ct.load(B, (bb, bn, kt), (1, TN, TKD), padding_mode=_ZERO)
        sa = _load_scales(A_scale, ba, bm, kt, TM, SC, SWIZZLED, KS)
        sb = _load_scales(B_scale, bb, bn, kt, TN, SC, SWIZZLED, KS)
        a = _dequantize(a_raw.reshape((TM, TKD)), sa, TM, TK, SC, ELEMENT)
        b = _dequantize(b_raw.reshape((TN, TKD)), sb, TN, TK, SC, ELEMENT)
        acc = ct.mma(a, b.transpose(), acc)
    epilogue(acc, C, Alpha, Bias, batch, bm, bn, TM, TN)


# --------------------------------------------------------------------------------------------------
# Configs: a small table per format, keyed by shape bucket
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes (TM and TN multiples of 128: swizzled scales are read in 128-row blocks), the
    GROUP_SIZE_M swizzle, the load latency hint (0: the compiler's choice) and compiler hints."""

    tile_m: int
    tile_n: int
    tile_k: int
    group_size_m: int = 8
    latency: int = 0
    num_worker_warps: int = 8
    occupancy: int | None = None

    def hints(self) -> dict:
        h = {"num_worker_warps": ct.ByTarget(sm_90=self.num_worker_warps)}
        if self.occupancy is not None:
            h["occupancy"] = self.occupancy
        return h


#: A tile grid with at least this many 128x256 tiles fills the H100's 132 SMs: use the large tile.
_LARGE_TILES = 132

# "small": fewer output tiles than SMs; "large": at least one full wave of 128x256 tiles. The large
# tiles use TK = 64 (MXFP4 at TK = 128 spills registers); at sm_90's 168 registers per thread with
# num_worker_warps = 8 none of these spill (cuobjdump, JIT-like specialisation at 8192^3).
_CONFIGS: dict[str, dict[str, TileConfig]] = {
    "mxfp8": {"small": TileConfig(128, 128, 128), "large": TileConfig(128, 256, 64)},
    "mxfp4": {"small": TileConfig(128, 128, 128), "large": TileConfig(128, 256, 64)},
    "nvfp4": {"small": TileConfig(128, 128, 64), "large": TileConfig(128, 256, 64)},
}


def _family(fmt: Format) -> str:
    if fmt.element == "e2m1":
        return "nvfp4" if fmt.has_global_scale else "mxfp4"
    return "mxfp8"


def _element_code(fmt: Format) -> int:
    return {"mxfp8": _MXFP8, "mxfp4": _MXFP4, "nvfp4": _NVFP4}[_family(fmt)]


def config_for(fmt: Format, batch: int, m: int, n: int) -> TileConfig:
    """The table's config for a problem of ``batch`` x (m, n) outputs."""
    table = _CONFIGS[_family(fmt)]
    big = batch * -(-m // 128) * -(-n // 256)
    return table["large" if big >= _LARGE_TILES else "small"]


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------

def _constants(fmt: Format, swizzled: bool, cfg: TileConfig) -> tuple:
    return (_element_code(fmt), fmt.block, swizzled, cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.group_size_m,
            cfg.latency)


def _scale_operand(fmt: Format, scale: torch.Tensor, swizzled: bool, cfg: TileConfig) -> torch.Tensor:
    """The scale tensor as the kernel reads it: uint8 bytes for e8m0 (cuTile has no e8m0 on sm_90),
    e4m3 as it is; logical scales with unit stride along K; swizzled ones as the 6-D view."""
    if fmt.is_mx:
        scale = scale.view(torch.uint8)
    if swizzled:
        return swizzled_scale_view(scale.contiguous(), cfg.tile_k // fmt.block)
    return scale if scale.stride(-1) == 1 or scale.shape[-1] == 1 else scale.contiguous()


def launch(problem, config: TileConfig | None = None) -> None:
    """Run a ``tilemm.matmul.BlockScaledProblem`` on an sm_90 GPU, writing ``problem.out``.

    ``config`` overrides the table's choice (for tuning and benchmarks)."""
    fmt = problem.fmt
    out = problem.out
    batch, m, n = out.shape
    cfg = config or config_for(fmt, batch, m, n)
    device = out.device
    a = problem.a if fmt.is_packed else problem.a.view(fmt.data_dtype)
    b = problem.b if fmt.is_packed else problem.b.view(fmt.data_dtype)
    a_scale = _scale_operand(fmt, problem.a_scale, problem.swizzled, cfg)
    b_scale = _scale_operand(fmt, problem.b_scale, problem.swizzled, cfg)
    alpha = ones_scalar(device) if problem.alpha is None else problem.alpha.reshape(1)
    bias = zeros_vector(device, n) if problem.bias is None else problem.bias
    grid = (batch * -(-m // cfg.tile_m) * -(-n // cfg.tile_n), 1, 1)
    kernel = hinted(_block_scaled_kernel, **cfg.hints())
    ct.launch(torch.cuda.current_stream(device), grid, kernel,
              (a, a_scale, b, b_scale, out, alpha, bias, *_constants(fmt, problem.swizzled, cfg)))


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_OUT_DTYPES = {"bf16": ct.bfloat16, "fp16": ct.float16, "fp32": ct.float32}
_FORMATS = (MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4)


def _data_dtype(fmt: Format):
    return {"e4m3": ct.float8_e4m3fn, "e5m2": ct.float8_e5m2, "e2m1": ct.uint8}[fmt.element]


def aot_variants() -> list[AotVariant]:
    """Every (format, scale layout, output dtype, config) that ``launch`` can pick, for sm_90."""
    variants = []
    for fmt in _FORMATS:
        data = _data_dtype(fmt)
        scale = ct.uint8 if fmt.is_mx else ct.float8_e4m3fn
        configs = sorted(set(_CONFIGS[_family(fmt)].values()), key=repr)
        for swizzled in (False, True):
            sdim = 6 if swizzled else 3
            for out_name, out_dtype in _OUT_DTYPES.items():
                for cfg in configs:
                    params = [array(data, 3), array(scale, sdim), array(data, 3), array(scale, sdim),
                              array(out_dtype, 3), array(ct.float32, 1), array(ct.float32, 1),
                              *_constants(fmt, swizzled, cfg)]
                    name = (f"hopper_{fmt.name}_{'swz' if swizzled else 'log'}_{out_name}_"
                            f"{cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k}")
                    variants.append(AotVariant(name, hinted(_block_scaled_kernel, **cfg.hints()), params,
                                               targets=("sm_90",)))
    return variants
