"""GPU quantizers: MXFP8, MXFP4, NVFP4 and FP8 in cuTile, bit-identical to ``tilemm.quantize``'s reference.

Each kernel computes exactly what ``tilemm.quantize._quantize_<fmt>_reference`` computes
(docs/numerics.md) for fp32 / bf16 / fp16 input (widened to fp32 in registers: exact), every rounding
step on fp32 values and bits, in the reference's order:

* e8m0 scales (MX): RCEIL or FLOOR from the bits, clamped to [0, 254]; a NaN / Inf block gets 255
  (``_e8m0_scale``). Data: ``x * 2^(127-s)`` (exact), then e4m3 / e5m2 by ``ct.astype``
  (``cvt.rn.satfinite``: the reference's clamp-then-round) or e2m1 by ``_e2m1_codes``.
* NVFP4: ``S_enc``, ``s_b`` and ``enc`` as the reference, divisions IEEE (``RoundingMode.RN``), the
  tensor amax over the finite elements; a NaN / Inf block gets the NaN scale 0x7F.
* FP8: ``fp32(x / s)`` correctly rounded from one IEEE division per group (``_fp8_divide``, with the
  proof); NaN groups store 0x7F.

Each element is read once, except where a tensor amax comes first (``tensor_amax``: FP8 per tensor
and NVFP4 beyond one wave of tiles; within one, ``_grid_amax`` takes it inside the launch), FP8 per row with K > 8192 (read twice, the second time from L2) and
FP8 per row along axis=-2 (``_column_amax_kernel`` first). One block quantizes one (TILE_R, TILE_K)
tile of the (B, R, K) view of x, or of the (B, K, R) storage of ``x.mT`` (the ``axis=-2``
quantizers: no copy); scales are stored logical or already in the 32x4x4 layout (``_store_scales``),
the layout's padding written as zeros by the tiles past R, so no output byte is left unwritten. One
portable implementation serves sm_90, sm_100 and sm_120 (nothing uses float8_e8m0fnu or float4_e2m1fn,
which cuTile rejects on Hopper). Tiles: ``plan``. Speed against a device-to-device copy, and the
designs measured and not adopted: benchmarks/results/quantize-nvidia-h100-80gb-hbm3.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import threading

import cuda.tile as ct
import torch
from cuda.tile import compilation as cc

from swizzle import swizzled_shape

from .._arch import capability, gpu_code, has_kernels
from ..formats import E2M1, E4M3, E5M2, ELEMENT_CODES, FP8_BLOCK, FP8_E4M3, NVFP4, Format, Granularity
from ..numerics import ceil_div
from . import _large
from ._aot import TARGETS, AotVariant, array
from ._common import (SWIZZLE_COLS, SWIZZLE_ROWS, Described, e2m1_to_fp32, e8m0_to_fp32, hinted, num_sms,
                      stream_handle)
from .weight_only_kernels import _capturing, _outside_graph_pools, _stream_key

__all__ = ["quantize_mx", "quantize_nvfp4", "quantize_fp8", "FakeQuant", "aot_variants", "supported"]

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

_ZERO = ct.PaddingMode.ZERO
#: Blocks per SM the compiler plans registers for (64 per thread at 256 threads). Without it, it takes
#: all 255 registers and one block per SM, which starves a memory-bound one-tile-per-block kernel.
_OCCUPANCY = 4
#: ``latency`` hint of the input loads (1..10: how heavy the DRAM traffic is); the highest was the
#: fastest. The loads go through TMA: without it cuTile loads bf16 two bytes per instruction.
_LATENCY = 10
_RN = ct.RoundingMode.RN
_RELAXED = ct.MemoryOrder.RELAXED
_RELEASE = ct.MemoryOrder.RELEASE
_ACQUIRE = ct.MemoryOrder.ACQUIRE


def _f32(value: float) -> float:
    """``value`` rounded once to the nearest fp32 (as a Python float, so the kernel sees it exactly)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


_FLT_MAX = _f32(3.4028234663852886e38)
_ONE_SIXTH = _f32(1.0 / 6.0)  # fp32(1/6), as the reference's _f32(1.0 / NVFP4.qmax)
_NVFP4_AMAX_TARGET = NVFP4.qmax * FP8_E4M3.qmax  # 2688 = 6 * 448, exact
_FP8_BLOCK_AMAX_FLOOR = _f32(1e-4)
_INV_QMAX_E4M3 = _f32(1.0 / 448.0)  # fp32(1/Qmax) for RCEIL, as the reference's _f32(1.0 / qmax)
_INV_QMAX_E5M2 = _f32(1.0 / 57344.0)
_INV_QMAX_E2M1 = _f32(1.0 / 6.0)

# The element codes (the ELEMENT constant) are tilemm.formats' E4M3 / E5M2 / E2M1; host code uses those
# and ``Format.element_code``. These names exist only because the tile code compares ELEMENT with them.
_E4M3, _E5M2, _E2M1 = E4M3, E5M2, E2M1

# The granularity codes (the GRANULARITY constant of ``_fp8_quantize_kernel``; per row has its own kernel)
# are ``tilemm.formats.Granularity.code``; host code uses the members. These names exist only because the
# tile code compares GRANULARITY with them.
_FP8_TENSOR = Granularity.TENSOR.code
_FP8_1X128 = Granularity.BLOCK_1X128.code
_FP8_128X128 = Granularity.BLOCK_128X128.code
FP8_STRIP = 32  # rows of a 128x128 block quantized at a time (``_fp8_square_tile``)

_NAN_BYTE = 0x7F  # positive NaN in e4m3fn and e5m2
_E8M0_NAN = 255
_E8M0_MAX_FINITE = 254
_EXP_MASK = 0x7F800000  # fp32 exponent field; bits >= this (sign cleared) are Inf or NaN
_SIGN_BIT = -0x80000000  # 0x80000000 as an int32
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: v + M rounds v (|v| < 2^22) to an integer, ties to even
_ROUND_MAGIC_BITS = 0x4B400000


# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def _tile_index(tile, row_tiles, K, TILE_K):
    """(batch, row tile, K tile) of tile number ``tile`` (the block index) of B * row_tiles *
    cdiv(K, TILE_K), K fastest."""
    num_k = ct.cdiv(K, TILE_K)
    per_batch = row_tiles * num_k
    b = tile // per_batch
    t = tile % per_batch
    return b, t // num_k, t % num_k


