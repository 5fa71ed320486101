"""Tile helpers shared by tilemm's cuTile kernels (any architecture), and small host-side utilities.

Tile-code helpers (called from inside ``@ct.kernel`` functions, inlined by cuTile):

* ``tile_coords`` / ``tile_coords_at``: the batch index and the (M-tile, N-tile) of a block of a 1-D
  grid (or of tile number t of a persistent block), visiting tiles in GROUP_SIZE_M-row groups so that
  neighbouring blocks share operand tiles in L2.
* The one e8m0 and e2m1 decode every Hopper kernel uses. ``e8m0_to_bf16`` / ``e8m0_to_fp32`` (the
  bits: ``e8m0_bits_bf16``): e8m0 scale bytes -> their exact values (2^(s-127); 0 -> 2^-127; 255 ->
  NaN). ``e2m1_bits``: an e2m1 field, wherever it sits in a 16-bit lane (a nibble of a packed byte,
  a plane of the weight-only layout), as the bits of a 16-bit float with a known power-of-two offset,
  two lanes per 32-bit word; ``e2m1_to_fp32``: codes -> fp32 values.
* ``unswizzle_scale_tile``: a tile of the 32x4x4 ("swizzled") scale layout back to (rows, columns).
* ``epilogue``: ``acc * alpha + bias``, cast once to the output dtype, stored (partial tiles masked).

Host helpers: ``folded_alpha`` (a problem's alpha with NVFP4's decode scales), ``ones_scalar`` /
``zeros_vector`` (cached device constants that stand in for an absent ``alpha`` / ``bias``, so that
one kernel specialisation serves calls with and without them), ``swizzled_scale_view`` (the 6-D
view of a swizzled scale tensor that the kernels load from), and ``hinted`` (cached ``replace_hints``).
"""

from __future__ import annotations

import cuda.tile as ct
import torch

import swizzle as _swizzle

from ..formats import Granularity
from ..numerics import ceil_div

__all__ = ["launch_all_on", "tile_coords", "tile_coords_at", "e8m0_bits_bf16", "e8m0_to_bf16", "e8m0_to_fp32",
           "e2m1_bits", "e2m1_to_fp32", "unswizzle_scale_tile",
           "epilogue", "ones_scalar", "zeros_vector", "swizzled_scale_view", "hinted", "num_sms", "stream_handle",
           "ceil_div", "folded_alpha", "SWIZZLE_ROWS", "SWIZZLE_COLS"]

#: Rows and scale columns covered by one 32x16 block of the 32x4x4 layout.
SWIZZLE_ROWS = _swizzle.ROW_TILE
SWIZZLE_COLS = _swizzle.COL_TILE

# --------------------------------------------------------------------------------------------------
# Tile code
# --------------------------------------------------------------------------------------------------


def tile_coords(M, N, TM, TN, GROUP_SIZE_M):
    """(batch, m_tile, n_tile) of this block in a 1-D grid of B * cdiv(M, TM) * cdiv(N, TN) blocks.

    Within one batch entry, blocks walk GROUP_SIZE_M tile rows column by column, so consecutive blocks
    reuse the same B tiles (and a group's A tiles) from L2.
    """
    return tile_coords_at(ct.bid(0), M, N, TM, TN, GROUP_SIZE_M)


