"""Weight-only matmul: bf16 / fp16 / fp32 activations x (M, K) times a prepacked MXFP4, NVFP4 or MXFP8
weight (N, K), ``out = (x @ dequantize(w).T) * alpha + bias`` accumulated in fp32 and rounded once,
reading each weight byte once and writing no dequantized weight. ``plan`` picks the tensor-core kernel
``_weight_only_kernel`` or, for one row of x, the FMA kernel ``_gemv_kernel`` (or there, as the
variant ``M1_KERNEL = "mma"``, the tensor-core kernel again); ``_dequantize_kernel``
and ``_k_tile`` also serve ``hopper_weight_only_large`` and ``moe_kernels`` (same layout, same decode).

Layout (``tilemm.prepack`` builds it once; ``Layout``, ``E2M1_FIELDS``). A K tile is PLANES planes of
G scale blocks; 32-bit word w of a row's tile holds elements 2w and 2w + 1 of every plane, one per
16-bit lane. Decoding a plane (``_decode_plane``) is one or two shifts and masks on whole words and
yields two bf16 bit patterns at once: e2m1 * 2^-126, e4m3 * 2^-120 or e5m2 * 2^-112.

Scaling. Each decoded pair is multiplied (one bf16x2 multiply) by the bf16 multiplier ``scale *
2^(OFFSET - E)`` of its row and block (``_multipliers``); E >= 0 is chosen by ``prepack`` so that every
multiplier is a finite bf16 number, and the epilogue multiplies by ``alpha = 2^E`` (times NVFP4's
per-tensor decode scale). Invariant: the scaled element is exactly ``dequantize(w) * 2^-E`` in bf16
(``_scaled_plane``); a NaN scale gives a NaN multiplier, so NaN reaches exactly the output columns the
reference makes NaN. The scale is applied per element, not to per-block partial sums (``_k_tile``).

Exactness. bf16 x bf16 products are exact in fp32; fp16 / fp32 activations are split into 2 / 3 bf16
parts whose sum is x (``_mma_x``; fp32 values below about 2^-110 can lose the last part); the FMA
kernel turns bf16 into fp32 by bit operations and rounds each product once into an fp32 sum. So each
output equals the fp32-accumulated ``x @ dequantize(w).T`` up to the order of the additions and the
placement of alpha.
"""

from __future__ import annotations

import dataclasses
import threading

import cuda.tile as ct
import torch

from ..formats import E2M1, E4M3, E5M2, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, Format
from ..numerics import ceil_div
from ._aot import AotVariant, array
from ._common import Described, e2m1_bits, e8m0_bits_bf16, hinted, sm90_hints


__all__ = ["WeightOnlyConfig", "plan", "M1_KERNELS", "launch", "Prepared", "aot_variants", "LAYOUTS", "NVFP4_NORMAL",
           "Layout"]

ConstInt = ct.Constant[int]

_ZERO = ct.PaddingMode.ZERO

# Element codes (the ELEMENT constant of the kernel): E2M1, E4M3, E5M2 from tilemm.formats.


@dataclasses.dataclass(frozen=True)
class Layout:
    """A prepacked weight layout: the weight's ``format`` (which owns the element code, the scale block
    B and the scale encoding) and the layout's own choices, planes per K tile and blocks per plane G.

    ``tile_k = planes * group * block`` elements make one K tile; a row of a tile is
    ``group * block / 2`` 32-bit words. ``offset`` is the power of two the element decode divides by.
    ``normal_scales`` (NVFP4 only; ``prepack`` sets it per weight): every e4m3 scale byte is normal
    and positive, or 0 over a block of zero elements, so the kernels decode scales by one integer
    multiply-add (``scale_mode`` 2).
    """

    format: Format
    planes: int
    group: int
    normal_scales: bool = False

    def __post_init__(self):
        if self.normal_scales and (self.format.is_mx or self.format.block != 16):
            raise ValueError(f"Layout: normal_scales is for NVFP4's e4m3 scales, not {self.format.name}")

    @property
    def element(self) -> int:
        """The element code (the kernels' ELEMENT constant)."""
        return self.format.element_code

    @property
    def block(self) -> int:
        """Elements per scale along K."""
        return self.format.block

    @property
    def scale_e8m0(self) -> int:
        """1 for e8m0 (MX) scale bytes, 0 for NVFP4's e4m3 ones."""
        return int(self.format.is_mx)

    @property
    def scale_mode(self) -> int:
        """How the kernels decode a scale byte (their SCALE_MODE constant, ``_multipliers``): 1 e8m0,
        0 e4m3, 2 e4m3 known normal (``normal_scales``)."""
        return 2 if self.normal_scales else int(self.format.is_mx)

    @property
    def offset(self) -> int:
        """``_decode_plane`` moves an eXmY element's exponent and mantissa fields into bf16's, so it
        reads them with bf16's exponent bias 127 instead of the element's 2^(X-1) - 1: the decoded
        value is the element times 2^-offset, offset = 127 - (2^(X-1) - 1) (126 for e2m1, 120 for
        e4m3, 112 for e5m2)."""
        exponent_bits = int(self.format.element[1:].split("m")[0])
        return 127 - (2 ** (exponent_bits - 1) - 1)

    @property
    def scale_rows(self) -> bool:
        """Whether a single weight of this layout keeps its scale bytes row-major, (N, K / B), rather than
        transposed, (K / B, N): NVFP4's, whose 16 scale bytes per row and K tile the kernels read with
        one vector load instead of one byte load each (``_scale_tile``, which keys it on B = 16).
        Stacked experts keep theirs transposed whatever the format."""
        return self.block == 16

    @property
    def tile_k(self) -> int:
        return self.planes * self.group * self.block

    @property
    def words_per_tile(self) -> int:
        return self.group * self.block // 2

    @property
    def elements_per_word(self) -> int:
        return 2 * self.planes


#: One layout per weight format, by the format's name. tile_k = 256 (4-bit) / 128 (8-bit): 128 bytes
#: of a weight row per K tile, one 128-byte line.
LAYOUTS = {layout.format.name: layout for layout in (
    Layout(MXFP4, planes=4, group=2),
    Layout(NVFP4, planes=4, group=4),
    Layout(MXFP8_E4M3, planes=2, group=2),
    Layout(MXFP8_E5M2, planes=2, group=2),
)}

#: NVFP4's layout for a weight whose scale bytes are all normal (``Layout.normal_scales``; ``prepack``
#: decides, ``tilemm.packed.layout_of`` hands it out).
NVFP4_NORMAL = dataclasses.replace(LAYOUTS["nvfp4"], normal_scales=True)


#: e2m1 fields within each 16-bit lane, per plane p: (lowest of the 3 magnitude bits, sign bit). Planes
#: 0 and 1 keep the sign 9 bits above the magnitude's lowest bit, as bf16 does (bits 6..8 and 15), so one
#: shift and one mask decode both lanes; plane 2's magnitude already sits at bits 6..8. No placement of
#: four such fields tiles 16 bits, so planes 2 and 3 move the sign by a shift of its own.
E2M1_FIELDS = ((0, 9), (3, 12), (6, 10), (13, 11))


# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------

def _decode_plane(w, P, ELEMENT):
    """Plane P of a (TN, WORDS) uint32 word tile as uint32 words of two bf16 bit patterns each.

    e2m1: the magnitude field (e1 e0 m) of ``E2M1_FIELDS`` moves to bf16 bits 6..8 and the sign to bit
    15, giving e2m1 * 2^-126. e4m3 / e5m2: plane 0 is each lane's low byte, plane 1 its high byte; the
    7 magnitude bits move to bf16 bits 4..10 (e4m3 * 2^-120) or 5..11 (e5m2 * 2^-112), the sign to bit
    15. Subnormal codes land on bf16 subnormals of the same value. The same shift serves both lanes;
    bits shifted across the lane boundary fall outside the masks. The e2m1 fields are placed so that
    planes 0 and 1 need one shift for magnitude and sign together and plane 2's magnitude none; the
    8-bit lanes are already minimal."""
    if ELEMENT == E2M1:  # the fields of E2M1_FIELDS, both lanes at once
        if P == 0:
            return e2m1_bits(w, 0, 9, 0, 2)
        if P == 1:
            return e2m1_bits(w, 3, 12, 0, 2)
        if P == 2:
            return e2m1_bits(w, 6, 10, 0, 2)
        return e2m1_bits(w, 13, 11, 0, 2)
    if ELEMENT == E4M3:
        if P == 0:
            return ((w << 4) & 0x07F007F0) | ((w << 8) & 0x80008000)
        return ((w >> 4) & 0x07F007F0) | (w & 0x80008000)
    # e5m2
    if P == 0:
        return ((w << 5) & 0x0FE00FE0) | ((w << 8) & 0x80008000)
    return ((w >> 3) & 0x0FE00FE0) | (w & 0x80008000)


