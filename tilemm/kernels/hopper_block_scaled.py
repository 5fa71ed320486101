"""MXFP8, MXFP4 and NVFP4 matmuls on Hopper (sm_90), exact, in cuTile.

Computes ``out = (dequantize(a) @ dequantize(b).T) * alpha + bias`` per batch entry, fp32
accumulation, one rounding to ``out``'s dtype (docs/numerics.md). a (Ba, M, Kd) and b, the
(Bb, N, Kd) weight, are K-contiguous; scales are e8m0 (MX) or e4m3 (NVFP4, whose product is also
multiplied by ``fp32(global_scale_x * global_scale_y)``). sm_90 has no block-scaled MMA (cuTile rejects
e8m0 and e2m1 there), so ``_decode`` turns data and scale bytes into 16-bit floats in which every
scaled element is exact (``kernels._common``'s e8m0 / e2m1 decode), and ``ct.mma`` multiplies those
exactly into fp32. ``plan`` picks one of two designs by M:

* stream (M < ``TWO_PASS_MIN_M``): ``_stream_kernel`` reads each weight byte once, operands swapped
  (the weight fills the MMA's M side), K split over ``split_k`` blocks when the output has few tiles
  (the last block of each output tile adds the partials in a fixed order, in the same launch), and,
  with ``x16`` (M > 16, no K split), the activation decoded once by ``_dequantize_kernel``. Up to
  M = 16 a call is one launch (NVFP4's two decode scales are multiplied in the epilogue).
* two-pass: ``_dequantize_kernel`` writes both operands as bf16 / fp16, ``hopper_gemm`` multiplies.

Invariants: the only rounding is the fp32 accumulation (split-K changes its order, deterministically);
packed nibbles are decoded as [low | high] half tiles on both operands (the same permutation of K);
K padding loads as zero data with finite scales and adds exactly 0; scale byte 255 / an e4m3 NaN
makes its row or column NaN; scale rows past M / N reach only accumulators that are never stored.
MXFP8 elements below 2^-133 are lost (bf16's range), where the fp32 reference keeps them.
``Prepared`` plans a signature once and launches it; ``launch`` is one prepared call. Design notes
and measurements: benchmarks/results/matmul-hopper-design-nvidia-h100-80gb-hbm3.md.
"""

from __future__ import annotations

import dataclasses
import math

import cuda.tile as ct
import torch

from ..formats import E2M1, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Format
from . import _large
from ._aot import AotVariant, array
from ._common import (SWIZZLE_COLS, SWIZZLE_ROWS, Described, ceil_div, e2m1_bits, e8m0_to_bf16, folded_alpha,
                      hinted, ones_scalar, sm90_hints, stream_handle, zeros_vector)
from .hopper_gemm import GemmConfig, gemm_constants, gemm_kernel, launch_gemm, load_k_tile, num_sms
from .weight_only_kernels import _capturing, _stream_key, workspace

__all__ = ["launch", "Prepared", "aot_variants", "BlockScaledConfig", "StreamConfig", "TwoPassConfig", "plan",
           "TWO_PASS_MIN_M"]

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

# The kernels' format constants: ELEMENT, the element code (``Format.element_code``), and SCALE_E8M0
# (e8m0 scales, else e4m3). MXFP8 (e4m3 / e5m2) and MXFP4 decode in bf16, NVFP4 (e2m1, e4m3 scales) in fp16.

#: The stream kernel's NVFP4 elements carry 2^-7 each (see the module docstring); products 2^-14.
_NVFP4_FOLD = 2.0 ** 7

_ZERO = ct.PaddingMode.ZERO



# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def _load_scale_tile(S, b, r_tile, kt, ROWS, SC, SWIZZLED, KS):
    """Scale tile (ROWS, SC) of uint8 bytes (e8m0, or e4m3 bits), for rows r_tile*ROWS.. and K tile
    kt (SC scale columns per K tile).

    Logical S is (Bs, R, Ks): rows and columns past the edges load as 0. Swizzled S is the
    (Bs, R/128, Ks/4, 32, 4, 4) view; SC is a multiple of 4; ROWS is 16, 32, 64 or a multiple of 128;
    columns at or past KS (the 4-column padding) are forced to 0.
    """
    if SWIZZLED:
        KG = SC // SWIZZLE_COLS
        if ROWS >= SWIZZLE_ROWS:
            t = ct.load(S, (b, r_tile, kt, 0, 0, 0), (1, ROWS // SWIZZLE_ROWS, KG, 32, 4, SWIZZLE_COLS),
                        padding_mode=_ZERO)
            # (rb, kg, m1, m2, k1) -> (rb, m2, m1, kg, k1): row = rb * 128 + m2 * 32 + m1
            t = t.reshape((ROWS // SWIZZLE_ROWS, KG, 32, 4, SWIZZLE_COLS)).permute((0, 3, 2, 1, 4))
        else:
            R1 = min(ROWS, 32)  # rows of the tile along m1 (lanes of one 32-row sub-block)
            R2 = ROWS // R1     # and along m2 (32-row sub-blocks)
            r0 = r_tile * ROWS
            t = ct.load(S, (b, r0 // SWIZZLE_ROWS, kt, (r0 % 32) // R1, (r0 % SWIZZLE_ROWS) // (32 * R2), 0),
                        (1, 1, KG, R1, R2, SWIZZLE_COLS), padding_mode=_ZERO)
            t = t.reshape((KG, R1, R2, SWIZZLE_COLS)).permute((2, 1, 0, 3))  # (m2, m1, kg, k1)
        t = t.reshape((ROWS, SC))
        col = kt * SC + ct.arange(SC, dtype=ct.int32)
        keep = ct.broadcast_to((col < KS).reshape((1, SC)), (ROWS, SC))
        return ct.where(keep, t, ct.zeros((ROWS, SC), t.dtype))
    return ct.load(S, (b, r_tile, kt), (1, ROWS, SC), padding_mode=_ZERO).reshape((ROWS, SC))


def _scale_blocks(x, s, ROWS, WIDTH, SC):
    """x (ROWS, WIDTH) times s (ROWS, SC), each scale covering WIDTH / SC consecutive columns."""
    x = x.reshape((ROWS, SC, WIDTH // SC)) * s.reshape((ROWS, SC, 1))
    return x.reshape((ROWS, WIDTH))


def _decode(raw, s_raw, ROWS, TK, SC, ELEMENT, SCALE_E8M0, FOLD_NVFP4):
    """Raw operand tile (ROWS, TK or TK/2 bytes) and its raw scale tile (ROWS, SC) -> (ROWS, TK) in bf16
    (MX) or fp16 (NVFP4), each element times its block scale (times 2^-7 for NVFP4 with
    FOLD_NVFP4), exactly. Packed tiles come out as [low nibbles | high nibbles]."""
    if ELEMENT != E2M1:  # MXFP8
        return _scale_blocks(raw.astype(ct.bfloat16), e8m0_to_bf16(s_raw), ROWS, TK, SC)
    p = raw.astype(ct.uint16)
    if SCALE_E8M0:  # MXFP4
        s = e8m0_to_bf16(s_raw)
        lo = ct.bitcast(e2m1_bits(p, 0, 3, 0, 1), ct.bfloat16) * ct.bfloat16(2.0 ** 126)  # low nibbles
        hi = ct.bitcast(e2m1_bits(p, 4, 7, 0, 1), ct.bfloat16) * ct.bfloat16(2.0 ** 126)  # high nibbles
    elif FOLD_NVFP4:
        s = ct.bitcast(s_raw, ct.float8_e4m3fn).astype(ct.float16) * ct.float16(_NVFP4_FOLD)
        lo = ct.bitcast(e2m1_bits(p, 0, 3, 1, 1), ct.float16)
        hi = ct.bitcast(e2m1_bits(p, 4, 7, 1, 1), ct.float16)
    else:
        s = ct.bitcast(s_raw, ct.float8_e4m3fn).astype(ct.float16)
        lo = ct.bitcast(e2m1_bits(p, 0, 3, 1, 1), ct.float16) * ct.float16(2.0 ** 14)
        hi = ct.bitcast(e2m1_bits(p, 4, 7, 1, 1), ct.float16) * ct.float16(2.0 ** 14)
    # Element 2j of the tile is the low nibble of byte j, element 2j + 1 its high nibble; both sit in
    # block (2j) // B = j // (B / 2), so each half tile takes the scales with half the block width.
    lo = _scale_blocks(lo, s, ROWS, TK // 2, SC)
    hi = _scale_blocks(hi, s, ROWS, TK // 2, SC)
    return ct.cat((lo, hi), 1)


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=8))
def _stream_kernel(A, A_scale, B, B_scale, C, Alpha, GlobalScaleX, GlobalScaleY, Bias, Partial, Counter,
                   ELEMENT: ConstInt, SCALE_E8M0: ConstBool, SCALE_BLOCK: ConstInt, SWIZZLED: ConstBool,
                   TM: ConstInt, TN: ConstInt, TK: ConstInt, SPLIT_K: ConstInt, LATENCY: ConstInt,
                   X16: ConstBool):
    """One (TM, TN) output tile (or, with SPLIT_K > 1, one K slice of it) with swapped operands:
    acc (TN, TM) = deq(B[bb]) @ deq(A[ba]).T over this block's K tiles.

    Grid: SPLIT_K * Bt * cdiv(N, TN) * cdiv(M, TM) blocks, M tiles fastest (blocks that share a weight
    tile run together). A (Ba, M, Kd), B (Bb, N, Kd); scales logical (B*, R, Ks) or the 6-D swizzled
    view; C (Bt, M, N); Alpha, GlobalScaleX, GlobalScaleY (1,) fp32 (``_epilogue``); Partial
    (SPLIT_K * Bt, M, N) fp32 and
    Counter (one int32 per output tile, zero between launches), used when SPLIT_K > 1
    (``_split_k_finish``). With X16, A is instead ``_dequantize_kernel``'s 16-bit copy of the
    activation (Ba, M, Kp), written with TK-wide tiles so that its [lo | hi] order is the weight's, and
    A_scale is not read.
    """
    M = C.shape[1]
    N = C.shape[2]
    num_m = ct.cdiv(M, TM)
    num_n = ct.cdiv(N, TN)
    pid = ct.bid(0)
    bm = pid % num_m
    rest = pid // num_m
    bn = rest % num_n
    rest = rest // num_n
    batch = rest % C.shape[0]
    split = rest // C.shape[0]
    ba = batch % A.shape[0]
    bb = batch % B.shape[0]

    EPB = 2 if ELEMENT == E2M1 else 1  # elements per stored byte
    TKD = TK // EPB                       # stored K per tile
    SC = TK // SCALE_BLOCK                # scale columns per tile
    KS = B.shape[2] * EPB // SCALE_BLOCK  # scale columns in all
    k_tiles = ct.cdiv(B.shape[2], TKD)
    per_split = ct.cdiv(k_tiles, SPLIT_K)
    k_begin = split * per_split
    k_end = min(k_begin + per_split, k_tiles)

    acc = ct.zeros((TN, TM), ct.float32)
    for kt in range(k_begin, k_end):
        w_raw = load_k_tile(B, bb, bn, kt, TN, TKD, LATENCY)
        sw = _load_scale_tile(B_scale, bb, bn, kt, TN, SC, SWIZZLED, KS)
        w = _decode(w_raw, sw, TN, TK, SC, ELEMENT, SCALE_E8M0, True)
        if X16:
            x = load_k_tile(A, ba, bm, kt, TM, TK, LATENCY)
        else:
            x_raw = load_k_tile(A, ba, bm, kt, TM, TKD, LATENCY)
            sx = _load_scale_tile(A_scale, ba, bm, kt, TM, SC, SWIZZLED, KS)
            x = _decode(x_raw, sx, TM, TK, SC, ELEMENT, SCALE_E8M0, True)
        acc = ct.mma(w, x.transpose(), acc)
    if not SCALE_E8M0:  # NVFP4
        # exact: a power of two (the dequantized copy of A carries no 2^-7)
        acc = acc * (_NVFP4_FOLD if X16 else _NVFP4_FOLD * _NVFP4_FOLD)
    out = acc.transpose()
    if SPLIT_K == 1:
        _epilogue(out, C, Alpha, GlobalScaleX, GlobalScaleY, Bias, batch, bm, bn, SCALE_E8M0, TM, TN)
    else:
        _split_k_finish(out, C, Alpha, GlobalScaleX, GlobalScaleY, Bias, Partial, Counter, split, batch, bm, bn,
                        pid % (num_m * num_n * C.shape[0]), SCALE_E8M0, SPLIT_K, TM, TN)


def _epilogue(acc, C, Alpha, GlobalScaleX, GlobalScaleY, Bias, batch, bm, bn, SCALE_E8M0, TM, TN):
    """C[batch] tile (bm, bn) = acc * alpha + bias, rounded once to C's dtype; NVFP4's alpha is
    fp32(fp32(global_scale_x * global_scale_y) * Alpha), the two tensors' decode scales GlobalScaleX,
    GlobalScaleY multiplied in the order
    ``nvfp4_matmul`` documents (Alpha is 1 when the call gives none: an exact factor)."""
    if SCALE_E8M0:
        alpha = ct.load(Alpha, (0,), (1,))
    else:
        alpha = ct.load(GlobalScaleX, (0,), (1,)) * ct.load(GlobalScaleY, (0,), (1,)) * ct.load(Alpha, (0,), (1,))
    bias = ct.load(Bias, (bn,), (TN,), padding_mode=_ZERO).reshape((1, TN))
    out = acc * alpha.reshape((1, 1)) + bias
    ct.store(C, (batch, bm, bn), out.astype(C.dtype).reshape((1, TM, TN)))


def _split_k_finish(out, C, Alpha, GlobalScaleX, GlobalScaleY, Bias, Partial, Counter, split, batch, bm, bn, tile,
                    SCALE_E8M0, SPLIT_K, TM, TN):
    """The batched form of ``weight_only_kernels._split_k_finish``: store this block's fp32 partial
    tile ``out`` (TM, TN) as Partial[split * Bt + batch]; the block that brings output tile ``tile``'s
    arrival counter to SPLIT_K adds the SPLIT_K partials in split order (the same order whichever
    block arrives last: deterministic), runs the epilogue and sets the counter back to zero for the
    next launch (or CUDA-graph replay). The increment is acquire-release at device scope, so every
    partial stored before it is visible to the block that reads it."""
    bt = C.shape[0]
    ct.store(Partial, (split * bt + batch, bm, bn), out.reshape((1, TM, TN)))
    arrived = ct.atomic_add(Counter, tile, 1)
    if arrived == SPLIT_K - 1:
        total = ct.zeros((TM, TN), ct.float32)
        for s in range(SPLIT_K):
            part = ct.load(Partial, (s * bt + batch, bm, bn), (1, TM, TN), padding_mode=_ZERO)
            total = total + part.reshape((TM, TN))
        _epilogue(total, C, Alpha, GlobalScaleX, GlobalScaleY, Bias, batch, bm, bn, SCALE_E8M0, TM, TN)
        ct.atomic_xchg(Counter, tile, 0)


#: 8 blocks per SM (against the compiler's default): faster for the 4-bit formats, the same for MXFP8.
@ct.kernel(occupancy=8)
def _dequantize_kernel(X, X_scale, Out, ELEMENT: ConstInt, SCALE_E8M0: ConstBool, SCALE_BLOCK: ConstInt,
                       SWIZZLED: ConstBool,
                       TR: ConstInt, TK: ConstInt):
    """Out[b] tile (TR, TK) = deq(X[b]) as bf16 (MX) / fp16 (NVFP4); packed tiles as [lo | hi].

    X (Bx, R, Kd); Out (Bx, R, Kp), Kp a multiple of TK (columns past K come out 0). Grid:
    Bx * cdiv(R, TR) * Kp / TK, K tiles fastest.
    """
    EPB = 2 if ELEMENT == E2M1 else 1
    SC = TK // SCALE_BLOCK
    KS = X.shape[2] * EPB // SCALE_BLOCK
    k_tiles = Out.shape[2] // TK
    r_tiles = ct.cdiv(Out.shape[1], TR)
    pid = ct.bid(0)
    kt = pid % k_tiles
    rt = (pid // k_tiles) % r_tiles
    b = pid // (k_tiles * r_tiles)
    raw = ct.load(X, (b, rt, kt), (1, TR, TK // EPB), padding_mode=_ZERO).reshape((TR, TK // EPB))
    s = _load_scale_tile(X_scale, b, rt, kt, TR, SC, SWIZZLED, KS)
    out = _decode(raw, s, TR, TK, SC, ELEMENT, SCALE_E8M0, False)
    ct.store(Out, (b, rt, kt), out.reshape((1, TR, TK)))


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """The stream kernel's tiles: tile_m (16, 64 or 128: the MMA's N side), tile_n (weight rows,
    64 or a multiple of 128), tile_k (a multiple of 4 x block), the K split, a load latency hint (0: the
    compiler's choice) and compiler hints."""

    tile_m: int
    tile_n: int = 128
    tile_k: int = 128
    split_k: int = 1
    latency: int = 0
    num_worker_warps: int = 8
    occupancy: int | None = None
    x16: bool = False

    def hints(self) -> dict:
        return sm90_hints(self.num_worker_warps, self.occupancy)

    @property
    def name(self) -> str:
        s = f"stream_{self.tile_m}x{self.tile_n}x{self.tile_k}_s{self.split_k}"
        if self.latency:
            s += f"_lat{self.latency}"
        if self.num_worker_warps != 8:
            s += f"_w{self.num_worker_warps}"
        if self.occupancy:
            s += f"_occ{self.occupancy}"
        if self.x16:
            s += "_x16"
        return s


@dataclasses.dataclass(frozen=True)
class TwoPassConfig:
    """Dequantize tiles (rows x K elements) and the 16-bit GEMM's config."""

    gemm: GemmConfig
    dequant_rows: int = 128
    dequant_k: int = 256

    @property
    def name(self) -> str:
        return f"twopass_{self.dequant_rows}x{self.dequant_k}_{self.gemm.name}"


#: The family's config: one of its two designs, each a frozen record of its own tiles (``plan``).
BlockScaledConfig = StreamConfig | TwoPassConfig

#: M from which the two-pass design is used (below it the stream kernel reads the weight once); the
#: crossing point measured at N=14336, K=4096 lies between M = 128 and M = 1024.
TWO_PASS_MIN_M = 512

# The fastest GEMM tiles and dequantize tiles measured (the alternatives are in the results notes).
_TWO_PASS = TwoPassConfig(GemmConfig(256, 256, 64, num_ctas=2, persistent=True), 64, 128)
#: The 4-bit formats' dequantize pass streams fastest in 16x512 tiles (see ``_dequantize_kernel``).
_TWO_PASS_PACKED = dataclasses.replace(_TWO_PASS, dequant_rows=16, dequant_k=512)
#: Rows per tile of the activation's dequantize pass before an X16 stream kernel (as the two-pass one).
_X16_DEQUANT_ROWS = _TWO_PASS.dequant_rows

#: The stream kernel's tile_k, every format: 4 scale columns (MX, 32-element blocks) or 8 (NVFP4, 16).
_STREAM_TK = 128

_STREAM_TILE_M = (16, 64, 128)
# Per tile_m: (tile_n, num_worker_warps, occupancy). The decode chain of one block stalls on LDS and
# HGMMA latency, so more blocks per SM help where the registers allow it (cuobjdump: 64 per thread at
# 16x64 tiles with one warpgroup, 80 at 64x128, 168 at 128x128). At M = 16 one warpgroup on 64 weight
# rows with 4 blocks per SM beat two warpgroups on 128 rows with 2 per SM for every format.
_STREAM_SHAPE = {16: (64, 4, 4), 64: (128, 8, 2), 128: (128, 8, None)}
_STREAM_SPLITS = (1, 2, 4, 8)


def _format_constants(fmt: Format) -> tuple:
    """The kernels' ELEMENT, SCALE_E8M0 and SCALE_BLOCK for ``fmt``."""
    return (fmt.element_code, fmt.is_mx, fmt.block)


def _x16(tile_m: int, split_k: int) -> bool:
    """Whether the stream kernel reads a dequantized 16-bit copy of the activation instead of decoding
    it in every block: from M = 64 on, where that was faster for every format, and only without a K
    split. Up to M = 16 every block decodes its (16, TK) activation tile itself, so that a call is one
    launch. The products are the same bits either way (the decode is exact; NVFP4's in-kernel decode
    carries 2^-7, taken back exactly after the MMA).

    The copy with a K split is left out because tileiras 13.4 compiled some of those specialisations
    wrongly for sm_90: on an H100 their partial tiles were wrong (logical scale layout; NVFP4 at 64x128
    tiles, MXFP4 and MXFP8 at 128x128), while the emulator and every in-kernel-decode specialisation
    gave the right bits. tests/test_kernels_gpu.py keeps one of them as a strict expected failure."""
    return tile_m >= 64 and split_k == 1


def _stream_config(fmt: Format, batch: int, m: int, n: int, k: int, sms: int) -> StreamConfig:
    """The stream kernel's config: the smallest tile_m that covers M (up to 128), and a K split
    that gives at least ``occupancy`` blocks per SM when the output alone has too few tiles."""
    tile_m = next((t for t in _STREAM_TILE_M if t >= m), _STREAM_TILE_M[-1])
    tile_n, warps, occupancy = _STREAM_SHAPE[tile_m]
    tile_k = _STREAM_TK
    tiles = batch * ceil_div(m, tile_m) * ceil_div(n, tile_n)
    k_tiles = ceil_div(k, tile_k)
    split = 1
    while (tiles * split < (occupancy or 1) * sms and split * 2 <= _STREAM_SPLITS[-1]
           and k_tiles >= split * 2 * 4):
        split *= 2
    return StreamConfig(tile_m, tile_n, tile_k, split, num_worker_warps=warps, occupancy=occupancy,
                        x16=_x16(tile_m, split))


def plan(fmt: Format, batch: int, m: int, n: int, k: int, sms: int = 132) -> BlockScaledConfig:
    """The design and config for a problem: a StreamConfig below ``TWO_PASS_MIN_M`` rows, else a
    TwoPassConfig."""
    if m >= TWO_PASS_MIN_M:
        return _TWO_PASS_PACKED if fmt.is_packed else _TWO_PASS
    return _stream_config(fmt, batch, m, n, k, sms)


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------

def _scale_operand(scale: torch.Tensor, swizzled: bool) -> torch.Tensor:
    """The scale tensor as the kernels read it: uint8 bytes (cuTile has no e8m0 on sm_90; NVFP4's e4m3
    bytes are reinterpreted in the kernel once the tile is loaded, so both scale kinds share the byte
    path); logical scales with unit stride along K; swizzled ones as the 6-D view."""
    if scale.dtype != torch.uint8:
        scale = scale.view(torch.uint8)
    if swizzled:
        b, rt, kt = scale.shape[:3]
        return scale.reshape(b, rt, kt, 32, 4, SWIZZLE_COLS)  # a view of a contiguous scale (the usual)
    return scale if scale.stride(-1) == 1 or scale.shape[-1] == 1 else scale.contiguous()


def _stream_constants(fmt: Format, swizzled: bool, cfg: StreamConfig) -> tuple:
    return (*_format_constants(fmt), swizzled, cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.split_k,
            cfg.latency, cfg.x16)


def _check_scale_tile(fmt: Format, tile_k: int, what: str) -> None:
    if tile_k % (fmt.block * SWIZZLE_COLS):
        raise ValueError(f"hopper_block_scaled: {what} tile_k must be a multiple of {fmt.block * SWIZZLE_COLS} "
                         f"for {fmt.name}, got {tile_k}")


def _launch_stream(problem, cfg: StreamConfig, a, a_scale, b, b_scale, alpha, global_scale_x, global_scale_y, bias,
                   stream) -> None:
    fmt, out = problem.fmt, problem.out
    batch, m, n = out.shape
    if cfg.x16:
        a = _dequantize(fmt, a, a_scale, problem.swizzled, dequant_rows=_X16_DEQUANT_ROWS,
                        dequant_k=cfg.tile_k, stream=stream)
    # Operands of 2^31 elements and more (in practice the weight): one launch per piece of the
    # output along M and N (``_large``), each with the whole problem's config, so every output tile,
    # K split included, is computed exactly as in one launch.
    lg = _large
    per = SWIZZLE_ROWS if problem.swizzled else 1
    axes = lg.matmul_axes(batch, m, n, math.lcm(cfg.tile_m, per), math.lcm(cfg.tile_n, per))
    operands = lg.matmul_operands(a, a_scale, b, b_scale, out, alpha, bias, batch, per, per)
    kernel = hinted(_stream_kernel, **cfg.hints())
    pieces = lg.split("block-scaled matmul", axes, operands)
    # The pieces run one after another on one stream, so they share one K-split workspace (each
    # launch leaves its counters at zero); it is the call's own, not the stream's persistent one,
    # whose size would follow these operands.
    partial = counters = None
    if cfg.split_k > 1:
        most = max(p[4].numel() for p in pieces)
        tiles = max(p[4].shape[0] * ceil_div(p[4].shape[1], cfg.tile_m) * ceil_div(p[4].shape[2], cfg.tile_n)
                    for p in pieces)
        partial = torch.empty(cfg.split_k * most, dtype=torch.float32, device=out.device)
        counters = torch.zeros(tiles, dtype=torch.int32, device=out.device)
    for pa, psa, pb, psb, pout, palpha, pbias in pieces:
        pbatch, pm, pn = pout.shape
        tiles = pbatch * ceil_div(pm, cfg.tile_m) * ceil_div(pn, cfg.tile_n)
        work = ((pout, palpha) if cfg.split_k == 1 else
                (partial[:cfg.split_k * pout.numel()].view(cfg.split_k * pbatch, pm, pn), counters[:tiles]))
        ct.launch(stream, (cfg.split_k * tiles, 1, 1), kernel,
                  (pa, psa, pb, psb, pout, palpha, global_scale_x, global_scale_y, pbias, *work,
                   *_stream_constants(fmt, problem.swizzled, cfg)))


def _dequantize(fmt: Format, data, scale, swizzled: bool, dequant_rows: int, dequant_k: int,
                stream) -> torch.Tensor:
    bx, rows, kd = data.shape
    k = fmt.logical_k(kd)
    kp = ceil_div(k, dequant_k) * dequant_k
    out = torch.empty((bx, rows, kp), dtype=torch.float16 if fmt.has_global_scale else torch.bfloat16,
                      device=data.device)
    # Operands of 2^31 elements and more: one launch per piece of (batch, rows, K) (``_large``); the
    # decode is per element, so any cut on whole tiles (and 128-row / 4-column scale blocks) is exact.
    lg = _large
    per_row, per_col = (SWIZZLE_ROWS, fmt.block * SWIZZLE_COLS) if swizzled else (1, fmt.block)
    axes = (("batch", bx, 1), ("rows", rows, math.lcm(dequant_rows, per_row)), ("K", kp, dequant_k))
    operands = [("data", data, ((0, 0, 1), (1, 1, 1), (2, 2, fmt.elements_per_byte))),
                ("scale", scale, ((0, 0, 1), (1, 1, per_row), (2, 2, per_col))),
                ("dequantized", out, ((0, 0, 1), (1, 1, 1), (2, 2, 1)))]
    for pdata, pscale, pout in lg.split("block-scaled matmul (dequantize)", axes, operands):
        pb, pr, pk = pout.shape
        grid = (pb * ceil_div(pr, dequant_rows) * (pk // dequant_k), 1, 1)
        ct.launch(stream, grid, _dequantize_kernel,
                  (pdata, pscale, pout, *_format_constants(fmt), swizzled, dequant_rows, dequant_k))
    return out


def _launch_two_pass(problem, cfg: TwoPassConfig, a, a_scale, b, b_scale, alpha, bias, stream) -> None:
    """The two-pass design; ``alpha`` has NVFP4's decode scales multiplied in already."""
    fmt = problem.fmt
    a16 = _dequantize(fmt, a, a_scale, problem.swizzled, cfg.dequant_rows, cfg.dequant_k, stream)
    b16 = _dequantize(fmt, b, b_scale, problem.swizzled, cfg.dequant_rows, cfg.dequant_k, stream)
    launch_gemm(a16, alpha, b16, alpha, problem.out, alpha, bias, cfg.gemm, fast_acc=False, scaled=False)


class Prepared:
    """One block-scaled matmul signature (format, scale layout, shapes, output dtype, device) on sm_90,
    planned once: the config, the hinted kernels, grids and constants. ``run`` launches it for any
    operands of that signature. Up to M = 16 that is one launch, the K split (``split_k > 1``)
    included: its fp32 partial tiles and arrival counters live in the stream's persistent workspace
    (``weight_only_kernels.workspace``), which the kernel leaves ready for the next launch, and
    NVFP4's decode scales are multiplied in the epilogue. From M = 64 on, the activation's
    dequantize launch (``x16``) comes first. Operands of 2^31 elements and more, and the two-pass
    design, go through ``launch``'s general path."""

    __slots__ = ("fmt", "swizzled", "cfg", "direct", "kernel", "grid", "consts", "work_shape", "tiles",
                 "x16_shape", "x16_dtype", "x16_grid", "x16_consts", "n", "_work")

    def __init__(self, problem, config: BlockScaledConfig | None = None):
        fmt, out = problem.fmt, problem.out
        batch, m, n = out.shape
        self.fmt, self.swizzled, self.n = fmt, problem.swizzled, n
        cfg = self.cfg = config or plan(fmt, batch, m, n, problem.k, num_sms(out.device))
        if isinstance(cfg, TwoPassConfig):
            _check_scale_tile(fmt, cfg.dequant_k, "dequantize")
        else:
            _check_scale_tile(fmt, cfg.tile_k, "stream")
        kd = problem.a.shape[2]
        x16_kp = ceil_div(fmt.logical_k(kd), cfg.tile_k) * cfg.tile_k if isinstance(cfg, StreamConfig) else 0
        big = max(problem.b.numel(), problem.a.numel(), out.numel(), problem.a.shape[0] * m * x16_kp,
                  cfg.split_k * out.numel() if isinstance(cfg, StreamConfig) else 0)
        self.direct = isinstance(cfg, StreamConfig) and big < _large.LIMIT
        if not self.direct:
            return
        self.kernel = hinted(_stream_kernel, **cfg.hints())
        self.tiles = batch * ceil_div(m, cfg.tile_m) * ceil_div(n, cfg.tile_n)
        self.grid = (cfg.split_k * self.tiles, 1, 1)
        self.consts = _stream_constants(fmt, problem.swizzled, cfg)
        # the workspace as (split, rows, N): one "row" per (batch entry, M) row
        self.work_shape = (cfg.split_k, batch * m, n) if cfg.split_k > 1 else None
        self._work = {}
        if cfg.x16:
            ba = problem.a.shape[0]
            self.x16_shape = (ba, m, x16_kp)
            self.x16_dtype = torch.float16 if fmt.has_global_scale else torch.bfloat16
            self.x16_grid = (ba * ceil_div(m, _X16_DEQUANT_ROWS) * (x16_kp // cfg.tile_k), 1, 1)
            self.x16_consts = (*_format_constants(fmt), problem.swizzled, _X16_DEQUANT_ROWS, cfg.tile_k)

    def _workspace(self, out, stream):
        """(partial (SPLIT_K * Bt, M, N) fp32, counters): views of the stream's persistent split-K
        workspace (described for cuTile once per stream), or, without a split, stand-ins the kernel
        never reads."""
        if self.work_shape is None:
            return out, out
        if _capturing(out.device):  # the workspace may be allocated in the graph's pool: never keep it
            split, rows, n = self.work_shape
            partial, counters = workspace(out.device, stream, split, rows, n, self.tiles)
            return partial.view(split * out.shape[0], out.shape[1], n), counters
        key = _stream_key(stream)
        work = self._work.get(key)
        if work is None:
            split, rows, n = self.work_shape
            partial, counters = workspace(out.device, stream, split, rows, n, self.tiles)
            partial = partial.view(split * out.shape[0], out.shape[1], n)
            wrap = Described if out.is_cuda else (lambda t: t)
            work = self._work[key] = (wrap(partial), wrap(counters))
        return work

    def operands(self, problem):
        """(a, a_scale, b, b_scale) as the kernels read them: FP8 data in its own dtype (uint8 bytes
        viewed), scales as uint8 (swizzled ones as the 6-D view). Views of the problem's tensors."""
        fmt = self.fmt
        a, b = problem.a, problem.b
        if a.dtype != fmt.data_dtype:  # uint8 bytes of FP8 data
            a, b = a.view(fmt.data_dtype), b.view(fmt.data_dtype)
        return (a, _scale_operand(problem.a_scale, self.swizzled), b,
                _scale_operand(problem.b_scale, self.swizzled))

    def run(self, problem, stream) -> None:
        """Launch for ``problem`` (a ``BlockScaledProblem`` of this signature) on raw stream ``stream``."""
        out = problem.out
        device = out.device
        a, a_scale, b, b_scale = self.operands(problem)
        bias = zeros_vector(device, self.n) if problem.bias is None else problem.bias
        cfg = self.cfg
        if isinstance(cfg, TwoPassConfig):
            alpha = folded_alpha(problem)
            alpha = ones_scalar(device) if alpha is None else alpha.reshape(1)
            _launch_two_pass(problem, cfg, a, a_scale, b, b_scale, alpha, bias, stream)
            return
        alpha = ones_scalar(device) if problem.alpha is None else problem.alpha.reshape(1)
        if problem.global_scales is None:
            global_scale_x = global_scale_y = ones_scalar(device)
        else:
            global_scale_x, global_scale_y = (g.reshape(1) for g in problem.global_scales)
        if not self.direct:
            _launch_stream(problem, cfg, a, a_scale, b, b_scale, alpha, global_scale_x, global_scale_y, bias, stream)
            return
        self.launch(stream, a, a_scale, b, b_scale, out, alpha, global_scale_x, global_scale_y, bias)

    def launch(self, stream, a, a_scale, b, b_scale, out, alpha, global_scale_x, global_scale_y, bias) -> None:
        """The launch(es) of a ``direct`` signature for its kernel operands (``operands``; out (B, M, N),
        alpha and the decode scales (1,) fp32, bias (N,) fp32), on raw stream ``stream``."""
        if self.cfg.x16:
            a16 = torch.empty(self.x16_shape, dtype=self.x16_dtype, device=out.device)
            ct.launch(stream, self.x16_grid, _dequantize_kernel, (a, a_scale, a16, *self.x16_consts))
            a = a16
        ct.launch(stream, self.grid, self.kernel, (a, a_scale, b, b_scale, out, alpha, global_scale_x, global_scale_y,
                                                   bias, *self._workspace(out, stream), *self.consts))


def launch(problem, config: BlockScaledConfig | None = None) -> None:
    """Run a ``tilemm.matmul.BlockScaledProblem`` on an sm_90 GPU, writing ``problem.out``.

    ``config`` overrides ``plan``'s choice (for tuning and benchmarks)."""
    Prepared(problem, config).run(problem, stream_handle(problem.out.device))


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_OUT_DTYPES = {"bf16": ct.bfloat16, "fp16": ct.float16, "fp32": ct.float32}
_FORMATS = (MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4)


def _data_dtype(fmt: Format):
    return {"e4m3": ct.float8_e4m3fn, "e5m2": ct.float8_e5m2, "e2m1": ct.uint8}[fmt.element]


def _stream_configs(fmt: Format) -> list[StreamConfig]:
    """Every StreamConfig ``plan`` can return for ``fmt`` (tile_m x split)."""
    tk = _STREAM_TK
    return [StreamConfig(tm, _STREAM_SHAPE[tm][0], tk, split, num_worker_warps=_STREAM_SHAPE[tm][1],
                         occupancy=_STREAM_SHAPE[tm][2], x16=_x16(tm, split))
            for tm in _STREAM_TILE_M for split in _STREAM_SPLITS]


def aot_variants() -> list[AotVariant]:
    """Every specialisation ``launch`` can pick, for sm_90: stream kernels per (format, scale layout,
    output dtype, config; the K split's reduction is inside), the dequantize kernel per (format,
    layout) and the 16-bit GEMM per (input, output dtype)."""
    variants = []
    for fmt in _FORMATS:
        data = _data_dtype(fmt)
        scale = ct.uint8
        for swizzled in (False, True):
            sdim = 6 if swizzled else 3
            layout = "swz" if swizzled else "log"
            for out_name, out_dtype in _OUT_DTYPES.items():
                for cfg in _stream_configs(fmt):
                    a_dtype = (ct.float16 if fmt.has_global_scale else ct.bfloat16) if cfg.x16 else data
                    split = cfg.split_k > 1
                    params = [array(a_dtype, 3), array(scale, sdim), array(data, 3), array(scale, sdim),
                              array(out_dtype, 3), array(ct.float32, 1), array(ct.float32, 1),
                              array(ct.float32, 1), array(ct.float32, 1),
                              array(ct.float32, 3) if split else array(out_dtype, 3),
                              array(ct.int32, 1) if split else array(out_dtype, 3),
                              *_stream_constants(fmt, swizzled, cfg)]
                    variants.append(AotVariant(f"hopper_{fmt.name}_{layout}_{out_name}_{cfg.name}",
                                               hinted(_stream_kernel, **cfg.hints()), params, ("sm_90",)))
            d16 = ct.float16 if fmt.has_global_scale else ct.bfloat16
            # the two-pass tiles and the X16 stream kernel's activation tiles (often the same)
            two_pass = _TWO_PASS_PACKED if fmt.is_packed else _TWO_PASS
            for rows, k in sorted({(two_pass.dequant_rows, two_pass.dequant_k),
                                   (_X16_DEQUANT_ROWS, _STREAM_TK)}):
                params = [array(data, 3), array(scale, sdim), array(d16, 3), *_format_constants(fmt),
                          swizzled, rows, k]
                variants.append(AotVariant(f"hopper_{fmt.name}_{layout}_dequantize_{rows}x{k}", _dequantize_kernel,
                                           params, ("sm_90",)))
    for out_name, out_dtype in _OUT_DTYPES.items():
        for d16_name, d16 in (("bf16", ct.bfloat16), ("fp16", ct.float16)):
            g = _TWO_PASS.gemm
            params = [array(d16, 3), array(ct.float32, 1), array(d16, 3), array(ct.float32, 1),
                      array(out_dtype, 3), array(ct.float32, 1), array(ct.float32, 1),
                      *gemm_constants(g, False, False)]
            variants.append(AotVariant(f"hopper_gemm_{d16_name}_{out_name}_{g.name}",
                                       hinted(gemm_kernel(), **g.hints()), params, ("sm_90",)))
    return variants