def tile_coords_at(t, M, N, TM, TN, GROUP_SIZE_M):
    """``tile_coords`` for output tile number ``t`` (a persistent block's loop variable)."""
    num_m = ct.cdiv(M, TM)
    num_n = ct.cdiv(N, TN)
    per_batch = num_m * num_n
    batch = t // per_batch
    t = t % per_batch
    per_group = GROUP_SIZE_M * num_n
    first_m = (t // per_group) * GROUP_SIZE_M
    group_m = min(num_m - first_m, GROUP_SIZE_M)
    bm = first_m + (t % per_group) % group_m
    bn = (t % per_group) // group_m
    return batch, bm, bn


def e8m0_bits_bf16(s, dtype, base, SHIFTED):
    """The e8m0 decode: scale bytes s (0..255 in an integer tile) -> the bf16 bit patterns of exactly
    2^(s-127) * 2^(base / 128), as a tile of integer ``dtype`` (``ct.uint16`` to bit-cast to bf16,
    ``ct.int32`` for fp32's upper half).

    bf16 has fp32's 8-bit exponent, so byte s goes straight into the exponent field: the bits are
    s * 128 + base. SHIFTED = 0 (base 0, the plain decode): s = 0 is 2^-127, the bf16 subnormal 0x0040,
    and s = 255 becomes 0x7FC0, a quiet NaN (s << 7 alone would be +inf, and inf would survive as inf
    instead of NaN); both specials set bit 6. SHIFTED = 1: base (an int32 tile or int) is a positive
    multiple of 128 that the caller keeps small enough for every finite byte's product to stay below
    2^128 (``weight_only_kernels._multipliers``): then no byte is subnormal, finite bytes give at most
    0x7F00 and s = 255 at least 0x8000, so ``min(bits, 0x7FC0)`` turns exactly the NaN byte into NaN,
    with no compare: one multiply-add and one min."""
    if SHIFTED:
        return ct.minimum(s.astype(ct.int32) * 128 + base, 0x7FC0).astype(dtype)
    b = s.astype(dtype)
    special = ((b + 1) & 0xFF) < 2  # s == 255 or s == 0
    return (b << 7) | ct.where(special, ct.full(b.shape, 0x40, dtype), ct.full(b.shape, 0, dtype))


def e8m0_to_bf16(s):
    """e8m0 scale bytes (an integer tile, e.g. uint8) -> bf16 tile of exactly 2^(s-127) (``e8m0_bits_bf16``)."""
    return ct.bitcast(e8m0_bits_bf16(s, ct.uint16, 0, 0), ct.bfloat16)


def e8m0_to_fp32(s):
    """e8m0 scale bytes (an integer tile) -> fp32 tile of exactly 2^(s-127): ``e8m0_bits_bf16``'s
    pattern in the upper half of the word (fp32 is bf16 with 16 more mantissa bits), so byte 0 is the
    subnormal 2^-127 (0x00400000) and byte 255 the quiet NaN 0x7FC00000."""
    return ct.bitcast(e8m0_bits_bf16(s, ct.int32, 0, 0) << 16, ct.float32)


def _shifted(w, n):
    """w << n for n > 0, w >> -n for n < 0 (n a compile-time constant)."""
    if n > 0:
        return w << n
    if n < 0:
        return w >> (0 - n)
    return w


def e2m1_bits(w, MAG_AT, SIGN_AT, FP16, LANES):
    """The e2m1 decode: an e2m1 field of each 16-bit lane of w -> that lane as a 16-bit float's bits.

    The field's magnitude (2 exponent bits, 1 mantissa bit: e1 e0 m) sits at bits MAG_AT..MAG_AT + 2
    of the lane, its sign at bit SIGN_AT. The magnitude moves to the lowest exponent bits and the
    mantissa's top bit of a 16-bit float, bits 6..8 of bf16 (FP16 = 0) or 9..11 of fp16 (FP16 = 1), and
    the sign to bit 15: the result is the (sub)normal float e2m1 * 2^-126 (bf16, bias 127) or e2m1 *
    2^-14 (fp16, bias 15), exact for every code (code 1, 0.5, lands on the subnormal encoding). w is a
    uint16 tile (LANES = 1) or a uint32 tile of two lanes decoded at once (LANES = 2); bits moved across
    a lane boundary fall outside the masks. When the sign sits as far above the magnitude as in the
    float (SIGN_AT - MAG_AT = 15 - target), one shift and one mask move both; words shift, then mask,
    and a one-lane tile masks, then shifts (the forms tileiras compiles to the fewest instructions).

    Packed bytes (element 2j in the low nibble of byte j) are fields (0, 3) and (4, 7) of a uint16 tile
    of the bytes; the weight-only layout's planes are ``weight_only_kernels.E2M1_FIELDS``."""
    if FP16:
        to = 9
    else:
        to = 6
    mag = 0x7 << to
    sign = 0x8000
    if LANES == 2:
        mag = mag * 0x10001
        sign = 0x80008000
    if SIGN_AT - MAG_AT == 15 - to:
        return _shifted(w, to - MAG_AT) & (mag | sign)
    if LANES == 2:
        return (_shifted(w, to - MAG_AT) & mag) | (_shifted(w, 15 - SIGN_AT) & sign)
    return _shifted(w & (0x7 << MAG_AT), to - MAG_AT) | _shifted(w & (1 << SIGN_AT), 15 - SIGN_AT)


def e2m1_to_fp32(codes):
    """e2m1 codes (an int32 tile of 0..15, sign in bit 3) -> their fp32 values, exactly:
    ``e2m1_bits``' e2m1 * 2^-126 in the upper half of the word, times 2^126."""
    return ct.bitcast(e2m1_bits(codes, 0, 3, 0, 1) << 16, ct.float32) * (2.0 ** 126)


def unswizzle_scale_tile(t, ROWS, COLS):
    """A tile (ROWS/128, KG, 128, C) loaded from ``swizzled_scale_view`` -> (ROWS, COLS = KG * C).

    The 128 axis is (r % 32) * 4 + (r % 128) // 32 for row r of a 128-row tile (docs/numerics.md,
    the 32x4x4 layout), so splitting it into (32, 4) and moving the 4 in front of the 32 restores row order.
    """
    m0 = ROWS // SWIZZLE_ROWS
    kg = t.shape[1]
    c = t.shape[3]
    t = t.reshape((m0, kg, 32, 4, c))
    t = t.permute((0, 3, 2, 1, 4))  # (m0, 4, 32, kg, c): row = m0 * 128 + m2 * 32 + m1
    return t.reshape((ROWS, COLS))


def epilogue(acc, C, Alpha, Bias, batch, bm, bn, TM, TN):
    """Store ``acc * alpha + bias`` cast once to C's dtype; rows/columns beyond C's edges are dropped."""
    alpha = ct.load(Alpha, (0,), (1,)).reshape((1, 1))
    bias = ct.load(Bias, (bn,), (TN,), padding_mode=ct.PaddingMode.ZERO).reshape((1, TN))
    out = acc * alpha + bias
    ct.store(C, (batch, bm, bn), out.astype(C.dtype).reshape((1, TM, TN)))


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

_ONES: dict[torch.device, torch.Tensor] = {}
_ZEROS: dict[torch.device, torch.Tensor] = {}


def ones_scalar(device: torch.device) -> torch.Tensor:
    """A cached (1,) fp32 tensor holding 1.0 on ``device``: ``alpha`` when none is given."""
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def zeros_vector(device: torch.device, n: int) -> torch.Tensor:
    """A cached fp32 zero vector of length ``n`` on ``device``: ``bias`` when none is given.

    Adding +0.0 changes nothing but the sign of a -0.0 result."""
    t = _ZEROS.get(device)
    if t is None or t.numel() < n:
        t = _ZEROS[device] = torch.zeros(max(n, 1024), dtype=torch.float32, device=device)
    return t[:n]


def fp8_kind(granularity: Granularity, where: str) -> str:
    """The FP8 kernel for a ``tilemm.matmul.FP8Problem`` granularity (``Granularity.matmul_kernel``):
    "scaled" (per tensor or per row: one kernel, scales in the epilogue) or "blockwise" (128-element
    blocks); ``where`` names the caller in errors."""
    if not isinstance(granularity, Granularity):
        raise TypeError(f"{where}: granularity must be a tilemm.formats.Granularity, got {granularity!r}")
    return granularity.matmul_kernel


def swizzled_scale_view(scale: torch.Tensor, cols_per_tile: int) -> torch.Tensor:
    """View a swizzled scale (B, Rt, Kt, 32, 16) as (B, Rt, Kt, 128, G, C) with C = min(cols_per_tile,
    4) and G = 4 / C, so that a K tile covering ``cols_per_tile`` scale columns is one rectangular
    load: (1, TR/128, max(cols_per_tile/4, 1), 128, 1, C) at (b, rt, kt // G, 0, kt % G, 0).

    The trailing 16 of a 32x16 block is (m2 = 4 row sub-tiles) x (k1 = 4 columns); k1 splits as (G, C).
    """
    c = min(cols_per_tile, SWIZZLE_COLS)
    b, rt, kt = scale.shape[:3]
    return scale.reshape(b, rt, kt, SWIZZLE_ROWS, SWIZZLE_COLS // c, c)


#: The current stream's raw handle for a device index (``torch.cuda.current_stream()`` builds a Stream
#: object per call; ``ct.launch`` takes the raw integer).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(device: torch.device):
    """The current CUDA stream of ``device`` as the raw handle ``ct.launch`` takes (a PyTorch built
    without CUDA, where only the tests' CPU emulation launches, gets ``torch.cuda.current_stream``)."""
    if _RAW_STREAM is None:
        return torch.cuda.current_stream(device)
    return _RAW_STREAM(device.index if device.index is not None else torch.cuda.current_device())


_SMS: dict[int, int] = {}


def num_sms(device: torch.device | int) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device index)."""
    index = device if isinstance(device, int) else (
        device.index if device.index is not None else torch.cuda.current_device())
    count = _SMS.get(index)
    if count is None:
        count = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


_HINTED: dict = {}


def sm90_hints(num_worker_warps: int, occupancy: int | None = None, num_ctas: int | None = None) -> dict:
    """The compiler hints of a Hopper config: worker warps on sm_90 (other targets keep their
    defaults), and occupancy / CTAs per cluster where the config sets them."""
    h = {"num_worker_warps": ct.ByTarget(sm_90=num_worker_warps)}
    if occupancy is not None:
        h["occupancy"] = occupancy
    if num_ctas is not None:
        h["num_ctas"] = num_ctas
    return h


def hinted(kernel, **hints):
    """``kernel.replace_hints(**hints)``, once per distinct set of hints (each result has its own JIT
    cache, so calling replace_hints per launch would recompile). Hint values may be ``ct.ByTarget``."""
    if not hints:
        return kernel
    key = (id(kernel), tuple(sorted((k, repr(v)) for k, v in hints.items())))
    cached = _HINTED.get(key)
    if cached is None:
        cached = _HINTED[key] = (kernel, kernel.replace_hints(**hints))
    return cached[1]


def launch_all_on(device: torch.device, launch, stream, kernel, launches) -> None:
    """``launch(stream, grid, kernel, args)`` for each (grid, args) of ``launches``, with ``device``
    the current CUDA device meanwhile (``ct.launch`` launches on the current one). ``launch`` is the
    caller's ``ct.launch``."""
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            for grid, args in launches:
                launch(stream, grid, kernel, args)
        return
    for grid, args in launches:
        launch(stream, grid, kernel, args)


def folded_alpha(problem):
    """A ``BlockScaledProblem``'s alpha with NVFP4's decode scales multiplied in, as one fp32 tensor:
    ``fp32(global_scale_x * global_scale_y)``, then ``* alpha`` when one is given (the order
    ``nvfp4_matmul`` documents), or
    ``problem.alpha`` (None for none) when the problem carries no decode scales. For the launchers
    that apply one alpha; Hopper's stream kernel multiplies the scales in its epilogue instead."""
    if problem.global_scales is None:
        return problem.alpha
    global_scale_x, global_scale_y = problem.global_scales
    scales = global_scale_x * global_scale_y
    return scales if problem.alpha is None else scales * problem.alpha


class Described:
    """A tensor's memory as cuTile reads it (``__cuda_array_interface__``), worked out once.

    ``ct.launch`` describes every torch tensor argument anew on each call (about a microsecond each);
    a launch prepared for many calls passes its fixed tensors through this instead. It holds the
    tensor, so the memory it describes lives as long as it does."""

    __slots__ = ("__cuda_array_interface__", "_tensor")

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = t.__cuda_array_interface__
        self._tensor = t