def _as_bf16_pairs(bits, ROWS, WORDS):
    """(ROWS, WORDS) uint32 -> (ROWS, 2 * WORDS) bf16: low half of word j is element 2j, high 2j + 1."""
    raw = ct.pack_to_bytes(bits.reshape((ROWS * WORDS,)))
    return ct.unpack_from_bytes(raw, ct.bfloat16).reshape((ROWS, 2 * WORDS))


def _scale_tile(S, kt, bn, ROWS, TN, BLOCK):
    """The (TN, ROWS) scale bytes of weight-row tile ``bn``, scale columns ``kt * ROWS`` on (ROWS per K
    tile, or per group of K tiles). A single NVFP4 weight (BLOCK 16, ``Layout.scale_rows``) keeps its
    scales row-major, (N, K / 16): a weight row's scales of a K tile are 16 contiguous bytes, one
    vector load. The MX formats keep them transposed, (K / B, N): a K tile holds 8 of a row's bytes,
    fewer than a tile row of the tensor memory accelerator takes (16), and their tile comes
    transposed, one byte load per scale."""
    if BLOCK == 16:
        return ct.load(S, (bn, kt), (TN, ROWS), padding_mode=_ZERO)
    return ct.load(S, (kt, bn), (ROWS, TN), padding_mode=_ZERO).transpose()


def _multipliers(s_raw, Mult, SCALE_MODE):
    """Scale bytes (TN, SC) -> bf16 ``scale * 2^(OFFSET - E)`` (Mult holds 2^(OFFSET - E)), exactly.
    SCALE_MODE is ``Layout.scale_mode``.

    1, e8m0: ``e8m0_bits_bf16`` with base = (OFFSET - E) * 128, read off Mult's fp32 exponent field: one
    integer multiply-add and a min per byte. ``prepack`` keeps 1 <= OFFSET - E and every finite field
    s + OFFSET - E <= 254 (s = 0 included, the zero padding past K too), which that form needs.
    0, e4m3 (NVFP4): the byte as bf16 (exact, subnormals and NaN included) times 2^(OFFSET - E) in
    bf16, exact below 2^128, which ``prepack``'s E guarantees.
    2, e4m3 bytes that ``prepack`` found all normal and positive (or 0 over a block of zeros): the
    byte's exponent and mantissa fields, shifted into bf16's (s * 16), plus the exponent bias
    (120 + OFFSET - E) * 128: one integer multiply-add per byte. The field stays in 1..254 for
    exponents 1..15 because the largest multiplier is below 2^128; a byte 0 (the zero padding past K
    too) gives a finite multiplier that meets only zero elements."""
    mult = ct.load(Mult, (0,), (1,)).reshape((1, 1))
    if SCALE_MODE == 1:
        base = ((ct.bitcast(mult, ct.int32) >> 16) & 0x7F80) - 0x3F80
        return ct.bitcast(e8m0_bits_bf16(s_raw, ct.uint16, base, 1), ct.bfloat16)
    if SCALE_MODE == 2:
        base = ((ct.bitcast(mult, ct.int32) >> 16) & 0x7F80) - (7 << 7)
        return ct.bitcast((s_raw.astype(ct.int32) * 16 + base).astype(ct.uint16), ct.bfloat16)
    return ct.bitcast(s_raw, ct.float8_e4m3fn).astype(ct.bfloat16) * mult.astype(ct.bfloat16)


def _mma_x(plane, x, acc, X_PARTS):
    """acc + plane @ x.T, with x (fp32 / fp16 / bf16) split into X_PARTS bf16 tiles whose sum is
    exactly x (8 significant bits each), one MMA per part."""
    if X_PARTS == 1:
        return ct.mma(plane, x.transpose(), acc)
    xf = x.astype(ct.float32)
    hi = xf.astype(ct.bfloat16)
    rest = xf - hi.astype(ct.float32)
    mid = rest.astype(ct.bfloat16)
    acc = ct.mma(plane, hi.transpose(), acc)
    acc = ct.mma(plane, mid.transpose(), acc)
    if X_PARTS == 3:
        lo = (rest - mid.astype(ct.float32)).astype(ct.bfloat16)
        acc = ct.mma(plane, lo.transpose(), acc)
    return acc