def _row_tiles(R, TILE_R, SWIZZLED):
    """Row tiles per batch entry: swizzled scales cover R rounded up to 128 rows (the layout's
    padding, which tiles past R fill with zeros)."""
    if SWIZZLED:
        return ct.cdiv(R, SWIZZLE_ROWS) * (SWIZZLE_ROWS // TILE_R)
    return ct.cdiv(R, TILE_R)


def _rows_and_k(X, TRANSPOSED):
    """(R, K) of the (B, R, K) tensor being quantized; X is (B, K, R) when TRANSPOSED."""
    if TRANSPOSED:
        return X.shape[2], X.shape[1]
    return X.shape[1], X.shape[2]


def _load_fp32(X, b, rt, kt, TILE_R, TILE_K, TRANSPOSED):
    """The (TILE_R, TILE_K) tile (rt, kt) of batch entry b as fp32; zeros past the edges."""
    if TRANSPOSED:
        # X is (B, K, R): tile axis 1 walks array axis 2 (R), tile axis 2 walks array axis 1 (K).
        x = ct.load(X, (b, rt, kt), (1, TILE_R, TILE_K), order=(0, 2, 1), padding_mode=_ZERO,
                    latency=_LATENCY)
    else:
        x = ct.load(X, (b, rt, kt), (1, TILE_R, TILE_K), padding_mode=_ZERO, latency=_LATENCY)
    return x.reshape((TILE_R, TILE_K)).astype(ct.float32)


def _load_blocks(X, b, rt, kt, TILE_R, TILE_K, BLOCK, TRANSPOSED):
    """The (TILE_R, TILE_K) tile (rt, kt) of batch entry b as fp32 blocks of BLOCK elements along K,
    zeros past the edges: (TILE_R, NB, BLOCK), or with TRANSPOSED (NB, BLOCK, TILE_R), in X's storage
    order (rows contiguous), so that the transposed operand is read without a transposition: only the
    quantized bytes are transposed, on the store (``_store_data``)."""
    NB = TILE_K // BLOCK
    if TRANSPOSED:
        x = ct.load(X, (b, kt, rt), (1, TILE_K, TILE_R), padding_mode=_ZERO, latency=_LATENCY)
        return x.reshape((NB, BLOCK, TILE_R)).astype(ct.float32)
    x = ct.load(X, (b, rt, kt), (1, TILE_R, TILE_K), padding_mode=_ZERO, latency=_LATENCY)
    return x.reshape((TILE_R, NB, BLOCK)).astype(ct.float32)


def _block_amax(x, TRANSPOSED):
    """max |x| over each block of ``_load_blocks``' tile, NaN propagating: (TILE_R, NB, 1), or
    (NB, 1, TILE_R) with TRANSPOSED."""
    if TRANSPOSED:
        return ct.max(ct.abs(x), axis=1, keepdims=True, propagate_nan=True)
    return ct.max(ct.abs(x), axis=2, keepdims=True, propagate_nan=True)


def _store_data(Data, q, b, rt, kt, TILE_R, COLS, TRANSPOSED):
    """Store q, the quantized tile (rt, kt) with COLS bytes or fp8 values per row, to Data (B, R, *):
    q has the shape of ``_load_blocks``' tile, (TILE_R, ...) or with TRANSPOSED (..., TILE_R), which
    is stored transposed.

    Through TMA (the default): plain stores were slower for the 4-bit formats and the transposed
    stores, and made MXFP8 spill."""
    if TRANSPOSED:
        ct.store(Data, (b, kt, rt), q.reshape((1, COLS, TILE_R)), order=(0, 2, 1))
    else:
        ct.store(Data, (b, rt, kt), q.reshape((1, TILE_R, COLS)))


def _bits(v):
    return ct.bitcast(v, ct.int32)


def _is_finite(v):
    """Finite-ness of an fp32 tile from its bits (NaN and Inf have all exponent bits set), whatever
    the sign bit of a NaN."""
    return (_bits(v) & 0x7FFFFFFF) < _EXP_MASK


def _e8m0_rceil(amax, INV_QMAX):
    """Smallest power of two >= d = amax * fp32(1/Qmax), as an e8m0 byte (int32), from d's bits.

    Normal d: exponent field, plus one unless the mantissa is zero. Subnormal d: d <= 2^-127
    (mantissa <= 0x400000) fits byte 0, anything larger needs byte 1."""
    d = _bits(amax * INV_QMAX)
    exponent = d >> 23
    mantissa = d & 0x7FFFFF
    sub = ct.where(mantissa > 0x400000, 1, 0)
    normal = exponent + ct.where(mantissa != 0, 1, 0)
    return ct.where(exponent == 0, sub, normal)


def _e8m0_floor(amax, EMAX):
    """floor(log2(amax)) - emax + 127 from amax's exponent field (zero / subnormal amax -> 0)."""
    exponent = _bits(amax) >> 23
    return ct.where(exponent == 0, 0, exponent - EMAX)


def _e8m0_scale(amax, Floor, INV_QMAX, EMAX):
    """Scale bytes (int32 0..255) for non-negative block maxima (NaN for a block holding NaN).

    ``Floor`` is a runtime flag (0: RCEIL, 1: FLOOR): both are a few integer operations per block,
    cheaper than a second compiled kernel."""
    s = ct.where(Floor != 0, _e8m0_floor(amax, EMAX), _e8m0_rceil(amax, INV_QMAX))
    s = ct.minimum(ct.maximum(s, 0), _E8M0_MAX_FINITE)
    return ct.where(_is_finite(amax), s, _E8M0_NAN)


def _e8m0_multiplier(s):
    """x -> x * 2^(127 - s) multipliers (fp32, exact powers of two) for scale bytes s (int32): the
    e8m0 value of byte 254 - s (``e8m0_to_fp32``), so byte 254 gives the subnormal 2^-127. Bytes 0
    and 255 give 0: their blocks store zero data (the fp8 path sets NaN blocks afterwards)."""
    return ct.where((s == 0) | (s == _E8M0_NAN), 0.0, e8m0_to_fp32(_E8M0_MAX_FINITE - s))


def _fp8_cast(y, dtype):
    """fp32 -> e4m3 / e5m2 (``dtype``) with RNE and saturation to +-Qmax.

    ``ct.astype`` to float8 is ``cvt.rn.satfinite`` (F2FP.SATFINITE on sm_90): round to nearest even,
    finite values and +-Inf beyond +-Qmax become +-Qmax, which is the reference's clamp-then-round.
    NaN inputs are the callers' business (``_set_bytes``)."""
    return ct.astype(y, dtype)


def _set_bytes(q, where, byte, dtype):
    """The float8 tile q (of ``dtype``) with the byte ``byte`` wherever ``where`` holds (broadcast)."""
    raw = ct.bitcast(q, ct.uint8)
    return ct.bitcast(ct.where(where, ct.full(raw.shape, byte, ct.uint8), raw), dtype)


def _fp8_bytes(y):
    """e4m3 bytes (uint8) of y as the reference's cast_RNE_satfinite, NaN as 0x7F (for NVFP4's scales)."""
    raw = ct.bitcast(_fp8_cast(y, ct.float8_e4m3fn), ct.uint8)
    return ct.where(ct.isnan(y), ct.full(raw.shape, _NAN_BYTE, ct.uint8), raw)


def _e2m1_codes(y):
    """fp32 -> e2m1 codes (int32 0..15), round to nearest even, saturating at 6, as the reference.

    The code of a magnitude a <= 6 is the rounded value of the concave piecewise-linear
    f(a) = min(2a, a + 2, a/2 + 4) (slope 2, 1, 1/2 on [0, 2], [2, 4], [4, 6]: one code per grid step
    of e2m1). Rounding is monotonic, so round(f(a)) = min(round(2a), round(a) + 2, round(a/2) + 4),
    and each round() is exact and ties-to-even: adding M = 1.5 * 2^23 (ulp 1) to the exact 2a, a or
    a/2 rounds once to an integer, with the even offsets 2 and 4 folded into M. Even values are even
    codes, so ties go where the reference's midpoints send them (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Capping at M + 7 saturates everything past 6 (Inf
    included); NaN becomes 0 (max(NaN, 0) = 0). The sign bit (8) is set exactly when y < 0 (a negative
    value that rounds to 0 gives code 8, -0.0 and NaN give 0), the reference's rule."""
    a = ct.maximum(ct.abs(y), 0.0)
    t = ct.minimum(ct.minimum(a * 2.0 + _ROUND_MAGIC, a + (_ROUND_MAGIC + 2.0)),
                   ct.minimum(a * 0.5 + (_ROUND_MAGIC + 4.0), _ROUND_MAGIC + 7.0))
    # code + 8 = code | 8 (code <= 7): one three-input integer add with the magic's bits.
    return _bits(t) + (ct.where(y < 0.0, 8, 0) - _ROUND_MAGIC_BITS)


def _pack_e2m1(codes, TILE_R, TILE_K, TRANSPOSED):
    """Codes int32 in the shape of ``_load_blocks``' tile -> bytes uint8, (TILE_R, TILE_K / 2) or with
    TRANSPOSED (TILE_K / 2, TILE_R), element 2i along K in the low nibble.

    The even and odd elements are taken apart with ``ct.extract`` on a view with a pair axis: unlike a
    multiply-and-sum over that axis, it keeps each pair in the thread that holds it (no round trip
    through shared memory in the NVFP4 kernel)."""
    HALF = TILE_K // 2
    if TRANSPOSED:
        pairs = codes.reshape((HALF, 2, TILE_R))
        low = ct.extract(pairs, (0, 0, 0), (HALF, 1, TILE_R))
        high = ct.extract(pairs, (0, 1, 0), (HALF, 1, TILE_R))
        return (low | (high << 4)).reshape((HALF, TILE_R)).astype(ct.uint8)
    pairs = codes.reshape((TILE_R, HALF, 2))
    low = ct.extract(pairs, (0, 0, 0), (TILE_R, HALF, 1))
    high = ct.extract(pairs, (0, 0, 1), (TILE_R, HALF, 1))
    return (low | (high << 4)).reshape((TILE_R, HALF)).astype(ct.uint8)


def _store_scales(Scale, s, b, rt, kt, TILE_R, NB, SWIZZLED, TRANSPOSED):
    """Store the scale bytes (uint8) of tile (rt, kt): s holds TILE_R x NB of them in the shape of the
    block maxima of ``_load_blocks``' tile, (TILE_R, NB, 1), or with TRANSPOSED (NB, 1, TILE_R).

    Logical: Scale is (B, R, Ks). Swizzled: Scale is the (B, cdiv(R, 128), cdiv(Ks, 4), 32, 4, 4) view
    of the 32x4x4 layout (the last 16 split as m2 x k1), TILE_R in {32, 64, 128} and NB = 4 * G: row
    32 * m2 + m1 of the tile's 128-row block and column 4 * g + k1 go to block g, row m1, m2, k1.

    The transposed kernels scatter their bytes to those places, which was faster for them than a tile
    store of the permuted scales; the others keep the tile store, which was faster for them."""
    if SWIZZLED and TRANSPOSED:  # scale (k, r) -> [r // 128, c // 4, r % 32, r // 32 % 4, c % 4]
        r = rt * TILE_R + ct.arange(TILE_R, dtype=ct.int32).reshape((1, 1, TILE_R))
        c = kt * NB + ct.arange(NB, dtype=ct.int32).reshape((NB, 1, 1))
        ct.scatter(Scale, (b, r // SWIZZLE_ROWS, c // SWIZZLE_COLS, r % 32, r // 32 % 4, c % SWIZZLE_COLS), s)
    elif SWIZZLED:  # [32 m2 + m1, 4g + k1] -> [g, m1, m2, k1]
        G = NB // SWIZZLE_COLS
        M2 = TILE_R // 32  # 32-row sub-tiles in this tile
        PER_BLOCK = SWIZZLE_ROWS // TILE_R  # tiles per 128-row block
        t = ct.permute(s.reshape((M2, 32, G, SWIZZLE_COLS)), (2, 1, 0, 3))
        ct.store(Scale, (b, rt // PER_BLOCK, kt, 0, rt % PER_BLOCK, 0),
                 t.reshape((1, 1, G, 32, M2, SWIZZLE_COLS)))
    elif TRANSPOSED:
        ct.store(Scale, (b, kt, rt), s.reshape((1, NB, TILE_R)), order=(0, 2, 1))
    else:
        ct.store(Scale, (b, rt, kt), s.reshape((1, TILE_R, NB)))


def _store_zero_scales(Scale, b, rt, kt, TILE_R, NB, SWIZZLED, TRANSPOSED):
    """Zero scale bytes for tile (rt, kt), which lies wholly in the rows padding R to 128."""
    if TRANSPOSED:
        _store_scales(Scale, ct.zeros((NB, 1, TILE_R), ct.uint8), b, rt, kt, TILE_R, NB, SWIZZLED, True)
    else:
        _store_scales(Scale, ct.zeros((TILE_R, NB, 1), ct.uint8), b, rt, kt, TILE_R, NB, SWIZZLED, False)


def _mx_limits(ELEMENT):
    """(fp32(1/Qmax), emax) of an MX element type: what RCEIL and FLOOR scale rounding take."""
    if ELEMENT == _E4M3:
        return _INV_QMAX_E4M3, 8
    if ELEMENT == _E5M2:
        return _INV_QMAX_E5M2, 15
    return _INV_QMAX_E2M1, 2


@ct.kernel(occupancy=_OCCUPANCY)
def _mx_quantize_kernel(X, Data, Scale, Floor,
                        ELEMENT: ConstInt, SWIZZLED: ConstBool, TRANSPOSED: ConstBool,
                        TILE_R: ConstInt, TILE_K: ConstInt):
    """MXFP8 / MXFP4 quantization of one (TILE_R, TILE_K) tile.

    X: (B, R, K) input ((B, K, R) when TRANSPOSED). Data: (B, R, K) float8_e4m3fn / float8_e5m2, or
    (B, R, K/2) uint8 packed e2m1. Scale: e8m0 bytes, logical (B, R, K/32) or the (B, Rt, Kt, 32, 4, 4)
    view of the swizzled layout.
    Floor: int32, 1 for FLOOR scale rounding, 0 for RCEIL.
    """
    NB = TILE_K // 32
    INV_QMAX, EMAX = _mx_limits(ELEMENT)
    R, K = _rows_and_k(X, TRANSPOSED)
    b, rt, kt = _tile_index(ct.bid(0), _row_tiles(R, TILE_R, SWIZZLED), K, TILE_K)
    if rt * TILE_R >= R:  # swizzle padding rows only
        _store_zero_scales(Scale, b, rt, kt, TILE_R, NB, SWIZZLED, TRANSPOSED)
    else:
        _mx_tile(X, Data, Scale, Floor, b, rt, kt, INV_QMAX, EMAX, ELEMENT, SWIZZLED, TRANSPOSED, TILE_R,
                 TILE_K)


def _mx_tile(X, Data, Scale, Floor, b, rt, kt, INV_QMAX, EMAX, ELEMENT, SWIZZLED, TRANSPOSED,
             TILE_R, TILE_K):
    """MXFP8 / MXFP4 of tile (b, rt, kt), which holds rows of the input."""
    BLOCK = 32
    x = _load_blocks(X, b, rt, kt, TILE_R, TILE_K, BLOCK, TRANSPOSED)
    s = _e8m0_scale(_block_amax(x, TRANSPOSED), Floor, INV_QMAX, EMAX)
    # Exact: a power of two (or 0 for blocks with scale byte 0 or 255). -0 * 2^k stays -0 (byte
    # 0x80, as the reference); x * 0 may be -0, which the zero blocks then fix.
    y = x * _e8m0_multiplier(s)
    if ELEMENT == _E2M1:
        # Zero and NaN / Inf blocks: y is +-0 or NaN, both code 0, as the reference stores.
        q = _pack_e2m1(_e2m1_codes(y), TILE_R, TILE_K, TRANSPOSED)
        _store_data(Data, q, b, rt, kt, TILE_R, TILE_K // 2, TRANSPOSED)
    else:
        q = _fp8_cast(y, Data.dtype)
        # Blocks with scale byte 0 store +0 bytes and NaN / Inf blocks 0x7F; rare, so a tile without
        # them skips the per-element selects.
        if (ct.min(s) == 0) | (ct.max(s) == _E8M0_NAN):
            q = _set_bytes(_set_bytes(q, s == 0, 0, Data.dtype), s == _E8M0_NAN, _NAN_BYTE, Data.dtype)
        _store_data(Data, q, b, rt, kt, TILE_R, TILE_K, TRANSPOSED)
    _store_scales(Scale, s.astype(ct.uint8), b, rt, kt, TILE_R, TILE_K // BLOCK, SWIZZLED, TRANSPOSED)


def _nvfp4_block_scale(amax, s_enc):
    """s_b = min(amax * (S_enc * fp32(1/6)), 448) in fp32, NaN (e4m3 byte 0x7F once cast) where the
    block holds a NaN or an Inf, so that it decodes to NaN; a finite amax whose product overflows
    still saturates to 448."""
    s_b = ct.minimum(amax * (s_enc * _ONE_SIXTH), 448.0, propagate_nan=True)
    return ct.where(_is_finite(amax), s_b, _nan_like(s_b))


def _nvfp4_encode_scale(g, FROM_AMAX):
    """(S_enc, S_dec) from a (1,) fp32 tile: the tensor amax (FROM_AMAX) or a given decode scale."""
    if FROM_AMAX:
        s_enc = ct.minimum(ct.truediv(_NVFP4_AMAX_TARGET, g, rounding_mode=_RN), _FLT_MAX)
        s_enc = ct.where((g == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        s_dec = ct.truediv(1.0, s_enc, rounding_mode=_RN)
    else:
        s_dec = g
        s_enc = ct.minimum(ct.truediv(1.0, g, rounding_mode=_RN), _FLT_MAX)
    return s_enc, s_dec


@ct.kernel(occupancy=_OCCUPANCY)
def _nvfp4_quantize_kernel(X, Data, Scale, Global, GlobalScaleOut,
                           FROM_AMAX: ConstBool, GRID_AMAX: ConstBool, SWIZZLED: ConstBool,
                           TRANSPOSED: ConstBool, TILE_R: ConstInt, TILE_K: ConstInt):
    """NVFP4 quantization of one (TILE_R, TILE_K) tile.

    X as for ``_mx_quantize_kernel``; Data (B, R, K/2) packed e2m1; Scale e4m3 bytes, logical
    (B, R, K/16) or swizzled. Global: ``tensor_amax``'s int32 maxima (FROM_AMAX), or the decode scale,
    (1,) fp32; with GRID_AMAX (and FROM_AMAX) the tensor amax comes from this launch instead, as in
    ``_fake_quant_kernel``: Global is ``_grid_amax``'s int32 [maximum bits, arrived, departed] (zero
    between launches), every block adds its tile's maximum (``_amax_bits``) and waits for all the
    others, so the grid must be resident at once (the launcher keeps it within one block per SM).
    Block 0 writes the decode scale S_dec (the returned ``global_scale``) to GlobalScaleOut (1,).
    """
    NB = TILE_K // 16
    R, K = _rows_and_k(X, TRANSPOSED)
    b, rt, kt = _tile_index(ct.bid(0), _row_tiles(R, TILE_R, SWIZZLED), K, TILE_K)
    if GRID_AMAX:
        if rt * TILE_R >= R:  # swizzle padding rows only (never block 0): nothing to add to the amax
            _grid_amax(Global, ct.max(ct.zeros((1,), ct.int32)))
            _store_zero_scales(Scale, b, rt, kt, TILE_R, NB, SWIZZLED, TRANSPOSED)
        else:
            x = _load_blocks(X, b, rt, kt, TILE_R, TILE_K, 16, TRANSPOSED)
            s_enc, s_dec = _nvfp4_encode_scale(ct.bitcast(_grid_amax(Global, _amax_bits(x)), ct.float32), True)
            if ct.bid(0) == 0:
                ct.store(GlobalScaleOut, (0,), s_dec)
            _nvfp4_encode_tile(x, Data, Scale, s_enc.reshape((1, 1, 1)), s_dec.reshape((1, 1, 1)), b, rt, kt,
                               SWIZZLED, TRANSPOSED, TILE_R, TILE_K)
    else:
        g = _tensor_amax(Global) if FROM_AMAX else ct.load(Global, (0,), (1,))
        s_enc, s_dec = _nvfp4_encode_scale(g, FROM_AMAX)
        if ct.bid(0) == 0:
            ct.store(GlobalScaleOut, (0,), s_dec)
        if rt * TILE_R >= R:  # swizzle padding rows only
            _store_zero_scales(Scale, b, rt, kt, TILE_R, NB, SWIZZLED, TRANSPOSED)
        else:
            _nvfp4_tile(X, Data, Scale, s_enc.reshape((1, 1, 1)), s_dec.reshape((1, 1, 1)), b, rt, kt, SWIZZLED,
                        TRANSPOSED, TILE_R, TILE_K)


def _amax_bits(x):
    """The tensor amax's contribution of a tile: max |x| as fp32 bits (int32), NaN and Inf counted as
    0 (NVFP4's amax over the finite elements: the rule of ``_amax_kernel`` without PROPAGATE_NAN)."""
    bits = _bits(x) & 0x7FFFFFFF
    return ct.max(ct.where(bits >= _EXP_MASK, 0, bits))


def _nvfp4_tile(X, Data, Scale, s_enc, s_dec, b, rt, kt, SWIZZLED, TRANSPOSED, TILE_R, TILE_K):
    """NVFP4 of tile (b, rt, kt), which holds rows of the input; s_enc, s_dec (1, 1, 1)."""
    x = _load_blocks(X, b, rt, kt, TILE_R, TILE_K, 16, TRANSPOSED)
    _nvfp4_encode_tile(x, Data, Scale, s_enc, s_dec, b, rt, kt, SWIZZLED, TRANSPOSED, TILE_R, TILE_K)


def _nvfp4_encode_tile(x, Data, Scale, s_enc, s_dec, b, rt, kt, SWIZZLED, TRANSPOSED, TILE_R, TILE_K):
    """NVFP4 of the loaded blocks x of tile (b, rt, kt) (``_load_blocks``), stored to Data and Scale."""
    BLOCK = 16
    amax = _block_amax(x, TRANSPOSED)
    s_b_bytes = _fp8_bytes(_nvfp4_block_scale(amax, s_enc))
    s_b_f32 = ct.bitcast(s_b_bytes, ct.float8_e4m3fn).astype(ct.float32)
    enc = ct.minimum(ct.truediv(1.0, s_b_f32 * s_dec, rounding_mode=_RN), _FLT_MAX, propagate_nan=True)
    # e2m1(clamp(x * enc, -6, 6)): the clamp changes no code, so it is left out.
    q = _pack_e2m1(_e2m1_codes(x * enc), TILE_R, TILE_K, TRANSPOSED)
    _store_data(Data, q, b, rt, kt, TILE_R, TILE_K // 2, TRANSPOSED)
    _store_scales(Scale, s_b_bytes, b, rt, kt, TILE_R, TILE_K // BLOCK, SWIZZLED, TRANSPOSED)


def _grid_amax(Sync, bits):
    """The maximum of every block's ``bits`` (non-negative int32), as a (1,) tile, through Sync
    (int32 [maximum, arrived, departed], zero on entry and again on exit): a barrier over the whole
    grid, so every block of the launch must be resident at once.

    Ordering (device scope): the maximum is a relaxed atomic that the arrival, a release, publishes;
    the wait polls relaxed and ends with an acquire read of the arrivals, after which the maximum reads
    every block's contribution. The departure is acquire-release, so the last block out resets Sync
    only after every block has read it."""
    n = ct.num_blocks(0)
    ct.atomic_max(Sync, 0, bits, memory_order=_RELAXED)
    ct.atomic_add(Sync, 1, 1, memory_order=_RELEASE)
    while ct.atomic_add(Sync, 1, 0, memory_order=_RELAXED) < n:
        pass
    ct.atomic_add(Sync, 1, 0, memory_order=_ACQUIRE)
    g = ct.atomic_max(Sync, 0, 0, memory_order=_RELAXED)
    if ct.atomic_add(Sync, 2, 1) == n - 1:  # the last block out resets Sync for the next launch
        ct.atomic_xchg(Sync, 0, 0, memory_order=_RELAXED)
        ct.atomic_xchg(Sync, 1, 0, memory_order=_RELAXED)
        ct.atomic_xchg(Sync, 2, 0, memory_order=_RELAXED)
    return ct.full((1,), 0, ct.int32) + g


@ct.kernel(occupancy=_OCCUPANCY)
def _fake_quant_kernel(X, Out, Floor, Amax, Alpha, AlphaOut, ELEMENT: ConstInt, NV: ConstBool,
                       AMAX_SOURCE: ConstInt, WHOLE_R: ConstInt, WHOLE_K: ConstInt, TILE_R: ConstInt,
                       TILE_K: ConstInt):
    """Out (R, K) bf16 = dequantize(quantize(X)) for X (R, K): the activation as the block-scaled
    matmul reads it, quantized exactly as ``_mx_quantize_kernel`` / ``_nvfp4_quantize_kernel`` do
    (logical scales), then decoded, in one pass and with no quantized bytes stored.

    MX (NV false): ``element * 2^(s - 127)``, with ELEMENT e4m3 / e5m2 / e2m1 and Floor the scale
    rounding as in ``_mx_quantize_kernel``; blocks with scale byte 0 give +0, byte 255 NaN. NVFP4 (NV):
    ``element * s_b``, without the tensor's decode scale S_dec, which block 0 instead multiplies into
    ``AlphaOut = S_dec * Alpha`` (so that the matmul's epilogue applies it to the fp32 sum, as
    ``nvfp4_matmul``'s alpha does). The tensor amax (over the finite elements) comes from
    ``AMAX_SOURCE``: ``AMAX_PARTIALS`` (0), ``tensor_amax``'s partial maxima in Amax; ``AMAX_GRID``
    (1), this launch: every block adds its tile's maximum to Amax (int32 [maximum bits, arrived,
    departed], zero between launches) and waits until all blocks have (``_grid_amax``), which saves a
    launch, and the grid must be resident at once (the launcher keeps it within one block per SM);
    ``AMAX_WHOLE`` (2), every block's own load of all of X, one (WHOLE_R, WHOLE_K) tile of at most
    ``WHOLE_ELEMENTS`` (read again from L2 by every block): no atomics and no wait, which a grid-wide
    barrier costs even over a few blocks. WHOLE_R and WHOLE_K are unused (1) otherwise. (Looping over
    tiles to cover larger X made each block's loads sequential: slower than the barrier at 16 rows.)

    Exactness: e2m1 * 2^k is a bf16 number for every e8m0 byte and e2m1 * e4m3 (at most 5
    significant bits, 2^-10 .. 2688) too; e4m3 * 2^k for k >= -124 and e5m2 * 2^k for k >= -117, so
    MXFP8 blocks with scale bytes below 3 (e4m3) / 10 (e5m2) lose the magnitudes under bf16's
    smallest subnormal, 2^-133, exactly as the block-scaled kernels' decode does. Grid: cdiv(R, TILE_R)
    * cdiv(K, TILE_K) blocks, K fastest.
    """
    K = X.shape[1]
    num_k = ct.cdiv(K, TILE_K)
    rt = ct.bid(0) // num_k
    kt = ct.bid(0) % num_k
    if NV:
        BLOCK = 16
    else:
        BLOCK = 32
    NB = TILE_K // BLOCK
    x = ct.load(X, (rt, kt), (TILE_R, TILE_K), padding_mode=_ZERO, latency=_LATENCY).astype(
        ct.float32).reshape((TILE_R, NB, BLOCK))
    amax = ct.max(ct.abs(x), axis=2, keepdims=True, propagate_nan=True)
    if NV:
        if AMAX_SOURCE == AMAX_WHOLE:
            whole = ct.load(X, (0, 0), (WHOLE_R, WHOLE_K), padding_mode=_ZERO).astype(ct.float32)
            g = ct.bitcast(ct.full((1,), 0, ct.int32) + _amax_bits(whole), ct.float32)
        elif AMAX_SOURCE == AMAX_GRID:
            g = ct.bitcast(_grid_amax(Amax, _amax_bits(x)), ct.float32)
        else:
            g = _tensor_amax(Amax)
        s_enc, s_dec = _nvfp4_encode_scale(g, True)
        if ct.bid(0) == 0:
            ct.store(AlphaOut, (0,), s_dec * ct.load(Alpha, (0,), (1,)))
        s_b_f32 = ct.bitcast(_fp8_bytes(_nvfp4_block_scale(amax, s_enc.reshape((1, 1, 1)))),
                             ct.float8_e4m3fn).astype(ct.float32)
        enc = ct.minimum(ct.truediv(1.0, s_b_f32 * s_dec.reshape((1, 1, 1)), rounding_mode=_RN), _FLT_MAX,
                         propagate_nan=True)
        v = e2m1_to_fp32(_e2m1_codes(x * enc)) * s_b_f32
    else:
        INV_QMAX, EMAX = _mx_limits(ELEMENT)
        sb = _e8m0_scale(amax, Floor, INV_QMAX, EMAX)
        y = x * _e8m0_multiplier(sb)
        if ELEMENT == _E2M1:
            q = e2m1_to_fp32(_e2m1_codes(y))
        elif ELEMENT == _E4M3:
            q = _fp8_cast(y, ct.float8_e4m3fn).astype(ct.float32)
        else:
            q = _fp8_cast(y, ct.float8_e5m2).astype(ct.float32)
        # Scale byte 0 blocks store +0 data; NaN blocks give q * NaN = NaN whatever q is.
        v = ct.where(sb == 0, 0.0, q * e8m0_to_fp32(sb))
    ct.store(Out, (rt, kt), v.reshape((TILE_R, TILE_K)).astype(ct.bfloat16))


@ct.kernel(occupancy=_OCCUPANCY)
def _amax_kernel(X, Partial, PROPAGATE_NAN: ConstBool, COLUMNS: ConstBool, TILE_R: ConstInt,
                 TILE_K: ConstInt):
    """Partial[block] = max |x| over the tiles of X (B, R, K) that this block strides over, as fp32 bits
    in an int32 (``_tensor_amax`` combines them where they are used).

    Non-negative fp32 values order like their bit patterns, and NaN's bits exceed +Inf's, so an integer
    maximum of the bits is the float maximum with NaN propagating; without PROPAGATE_NAN (NVFP4's
    tensor amax, over the finite elements), NaN and Inf count as 0. Each block writes its own slot: no zeroed buffer, no atomic.

    The blocks walk the tiles from the last to the first, so the input they read last is where the
    quantize kernel that follows begins, and that part is still in L2 (50 MB on the H100) when it is
    read again: the start of X, or with COLUMNS (X the (B, K, R) storage of a transposed input, whose
    quantize kernel walks it a column strip at a time) its first column strips, the tiles walked
    column by column. (The same order in ``_column_amax_kernel``, whose blocks all run at once, gains
    nothing.)
    """
    num_r = ct.cdiv(X.shape[1], TILE_R)
    num_k = ct.cdiv(X.shape[2], TILE_K)
    per_batch = num_r * num_k
    tiles = X.shape[0] * per_batch
    acc = ct.zeros((TILE_R, TILE_K), ct.int32)
    for i in range(ct.bid(0), tiles, ct.num_blocks(0)):
        t = tiles - 1 - i
        b = t // per_batch
        rk = t % per_batch
        if COLUMNS:
            x = _load_fp32(X, b, rk % num_r, rk // num_r, TILE_R, TILE_K, False)
        else:
            x = _load_fp32(X, b, rk // num_k, rk % num_k, TILE_R, TILE_K, False)
        bits = _bits(x) & 0x7FFFFFFF
        if not PROPAGATE_NAN:
            bits = ct.where(bits >= _EXP_MASK, 0, bits)
        acc = ct.maximum(acc, bits)
    ct.store(Partial, (ct.bid(0),), ct.max(acc).reshape((1,)))


def _tensor_amax(Partial):
    """The tensor amax, a (1,) fp32 tile, from Partial (P,) int32 with P <= AMAX_PARTIALS: the per-block
    maxima of ``_amax_kernel`` as bits, or the bits of a known amax (P = 1)."""
    bits = ct.load(Partial, (0,), (AMAX_PARTIALS,), padding_mode=_ZERO)
    return ct.bitcast(ct.max(bits, axis=0, keepdims=True), ct.float32)


def _fp8_tensor_scale(amax, QMAX):
    """Per tensor / row: s = amax / Qmax, 1 where that is 0, NaN where amax is NaN or +Inf."""
    s = ct.truediv(amax, QMAX, rounding_mode=_RN)
    s = ct.where(s == 0.0, 1.0, s)
    return ct.where(_is_finite(amax), s, _nan_like(s))


def _fp8_block_scale(amax, Pow2):
    """1x128 / 128x128 blocks: s = max(amax, 1e-4) / 448, rounded up to a power of two (from the bits)
    when Pow2 != 0; NaN where amax is NaN or +Inf."""
    s = ct.truediv(ct.maximum(amax, _FP8_BLOCK_AMAX_FLOOR, propagate_nan=True), 448.0, rounding_mode=_RN)
    bits = _bits(s)
    up = ct.bitcast(ct.where((bits & 0x7FFFFF) != 0, (bits >> 23) + 1, bits >> 23) << 23, ct.float32)
    s = ct.where((Pow2 != 0) & _is_finite(s), up, s)
    return ct.where(_is_finite(amax), s, _nan_like(s))


def _nan_like(v):
    """The canonical quiet NaN (0x7FC00000) in v's shape, as the reference's float('nan')."""
    return ct.bitcast(ct.full(v.shape, 0x7FC00000, ct.int32), ct.float32)


def _fp8_qmax(ELEMENT):
    if ELEMENT == _E4M3:
        return 448.0
    return 57344.0


def _fp8_divide(x, s, dtype):
    """cast_RNE_satfinite(fp32(x / s)) to ``dtype``, bit for bit, with one IEEE division per group
    instead of one per element (Markstein's correctly rounded division); NaN (byte 0x7F) where s is
    NaN.

    Per group, s is first brought to s' = s * p in [1, 2) (p = 2^(127 - E) from s's exponent field
    E; 2^126 for an fp32-subnormal s, which lands in [2^-23, 1)), and x to x' = x * p: the quotient
    is the same real number, and x' is exact wherever the quotient matters (below). Then
    y = fp32(1/s') (IEEE) and y_lo = fp32((1 - s' * y) * y), whose residual 1 - s' * y is exact (y
    is faithful). Per element, every ``a * b + c`` one fused multiply-add (cuTile fuses a multiply
    whose only use is an add or subtract; the SASS shows FFMA):

        q0 = x' * y + fp32(x' * y_lo)    within 1/2 ulp + 2^-45 relative of x / s: faithful
        r  = q0 * s' - x'                exact (the remainder of a faithful quotient is an fp32)
        q1 = r * (-y) + q0               = fp32(q0 + (x' - s' * q0) * y) = fp32(x / s)

    the last line by Markstein's theorem (Muller et al., Handbook of Floating-Point Arithmetic):
    q0 faithful and y within 2^-24 relative of 1/s' give the correctly rounded quotient, barring
    underflow. None occurs where it matters: for |x / s| >= 2^-20, x' >= 2^-20 * s' is normal, the
    remainder is a multiple of ulp(q0) * ulp(s') >= 2^-66 and x' * y_lo is normal; smaller
    quotients round to +-0 in e4m3 and e5m2 either way (both round |v| <= 2^-17 to zero). No
    overflow either: s >= amax / Qmax, so |x / s| <= Qmax (1 + 2^-23). The sign is x's, set from
    its bits (q1 can lose the sign of a zero x), as the IEEE quotient has it. Checked against exact
    rational arithmetic on every fp8 value and midpoint +-4 ulps, scales 2^-80 .. 2^99."""
    sb = _bits(s)
    exponent = ct.minimum(sb >> 23, 253)  # s > 0; NaN scales are patched below
    p = ct.bitcast(ct.where(exponent == 0, 253 << 23, (254 - exponent) << 23), ct.float32)
    s1 = s * p
    y = ct.truediv(1.0, s1, rounding_mode=_RN)
    y_lo = (1.0 - s1 * y) * y
    x1 = x * p
    q0 = x1 * y + x1 * y_lo
    r = q0 * s1 - x1
    q1 = r * (-y) + q0
    q = _fp8_cast(ct.bitcast((_bits(q1) & 0x7FFFFFFF) | (_bits(x) & _SIGN_BIT), ct.float32), dtype)
    if ct.max(ct.where(ct.isnan(s), 1, 0)) > 0:
        q = _set_bytes(q, ct.isnan(s), _NAN_BYTE, dtype)
    return q


@ct.kernel(occupancy=_OCCUPANCY)
def _fp8_quantize_kernel(X, Data, Scale, Amax, Pow2,
                         ELEMENT: ConstInt, GRANULARITY: ConstInt, TRANSPOSED: ConstBool, GRID_AMAX: ConstBool,
                         TMA_STORE: ConstBool, TILE_R: ConstInt, TILE_K: ConstInt):
    """FP8 per tensor, 1x128 or 128x128 (GRANULARITY) of one (TILE_R, TILE_K) tile: q = sat(x / s).

    X as for ``_mx_quantize_kernel``; Data (B, R, K) e4m3 / e5m2 bytes. Per tensor: Amax holds
    ``tensor_amax``'s int32 maxima (NaN propagated), or with GRID_AMAX ``_grid_amax``'s sync words: the
    tensor amax is then taken in this launch (every block adds its tile's max |x| bits, NaN
    propagating, and waits for the others: the grid must be resident at once, as for
    ``_nvfp4_quantize_kernel``); Scale is (1,) and block 0 writes it. 1x128: Scale
    (B, R, K/128). 128x128 (TILE_R = TILE_K = 128): Scale (B, cdiv(R, 128), K/128). Amax is only read per tensor.
    Pow2: int32, 1 to round block scales up to a power of two. TMA_STORE: the fp8 tile of a tile loaded
    in its logical order is stored through TMA rather than with plain stores (``fp8_tma_store``).
    """
    QMAX = _fp8_qmax(ELEMENT)
    R, K = _rows_and_k(X, TRANSPOSED)
    b, rt, kt = _tile_index(ct.bid(0), ct.cdiv(R, TILE_R), K, TILE_K)
    if GRANULARITY == _FP8_128X128:
        _fp8_square_tile(X, Data, Scale, Pow2, TRANSPOSED, b, rt, kt)
    elif TRANSPOSED and GRANULARITY == _FP8_TENSOR:
        _fp8_tensor_tile_transposed(X, Data, Scale, Amax, QMAX, GRID_AMAX, b, rt, kt, TILE_R, TILE_K)
    else:
        _fp8_tile(X, Data, Scale, Amax, Pow2, QMAX, GRANULARITY, GRID_AMAX, TRANSPOSED, TMA_STORE, b, rt, kt,
                  TILE_R, TILE_K)


def _fp8_tile(X, Data, Scale, Amax, Pow2, QMAX, GRANULARITY, GRID_AMAX, TRANSPOSED, TMA_STORE, b, rt, kt,
              TILE_R, TILE_K):
    """FP8 per tensor or 1x128 of the (TILE_R, TILE_K) tile (b, rt, kt), loaded through ``order``
    when TRANSPOSED."""
    x = _load_fp32(X, b, rt, kt, TILE_R, TILE_K, TRANSPOSED)
    if GRANULARITY == _FP8_TENSOR:
        q = _fp8_tensor_quantize(x, Scale, Amax, QMAX, GRID_AMAX, Data.dtype)
    else:
        NB = TILE_K // FP8_BLOCK
        xb = x.reshape((TILE_R, NB, FP8_BLOCK))
        s = _fp8_block_scale(ct.max(ct.abs(xb), axis=2, keepdims=True, propagate_nan=True), Pow2)
        q = _fp8_divide(xb, s, Data.dtype).reshape((TILE_R, TILE_K))
        ct.store(Scale, (b, rt, kt), s.reshape((1, TILE_R, NB)))
    ct.store(Data, (b, rt, kt), q.reshape((1, TILE_R, TILE_K)), allow_tma=TMA_STORE)


def _fp8_square_tile(X, Data, Scale, Pow2, TRANSPOSED, b, rt, kt):
    """FP8 of the 128x128 block (b, rt, kt), in its input dtype and X's storage order ((K, R) when
    TRANSPOSED: a block's maximum does not depend on the orientation). Quantized in strips of
    FP8_STRIP rows (of the output, so transposed strips of the stored tile when TRANSPOSED), each
    widened to fp32 only when it is divided, and stored plainly.

    Keeping the tile in its input dtype (half the registers of fp32 for bf16) lets 3 blocks (4 along
    axis=-2) share an SM without spilling (``FP8_BLOCK_CONFIGS``); that was faster than one fp32 tile
    divided and stored whole."""
    if TRANSPOSED:
        raw = ct.load(X, (b, kt, rt), (1, FP8_BLOCK, FP8_BLOCK), padding_mode=_ZERO, latency=_LATENCY)
    else:
        raw = ct.load(X, (b, rt, kt), (1, FP8_BLOCK, FP8_BLOCK), padding_mode=_ZERO, latency=_LATENCY)
    raw = raw.reshape((FP8_BLOCK, FP8_BLOCK))
    # The maximum of |x| in the input dtype is the fp32 one: widening is exact and monotonic.
    amax = ct.max(ct.abs(raw), axis=(0, 1), keepdims=True, propagate_nan=True).astype(ct.float32)
    s = _fp8_block_scale(amax, Pow2)
    ct.store(Scale, (b, rt, kt), s.reshape((1, 1, 1)))
    STRIPS = FP8_BLOCK // FP8_STRIP
    for i in ct.static_iter(range(STRIPS)):
        if TRANSPOSED:
            x = ct.transpose(ct.extract(raw, (0, i), (FP8_BLOCK, FP8_STRIP)).astype(ct.float32))
        else:
            x = ct.extract(raw, (i, 0), (FP8_STRIP, FP8_BLOCK)).astype(ct.float32)
        q = _fp8_divide(x, s, Data.dtype)
        ct.store(Data, (b, rt * STRIPS + i, kt), q.reshape((1, FP8_STRIP, FP8_BLOCK)), allow_tma=False)


def _fp8_tensor_tile_transposed(X, Data, Scale, Amax, QMAX, GRID_AMAX, b, rt, kt, TILE_R, TILE_K):
    """FP8 per tensor of tile (b, rt, kt) of a transposed input, X (B, K, R): read in storage order as a
    (TILE_K, TILE_R) tile and the fp8 bytes stored transposed into Data (B, R, K), as
    ``_fp8_columns_kernel`` does; faster than a load through ``order``. (For 1x128 blocks it was
    slower than their transposed loads.)"""
    q = _fp8_tensor_quantize(_column_tile(X, b, kt, rt, TILE_K, TILE_R), Scale, Amax, QMAX, GRID_AMAX,
                             Data.dtype)
    ct.store(Data, (b, kt, rt), q.reshape((1, TILE_K, TILE_R)), order=(0, 2, 1))


def _fp8_tensor_quantize(x, Scale, Amax, QMAX, GRID_AMAX, dtype):
    """sat(x / s) of a 2-D tile with the per-tensor scale s from ``tensor_amax``'s maxima, or with
    GRID_AMAX from every block's max |x| bits through ``_grid_amax`` (the integer maximum of the bits
    is the float maximum, NaN propagating: the same amax as ``_amax_kernel``'s); block 0 stores s to
    Scale (1,)."""
    if GRID_AMAX:
        amax = ct.bitcast(_grid_amax(Amax, ct.max(_bits(x) & 0x7FFFFFFF)), ct.float32)
    else:
        amax = _tensor_amax(Amax)
    s = _fp8_tensor_scale(amax, QMAX)
    if ct.bid(0) == 0:
        ct.store(Scale, (0,), s)
    return _fp8_divide(x, s.reshape((1, 1)), dtype)


@ct.kernel(occupancy=_OCCUPANCY)
def _fp8_row_kernel(X, Data, Scale, ELEMENT: ConstInt, TMA_STORE: ConstBool, TILE_R: ConstInt,
                    TILE_K: ConstInt):
    """FP8 per row of TILE_R rows, X (B, R, K), Scale (B, R, 1). When one (TILE_R, TILE_K) tile spans
    K, the rows are read once: amax, s and q = sat(x / s) from the same registers. Otherwise the row
    amax over all of K (first loop), then q (second loop, which reads the rows again: from L2 when the
    blocks in flight hold few enough rows). A transposed input goes through ``_column_amax_kernel``
    and ``_fp8_columns_kernel`` instead."""
    QMAX = _fp8_qmax(ELEMENT)
    R, K = X.shape[1], X.shape[2]
    num_r = ct.cdiv(R, TILE_R)
    b = ct.bid(0) // num_r
    rt = ct.bid(0) % num_r
    num_k = ct.cdiv(K, TILE_K)
    if num_k == 1:
        x = _load_fp32(X, b, rt, 0, TILE_R, TILE_K, False)
        s = _fp8_tensor_scale(ct.max(ct.abs(x), axis=1, keepdims=True, propagate_nan=True), QMAX)
        ct.store(Data, (b, rt, 0), _fp8_divide(x, s, Data.dtype).reshape((1, TILE_R, TILE_K)),
                 allow_tma=TMA_STORE)
    else:
        amax = ct.zeros((TILE_R, 1), ct.float32)
        for kt in range(num_k):
            x = _load_fp32(X, b, rt, kt, TILE_R, TILE_K, False)
            amax = ct.maximum(amax, ct.max(ct.abs(x), axis=1, keepdims=True, propagate_nan=True),
                              propagate_nan=True)
        s = _fp8_tensor_scale(amax, QMAX)
        for kt in range(num_k):
            x = _load_fp32(X, b, rt, kt, TILE_R, TILE_K, False)
            ct.store(Data, (b, rt, kt), _fp8_divide(x, s, Data.dtype).reshape((1, TILE_R, TILE_K)),
                     allow_tma=TMA_STORE)
    ct.store(Scale, (b, rt, 0), s.reshape((1, TILE_R, 1)))


def _column_tile(X, b, kt, rt, TILE_K, TILE_R):
    """The (TILE_K, TILE_R) tile (kt, rt) of X (B, K, R) in storage order, as fp32: ``_load_blocks``'
    transposed tile as one block."""
    return _load_blocks(X, b, rt, kt, TILE_R, TILE_K, TILE_K, True).reshape((TILE_K, TILE_R))


@ct.kernel(occupancy=_OCCUPANCY)
def _column_amax_kernel(X, Amax, CHUNK: ConstInt, TILE_R: ConstInt, TILE_K: ConstInt):
    """FP8 per row of a transposed input, first pass. X (B, K, R) is the storage of the input, whose
    rows are its columns; Amax (B, R) int32, zeroed, gets max |x| over each column as fp32 bits, by an
    atomic integer maximum (non-negative floats order like their bits, and NaN's exceed +Inf's, so NaN
    propagates). Each block reduces up to CHUNK tiles down K in registers, every cdiv(K tiles, CHUNK)-th
    one: the blocks fill the GPU whatever R is, which one block per row tile over all of K did not."""
    R, K = X.shape[2], X.shape[1]
    num_c = ct.cdiv(ct.cdiv(K, TILE_K), CHUNK)
    per_batch = ct.cdiv(R, TILE_R) * num_c
    b = ct.bid(0) // per_batch
    rt = ct.bid(0) % per_batch // num_c
    c = ct.bid(0) % num_c
    acc = ct.zeros((1, TILE_R), ct.int32)
    # Block c takes K tiles c, c + num_c, ... from the last to the first, so that the input read
    # last is its first rows, where ``_fp8_columns_kernel`` begins (see there).
    count = ct.cdiv(ct.cdiv(K, TILE_K) - c, num_c)
    for j in range(count):
        kt = c + (count - 1 - j) * num_c
        acc = ct.maximum(acc, ct.max(_bits(_column_tile(X, b, kt, rt, TILE_K, TILE_R)) & 0x7FFFFFFF,
                                     axis=0, keepdims=True))
    cols = rt * TILE_R + ct.arange(TILE_R, dtype=ct.int32)
    ct.atomic_max(Amax, (b, cols), acc.reshape((TILE_R,)), memory_order=ct.MemoryOrder.RELAXED)


@ct.kernel(occupancy=_OCCUPANCY)
def _fp8_columns_kernel(X, Data, Scale, Amax, ELEMENT: ConstInt, TILE_R: ConstInt, TILE_K: ConstInt):
    """FP8 per row of a transposed input, second pass: tile (kt, rt) of X (B, K, R), read in storage
    order, becomes q = sat(x / s), s from ``_column_amax_kernel``'s Amax (B, R), and its fp8 bytes are
    stored transposed into Data (B, R, K). The blocks with kt = 0 store the scales, Scale (B, R, 1).

    The tiles go row tile by row tile of X (rt fastest), first rows first, where the amax pass ended
    (so those tiles are still in L2)."""
    QMAX = _fp8_qmax(ELEMENT)
    R, K = X.shape[2], X.shape[1]
    num_r = ct.cdiv(R, TILE_R)
    per_batch = num_r * ct.cdiv(K, TILE_K)
    b = ct.bid(0) // per_batch
    kt = ct.bid(0) % per_batch // num_r
    rt = ct.bid(0) % num_r
    s = _fp8_tensor_scale(ct.bitcast(ct.load(Amax, (b, rt), (1, TILE_R)), ct.float32), QMAX)  # (1, TILE_R)
    q = _fp8_divide(_column_tile(X, b, kt, rt, TILE_K, TILE_R), s, Data.dtype)
    ct.store(Data, (b, kt, rt), q.reshape((1, TILE_K, TILE_R)), order=(0, 2, 1))
    if kt == 0:
        ct.store(Scale, (b, rt, 0), s.reshape((1, TILE_R, 1)))


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """A quantize kernel's tile (``plan``): rows and K columns per block, and blocks per SM (the
    compiler's register budget: 64 registers per thread at 4). Block-scaled formats need tile_r in
    {32, 64, 128} and tile_k / block a multiple of 4 (whole 32x16 blocks of swizzled scales) when
    swizzled; FP8 blocks need tile_k % 128 == 0 and, for 128x128, tile_r = tile_k = 128."""

    tile_r: int
    tile_k: int
    occupancy: int = _OCCUPANCY


#: (format, swizzled scales, transposed input) -> tile: the fastest of ``bench_quantize.py --sweep`` on
#: the H100 (bf16 input). Transposed inputs are read in storage order (tile_r rows contiguous), and
#: their swizzled scales scattered (``_store_scales``).
BLOCK_CONFIGS = {
    ("mxfp8", True, False): QuantizeConfig(64, 128),
    ("mxfp8", False, False): QuantizeConfig(16, 512),
    ("mxfp8", True, True): QuantizeConfig(64, 128),
    ("mxfp8", False, True): QuantizeConfig(128, 64),
    ("mxfp4", True, False): QuantizeConfig(32, 256),
    ("mxfp4", False, False): QuantizeConfig(16, 512),
    ("mxfp4", True, True): QuantizeConfig(64, 128),
    ("mxfp4", False, True): QuantizeConfig(128, 64),
    ("nvfp4", True, False): QuantizeConfig(32, 256),
    ("nvfp4", False, False): QuantizeConfig(16, 512),
    ("nvfp4", True, True): QuantizeConfig(128, 64),
    ("nvfp4", False, True): QuantizeConfig(128, 64),
}
#: FP8 per tensor.
FP8_CONFIG = QuantizeConfig(64, 128)
#: FP8 1x128 blocks: 64x128 spills (with bf16 input) and is still the fastest.
FP8_1X128_CONFIG = QuantizeConfig(64, 128)
#: 128x128 blocks (``_fp8_square_tile``, one block per tile), blocks per SM by (transposed input,
#: bytes per input element): the input tile stays in its dtype, 64 registers per thread for bf16 and
#: fp16, 128 for fp32; the occupancies are the fastest measured.
FP8_BLOCK_CONFIGS = {
    (False, 2): QuantizeConfig(128, 128, occupancy=3),
    (False, 4): QuantizeConfig(128, 128, occupancy=2),
    (True, 2): QuantizeConfig(128, 128, occupancy=4),
    (True, 4): QuantizeConfig(128, 128, occupancy=2),
}
#: FP8 of a transposed input (axis=-2), per tensor and 1x128: per tensor read in storage order
#: (``_fp8_tensor_tile_transposed``; tile_r input columns by tile_k of K), 1x128 loaded through
#: ``order``; both the fastest of the forms measured.
FP8_TRANSPOSED_CONFIGS = {
    Granularity.TENSOR: QuantizeConfig(32, 256),
    Granularity.BLOCK_1X128: QuantizeConfig(64, 128),
}


#: Tile of ``_fake_quant_kernel`` (activations of a few rows).
FAKE_QUANT_CONFIG = QuantizeConfig(16, 256)
#: ``_fake_quant_kernel``'s sources of NVFP4's tensor amax (AMAX_SOURCE).
AMAX_PARTIALS, AMAX_GRID, AMAX_WHOLE = 0, 1, 2
#: The most elements (rows and columns each rounded up to a power of two) of an NVFP4 activation
#: whose every fake-quant block loads all of it for the tensor amax (AMAX_WHOLE): 64 fp32 registers
#: per thread at WHOLE_WARPS warps. For sm_90 the (1, 16384) variant compiles without spills; the
#: (1, 4096) one stores and reloads one register once.
WHOLE_ELEMENTS = 16384
WHOLE_WARPS = 8
#: The elements of those launches' tiles: (rows rounded up to a power of two, WHOLE_TILE / that).
WHOLE_TILE = 4096
AMAX_CONFIG = QuantizeConfig(64, 128)
#: Blocks of the amax reduction per SM (each loops over its share of the tiles).
AMAX_BLOCKS_PER_SM = 4
#: Most blocks of the amax reduction, and the per-block maxima its users reduce with one tile load:
#: one slot per block instead of an atomic maximum into a zeroed word (no fill kernel).
AMAX_PARTIALS = 512
#: FP8 per row: one block holds ROW_ELEMENTS elements, whole rows when K <= ROW_MAX_K (longer rows
#: take two passes, the second from L2).
ROW_ELEMENTS = 8192
ROW_MIN_K = 1024
ROW_MAX_K = 8192
#: On sm_90, row tiles up to this many columns store their fp8 bytes with plain stores (faster there),
#: longer ones through TMA. Blackwell keeps TMA stores: the plain-store tiles need more registers
#: there, and nothing was timed.
ROW_PLAIN_STORE_K = 4096
#: Targets on which the per-row and 1x128 kernels may store plainly (``ROW_PLAIN_STORE_K``,
#: ``fp8_tma_store``), where that was measured faster.
PLAIN_STORE_TARGETS = ("sm_90",)


#: FP8 per row of a transposed input (axis=-2), whose rows are the columns of its (B, K, R) storage:
#: ``_column_amax_kernel`` reduces ROW_AMAX_CHUNK tiles of ROW_AMAX_CONFIG (tile_r input rows, contiguous
#: in storage, by tile_k of K) per block, then ``_fp8_columns_kernel`` quantizes one
#: ROW_TRANSPOSED_CONFIG tile per block (two kernels, so that enough blocks fill the GPU).
ROW_AMAX_CONFIG = QuantizeConfig(64, 128)
ROW_AMAX_CHUNK = 16
ROW_TRANSPOSED_CONFIG = QuantizeConfig(32, 256)


#: FP8 granularities by ``plan``'s kernel names (``Granularity.quantize_kernel``).
_FP8_GRANULARITY = {gran.quantize_kernel: gran for gran in Granularity}


def plan(kernel: str, *, swizzled: bool = False, transposed: bool = False, itemsize: int = 2,
         k: int = 0) -> QuantizeConfig:
    """The tile of a quantize launch, from the tables above.

    ``kernel``: "mxfp8", "mxfp4", "nvfp4" (``BLOCK_CONFIGS`` by ``swizzled`` scales and ``transposed``
    input); "fp8_tensor", "fp8_1x128", "fp8_128x128" (``_fp8_quantize_kernel``; 128x128 by the input's
    ``itemsize`` bytes per element); "fp8_row" (rows of ``k`` elements: tile_k the power of two >= k
    within [ROW_MIN_K, ROW_MAX_K], ``ROW_ELEMENTS`` per block; a transposed input's second pass:
    ``ROW_TRANSPOSED_CONFIG``); "fp8_row_amax" (a transposed input's first pass, ``ROW_AMAX_CONFIG``);
    "fake_quant" and "amax"."""
    if kernel in ("mxfp8", "mxfp4", "nvfp4"):
        return BLOCK_CONFIGS[kernel, swizzled, transposed]
    gran = _FP8_GRANULARITY.get(kernel)
    if gran is Granularity.BLOCK_128X128:
        return FP8_BLOCK_CONFIGS[transposed, itemsize]
    if gran in (Granularity.TENSOR, Granularity.BLOCK_1X128):
        if transposed:
            return FP8_TRANSPOSED_CONFIGS[gran]
        return FP8_CONFIG if gran is Granularity.TENSOR else FP8_1X128_CONFIG
    if gran is Granularity.ROW:
        if transposed:
            return ROW_TRANSPOSED_CONFIG
        tile_k = min(ROW_MAX_K, max(ROW_MIN_K, 1 << max(0, k - 1).bit_length()))
        return QuantizeConfig(ROW_ELEMENTS // tile_k, tile_k)
    if kernel == "fp8_row_amax":
        return ROW_AMAX_CONFIG
    if kernel == "fake_quant":
        return FAKE_QUANT_CONFIG
    if kernel == "amax":
        return AMAX_CONFIG
    raise ValueError(f"quantize_kernels.plan: unknown kernel {kernel!r}")


def _row_tma_store(cfg: QuantizeConfig, target: str) -> bool:
    """Whether the per-row kernel stores its fp8 tile through TMA on ``target`` (e.g. "sm_90")."""
    return cfg.tile_k > ROW_PLAIN_STORE_K or target not in PLAIN_STORE_TARGETS


def fp8_tma_store(gran: Granularity, target: str) -> bool:
    """Whether ``_fp8_quantize_kernel`` stores its fp8 tile through TMA on ``target``.

    Plain stores were faster on the H100. Per tensor stores plainly on every target (no spills either
    way); 1x128 only on sm_90 (``PLAIN_STORE_TARGETS``), since with plain stores it spills and
    Blackwell was never timed. A transposed per-tensor tile is stored through TMA regardless
    (``_fp8_tensor_tile_transposed``)."""
    return gran is Granularity.BLOCK_1X128 and target not in PLAIN_STORE_TARGETS


def _row_tiles_k() -> list[int]:
    tile_k, out = ROW_MIN_K, []
    while tile_k <= ROW_MAX_K:
        out.append(tile_k)
        tile_k *= 2
    return out


def _kernel(kernel, cfg: QuantizeConfig):
    """``kernel`` compiled for cfg's blocks per SM."""
    return kernel if cfg.occupancy == _OCCUPANCY else hinted(kernel, occupancy=cfg.occupancy)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

def supported(x: torch.Tensor) -> bool:
    """True when the quantizer kernels can run on x: a CUDA tensor on sm_90 or newer
    (``TILEMM_ARCH`` overrides the detected capability, as everywhere in tilemm)."""
    return has_kernels(x.device)


@dataclasses.dataclass
class _Operand:
    """x (..., R, K) as the kernel reads it: ``view`` is (B, R, K), or (B, K, R) -- the storage of
    ``x.mT`` -- when ``transposed``, so that a transposed view is read without a copy."""

    view: torch.Tensor
    batch: int
    rows: int
    k: int
    transposed: bool
    lead: tuple  # x.shape[:-2] (empty for 1-D x)


def _operand(x: torch.Tensor) -> _Operand:
    if x.ndim == 1:
        return _Operand(x.contiguous().view(1, 1, x.shape[0]), 1, 1, x.shape[0], False, ())
    *lead, r, k = x.shape
    transposed = x.stride(-1) != 1 and x.stride(-2) == 1 and k > 1
    if not transposed and x.stride(-1) != 1 and k > 1:
        x = x.contiguous()
    view = x.mT.reshape(-1, k, r) if transposed else x.reshape(-1, r, k)
    return _Operand(view, view.shape[0], r, k, transposed, tuple(lead))


def _rows_flattened(op: _Operand) -> _Operand:
    """Logical scales do not care about batch boundaries: (B, R, K) -> (1, B * R, K) when that is a
    view, so that small R wastes no rows of a tile."""
    v = op.view
    if op.transposed or op.batch == 1 or v.stride(0) != v.shape[1] * v.stride(1):
        return op
    flat = v.view(1, op.batch * op.rows, op.k)
    return _Operand(flat, 1, op.batch * op.rows, op.k, False, op.lead)


def _grid(batch: int, rows: int, k: int, cfg: QuantizeConfig, swizzle: bool = False) -> tuple[int, int, int]:
    """One block per tile; swizzled scales also need the tiles of the rows padding R to 128."""
    if swizzle:
        rows = ceil_div(rows, SWIZZLE_ROWS) * SWIZZLE_ROWS
    return (batch * ceil_div(rows, cfg.tile_r) * ceil_div(k, cfg.tile_k), 1, 1)


_RECORDS = threading.local()


def _launch_kernel(device: torch.device, grid, kernel, args: tuple) -> None:
    launch_on(stream_handle(device), grid, kernel, args)


def launch_on(stream, grid, kernel, args: tuple) -> None:
    """``ct.launch`` on raw stream ``stream``, recorded (``recording``) like every quantizer launch."""
    records = getattr(_RECORDS, "launches", None)
    if records is not None:
        records.append((grid, kernel, args))
    ct.launch(stream, grid, kernel, args)


def _buffer(shape: tuple, dtype: torch.dtype, device: torch.device, zeroed: bool = False) -> torch.Tensor:
    """A buffer one call uses between its launches (uninitialised, or zeroed), recorded (``recording``)."""
    t = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
    buffers = getattr(_RECORDS, "buffers", None)
    if buffers is not None:
        buffers.append((t, zeroed))
    return t


@contextlib.contextmanager
def recording():
    """(launches, buffers): the launches (grid, kernel, args) that this thread's quantizer calls make
    inside the block, and the buffers (tensor, zeroed) they allocate for them (``_buffer``): how
    ``tilemm.quantize`` prepares a signature's launches on its first call."""
    launches, buffers = [], []
    outer = getattr(_RECORDS, "launches", None), getattr(_RECORDS, "buffers", None)
    _RECORDS.launches, _RECORDS.buffers = launches, buffers
    try:
        yield launches, buffers
    finally:
        _RECORDS.launches, _RECORDS.buffers = outer




def _target(device: torch.device) -> str:
    """The device's architecture as an ``aot_variants`` target, e.g. "sm_90"."""
    return gpu_code(capability(device))


# Tensors of 2^31 elements and more (``_large``): every launch below goes through ``_pieces``, which
# returns the arrays themselves when they fit 32-bit indexing (one launch, the common case) and
# otherwise views of rectangular pieces of (batch entries, rows, K), one launch each. The cuts are
# exact for every quantizer: rows are independent, and cuts along K fall on whole tiles, so every
# block and its scale lie in one piece; cuts along rows of swizzled scales fall on 128-row blocks,
# K cuts on 4-column groups, so each piece's scales are one slab of the 32x4x4 layout, its padding
# written by the last piece. Per-tensor maxima are taken over all pieces first (``tensor_amax``);
# FP8 per row along axis=-2 takes the column maxima of every piece (an atomic maximum, exact) before
# any piece is quantized.

_BRK = ((0, 0, 1), (1, 1, 1), (2, 2, 1))  # a (B, R, K) array: batch, rows, K
_BKR = ((0, 0, 1), (1, 2, 1), (2, 1, 1))  # the (B, K, R) storage of a transposed input


def _input_dims(op: _Operand):
    return _BKR if op.transposed else _BRK


def _block_scale_dims(block: int, swizzle: bool):
    """How a block-scale buffer follows (batch, rows, K): logical (B, R, K / block), or the
    (B, R / 128, Ks / 4, ...) blocks of the swizzled layout."""
    if swizzle:
        return (0, 0, 1), (1, 1, SWIZZLE_ROWS), (2, 2, block * SWIZZLE_COLS)
    return (0, 0, 1), (1, 1, 1), (2, 2, block)


def _pieces(where: str, op: _Operand, row_unit: int, k_unit: int, operands) -> list[tuple[torch.Tensor, ...]]:
    """The arrays of each launch over op's (batch, rows, K): ``operands`` is (name, tensor, dims)
    per array (``_large.Operand``); rows are cut on multiples of ``row_unit``, K on multiples of
    ``k_unit`` (op.k: never)."""
    return _large.split(where, (("batch", op.batch, 1), ("rows", op.rows, row_unit), ("K", op.k, k_unit)),
                        operands)


def _row_unit(cfg: QuantizeConfig, swizzle: bool) -> int:
    """Row cuts on whole tiles, and for swizzled scales on whole 128-row blocks."""
    return max(cfg.tile_r, SWIZZLE_ROWS) if swizzle else cfg.tile_r


def _view_grid(view: torch.Tensor, transposed: bool, cfg: QuantizeConfig, swizzle: bool = False):
    """``_grid`` of a piece's input view, (B, R, K) or transposed (B, K, R)."""
    b, r, k = (view.shape[0], view.shape[2], view.shape[1]) if transposed else view.shape
    return _grid(b, r, k, cfg, swizzle)


def _scale_operand(scale: torch.Tensor, swizzle: bool) -> torch.Tensor:
    """The scale buffer as the kernel stores to it: swizzled (B, Rt, Ct, 32, 16) as (B, Rt, Ct, 32, 4, 4)."""
    return scale.view(*scale.shape[:4], 4, 4) if swizzle else scale


def _block_scale_buffer(op: _Operand, cols: int, swizzle: bool, dtype) -> torch.Tensor:
    """Scale output for ``cols`` scale columns per row: (B, R, cols), or swizzled (B, Rt, Ct, 32, 16).
    Uninitialised: the kernel writes every byte, the layout's zero padding included."""
    if swizzle:
        shape = (op.batch, *swizzled_shape(op.rows, cols))
    else:
        shape = (op.batch, op.rows, cols)
    return torch.empty(shape, dtype=dtype, device=op.view.device)


def _shaped(op: _Operand, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, swizzle: bool):
    """Data and scale reshaped to the reference's shapes for x (..., R, K)."""
    head = (*op.lead, op.rows) if x.ndim >= 2 else ()
    data = data.reshape(*head, data.shape[-1])
    if swizzle:
        return data, scale.reshape(*op.lead, *scale.shape[1:])
    return data, scale.reshape(*head, scale.shape[-1])


def quantize_mx(x: torch.Tensor, fmt: Format, rounding: str, swizzle: bool):
    """MXFP8 / MXFP4 of x (..., K) on the GPU: (data, scale bytes) in the reference's shapes: data
    (..., K) of fmt.data_dtype or (..., K/2) packed uint8; scale (..., K/32) or swizzled, uint8. A transposed view
    (x.stride(-2) == 1) is read as it is stored."""
    full = _operand(x)
    op = full if swizzle else _rows_flattened(full)
    cfg = plan("mxfp4" if fmt.is_packed else "mxfp8", swizzled=swizzle, transposed=op.transposed)
    data = torch.empty(op.batch, op.rows, fmt.data_k(op.k), dtype=fmt.data_dtype, device=x.device)
    scale = _block_scale_buffer(op, op.k // fmt.block, swizzle, torch.uint8)
    floor = 1 if rounding == "floor" else 0
    kernel = _kernel(_mx_quantize_kernel, cfg)
    where = "quantize_mxfp4" if fmt.is_packed else "quantize_mxfp8"
    for view, d, s in _pieces(where, op, _row_unit(cfg, swizzle), cfg.tile_k,
                              (("x", op.view, _input_dims(op)),
                               ("data", data, ((0, 0, 1), (1, 1, 1), (2, 2, fmt.elements_per_byte))),
                               ("scale", _scale_operand(scale, swizzle), _block_scale_dims(fmt.block, swizzle)))):
        _launch_kernel(x.device, _view_grid(view, op.transposed, cfg, swizzle), kernel,
                       (view, d, s, floor, fmt.element_code, swizzle, op.transposed, cfg.tile_r,
                        cfg.tile_k))
    return _shaped(full, x, data, scale, swizzle)


def tensor_amax(x: torch.Tensor, propagate_nan: bool) -> torch.Tensor:
    """max |x| over all of x, in one read, as the per-block maxima of ``_amax_kernel``: an int32 tensor
    of at most ``AMAX_PARTIALS`` fp32 bit patterns, which the quantize kernels reduce (``amax_value``
    on the host). NaN if x holds a NaN and ``propagate_nan``; else the maximum over the finite elements (NaN
    and Inf count as 0, NVFP4's rule). One launch: each
    block writes its own slot, so there is no zeroed buffer to fill first."""
    op = _operand(x)
    view = op.view  # the storage, (B, K, R) for a transposed x: a maximum does not care about order
    cfg = plan("amax")
    # The storage's pieces (``_pieces`` with the storage as (batch, rows, K)): each writes its own
    # share of the AMAX_PARTIALS slots, so the users' maximum covers every piece.
    storage = _Operand(view, view.shape[0], view.shape[1], view.shape[2], False, op.lead)
    views = [v for v, in _pieces("tensor amax", storage, cfg.tile_r, cfg.tile_k, (("x", view, _BRK),))]
    share = AMAX_PARTIALS // len(views)
    blocks = [min(v.shape[0] * ceil_div(v.shape[1], cfg.tile_r) * ceil_div(v.shape[2], cfg.tile_k),
                  num_sms(x.device) * AMAX_BLOCKS_PER_SM, share) for v in views]
    partial = _buffer((sum(blocks),), torch.int32, x.device)
    start = 0
    for v, n in zip(views, blocks):
        _launch_kernel(x.device, (n, 1, 1), _kernel(_amax_kernel, cfg),
                       (v, partial[start:start + n], propagate_nan, op.transposed, cfg.tile_r, cfg.tile_k))
        start += n
    return partial


def amax_slots(rows: int, k: int) -> int:
    """The tiles of ``AMAX_CONFIG`` over a (rows, k) activation: the fewest slots (blocks) that
    ``tile_amax`` may fill for it."""
    return ceil_div(rows, AMAX_CONFIG.tile_r) * ceil_div(k, AMAX_CONFIG.tile_k)


def tile_amax(x: torch.Tensor, slots: int, stream, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor_amax(x, propagate_nan=False)`` of a contiguous (M, K) x, as (slots,) int32 per-block
    maxima, launched with exactly ``slots`` blocks (``amax_slots(M, K) <= slots <= AMAX_PARTIALS``):
    the launch a row-wise tensor-parallel rank makes on the small-batch path, its arguments known
    without ``tensor_amax``'s general handling (any layout, 32-bit index pieces).

    ``_amax_kernel`` strides its blocks over the tiles, so with at least one block per tile each block
    reduces at most one tile and the blocks beyond x's tiles write 0 (the maximum of nothing, which
    leaves every maximum of the slots unchanged): ranks whose K-slices differ in length still fill the
    same number of slots, so their maxima can be combined slot by slot (an elementwise MAX all-reduce),
    and every quantize kernel that takes ``tensor_amax``'s maxima reduces them (``_tensor_amax``).
    The maximum over the slots is the bits of ``tensor_amax``'s: the same tiles, the same maxima.
    ``out``: a contiguous (slots,) int32 view to write them into (a row-wise rank's region of the
    one-shot amax exchange's vector), else a new tensor."""
    m, k = x.shape
    cfg = AMAX_CONFIG
    if out is None:
        partial = torch.empty(slots, dtype=torch.int32, device=x.device)
    elif out.shape != (slots,) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"tile_amax: out must be a contiguous ({slots},) int32 tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    else:
        partial = out
    ct.launch(stream, (slots, 1, 1), _kernel(_amax_kernel, cfg),
              (x.view(1, m, k), partial, False, False, cfg.tile_r, cfg.tile_k))
    return partial


def amax_value(partial: torch.Tensor) -> torch.Tensor:
    """The (1,) fp32 amax that ``tensor_amax``'s per-block maxima stand for."""
    return partial.amax().reshape(1).view(torch.float32)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None, swizzle: bool,
                   amax: torch.Tensor | None = None):
    """NVFP4 of x (..., K) on the GPU: (data uint8, scale e4m3 bytes as uint8, 0-d fp32 decode scale).

    ``global_scale`` (a 0-d fp32 decode scale on x's device) or None: S_enc from the tensor amax over
    the finite elements, or from ``amax`` when given: (1,) int32, the fp32 bits of a known amax
    (``_tensor_amax`` reads it as one partial maximum). The tensor amax is taken inside the quantize
    launch (``_grid_amax``: one launch) when its grid fits one block per SM, else by ``tensor_amax``
    first."""
    from_amax = global_scale is None
    global_scale_out = torch.empty(1, dtype=torch.float32, device=x.device)
    full = _operand(x)
    op = full if swizzle else _rows_flattened(full)
    cfg = plan("nvfp4", swizzled=swizzle, transposed=op.transposed)
    data = torch.empty(op.batch, op.rows, op.k // 2, dtype=torch.uint8, device=x.device)
    scale = _block_scale_buffer(op, op.k // NVFP4.block, swizzle, torch.uint8)
    kernel = _kernel(_nvfp4_quantize_kernel, cfg)
    operands = (("x", op.view, _input_dims(op)), ("data", data, ((0, 0, 1), (1, 1, 1), (2, 2, 2))),
                ("scale", _scale_operand(scale, swizzle), _block_scale_dims(NVFP4.block, swizzle)))
    pieces = _pieces("quantize_nvfp4", op, _row_unit(cfg, swizzle), cfg.tile_k, operands)
    grid = _view_grid(pieces[0][0], op.transposed, cfg, swizzle)
    grid_amax = from_amax and amax is None and len(pieces) == 1 and grid[0] <= num_sms(x.device)
    if grid_amax:
        g = _grid_sync(x.device, stream_handle(x.device))
    elif not from_amax:
        g = global_scale.reshape(1)
    else:
        g = tensor_amax(x, propagate_nan=False) if amax is None else amax.view(torch.int32).reshape(1)
    for view, d, s in pieces:
        _launch_kernel(x.device, _view_grid(view, op.transposed, cfg, swizzle), kernel,
                       (view, d, s, g, global_scale_out, from_amax, grid_amax, swizzle, op.transposed, cfg.tile_r,
                        cfg.tile_k))
    data, scale = _shaped(full, x, data, scale, swizzle)
    return data, scale, global_scale_out.reshape(())


class _Scratch:
    """One stream's buffers for an activation that one launch writes and the next reads."""

    __slots__ = ("values", "alpha", "retired", "matrices")

    #: (rows, cols) views of ``values`` kept before the table starts over.
    MAX_MATRICES = 64

    def __init__(self, values: torch.Tensor, alpha: torch.Tensor, retired: list):
        self.values, self.alpha, self.retired = values, alpha, retired
        self.matrices = {}

    def matrix(self, rows: int, cols: int) -> torch.Tensor:
        """The first rows * cols values as a (rows, cols) tensor, the view taken once per shape."""
        view = self.matrices.get((rows, cols))
        if view is None:
            if len(self.matrices) >= self.MAX_MATRICES:
                self.matrices.clear()
            view = self.matrices[(rows, cols)] = self.values[:rows * cols].view(rows, cols)
        return view


_SCRATCH: dict = {}


def activation_scratch(device: torch.device, stream, elements: int) -> _Scratch:
    """The (device, stream, thread)'s scratch: ``values``, a flat bf16 buffer of at least ``elements``
    (doubling when a call needs more), and ``alpha``, one fp32 word. For values that one launch
    writes and the next launch on the same stream reads, and nothing else: stream order then keeps
    every write after the previous read, across all the layers that share it (the thread is in the
    key because threads start on the same default stream: two threads' calls could interleave their
    launches there). Allocated outside
    torch.compile's graph pools (``_outside_graph_pools``, on another thread's stream: a buffer
    outgrown is kept, never freed, so that no allocation on that stream reuses memory a launch of
    this stream may still read); never used inside a capture."""
    key = (device, _stream_key(stream), threading.get_ident())
    scratch = _SCRATCH.get(key)
    if scratch is None:
        alpha = _outside_graph_pools(lambda: torch.empty(1, dtype=torch.float32, device=device))
        scratch = _SCRATCH[key] = _Scratch(torch.empty(0, dtype=torch.bfloat16, device=device), alpha, [])
    if scratch.values.numel() < elements:
        size = max(elements, 2 * scratch.values.numel(), 1 << 16)
        scratch.retired.append(scratch.values)
        scratch.values = _outside_graph_pools(lambda: torch.empty(size, dtype=torch.bfloat16, device=device))
        scratch.matrices.clear()
    return scratch


#: Activations of at most this many elements (4 MiB of bf16: 128 rows of K = 16384) take the scratch
#: buffer; larger ones, whose product costs far more than an allocation, are allocated per call.
SCRATCH_ELEMENTS = 1 << 21


class FakeQuant:
    """``dequantize(quantize(x))`` of an activation x (M, K), contiguous, as a bf16 (M, K) tensor, with
    everything but x worked out once: the format ("mxfp8" with e4m3 / e5m2, "mxfp4", "nvfp4"), the MX
    scale rounding, and for NVFP4 the (1,) fp32 ``alpha`` that the tensor's decode scale multiplies
    (``run`` returns ``S_dec * alpha`` in a (1,) tensor that a later call on the stream may rewrite). One
    launch, but NVFP4's tensor amax comes first: for x of at most ``whole_elements`` (``_whole_tiles``)
    every block loads all of x, in the same launch; else, in eager calls whose tiles fit one wave,
    through a grid-wide barrier in the same launch (``_grid_amax``, ``barrier`` "eager"); else from
    ``tensor_amax``, a launch of its own. Inside a CUDA graph the second launch costs less GPU time
    than the barrier; in eager calls the barrier saves a launch's host time.

    Its outputs are only ever read by what follows on the same stream before the next FakeQuant call
    there (the weight-only path), so outside CUDA-graph captures, up to ``SCRATCH_ELEMENTS``, they live
    in ``activation_scratch``, shared by every layer on that stream: a call's write follows the
    previous call's reads in stream order. Captures and larger activations take fresh ones, allocated
    on the current stream: ``run``'s stream must be the current one."""

    __slots__ = ("element", "nv", "floor", "alpha", "config", "whole_elements", "barrier", "_stub_i32",
                 "_kernel", "_whole_kernel", "_sms")

    def __init__(self, fmt: Format, rounding: str | None, alpha: torch.Tensor):
        self.element = fmt.element_code
        self.nv = fmt is NVFP4
        self.floor = 1 if rounding == "floor" else 0
        # Fixed arguments, described for cuTile once (``Described``).
        self.alpha = Described(alpha)
        self._stub_i32 = Described(torch.zeros(1, dtype=torch.int32, device=alpha.device))
        self.config = plan("fake_quant")
        self._kernel = _kernel(_fake_quant_kernel, self.config)
        self._whole_kernel = _whole_kernel()
        self.whole_elements = WHOLE_ELEMENTS
        self.barrier = "eager"  # or "always", "never" (benchmarks compare them)
        self._sms = num_sms(alpha.device)

    def _outputs(self, x: torch.Tensor, stream) -> tuple:
        """(bf16 (M, K), NVFP4's (1,) fp32 alpha or ``self.alpha``): in the stream's scratch, or
        allocated for this call inside a capture and above ``SCRATCH_ELEMENTS`` (a prefill's
        activation would grow the scratch, which is never freed, to its size for good)."""
        m, k = x.shape
        device = x.device
        if m * k > SCRATCH_ELEMENTS or _capturing(device):
            return (torch.empty((m, k), dtype=torch.bfloat16, device=device),
                    torch.empty(1, dtype=torch.float32, device=device) if self.nv else self.alpha)
        scratch = activation_scratch(device, stream, m * k)
        return scratch.matrix(m, k), scratch.alpha if self.nv else self.alpha

    def run(self, x: torch.Tensor, stream, amax: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bf16 (M, K) fake-quantized x, NVFP4's ``S_dec * alpha`` or None). ``stream``: a raw handle
        or a torch.cuda.Stream, the one x's producer ran on. ``amax`` (NVFP4): the tensor amax to use
        instead of x's, as int32 fp32 bits: (1,), or (P,) per-block maxima whose maximum it is, P <=
        AMAX_PARTIALS (a row-wise tensor-parallel rank's all-reduced one)."""
        m, k = x.shape
        tile_r, tile_k = self.config.tile_r, self.config.tile_k
        out, alpha_out = self._outputs(x, stream)
        kernel, source, whole_r, whole_k = self._kernel, AMAX_PARTIALS, 1, 1
        if not self.nv:
            amax = self._stub_i32
        elif amax is not None:
            if amax.dtype != torch.int32 or amax.ndim != 1:
                amax = amax.view(torch.int32).reshape(-1)
        elif (whole := _whole_tiles(m, k, self.whole_elements)) is not None:
            kernel, source, amax = self._whole_kernel, AMAX_WHOLE, self._stub_i32
            whole_r, whole_k, tile_r, tile_k = whole
        elif ceil_div(m, tile_r) * ceil_div(k, tile_k) <= self._sms and (
                self.barrier == "always" or self.barrier == "eager" and not _capturing(x.device)):
            source, amax = AMAX_GRID, _grid_sync(x.device, stream)
        else:
            amax = tensor_amax(x, propagate_nan=False)
        ct.launch(stream, (ceil_div(m, tile_r) * ceil_div(k, tile_k), 1, 1), kernel,
                  (x, out, self.floor, amax, self.alpha, alpha_out, self.element, self.nv, source, whole_r, whole_k,
                   tile_r, tile_k))
        return out, alpha_out if self.nv else None


def _whole_tiles(m: int, k: int, most: int = WHOLE_ELEMENTS) -> tuple[int, int, int, int] | None:
    """(WHOLE_R, WHOLE_K, tile_r, tile_k) of an AMAX_WHOLE fake-quant launch for x (m, k): x's rows and
    columns rounded up to powers of two, and tiles of ``WHOLE_TILE`` elements over those rows (at
    least one NVFP4 block wide); None where the rounded x has more than ``most`` elements."""
    whole_r = 1 << max(0, m - 1).bit_length()
    whole_k = 1 << max(0, k - 1).bit_length()
    if whole_r * whole_k > most:
        return None
    return whole_r, whole_k, whole_r, min(whole_k, max(16, WHOLE_TILE // whole_r))


def _whole_kernel():
    """``_fake_quant_kernel`` as AMAX_WHOLE launches run it: WHOLE_WARPS warps, so that the whole-x tile
    stays in registers."""
    return hinted(_fake_quant_kernel, num_worker_warps=ct.ByTarget(sm_90=WHOLE_WARPS))


_GRID_SYNC: dict = {}


def _grid_sync(device: torch.device, stream):
    """``_grid_amax``'s zeroed int32 (3,) buffer per (device, stream): the kernel leaves it at zero,
    so launches on one stream (in order) share it, and streams never do. Allocated outside CUDA-graph
    memory pools, as the split-K workspace is (``weight_only_kernels.workspace``); a capture on a
    stream that has none yet gets zeroed words of the graph's own (one fill kernel in the graph)."""
    key = (device, _stream_key(stream))
    t = _GRID_SYNC.get(key)
    if t is None:
        if _capturing(device):
            return torch.zeros(3, dtype=torch.int32, device=device)
        t = _outside_graph_pools(lambda: torch.zeros(3, dtype=torch.int32, device=device))
        t = _GRID_SYNC[key] = Described(t) if t.is_cuda else t
    return t


def quantize_fp8(x: torch.Tensor, fmt: Format, granularity, pow2_scale: bool,
                 amax: torch.Tensor | None = None):
    """FP8 of x on the GPU: (data of fmt.data_dtype in x's shape, fp32 scale in the reference's shape).

    granularity: a ``Granularity`` (or a spelling ``Granularity.parse`` reads): TENSOR (scale 0-d; the
    NaN-propagating tensor amax taken inside the launch (``_grid_amax``: one launch) when its grid fits
    one block per SM, else by ``tensor_amax`` first; ``amax``, a (1,) fp32 tensor holding max |x|,
    replaces it: the benchmark times the kernel alone that way), ROW (..., M, 1), BLOCK_1X128
    (..., M, K/128) or BLOCK_128X128 (..., cdiv(M, 128), K/128)."""
    gran = Granularity.parse(granularity, "quantize_kernels.quantize_fp8")
    element = fmt.element_code
    full = _operand(x)
    if gran is Granularity.ROW:
        op = _rows_flattened(full)
        data = torch.empty(op.batch, op.rows, op.k, dtype=fmt.data_dtype, device=x.device)
        scale = torch.empty(op.batch, op.rows, 1, dtype=torch.float32, device=x.device)
        row_scale = ((0, 0, 1), (1, 1, 1))  # (B, R, 1): its last dimension follows no axis
        if op.transposed:
            amax = _buffer((op.batch, op.rows), torch.int32, x.device, zeroed=True)
            acfg, cfg = plan("fp8_row_amax"), plan(gran.quantize_kernel, transposed=True)
            # Every piece's column maxima (atomic, into the rows of Amax it covers) before any piece
            # is quantized: pieces cut along K share their rows' maxima.
            views = _pieces("quantize_fp8", op, max(acfg.tile_r, cfg.tile_r), max(acfg.tile_k, cfg.tile_k),
                            (("x", op.view, _BKR), ("data", data, _BRK), ("scale", scale, row_scale),
                             ("amax", amax, ((0, 0, 1), (1, 1, 1)))))
            for view, _, _, a in views:
                k_tiles = ceil_div(view.shape[1], acfg.tile_k)
                chunks = ceil_div(k_tiles, ROW_AMAX_CHUNK)
                _launch_kernel(x.device, (view.shape[0] * ceil_div(view.shape[2], acfg.tile_r) * chunks, 1, 1),
                               _kernel(_column_amax_kernel, acfg),
                               (view, a, ROW_AMAX_CHUNK, acfg.tile_r, acfg.tile_k))
            for view, d, s, a in views:
                _launch_kernel(x.device, _view_grid(view, True, cfg), _kernel(_fp8_columns_kernel, cfg),
                               (view, d, s, a, element, cfg.tile_r, cfg.tile_k))
        else:
            cfg = plan(gran.quantize_kernel, k=op.k)
            tma = _row_tma_store(cfg, _target(x.device))
            for view, d, s in _pieces("quantize_fp8", op, cfg.tile_r, op.k,
                                      (("x", op.view, _BRK), ("data", data, _BRK), ("scale", scale, row_scale))):
                _launch_kernel(x.device, (view.shape[0] * ceil_div(view.shape[1], cfg.tile_r), 1, 1),
                               _kernel(_fp8_row_kernel, cfg),
                               (view, d, s, element, tma, cfg.tile_r, cfg.tile_k))
        return _shaped(full, x, data, scale, False)
    if gran is Granularity.TENSOR:
        op = _rows_flattened(full)
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
        scale_dims = ()
    elif gran is Granularity.BLOCK_1X128:
        op = _rows_flattened(full)
        amax = scale = _block_scale_buffer(op, op.k // FP8_BLOCK, False, torch.float32)
        scale_dims = amax_dims = ((0, 0, 1), (1, 1, 1), (2, 2, FP8_BLOCK))
    else:
        op = full
        scale = torch.empty(op.batch, ceil_div(op.rows, FP8_BLOCK), op.k // FP8_BLOCK, dtype=torch.float32,
                            device=x.device)
        amax = scale
        scale_dims = amax_dims = ((0, 0, 1), (1, 1, FP8_BLOCK), (2, 2, FP8_BLOCK))
    data = torch.empty(op.batch, op.rows, op.k, dtype=fmt.data_dtype, device=x.device)
    cfg = plan(gran.quantize_kernel, transposed=op.transposed, itemsize=x.element_size())
    kernel = _kernel(_fp8_quantize_kernel, cfg)
    tma = fp8_tma_store(gran, _target(x.device))
    operands = [("x", op.view, _input_dims(op)), ("data", data, _BRK), ("scale", scale, scale_dims)]
    grid_amax = False
    if gran is Granularity.TENSOR:  # every piece reads the one amax: taken in the launch, or first
        pieces = _pieces("quantize_fp8", op, cfg.tile_r, cfg.tile_k, operands)
        grid_amax = (amax is None and len(pieces) == 1
                     and _view_grid(pieces[0][0], op.transposed, cfg)[0] <= num_sms(x.device))
        if grid_amax:
            amax = _grid_sync(x.device, stream_handle(x.device))
        elif amax is None:
            amax = tensor_amax(x, propagate_nan=True)
        else:
            amax = amax.view(torch.int32)
        pieces = [(*piece, amax) for piece in pieces]
    else:
        pieces = _pieces("quantize_fp8", op, cfg.tile_r, cfg.tile_k, [*operands, ("amax", amax, amax_dims)])
    for view, d, s, a in pieces:
        _launch_kernel(x.device, _view_grid(view, op.transposed, cfg), kernel,
                       (view, d, s, a, 1 if pow2_scale else 0, element, gran.code, op.transposed, grid_amax, tma,
                        cfg.tile_r, cfg.tile_k))
    head = (*full.lead, full.rows) if x.ndim >= 2 else ()
    data = data.reshape(*head, op.k)
    if gran is Granularity.TENSOR:
        return data, scale.reshape(())
    if gran is Granularity.BLOCK_1X128:
        return data, scale.reshape(*head, scale.shape[-1])
    return data, scale.reshape(*full.lead, *scale.shape[1:])


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_INPUT_DTYPES = {"fp32": ct.float32, "bf16": ct.bfloat16, "fp16": ct.float16}
_INT32 = cc.ScalarConstraint(ct.int32)


def _data_array(element: str):
    return array({"e4m3": ct.float8_e4m3fn, "e5m2": ct.float8_e5m2, "e2m1": ct.uint8}[element], 3)


def aot_variants() -> list[AotVariant]:
    """Every kernel specialisation the launchers can pick, for sm_90, sm_100 and sm_120."""
    variants = []
    u8 = array(ct.uint8, 3)
    f32_1 = array(ct.float32, 1)
    i32_1 = array(ct.int32, 1)
    row = Granularity.ROW

    def add(name, kernel, cfg, params, targets=TARGETS):
        variants.append(AotVariant(name, _kernel(kernel, cfg), [*params, cfg.tile_r, cfg.tile_k], targets))

    for in_name, in_dtype in _INPUT_DTYPES.items():
        x = array(in_dtype, 3)
        for transposed in (False, True):
            t = "_t" if transposed else ""
            for swizzled in (False, True):
                scale = array(ct.uint8, 6 if swizzled else 3)
                layout = ("swz" if swizzled else "log") + t
                for element, code in ELEMENT_CODES.items():
                    cfg = plan("mxfp4" if element == "e2m1" else "mxfp8", swizzled=swizzled, transposed=transposed)
                    add(f"quantize_mx_{element}_{in_name}_{layout}", _mx_quantize_kernel, cfg,
                        [x, _data_array(element), scale, _INT32, code, swizzled, transposed])
                for source in ("given", "amax", "grid_amax"):
                    from_amax, grid_amax = source != "given", source == "grid_amax"
                    add(f"quantize_nvfp4_{source}_{in_name}_{layout}",
                        _nvfp4_quantize_kernel, plan("nvfp4", swizzled=swizzled, transposed=transposed),
                        [x, u8, scale, i32_1 if from_amax else f32_1, f32_1, from_amax, grid_amax, swizzled,
                         transposed])
            for element in ("e4m3", "e5m2"):
                code = ELEMENT_CODES[element]
                if transposed:
                    add(f"quantize_fp8_{row.value}cols_{element}_{in_name}", _fp8_columns_kernel,
                        plan(row.quantize_kernel, transposed=True),
                        [x, _data_array(element), array(ct.float32, 3), array(ct.int32, 2), code])
                for tile_k in [] if transposed else _row_tiles_k():
                    cfg = plan(row.quantize_kernel, k=tile_k)
                    for tma in (True, False):
                        targets = tuple(tg for tg in TARGETS if _row_tma_store(cfg, tg) == tma)
                        if targets:
                            add(f"quantize_fp8_{row.value}{cfg.tile_k}_{element}_{in_name}"
                                f"{'' if tma else '_plain'}",
                                _fp8_row_kernel, cfg,
                                [x, _data_array(element), array(ct.float32, 3), code, tma], targets)
                grans = [Granularity.TENSOR]
                if element == "e4m3":
                    grans += [Granularity.BLOCK_1X128, Granularity.BLOCK_128X128]
                for gran in grans:
                    cfg = plan(gran.quantize_kernel, transposed=transposed, itemsize=in_dtype.bitwidth // 8)
                    per_tensor = gran is Granularity.TENSOR
                    scale = f32_1 if per_tensor else array(ct.float32, 3)
                    amax = i32_1 if per_tensor else array(ct.float32, 3)
                    for grid_amax in (False, True) if per_tensor else (False,):
                        for tma in (False, True):
                            targets = tuple(tg for tg in TARGETS if fp8_tma_store(gran, tg) == tma)
                            if targets:
                                add(f"quantize_fp8_{gran.value}{'_grid_amax' if grid_amax else ''}_{element}_"
                                    f"{in_name}{t}{'_tma' if tma else ''}", _fp8_quantize_kernel, cfg,
                                    [x, _data_array(element), scale, amax, _INT32, code, gran.code, transposed,
                                     grid_amax, tma], targets)
        for element, code in ELEMENT_CODES.items():
            sources = [(False, AMAX_PARTIALS)]
            if element == "e2m1":
                sources += [(True, AMAX_PARTIALS), (True, AMAX_GRID)]
            for nv, source in sources:
                kind = ("nvfp4_grid_amax" if source == AMAX_GRID else "nvfp4") if nv else f"mx_{element}"
                add(f"fake_quant_{kind}_{in_name}", _fake_quant_kernel, plan("fake_quant"),
                    [array(in_dtype, 2), array(ct.bfloat16, 2), _INT32, i32_1, f32_1, f32_1, code, nv,
                     source, 1, 1])
            if element == "e2m1":  # one row of K = 4096 and of K = 14336, as a decode step has
                for k in (4096, 14336):
                    whole_r, whole_k, tile_r, tile_k = _whole_tiles(1, k)
                    variants.append(AotVariant(
                        f"fake_quant_nvfp4_whole{whole_k}_{in_name}", _whole_kernel(),
                        [array(in_dtype, 2), array(ct.bfloat16, 2), _INT32, i32_1, f32_1, f32_1, code, True,
                         AMAX_WHOLE, whole_r, whole_k, tile_r, tile_k]))
        add(f"amax_columns_{in_name}", _column_amax_kernel, plan("fp8_row_amax"),
            [array(in_dtype, 3), array(ct.int32, 2), ROW_AMAX_CHUNK])
        for propagate in (False, True):
            for columns in (False, True):
                add(f"amax_{'nan' if propagate else 'nonan'}_{in_name}{'_t' if columns else ''}", _amax_kernel,
                    plan("amax"), [x, i32_1, propagate, columns])
    return variants