def _scaled_plane(w, mult, P, ELEMENT, BLOCK, GROUP, TN):
    """Plane P of the word tile w, decoded and times its per-row, per-block multipliers: (TN, G * B)
    bf16, the dequantized weight times 2^-E, exactly (at most 6 significant bits; scale bytes near 0
    share the lower range limit of the block-scaled kernels)."""
    plane = _as_bf16_pairs(_decode_plane(w, P, ELEMENT), TN, GROUP * BLOCK // 2).reshape((TN, GROUP, BLOCK))
    m_p = ct.extract(mult, (0, P, 0, 0), (TN, 1, GROUP, 1)).reshape((TN, GROUP, 1))
    return (plane * m_p).reshape((TN, GROUP * BLOCK))


def _k_tile(w, s_raw, Mult, x, acc, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TN, TM, X_PARTS, CAT):
    """acc + decode(w) @ x.T for one K tile: w (TN, WORDS) uint32 words, s_raw (TN, PLANES * GROUP)
    scale bytes, x (TM, TK).

    CAT = 1 concatenates the decoded planes into one (TN, TK) operand and runs one ``ct.mma`` (one
    wait for the tensor cores per K tile, but all planes' registers live at once); CAT = 0 runs one
    ``ct.mma`` per plane, reusing the registers, and waits after each.

    The block scale is applied per element, not to per-block partial sums: for e8m0 that would be
    exact only if the unscaled products could not underflow (the decoded e2m1 * 2^-126 makes them),
    and an NVFP4 e4m3 factor would round each partial once more, which summation order does not allow."""
    TP = GROUP * BLOCK
    mult = _multipliers(s_raw, Mult, SCALE_MODE).reshape((TN, PLANES, GROUP, 1))
    if CAT == 1:
        a = ct.cat((_scaled_plane(w, mult, 0, ELEMENT, BLOCK, GROUP, TN),
                    _scaled_plane(w, mult, 1, ELEMENT, BLOCK, GROUP, TN)), 1)
        if PLANES == 4:
            a = ct.cat((a, ct.cat((_scaled_plane(w, mult, 2, ELEMENT, BLOCK, GROUP, TN),
                                   _scaled_plane(w, mult, 3, ELEMENT, BLOCK, GROUP, TN)), 1)), 1)
        acc = _mma_x(a, x, acc, X_PARTS)
    else:
        for p in ct.static_iter(range(PLANES)):
            plane = _scaled_plane(w, mult, p, ELEMENT, BLOCK, GROUP, TN)
            acc = _mma_x(plane, ct.extract(x, (0, p), (TM, TP)), acc, X_PARTS)
    return acc


def _epilogue(acc, C, Alpha, Bias, bm, bn, TM, TN):
    """C (M, N) tile (bm, bn) = acc * alpha + bias, rounded once to C's dtype."""
    alpha = ct.load(Alpha, (0,), (1,)).reshape((1, 1))
    bias = ct.load(Bias, (bn,), (TN,), padding_mode=_ZERO).reshape((1, TN))
    ct.store(C, (bm, bn), (acc * alpha + bias).astype(C.dtype))


def _split_k_finish(out, C, Alpha, Bias, Partial, Counter, split, bm, bn, num_m, SPLIT_K, TM, TN):
    """Store this block's fp32 partial tile ``out`` (TM, TN); the block that completes its output tile
    adds the SPLIT_K partials in split order and runs the epilogue (see ``_weight_only_kernel``)."""
    ct.store(Partial, (split, bm, bn), out.reshape((1, TM, TN)))
    tile = bn * num_m + bm
    arrived = ct.atomic_add(Counter, tile, 1)
    if arrived == SPLIT_K - 1:
        total = ct.zeros((TM, TN), ct.float32)
        for s in range(SPLIT_K):
            total = total + ct.load(Partial, (s, bm, bn), (1, TM, TN), padding_mode=_ZERO).reshape((TM, TN))
        _epilogue(total, C, Alpha, Bias, bm, bn, TM, TN)
        ct.atomic_xchg(Counter, tile, 0)


def _stacked_step(X, W, S, Mult, acc, bm, bn, kt, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TM, TN, X_PARTS,
                  CAT, STACK):
    """acc + the product of K tile (or stack of STACK K tiles) kt, loaded one tile at a time (see the
    stacked-K-tiles comment in ``_weight_only_kernel``)."""
    WORDS = GROUP * BLOCK // 2
    TK = PLANES * GROUP * BLOCK
    SC = PLANES * GROUP
    w = ct.bitcast(ct.load(W, (bn, kt), (TN, STACK * WORDS), padding_mode=_ZERO), ct.uint32)
    s_raw = _scale_tile(S, kt, bn, STACK * SC, TN, BLOCK)
    x = ct.load(X, (bm, kt), (TM, STACK * TK), padding_mode=_ZERO)
    return _k_tile(w.reshape((TN * STACK, WORDS)), s_raw.reshape((TN * STACK, SC)), Mult,
                   x.reshape((TM * STACK, TK)), acc, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP,
                   TN * STACK, TM * STACK, X_PARTS, CAT)


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=8))
def _weight_only_kernel(X, W, S, C, Alpha, Mult, Bias, Partial, Counter,
                        ELEMENT: ConstInt, SCALE_MODE: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                        GROUP: ConstInt, TM: ConstInt, TN: ConstInt, SPLIT_K: ConstInt,
                        X_PARTS: ConstInt, UNROLL: ConstInt, CAT: ConstInt, STACK: ConstInt):
    """acc (TN, TM) = sum over this block's K tiles and planes of decode(W plane) @ x_plane.T: the
    decoded weight is the MMA's left operand (Hopper's wgmma reads it from registers), x the right one;
    TM = 16 covers M <= 16 with one MMA column block.

    X (M, K) activations; W (N, k_tiles * WORDS) int32, WORDS = GROUP * BLOCK / 2 words per row and
    K tile; S the raw scale bytes, (K / BLOCK, N) or NVFP4's (N, K / 16) (``_scale_tile``); C
    (M, N) output; Partial (SPLIT_K, M, N) fp32 and Counter (one int32 per output tile, zero
    between launches), used when SPLIT_K > 1. Grid: SPLIT_K * cdiv(N, TN) * cdiv(M, TM) blocks, M tiles
    fastest.

    Loads. cuTile gives each load in the loop one shared-memory buffer, so a block has as many weight
    bytes in flight as its loads ask for. UNROLL = 2 loads two K tiles of W, S and x at once (one
    buffer twice the size; each split's K range is rounded to a multiple of UNROLL, the remainder
    runs one tile at a time). (Carrying the next K tile's loaded W across loop iterations, as a
    software prefetch, compiled for sm_90 with tileiras 13.4 but gave wrong results on the H100, so the
    kernel does not.)

    Stacked K tiles (STACK > 1, with UNROLL = 1; the loop's comment gives the index mapping): a
    wgmma's left operand has 64 rows per warpgroup, so a block of TN = 64 / STACK (or 128 / STACK,
    two warpgroups) weight rows loads STACK consecutive K tiles and uses them as those rows; N / TN
    blocks then fill the GPU without a K split where N / 64 would not. The entries of the product that
    pair different K tiles are computed and dropped: extra tensor-core work, no extra loads or decode.

    Split-K in one launch: every block stores its fp32 partial tile, then increments its output
    tile's counter (acquire-release, device scope: its stores are visible to whoever reads the
    increment). The block that brings the counter to SPLIT_K adds the SPLIT_K partials in split order
    -- the same order whichever block finishes last, so results are deterministic -- runs the epilogue
    and sets the counter back to zero for the next launch (or CUDA-graph replay).
    """
    M = X.shape[0]
    N = C.shape[1]
    WORDS = GROUP * BLOCK // 2
    TK = PLANES * GROUP * BLOCK  # elements per K tile
    SC = PLANES * GROUP          # scale rows per K tile
    num_m = ct.cdiv(M, TM)
    num_n = ct.cdiv(N, TN)
    pid = ct.bid(0)
    bm = pid % num_m
    bn = (pid // num_m) % num_n
    split = pid // (num_m * num_n)
    k_tiles = ct.cdiv(ct.cdiv(X.shape[1], TK), STACK)  # K tiles, or stacks of STACK K tiles
    per_split = ct.cdiv(ct.cdiv(k_tiles, SPLIT_K), UNROLL) * UNROLL
    k_begin = split * per_split
    k_end = max(min(k_begin + per_split, k_tiles), k_begin)

    if UNROLL == 1:
        # Stacked K tiles: STACK consecutive K tiles of TN weight rows are loaded at once and taken as
        # TN * STACK rows of one MMA operand (weight row r's K tile s becomes row r * STACK + s, a
        # row-major reshape of the loaded tile, as are the scales' and x's), against x's STACK K tiles
        # as TM * STACK columns (row m's K tile s is column m * STACK + s). Entry (r * STACK + s,
        # m * STACK + s) of the product is row r's partial sum over K tile s; the other entries pair
        # different K tiles and are dropped. STACK = 1 is the plain kernel.
        # From tile_m 64 on (unstacked), the first K tile outside the loop: a loop that starts from
        # zeros makes tileiras 13.4 select between the accumulator and a copy of it on every iteration
        # (FSEL + IMAD.MOV per accumulator register; the SASS counts are in
        # ``benchmarks/results/tune-weight-only-designs-nvidia-h100-80gb-hbm3.md``). The peeled loads
        # take shared memory of their own, which the smaller blocks (3-4 per SM) cannot spare.
        acc = ct.zeros((TN * STACK, TM * STACK), ct.float32)
        first = k_begin
        if STACK == 1 and TM >= 64:
            if k_begin < k_end:
                acc = _stacked_step(X, W, S, Mult, acc, bm, bn, k_begin, ELEMENT, SCALE_MODE, BLOCK, PLANES,
                                    GROUP, TM, TN, X_PARTS, CAT, STACK)
            first = k_begin + 1
        for kt in range(first, k_end):
            acc = _stacked_step(X, W, S, Mult, acc, bm, bn, kt, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TM,
                                TN, X_PARTS, CAT, STACK)
        if STACK > 1:
            acc4 = acc.reshape((TN, STACK, TM, STACK))
            acc = ct.extract(acc4, (0, 0, 0, 0), (TN, 1, TM, 1)).reshape((TN, TM))
            for s in ct.static_iter(range(1, STACK)):
                acc = acc + ct.extract(acc4, (0, s, 0, s), (TN, 1, TM, 1)).reshape((TN, TM))
    else:
        acc = ct.zeros((TN, TM), ct.float32)
        groups = (k_end - k_begin) // UNROLL
        for g in range(k_begin // UNROLL, k_begin // UNROLL + groups):
            ws = ct.bitcast(ct.load(W, (bn, g), (TN, UNROLL * WORDS), padding_mode=_ZERO), ct.uint32)
            ss = _scale_tile(S, g, bn, UNROLL * SC, TN, BLOCK)
            xs = ct.load(X, (bm, g), (TM, UNROLL * TK), padding_mode=_ZERO)
            for u in ct.static_iter(range(UNROLL)):
                acc = _k_tile(ct.extract(ws, (0, u), (TN, WORDS)), ct.extract(ss, (0, u), (TN, SC)),
                              Mult, ct.extract(xs, (0, u), (TM, TK)), acc, ELEMENT, SCALE_MODE, BLOCK, PLANES,
                              GROUP, TN, TM, X_PARTS, CAT)
        for kt in range(k_begin + groups * UNROLL, k_end):  # the K tiles left over, one at a time
            w = ct.bitcast(ct.load(W, (bn, kt), (TN, WORDS), padding_mode=_ZERO), ct.uint32)
            s_raw = _scale_tile(S, kt, bn, SC, TN, BLOCK)
            x = ct.load(X, (bm, kt), (TM, TK), padding_mode=_ZERO)
            acc = _k_tile(w, s_raw, Mult, x, acc, ELEMENT, SCALE_MODE, BLOCK, PLANES, GROUP, TN,
                          TM, X_PARTS, CAT)
    out = acc.transpose()
    if SPLIT_K == 1:
        _epilogue(out, C, Alpha, Bias, bm, bn, TM, TN)
    else:
        _split_k_finish(out, C, Alpha, Bias, Partial, Counter, split, bm, bn, num_m, SPLIT_K, TM, TN)


def _f32_halves(t, ROWS, COLS, BF16):
    """A (ROWS, COLS) bf16 (BF16 true) / fp16 / fp32 tile as two (ROWS, COLS / 2) fp32 tiles: its even
    and its odd columns, exactly. bf16 takes no conversion instruction: the low half of each 32-bit pair word
    shifted up, and the high half masked, are already the fp32 bit patterns."""
    if BF16:
        pairs = ct.unpack_from_bytes(ct.pack_to_bytes(t.reshape((ROWS * COLS,))), ct.uint32)
        pairs = pairs.reshape((ROWS, COLS // 2))
        return ct.bitcast(pairs << 16, ct.float32), ct.bitcast(pairs & 0xFFFF0000, ct.float32)
    f = t.astype(ct.float32).reshape((ROWS, COLS // 2, 2))
    return (ct.extract(f, (0, 0, 0), (ROWS, COLS // 2, 1)).reshape((ROWS, COLS // 2)),
            ct.extract(f, (0, 0, 1), (ROWS, COLS // 2, 1)).reshape((ROWS, COLS // 2)))


@ct.kernel(num_worker_warps=ct.ByTarget(sm_90=4))
def _gemv_kernel(X, W, S, C, Alpha, Mult, Bias, Partial, Counter,
                 ELEMENT: ConstInt, SCALE_MODE: ConstInt, BLOCK: ConstInt, PLANES: ConstInt,
                 GROUP: ConstInt, TM: ConstInt, TN: ConstInt, SPLIT_K: ConstInt, UNROLL: ConstInt):
    """The weight-only product for the few rows of a decode step, on the FMA pipes, without ``ct.mma``:
    acc (TM, TN, TP / 2) += decode(W plane) * x_plane, element by element in fp32, reduced over K once
    at the end.

    Same arguments and grid as ``_weight_only_kernel`` (TM rows of x per block, usually all of M).
    Each decoded, scaled plane is exact in bf16 (see the module docstring); its even and odd columns
    become fp32 by bit operations (``_f32_halves``) and meet x's even and odd columns in two fp32
    accumulators, so every product is rounded once into an fp32 sum, as in an fp32 GEMM (exact for
    bf16 and fp16 x). Why not the MMA: a wgmma needs 64 weight rows per block and keeps one
    shared-memory stage for every load of its loop; this kernel's blocks take 16 rows (the output
    alone gives the GPU enough blocks, with no K split, from N = 2048 on) and tileiras pipelines its
    loads, which is what a decode step, bound by streaming the weight, needs. From a few rows of x on,
    the per-element FMAs cost more than the MMA (``plan``). The UNROLL K tiles of a load form one
    group; the groups are split over SPLIT_K blocks, with the same deterministic last-block reduction.
    """
    M = X.shape[0]
    N = C.shape[1]
    WORDS = GROUP * BLOCK // 2
    TP = GROUP * BLOCK           # elements per plane
    TK = PLANES * TP             # elements per K tile
    SC = PLANES * GROUP          # scale rows per K tile
    num_m = ct.cdiv(M, TM)
    num_n = ct.cdiv(N, TN)
    pid = ct.bid(0)
    bm = pid % num_m
    bn = (pid // num_m) % num_n
    split = pid // (num_m * num_n)
    groups = ct.cdiv(ct.cdiv(X.shape[1], TK), UNROLL)
    per_split = ct.cdiv(groups, SPLIT_K)
    g_begin = split * per_split
    g_end = max(min(g_begin + per_split, groups), g_begin)

    acc = ct.zeros((TM, TN, TP // 2), ct.float32)
    for g in range(g_begin, g_end):
        ws = ct.bitcast(ct.load(W, (bn, g), (TN, UNROLL * WORDS), padding_mode=_ZERO), ct.uint32)
        ss = _scale_tile(S, g, bn, UNROLL * SC, TN, BLOCK)
        xs = ct.load(X, (bm, g), (TM, UNROLL * TK), padding_mode=_ZERO)
        for u in ct.static_iter(range(UNROLL)):
            w = ct.extract(ws, (0, u), (TN, WORDS))
            mult = _multipliers(ct.extract(ss, (0, u), (TN, SC)), Mult, SCALE_MODE)
            mult = mult.reshape((TN, PLANES, GROUP, 1))
            for p in ct.static_iter(range(PLANES)):
                w_lo, w_hi = _f32_halves(_scaled_plane(w, mult, p, ELEMENT, BLOCK, GROUP, TN), TN, TP, True)
                x_lo, x_hi = _f32_halves(ct.extract(xs, (0, u * PLANES + p), (TM, TP)), TM, TP,
                                         X.dtype == ct.bfloat16)
                acc = acc + w_lo.reshape((1, TN, TP // 2)) * x_lo.reshape((TM, 1, TP // 2))
                acc = acc + w_hi.reshape((1, TN, TP // 2)) * x_hi.reshape((TM, 1, TP // 2))
    out = ct.sum(acc, axis=2)
    if SPLIT_K == 1:
        _epilogue(out, C, Alpha, Bias, bm, bn, TM, TN)
    else:
        _split_k_finish(out, C, Alpha, Bias, Partial, Counter, split, bm, bn, num_m, SPLIT_K, TM, TN)


@ct.kernel
def _dequantize_kernel(W, S, Out, Mult, ELEMENT: ConstInt, SCALE_MODE: ConstInt, BLOCK: ConstInt,
                       PLANES: ConstInt, GROUP: ConstInt, TN: ConstInt):
    """Out (N, Kp) bf16 = the prepacked weight decoded, times 2^-E (the MMA operand of the kernel
    above, in K order); Kp = k_tiles * TK, columns past K are zero. Grid: cdiv(N, TN) * k_tiles, K
    tiles fastest."""
    WORDS = GROUP * BLOCK // 2
    TP = GROUP * BLOCK
    SC = PLANES * GROUP
    k_tiles = ct.cdiv(W.shape[1], WORDS)
    pid = ct.bid(0)
    kt = pid % k_tiles
    bn = pid // k_tiles
    w = ct.bitcast(ct.load(W, (bn, kt), (TN, WORDS), padding_mode=_ZERO), ct.uint32)
    s_raw = _scale_tile(S, kt, bn, SC, TN, BLOCK)
    mult = _multipliers(s_raw, Mult, SCALE_MODE).reshape((TN, PLANES, GROUP, 1))
    for p in ct.static_iter(range(PLANES)):
        plane = _as_bf16_pairs(_decode_plane(w, p, ELEMENT), TN, WORDS).reshape((TN, GROUP, BLOCK))
        m_p = ct.extract(mult, (0, p, 0, 0), (TN, 1, GROUP, 1)).reshape((TN, GROUP, 1))
        ct.store(Out, (bn, kt * PLANES + p), (plane * m_p).reshape((TN, TP)))


#: Rows per block of the dequantize kernel.
DEQUANT_TN = 64


def dequantize(words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor, layout: Layout,
               k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The prepacked weight as an (N, K) bf16 view (of an (N, Kp) tensor, ``out`` where given) holding
    dequantize(w) * 2^-E, exactly."""
    n = words.shape[0]
    k_tiles = words.shape[1] // layout.words_per_tile
    if out is None:
        out = torch.empty((n, k_tiles * layout.tile_k), dtype=torch.bfloat16, device=words.device)
    stream = torch.cuda.current_stream(words.device) if words.is_cuda else None  # None: the CPU emulator's
    ct.launch(stream, (ceil_div(n, DEQUANT_TN) * k_tiles, 1, 1),
              _dequantize_kernel, (words, scale_t, out, constants[1:2], layout.element,
                                   layout.scale_mode, layout.block, layout.planes, layout.group,
                                   DEQUANT_TN))
    return out[:, :k]


# --------------------------------------------------------------------------------------------------
# Configs and launch
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WeightOnlyConfig:
    """tile_m (rows of x per block: 8 .. 128), tile_n (weight rows per block), the K split, the compiler
    hints, and the kernel's load and MMA scheme: ``unroll`` K tiles per load, ``cat`` (one MMA per K
    tile) and ``stack`` (K tiles stacked into the MMA's rows: tile_n * stack rows against tile_m *
    stack columns). ``gemv`` selects ``_gemv_kernel`` (no MMA; tile_m = M)."""

    tile_m: int
    tile_n: int = 128
    split_k: int = 1
    num_worker_warps: int = 8
    occupancy: int | None = None
    unroll: int = 1
    cat: int = 0
    gemv: int = 0
    stack: int = 1

    def __post_init__(self):
        if self.stack > 1 and (self.unroll > 1 or self.gemv):
            raise ValueError(f"WeightOnlyConfig: stack={self.stack} needs unroll=1 and the MMA kernel")

    def hints(self) -> dict:
        return sm90_hints(self.num_worker_warps, self.occupancy)

    @property
    def kernel(self):
        return hinted(_gemv_kernel if self.gemv else _weight_only_kernel, **self.hints())

    @property
    def name(self) -> str:
        s = f"wo_{'gemv' if self.gemv else ''}{self.tile_m}x{self.tile_n}_s{self.split_k}_w{self.num_worker_warps}"
        s += f"_occ{self.occupancy}" if self.occupancy else ""
        s += f"_r{self.stack}" if self.stack > 1 else ""
        return s + (f"_u{self.unroll}" if self.unroll > 1 else "") + ("_cat" if self.cat else "")


_TILE_M = (16, 32, 64, 128)
_SPLITS = (1, 2, 4, 8, 16)
#: bf16 parts the kernel splits an activation into (exactly) per activation dtype.
_X_PARTS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
#: Per tile_m: (tile_n, num_worker_warps, occupancy). One warpgroup on 64 weight rows with four blocks
#: per SM where the registers allow it (64 per thread at tile_m 16 / 32, no spills on sm_90; 128 at
#: tile_m 64 with two blocks); tile_m 128 takes two warpgroups on 128 rows. The decode of one block
#: stalls on load and MMA latency, which other resident blocks hide
#: (``benchmarks/investigations/tune_weight_only.py`` measures the alternatives).
_SHAPE = {16: (64, 4, 4), 32: (64, 4, 4), 64: (64, 4, 2), 128: (128, 8, None)}


#: tile_m up to which the small-M load schemes apply (one MMA per K tile when the output tiles fill
#: the GPU; two K tiles per load). At tile_m 32 their registers and shared memory no longer fit the
#: occupancy the plan asks for (sm_90 compiles).
_SMALL_M = 16


def _unsplit(tile_m: int, layout: Layout) -> WeightOnlyConfig:
    """The config when the output tiles alone fill the GPU. Small M: the decoded planes concatenated
    into one MMA per K tile (registers for all of them: occupancy 3; 8-bit weights, whose two planes
    hold twice the bytes each, take occupancy 2), 4-bit weights two K tiles per load."""
    tile_n, warps, occupancy = _SHAPE[tile_m]
    if tile_m > _SMALL_M:
        return WeightOnlyConfig(tile_m, tile_n, 1, warps, occupancy)
    four_bit = layout.planes == 4
    return WeightOnlyConfig(tile_m, tile_n, 1, warps, 3 if four_bit else 2, unroll=2 if four_bit else 1,
                            cat=1)


#: Up to this many rows of x, ``plan`` picks the FMA kernel (``_gemv_kernel``); each thread then
#: multiplies every weight element it decodes by GEMV_M rows of x.
GEMV_M = 1
#: Its block shape: 16 weight rows, one warpgroup, four blocks per SM (64 registers per thread).
_GEMV_SHAPE = (16, 4, 4)
#: K tiles per load of the FMA kernel: 8 (2048 4-bit elements of a row, 16 KB of weight per block)
#: where K has that many, else 2 (a load past K is zero-filled, and its decode wasted).
_GEMV_UNROLL = (8, 2)
#: 4-bit weights where the 16-row blocks without a K split are more than one wave at four per SM:
#: eight blocks per SM, at most 4 K tiles per load (the registers of eight blocks), so half as many
#: waves: 28672 x 4096 and 14336 x 4096 ran faster this way, 4096 x 4096, 6144 x 4096 and
#: 4096 x 14336 (one wave either way) slower (``benchmarks/results/tune-weight-only-gemv-*``; 8-bit
#: weights not timed so).
_GEMV_WIDE = (8, (4, 2))


#: Up to this K the few-row kernels do not split K where their blocks are few: the FMA kernel at one row
#: (``_gemv``) and the stacked blocks at 2 .. 16 rows, and up to ``_FEW_M`` (``_stacked``,
#: ``short_k_stacked``). A split's finish
#: (partial tiles, an arrival counter, the last block's sum; or a second launch) sits on the critical
#: path of every output tile, and over a K of a few thousand it cost more than the extra blocks saved;
#: over K = 14336 the split still paid (``benchmarks/results/tune-weight-only-gemv-split-*.txt``,
#: ``benchmarks/results/gemv-few-rows-stacked-*.txt``).
_SHORT_K = 8192


def _gemv(m: int, n: int, k: int, layout: Layout, sms: int) -> WeightOnlyConfig:
    """The FMA kernel's config: 16-row blocks, a K split only for K above ``_SHORT_K`` and
    while the output tiles alone give fewer blocks than SMs (each split at least one load); for 4-bit
    weights, eight blocks per SM (``_GEMV_WIDE``) where the tiles alone are more than one wave of four
    per SM."""
    tile_n, warps, occupancy = _GEMV_SHAPE
    k_tiles = ceil_div(k, layout.tile_k)
    tiles = ceil_div(n, tile_n)
    if layout.planes == 4 and tiles > occupancy * sms:
        occupancy, unrolls = _GEMV_WIDE
        unroll = next(u for u in unrolls if u <= k_tiles or u == unrolls[-1])
        return WeightOnlyConfig(m, tile_n, 1, warps, occupancy, unroll=unroll, gemv=1)
    unroll = next(u for u in _GEMV_UNROLL if u <= k_tiles or u == _GEMV_UNROLL[-1])
    groups = ceil_div(k_tiles, unroll)
    split = 1
    while (k > _SHORT_K and tiles * split < sms and split * 2 <= _SPLITS[-1]
           and groups >= split * 2):
        split *= 2
    return WeightOnlyConfig(m, tile_n, split, warps, occupancy, unroll=unroll, gemv=1)


#: Stacked configs of the MMA kernel (one MMA per K tile, no K split), per tile_m: (tile_n, stack,
#: worker warps, blocks per SM) of the "wide" blocks (32 weight rows in 64 MMA rows), of the "narrow"
#: ones, for N below 32 rows per SM (tile_m 8: 16 rows in 64 MMA rows; tile_m 16: 32 rows in 128 MMA
#: rows, two warpgroups), and of the "few" ones, for N of at most one such block per SM over a short K
#: (tile_m 8: 8 rows, 8 K tiles stacked; tile_m 16: 16 rows, 4 K tiles; 64 MMA rows, one warpgroup,
#: three blocks per SM: twice the narrow blocks' number, where those leave most SMs idle). tile_m 8
#: covers up to 8 rows of x (the smallest MMA width), 16 up to 16.
_STACKED = {8: ((32, 2, 4, 3), (16, 4, 4, 3), (8, 8, 4, 3)), 16: ((32, 2, 4, 2), (32, 4, 8, 1), (16, 4, 4, 3))}


#: Up to this many rows of x, over M tiles of 16, where K is short (a weight row of at most 4 KiB: K up
#: to ``_SHORT_K`` for 4-bit weights, half that for 8-bit ones, whose 1024 x 8192 k / v projection ran
#: faster on the large-M plan's decode design), the "few" blocks of tile_m 16 where
#: they (all M tiles' together) are at most one per SM, else the narrow ones where those are (the
#: k / v projections of grouped-query attention at 17-32 rows, 1024 and 2048 x 4096: one launch, where
#: the fused kernel's 64-row blocks split K in two launches (4-bit) or the small-M plan's 64-row blocks
#: split it 16 ways (8-bit); from 33 rows on the large-M plan's decode design wins there;
#: ``benchmarks/results/gemv-few-rows-more-blocks-*.txt``, MXFP8: ``tune-weight-only-m17-mxfp8-*.txt``).
_FEW_M = 32


def _stacked(m: int, n: int, k: int, layout: Layout, sms: int) -> WeightOnlyConfig | None:
    """The stacked config for 2 .. 16 rows of x where it beats the 64-row blocks (and up to ``_FEW_M``
    rows, over M tiles of 16, where the few or narrow blocks fit one per SM), or None.

    Blocks of 32 (or 16) weight rows give the GPU enough blocks without a K split where 64-row blocks
    split K. Wide blocks are used while they fit one wave of resident blocks, or (tile_m 8) fill at
    least two; in between (N = 14336 at 132 SMs), the 64-row blocks without a split lose less to the
    last partial wave. Below 32 rows per SM the narrow blocks take over while they still give about
    one block per SM, and where K is short (``_SHORT_K``) whatever their number (``short_k_stacked``):
    there the "few" blocks (8 weight rows up to 8 rows of x, 16 above) while they are at most one per SM
    (the k / v projections of grouped-query attention, 1024 x 4096), the narrow ones above that. At
    9-16 rows NVFP4 does not take tile_m 16's narrow blocks, which ran slower than the K split
    (``benchmarks/results/tune-weight-only-designs-*.md``), but does take the few ones, and above 16
    rows both (``benchmarks/results/gemv-few-rows-*.txt``)."""
    # Rows of at most 4 KiB there: a 4-bit row of _SHORT_K elements, an 8-bit one of half as many.
    if _SMALL_M < m <= _FEW_M and k * 4 // layout.elements_per_word <= _SHORT_K // 2:
        for tile_n, stack, warps, occupancy in (_STACKED[16][2], _STACKED[16][1]):  # few, then narrow
            if ceil_div(n, tile_n) * ceil_div(m, 16) <= sms:
                return WeightOnlyConfig(16, tile_n, 1, warps, occupancy, cat=1, stack=stack)
    if not 1 < m <= _SMALL_M:
        return None
    tile_m = 8 if m <= 8 else 16
    wide, narrow = _STACKED[tile_m][:2]
    tiles = ceil_div(n, 32)
    short_k = k <= _SHORT_K
    few = _STACKED[tile_m][2]
    if tiles < sms:
        if short_k and ceil_div(n, few[0]) <= sms:
            tile_n, stack, warps, occupancy = few
        else:
            tile_n, stack, warps, occupancy = narrow
            if tile_m == 16 and not layout.scale_e8m0:
                return None
            if 10 * ceil_div(n, tile_n) < 9 * sms and not short_k:
                return None
    elif tiles <= wide[3] * sms or (tile_m == 8 and tiles >= 2 * wide[3] * sms):
        tile_n, stack, warps, occupancy = wide
    else:
        return None
    return WeightOnlyConfig(tile_m, tile_n, 1, warps, occupancy, cat=1, stack=stack)


def short_k_stacked(m: int, n: int, k: int, layout: Layout, sms: int) -> bool:
    """Whether 2 .. ``_FEW_M`` rows of x on a weight with fewer than 32 rows
    per SM and K at most ``_SHORT_K`` take stacked blocks without a K split (``_stacked``), which the
    large-M plan then leaves to this one (``hopper_weight_only_large.plan``). There, the fused
    kernel's 64-row blocks must split K to fill the GPU, and over a short K the split's second launch
    and finish cost more than the stacked blocks lose by running fewer, longer blocks; over a long K
    the split wins again (``benchmarks/results/gemv-few-rows-*.txt``)."""
    return k <= _SHORT_K and ceil_div(n, 32) < sms and _stacked(m, n, k, layout, sms) is not None


#: The kernels ``plan`` can give one row of x: "fma", the FMA kernel (``_gemv``), and "mma", the MMA
#: kernel with 8-column x tiles and stacked K tiles (``_one_row_mma``): 7 of its 8 x columns are zero
#: padding, which costs tensor-core work only, and its main loop issues fewer instructions per weight
#: element than the FMA kernel's (``benchmarks/results/decode-cost-sm90.txt``), where a decode step is
#: bound by instruction issue rather than memory (the H200). ``M1_KERNEL`` is the default;
#: ``benchmarks/investigations/tune_weight_only.py --m1`` times both.
M1_KERNELS = ("fma", "mma")
M1_KERNEL = "fma"


def _one_row_mma(n: int, k: int, layout: Layout, sms: int) -> WeightOnlyConfig:
    """The MMA kernel's config for one row of x: tile_m 8 with the stacked blocks of ``_STACKED[8]``,
    the wide ones (32 weight rows as 64 MMA rows) where they give a block per SM, else the narrow ones
    (16 rows), and a K split while the blocks are fewer than the SMs (each split at least 2 stacks)."""
    wide, narrow = _STACKED[8][:2]
    tile_n, stack, warps, occupancy = wide if ceil_div(n, wide[0]) >= sms else narrow
    stacks = ceil_div(ceil_div(k, layout.tile_k), stack)
    tiles = ceil_div(n, tile_n)
    split = 1
    while tiles * split < sms and split * 2 <= _SPLITS[-1] and stacks >= split * 2 * 2:
        split *= 2
    return WeightOnlyConfig(8, tile_n, split, warps, occupancy, cat=1, stack=stack)


def plan(m: int, n: int, k: int, layout: Layout, sms: int = 132, m1_kernel: str | None = None
         ) -> WeightOnlyConfig:
    """The weight-only kernel's config for an (M, K) x (N, K) problem: the smallest tile_m that covers
    M (up to 128) with its tile shape, and a K split: none when the output tiles alone give 1.5 blocks
    per SM, or (tile_m 64, where a split of 2 was slower than none) about one (then ``_unsplit``),
    else the largest power of two (each split at least 2 K tiles) that keeps the grid within the
    blocks the GPU holds at once, loading two K tiles at a time at small M.
    ``benchmarks/investigations/tune_weight_only.py`` measures the alternatives (results:
    ``benchmarks/results/tune-weight-only-designs-nvidia-h100-80gb-hbm3.md``). Up to ``GEMV_M`` rows: the
    FMA kernel (``_gemv``), or with ``m1_kernel`` "mma" (default ``M1_KERNEL``) and one row, the MMA
    kernel (``_one_row_mma``); from 2 to 16 rows, where they pay, stacked K tiles (``_stacked``)."""
    m1_kernel = M1_KERNEL if m1_kernel is None else m1_kernel
    if m1_kernel not in M1_KERNELS:
        raise ValueError(f"plan: m1_kernel must be one of {M1_KERNELS}, got {m1_kernel!r}")
    if m == 1 and m1_kernel == "mma":
        return _one_row_mma(n, k, layout, sms)
    if m <= GEMV_M:
        return _gemv(m, n, k, layout, sms)
    stacked = _stacked(m, n, k, layout, sms)
    if stacked is not None:
        return stacked
    tile_m = next((t for t in _TILE_M if t >= m), _TILE_M[-1])
    tile_n, warps, occupancy = _SHAPE[tile_m]
    tiles = ceil_div(m, tile_m) * ceil_div(n, tile_n)
    k_tiles = ceil_div(k, layout.tile_k)
    if 2 * tiles >= 3 * sms or (tile_m == 64 and 10 * tiles >= 9 * sms):
        return _unsplit(tile_m, layout)
    split = 1
    while (tiles * split * 2 <= (occupancy or 1) * sms and split * 2 <= _SPLITS[-1]
           and k_tiles >= split * 2 * 2):
        split *= 2
    if split == 1:  # too few K tiles to split
        return _unsplit(tile_m, layout)
    return WeightOnlyConfig(tile_m, tile_n, split, warps, occupancy, unroll=2 if tile_m <= _SMALL_M else 1)


def _constants(layout: Layout, cfg: WeightOnlyConfig, x_parts: int) -> tuple:
    common = (layout.element, layout.scale_mode, layout.block, layout.planes, layout.group,
              cfg.tile_m, cfg.tile_n, cfg.split_k)
    if cfg.gemv:
        return common + (cfg.unroll,)
    return common + (x_parts, cfg.unroll, cfg.cat, cfg.stack)


class Prepared:
    """One weight-only launch with everything but the activation and the output worked out: the
    grid, the specialised kernel and the argument tuple's fixed parts. ``run`` costs one
    ``ct.launch`` and no allocation: a K split's fp32 partial tiles and arrival counters live in the
    stream's persistent workspace (``workspace``), which the kernel leaves ready for the next launch.

    With ``keep_workspace`` (a launch made for many calls) the fixed tensors and the workspace views
    are passed to cuTile already described (``Described``), once per stream."""

    __slots__ = ("grid", "kernel", "m", "n", "split", "tiles", "fixed", "alpha", "rest", "consts", "_work")

    def __init__(self, words, scale_t, constants, bias, layout: Layout, cfg: WeightOnlyConfig, m: int,
                 x_dtype: torch.dtype, alpha: torch.Tensor | None = None, keep_workspace: bool = True,
                 n: int | None = None):
        self.m, self.n = m, words.shape[0] if n is None else n
        self.split = cfg.split_k
        self.tiles = ceil_div(m, cfg.tile_m) * ceil_div(self.n, cfg.tile_n)
        self.grid = (cfg.split_k * self.tiles, 1, 1)
        self.kernel = cfg.kernel
        wrap = Described if keep_workspace and words.is_cuda else (lambda t: t)
        self.fixed = (wrap(words), wrap(scale_t))
        self.alpha = wrap(constants[0:1] if alpha is None else alpha)
        self.rest = (wrap(constants[1:2]), wrap(bias))
        self.consts = _constants(layout, cfg, _X_PARTS[x_dtype])
        self._work = {} if keep_workspace else None

    def _workspace(self, out, stream):
        """(partial, counter): views of the stream's workspace holding the (SPLIT_K, M, N) fp32
        partial tiles and one arrival counter per output tile, or, without a split, stand-ins the
        kernel never reads."""
        if self.split == 1:
            return out, self.alpha
        return kept_workspace(self._work, out, stream, self.split, self.m, self.n, self.tiles)

    def run(self, x: torch.Tensor, out: torch.Tensor, stream, alpha: torch.Tensor | None = None) -> None:
        """out (M, N) = the product for x (M, K); ``stream`` is a torch.cuda.Stream or a raw stream
        handle (int)."""
        ct.launch(stream, self.grid, self.kernel,
                  (x, *self.fixed, out, self.alpha if alpha is None else alpha, *self.rest,
                   *self._workspace(out, stream), *self.consts))


def kept_workspace(kept: dict | None, out: torch.Tensor, stream, split: int, m: int, n: int, tiles: int):
    """``workspace``'s views for a prepared launch, kept in ``kept`` per stream (described, on CUDA),
    so that repeated calls neither look them up nor describe them again; ``kept`` None: looked up
    per call. Inside a CUDA-graph capture the workspace may be allocated in the graph's pool, so
    views are then never kept."""
    if kept is None or _capturing(out.device):
        return workspace(out.device, stream, split, m, n, tiles)
    key = _stream_key(stream)
    views = kept.get(key)
    if views is None:
        wrap = Described if out.is_cuda else (lambda t: t)
        views = kept[key] = tuple(wrap(v) for v in workspace(out.device, stream, split, m, n, tiles))
    return views


def _stream_key(stream):
    return stream if isinstance(stream, int) else getattr(stream, "cuda_stream", None)


def launch(x: torch.Tensor, words: torch.Tensor, scale_t: torch.Tensor, constants: torch.Tensor,
           bias: torch.Tensor, out: torch.Tensor, layout: Layout, cfg: WeightOnlyConfig,
           alpha: torch.Tensor | None = None) -> None:
    """out (M, N) = (x (M, K) @ W.T) * alpha + bias, W the prepacked weight (words, scale_t).

    ``constants`` is the PackedWeight's [2^E * decode scale, 2^(offset - E)]; ``alpha`` (a (1,) fp32
    tensor) replaces its first entry when given. ``bias`` is an (N,) fp32 tensor (zeros for none).
    """
    prepared = Prepared(words, scale_t, constants, bias, layout, cfg, out.shape[0], x.dtype, alpha,
                        keep_workspace=False, n=out.shape[1])
    prepared.run(x, out, torch.cuda.current_stream(out.device))


# --------------------------------------------------------------------------------------------------
# Persistent buffers: the split-K workspace and the zero bias
# --------------------------------------------------------------------------------------------------

#: Smallest buffers handed out (counters, fp32 partial elements, zero-bias length): one allocation
#: covers every shape of a model's layers at decode batch sizes.
_MIN_COUNTERS = 1 << 14
_MIN_PARTIAL = 1 << 20
_MIN_ZEROS = 1 << 15

#: (device, stream) and (device, "graphs") -> {"partial": fp32 buffer, "counters": int32 buffer (zero
#: between launches)}; device -> fp32 zeros. A buffer, once handed to a kernel, may be baked into a captured CUDA graph,
#: so a replaced (smaller) buffer is kept alive in ``_RETIRED``, never freed.
_WORKSPACES: dict = {}
_ZERO_BIAS: dict = {}
_RETIRED: list = []


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _outside_graph_pools(make):
    """``make()`` run on a helper thread and waited for.

    torch.compile's CUDA graphs (mode="reduce-overhead") route every allocation of the thread that
    warms up or records a graph to that graph's private memory pool, whose blocks the graph tree
    reuses for other tensors once the recording ends. A buffer that must outlive the call is therefore
    allocated (and zero-filled, then synchronized) from another thread, whose allocations go to the
    ordinary caching pool. Never called while the current stream is capturing."""
    box: list = []

    def body():
        try:
            t = make()
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
            box.append(t)
        except BaseException as e:  # re-raised in the caller's thread
            box.append(e)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _grow(table: dict, key, name: str, need: int, make):
    """table[key][name] with at least ``need`` elements: allocated outside the graph pools, the
    replaced buffer retired (kept alive)."""
    slot = table.setdefault(key, {})
    buf = slot.get(name)
    if buf is None or buf.numel() < need:
        if buf is not None:
            _RETIRED.append(buf)
        buf = slot[name] = _outside_graph_pools(make)
    return buf


def workspace(device: torch.device, stream, split: int, m: int, n: int, tiles: int):
    """(partial (split, M, N) fp32, counters (tiles,) int32): views of a persistent split-K workspace,
    as the kernel's ``Partial`` and ``Counter``.

    The kernel leaves every counter at zero when it ends, and only reads the partial tiles that its own
    blocks wrote in the same launch, so launches that run one after another can share one workspace,
    and a launch needs neither an allocation nor a fill kernel: under CUDA graphs and torch.compile a
    weight-only linear is exactly one kernel. Eager launches use the workspace of their stream
    (launches on one stream run in order; streams never share one). Launches captured into CUDA graphs
    use the workspace of the capture stream if it has one (torch.compile warms up and records on one
    stream), else the device's graph workspace, which every non-capturing call sizes in advance (a
    graph is usually captured on a stream of its own after a warm-up call elsewhere); so CUDA graphs
    that contain split-K weight-only launches must not be replayed concurrently with each other
    (torch.compile's graphs replay in order).

    Inside a capture that finds neither large enough (nothing may be allocated outside the graph while
    it records), the partial tiles and zeroed counters are allocated in the graph instead (one fill
    kernel more in that graph)."""
    partial_elements = split * m * n

    def fits(key):
        slot = _WORKSPACES.get(key, {})
        return ("partial" in slot and slot["partial"].numel() >= partial_elements
                and slot["counters"].numel() >= tiles)

    def views(key):
        slot = _WORKSPACES[key]
        return slot["partial"][:partial_elements].view(split, m, n), slot["counters"][:tiles]

    key = (device, _stream_key(stream))
    if _capturing(device):
        for k in (key, (device, "graphs")):
            if fits(k):
                return views(k)
        return (torch.empty((split, m, n), dtype=torch.float32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))
    for k in (key, (device, "graphs")):
        if not fits(k):
            _grow(_WORKSPACES, k, "partial", partial_elements,
                  lambda: torch.empty(max(partial_elements, _MIN_PARTIAL), dtype=torch.float32, device=device))
            _grow(_WORKSPACES, k, "counters", tiles,
                  lambda: torch.zeros(max(tiles, _MIN_COUNTERS), dtype=torch.int32, device=device))
    return views(key)


def zero_bias(device: torch.device, n: int) -> torch.Tensor:
    """A persistent (n,) fp32 zero vector on ``device``, the bias of a layer without one (shared,
    never written, allocated outside CUDA-graph pools; inside a capture with none long enough yet, a
    fresh zero vector of the graph)."""
    buf = _ZERO_BIAS.get(device)
    if buf is None or buf.numel() < n:
        if _capturing(device):
            return torch.zeros(n, dtype=torch.float32, device=device)
        if buf is not None:
            _RETIRED.append(buf)
        buf = _ZERO_BIAS[device] = _outside_graph_pools(
            lambda: torch.zeros(max(n, _MIN_ZEROS), dtype=torch.float32, device=device))
    return buf[:n]


# --------------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# --------------------------------------------------------------------------------------------------

_CT_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16, torch.float32: ct.float32}


def _configs(layout: Layout) -> list[WeightOnlyConfig]:
    """Every config ``plan`` can return for ``layout``."""
    out = []
    for tm in _TILE_M:
        tile_n, warps, occupancy = _SHAPE[tm]
        unroll = 2 if tm <= _SMALL_M else 1
        out.append(_unsplit(tm, layout))
        out += [WeightOnlyConfig(tm, tile_n, split, warps, occupancy, unroll=unroll) for split in _SPLITS[1:]]
    out += [WeightOnlyConfig(tile_m, tile_n, 1, warps, occupancy, cat=1, stack=stack)
            for tile_m, shapes in _STACKED.items() for tile_n, stack, warps, occupancy in shapes]
    # One row of x on the MMA kernel (``_one_row_mma``): the tile_m 8 stacked blocks with a K split.
    out += [WeightOnlyConfig(8, tile_n, split, warps, occupancy, cat=1, stack=stack)
            for tile_n, stack, warps, occupancy in _STACKED[8][:2] for split in _SPLITS[1:]]
    tile_n, warps, occupancy = _GEMV_SHAPE
    out += [WeightOnlyConfig(m, tile_n, split, warps, occupancy, unroll=unroll, gemv=1)
            for m in range(1, GEMV_M + 1) for unroll in _GEMV_UNROLL for split in _SPLITS]
    if layout.planes == 4:
        occupancy, unrolls = _GEMV_WIDE
        out += [WeightOnlyConfig(m, tile_n, 1, warps, occupancy, unroll=unroll, gemv=1)
                for m in range(1, GEMV_M + 1) for unroll in unrolls]
    return out


def _code_paths(every: list[WeightOnlyConfig]) -> list[WeightOnlyConfig]:
    """One config per code path of ``every``: each kernel without and with a K split, stacked or not."""
    out = []
    for cfg in every:
        path = (cfg.gemv, cfg.split_k > 1, cfg.stack > 1)
        if not any((c.gemv, c.split_k > 1, c.stack > 1) == path for c in out):
            out.append(cfg)
    return out


def aot_variant(name: str, cfg: WeightOnlyConfig, x_dtype: torch.dtype = torch.bfloat16, out_ct=None,
                normal_scales: bool = False) -> AotVariant:
    """The kernel of ``cfg`` for layout ``name`` (with ``normal_scales``: ``NVFP4_NORMAL``, named
    ``nvfp4_normal``) and an activation of ``x_dtype`` (output dtype ``out_ct``,
    default x's), as its launch specialises it, for sm_90, sm_100 and sm_120."""
    layout, x_ct = LAYOUTS[name], _CT_DTYPES[x_dtype]
    if normal_scales:
        layout, name = NVFP4_NORMAL, f"{name}_normal"
    c_ct = x_ct if out_ct is None else out_ct
    params = [array(x_ct, 2), array(ct.int32, 2), array(ct.uint8, 2), array(c_ct, 2),
              array(ct.float32, 1), array(ct.float32, 1), array(ct.float32, 1),
              array(ct.float32, 3) if cfg.split_k > 1 else array(c_ct, 2),
              array(ct.int32 if cfg.split_k > 1 else ct.float32, 1),
              *_constants(layout, cfg, _X_PARTS[x_dtype])]
    out = "" if c_ct is x_ct else f"_out_{c_ct.name}"
    return AotVariant(f"weight_only_{name}_{x_ct.name}_{cfg.name}{out}", cfg.kernel, params)


def aot_variants(full: bool = True) -> list[AotVariant]:
    """The weight-only kernel per (layout, activation dtype, config), for sm_90, sm_100 and sm_120 (the
    kernel uses bf16 ``ct.mma`` and integer operations only, so one kernel serves every architecture).
    ``full=False`` keeps one config per code path (kernel, with and without a K split, stacked)."""
    variants = []
    for name, layout in LAYOUTS.items():
        every = _configs(layout)
        paths = _code_paths(every)
        configs = every if full else paths
        for x_dtype, x_ct in _CT_DTYPES.items():
            # bf16 x with an fp16 / fp32 output: the small-batch path of block-scaled layers (the
            # decoded activation is bf16; the output has the caller's dtype), one config per code path.
            outs = [(x_ct, configs)] + ([(c, paths) for c in (ct.float16, ct.float32)]
                                        if x_dtype == torch.bfloat16 else [])
            for c_ct, c_configs in outs:
                variants += [aot_variant(name, cfg, x_dtype, c_ct) for cfg in c_configs]
    # NVFP4 weights with normal scale bytes: their scale decode (SCALE_MODE 2) on every code path and
    # activation dtype (the decode differs from the general layout's in ``_multipliers`` only).
    variants += [aot_variant("nvfp4", cfg, x_dtype, normal_scales=True)
                 for x_dtype in _CT_DTYPES for cfg in _code_paths(_configs(NVFP4_NORMAL))]
    for name, layout in (*LAYOUTS.items(), ("nvfp4_normal", NVFP4_NORMAL)):
        params = [array(ct.int32, 2), array(ct.uint8, 2), array(ct.bfloat16, 2), array(ct.float32, 1),
                  layout.element, layout.scale_mode, layout.block, layout.planes, layout.group,
                  DEQUANT_TN]
        variants.append(AotVariant(f"weight_only_dequantize_{name}", _dequantize_kernel, params))
    return variants

